"""A layer quantized on load, recorded by :func:`refit_verify.engine.quantized.settle` (no vLLM).

A toy layer's bf16 ``weight`` is loaded block by block (q, k, v rows, as vLLM's ``QKVParallelLinear``);
then, as vLLM's online quantization does, a per-channel FP8 quantizer (a CPU reference standing in
for vLLM's ``Fp8PtpcOnlineLinearMethod``) replaces it by an fp8 ``weight`` ``[in, out]`` (a transposed
view) and a float32 ``weight_scale``, and those become the engine's tensors. ``settle`` reads the
bf16 weight back against the delivered blocks, compares the engine's run with a second run of the
same quantizer, checks the scales, and the close reads the engine's tensors against what was
produced.
"""

from __future__ import annotations

import pytest
import torch

from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors
from refit_verify.engine import state as engine_state
from refit_verify.engine.quantized import settle
from tests.support.toy_model import default_weight_loader

HIDDEN, Q, KV = 16, 16, 8
OUT = Q + 2 * KV
FP8 = torch.float8_e4m3fn
WHAT = "quantized on load by RefPtpc"


def ref_quant(w: torch.Tensor, zero_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel FP8: scale = amax / 448 per row (float32), q = w / scale, clamped; the fp8
    weight is returned transposed (``[in, out]``), as vLLM keeps it."""
    amax = w.float().abs().amax(dim=1, keepdim=True)
    scale = torch.zeros_like(amax) if zero_scales else (amax / 448.0).clamp_min(1e-12)
    q = (w.float() / scale).clamp(-448.0, 448.0).to(FP8)
    return q.t(), scale


class QuantToy(torch.nn.Module):
    """A fused ``layer.weight`` ([q; k; v] rows of bf16) with a shard loader, and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Module()
        self.layer.weight = torch.nn.Parameter(torch.zeros(OUT, HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.layer.weight.weight_loader = self._qkv
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.misplace = False

    def _qkv(self, param, loaded, shard):
        off = {"q": 0, "k": Q, "v": Q + KV}[shard]
        if self.misplace and shard == "k":
            off += 1  # a loader writing k one row low
        param.data.narrow(0, off, loaded.shape[0]).copy_(loaded)

    def load_weights(self, weights):
        for name, w in weights:
            if name in ("q_proj", "k_proj", "v_proj"):
                p = self.layer.weight
                p.weight_loader(p, w, name[0])
            else:
                self.norm.weight_loader(self.norm, w)


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q_proj": torch.randn(Q, HIDDEN, generator=g).bfloat16(), "k_proj": torch.randn(KV, HIDDEN, generator=g).bfloat16(),
            "v_proj": torch.randn(KV, HIDDEN, generator=g).bfloat16(), "norm": torch.randn(HIDDEN, generator=g).bfloat16()}


def _refit(w, *, model=None, drop=(), engine_run=None, reference=True, after=None, skip=False):
    """One session: load ``w`` (less ``drop``), quantize the layer as vLLM does (``engine_run(bf16)``:
    the engine's run, default :func:`ref_quant`), settle, install the result as the engine's tensors,
    run ``after(model)``, close. Returns ``(manifest, report)``."""
    model = model or QuantToy()
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = engine_state.read_back
    wb.attach("model", model, default_weight_loader)
    sid = wb.open("s1", version=1)
    model.load_weights([(n, t) for n, t in w.items() if n not in drop])
    ms = wb.modules["model"].session
    bf16 = model.layer.weight
    before = {"layer.weight": bf16}
    if skip:  # the quant method returned at once (the layer counted as processed): nothing replaced
        after_t = dict(before)
    else:
        q, s = (engine_run or ref_quant)(bf16.detach())
        after_t = {"layer.weight": torch.nn.Parameter(q, requires_grad=False),
                   "layer.weight_scale": torch.nn.Parameter(s, requires_grad=False)}
    ref = None
    if reference:
        rq, rs = ref_quant(bf16.detach().clone(), zero_scales=engine_run is _zero)
        ref = {"layer.weight": rq, "layer.weight_scale": rs}
    settle(ms, "", before, after_t, ref, WHAT, None if reference else "no re-run for this method")
    for n, t in after_t.items():  # the engine's tensors from now on (vLLM's copy into them)
        setattr(model.layer, n.split(".")[-1], t)
    if after is not None:
        after(model)
    man = wb.close(sid)
    return man, compare_session({"model": digest_tensors(w.items())}, man, session="s1", version=1)


def _zero(w):
    return ref_quant(w, zero_scales=True)


def test_clean_quantization_is_proven_with_the_fp8_bytes():
    man, r = _refit(_weights(1))
    assert r.ok, r.describe()
    st, sc = man.engine.params["layer.weight"], man.engine.params["layer.weight_scale"]
    assert (st.status, st.bytes, sc.status, sc.bytes) == ("verified", OUT * HIDDEN, "verified", OUT * 4)
    assert sorted(s for s, _ in st.blocks) == ["k_proj", "q_proj", "v_proj"]
    assert WHAT in st.blocks[0][1]
    assert man.engine.proven_bytes == OUT * HIDDEN + OUT * 4 + HIDDEN * 2 and man.engine.unproven_bytes == 0
    assert r.not_proven == {} and r.unwritten == ()


def test_engine_copy_of_a_scale_that_differs_is_named():
    def stale(model):
        model.layer.weight_scale.data[3] *= 2

    man, r = _refit(_weights(2), after=stale)
    assert r.engine_mismatched == ("layer.weight_scale",) and r.mismatched == ()
    assert "differs from what its quantization produced" in man.engine.params["layer.weight_scale"].why


def test_zero_scale_in_the_engine_is_named_at_close():
    def zero(model):
        model.layer.weight_scale.data[0] = 0.0

    man, r = _refit(_weights(3), after=zero)
    assert r.engine_mismatched == ("layer.weight_scale",)
    assert "layer.weight_scale holds 1 of 32 scale elements that are zero" in man.engine.params["layer.weight_scale"].why


def test_quantization_giving_zero_scales_is_named_though_its_rerun_agrees():
    man, r = _refit(_weights(4), engine_run=_zero)
    assert r.engine_mismatched == ("layer.weight_scale",)
    assert "32 of 32 scale elements that are zero" in man.engine.params["layer.weight_scale"].why


def test_engine_run_that_differs_from_the_rerun_is_named():
    def off_by_one(w):
        q, s = ref_quant(w)
        q = q.clone()
        q.view(torch.uint8)[2, 5] ^= 0x01
        return q, s

    man, r = _refit(_weights(5), engine_run=off_by_one)
    assert r.engine_mismatched == ("layer.weight",)
    why = man.engine.params["layer.weight"].why
    assert "holds other bytes than the engine's quantization of the delivered tensor: 1 of 512 elements differ" in why


def test_bf16_weight_misplaced_by_its_loader_is_named_on_the_quantized_tensors():
    model = QuantToy()
    model.misplace = True
    man, r = _refit(_weights(6), model=model)
    assert set(r.engine_mismatched) == {"layer.weight", "layer.weight_scale"}
    assert "from layer.weight, which held other bytes than were delivered" in man.engine.params["layer.weight_scale"].why


def test_no_rerun_leaves_them_not_proven_with_why():
    man, r = _refit(_weights(7), reference=False)
    assert r.not_proven == {"layer.weight": f"{WHAT}: no re-run for this method",
                            "layer.weight_scale": f"{WHAT}: no re-run for this method"}
    assert man.engine.unproven_bytes == OUT * HIDDEN + OUT * 4


def test_part_of_the_bf16_weight_not_loaded_is_unwritten_and_a_mismatch():
    """vLLM's reload quantizes such a layer anyway (its finalize), from a fresh bf16 tensor whose other
    rows were never written: a failure even where a partial refit allows the rows."""
    man, r = _refit(_weights(8), drop=("k_proj",))
    assert set(r.unwritten) == {"layer.weight", "layer.weight_scale"}
    assert set(r.engine_mismatched) == {"layer.weight", "layer.weight_scale"}
    assert "which this refit wrote only in part (384 of 512 elements)" in man.engine.params["layer.weight"].why


def test_quantization_skipped_is_a_mismatch():
    man, r = _refit(_weights(9), skip=True, reference=False)
    assert r.engine_mismatched == ("layer.weight",)
    assert "nothing was quantized" in man.engine.params["layer.weight"].why


def test_settle_ignores_a_layer_this_session_did_not_load():
    model = QuantToy()
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = engine_state.read_back
    wb.attach("model", model, default_weight_loader)
    wb.open("s1", version=1)
    ms = wb.modules["model"].session
    q, s = ref_quant(model.layer.weight.detach())
    assert settle(ms, "", {"layer.weight": model.layer.weight}, {"layer.weight": q, "layer.weight_scale": s},
                  None, WHAT) == []
    assert ms.quantized == {} and ms.unexplained == {}


@pytest.mark.parametrize("seed", [11, 12])
def test_tensors_digested_where_they_landed_are_read_before_quantization(monkeypatch, seed):
    """Landing digests on the CPU, as on CUDA workers: the delivered blocks' digests come from the
    bf16 weight, read in :func:`settle` (its call's pending tensors decided first)."""
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    man, r = _refit(_weights(seed))
    assert r.ok, r.describe()
    assert man.engine.params["layer.weight"].status == "verified"
