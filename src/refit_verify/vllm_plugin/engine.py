"""Starting a small vLLM engine with dummy weights (the demo, tests and benchmarks)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["start_dummy_engine"]


def start_dummy_engine(model_dir: str | Path, device: str, tensor_parallel_size: int = 1, **overrides):
    """Start ``vllm.LLM`` on ``model_dir`` (a ``config.json``) with dummy weights, eager, no tokenizer.

    Args:
        model_dir: directory of the model's ``config.json``.
        device: ``"cuda"`` or ``"cpu"``; sets the memory fraction (CPU: checked against free host
            memory at start-up, the KV cache itself is ``VLLM_CPU_KVCACHE_SPACE``; a low fraction
            lets several engines share a machine).
        tensor_parallel_size: TP degree.
        overrides: further ``vllm.LLM`` keyword arguments.

    Returns:
        vllm.LLM: the engine (bf16, ``max_model_len=128``, seed 0).
    """
    from vllm import LLM

    kwargs = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                  dtype="bfloat16", seed=0, tensor_parallel_size=tensor_parallel_size,
                  gpu_memory_utilization=0.3 if device == "cuda" else 0.1)
    kwargs.update(overrides)
    return LLM(**kwargs)
