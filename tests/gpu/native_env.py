"""Shared set-up of the GPU tests of vLLM's native weight-transfer API: an in-process ``LLM`` with a
``weight_transfer_config`` backend, ``REFIT_VERIFY=enforce`` and the plugin found through its entry point."""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from refit_verify.testing import models
from tests.support.plugins import restore_env

ROOT = Path(__file__).resolve().parents[2]
_STUB = '"""Stand-in: vLLM 0.26\'s ipc_engine imports this at module level but needs it only for its ray/http send modes."""\n' \
        "def is_initialized():\n    return False\n"


@contextlib.contextmanager
def native_llm(tmp_path_factory: pytest.TempPathFactory, backend: str, env: dict[str, str] | None = None,
               **llm_kwargs) -> Iterator[tuple[object, dict]]:
    """Yield ``(LLM, model config)`` of the packaged tiny Llama (dummy weights) with the native
    ``backend``; ``env`` is set while the engine starts (e.g. ``CUDA_VISIBLE_DEVICES`` for its
    processes) and everything is restored after."""
    model_dir = tmp_path_factory.mktemp("tiny-llama")
    (model_dir / "config.json").write_text((models.packaged_config_dir() / "config.json").read_text())
    stubs = tmp_path_factory.mktemp("stubs")
    for name in ("ray", "requests"):  # appended to the path: an installed package always wins
        if importlib.util.find_spec(name) is None:
            (stubs / f"{name}.py").write_text(_STUB)
    full = {"REFIT_VERIFY": "enforce", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
            "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # IPC rebuild arguments ride collective_rpc pickled
            "NCCL_NVLS_ENABLE": "0",
            "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", ""), str(stubs)) if p),
            **(env or {})}
    old = {k: os.environ.get(k) for k in full}
    os.environ.update(full)
    sys.path.append(str(stubs))
    try:
        import vllm.plugins

        if vllm.plugins.plugins_loaded:  # an earlier module loaded plugins in this pytest process
            from refit_verify.vllm_plugin import register

            register()
        from vllm import LLM
        from vllm.config import WeightTransferConfig

        from tests.support.engine_utils import forget_vllm_env_cache

        forget_vllm_env_cache()  # an in-process engine started earlier in this process cached its environment

        llm = LLM(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                  dtype="bfloat16", seed=0, gpu_memory_utilization=0.3, weight_transfer_config=WeightTransferConfig(backend=backend),
                  **llm_kwargs)
        yield llm, models.load_config(model_dir)
        del llm
        gc.collect()  # an LLM sits in reference cycles: collect it now, so that its engine process exits before the
        # next module starts an engine (an in-process one profiles free memory: a release then fails its start)
    finally:
        sys.path.remove(str(stubs))
        restore_env(old)
