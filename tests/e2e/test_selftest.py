"""Against a real vLLM engine run in this process (tests/support/engine_utils.py): nothing checked is
never a pass, the version certificate, and ``refit_verify.selftest`` (API and command line).

One engine for the module. On CPU it keeps plain linear weights, so what the engine holds is read
directly and compared with the weights pushed.
"""

from __future__ import annotations

import re

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify.errors import RefitConfigError, RefitVerificationError, SelftestError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402
from tests.support.soak_lanes import engine_layout  # noqa: E402

pytestmark = pytest.mark.vllm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NOTHING = "nothing was checked: the trainer stated no tensor and the worker loaded none"


@pytest.fixture(scope="module")
def engine(inproc_engine):
    fresh(inproc_engine[0])
    return inproc_engine


def _weights(cfg, seed):
    return models.random_state_dict(cfg, seed=seed, device=DEVICE)


def _sync(llm, model, weights, version, load=True, **kw):
    """TRL-style: one load_weights call per parameter inside the trainer API."""
    with refit_verify.refit(llm, version=version, **kw) as r:
        for name, t in weights.items():
            r.add(name, t)
            if load:
                model.load_weights([(name, t)])
    return r


def _holds(model, weights) -> bool:
    held = dict(model.named_parameters())
    return all(torch.equal(held[n], t) for n, t in engine_layout(weights).items())


class _Answers:
    """The engine, but ``collective_rpc`` of the methods in ``answers`` answered by them."""

    def __init__(self, llm, answers):
        self.llm, self.answers = llm, answers

    def collective_rpc(self, method, args=(), timeout=None):
        if method in self.answers:
            return self.answers[method]
        return self.llm.collective_rpc(method, args=args, timeout=timeout)


def test_refits_that_compare_nothing_fail_and_an_empty_partial_one_passes_on_the_verified_state(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 1)
    with pytest.raises(RefitVerificationError, match=NOTHING) as ei:
        _sync(llm, model, {}, version=1)  # the trainer added nothing and the worker loaded nothing
    assert ei.value.report.unwritten and ei.value.report.verified == 0
    with pytest.raises(RefitVerificationError, match=re.escape("the worker loaded no tensor in this session (pushed outside")):
        _sync(llm, model, w, version=2, load=False)
    clean = _sync(llm, model, w, version=3)
    assert clean.reports[0].ok and clean.reports[0].verified == 21
    r = _sync(llm, model, {}, version=4, partial=True)  # deliberately empty: checked by the state version 3 left
    (rep,) = r.reports
    params = len(dict(model.named_parameters()))
    assert rep.ok and rep.verified == 0 and rep.unchanged == params == 15
    assert rep.unchecked[0] == ("no tensor was stated or loaded (an empty partial refit): nothing of the trainer's was compared; "
                                f"the close found the engine's {params} parameters holding the bytes session {clean.session!r} left")
    assert _holds(model, w)


def test_an_engine_answering_for_no_worker_fails_in_enforce_and_warns_in_log(engine, caplog):
    llm, model, cfg = engine
    empty = _Answers(llm, {"refit_verify_session_open": []})
    with pytest.raises(RefitConfigError, match="refit_verify_session_open through _Answers answered for no worker"):
        _sync(empty, model, _weights(cfg, 2), version=5, mode="enforce")
    with caplog.at_level("WARNING", logger="refit_verify"):
        r = _sync(empty, model, _weights(cfg, 2), version=6, mode="log")
    (rep,) = r.reports
    assert not rep.ok and "answered for no worker" in rep.describe() and "answered for no worker" in caplog.text
    with pytest.raises(RefitConfigError, match="refit_verify_session_close through _Answers answered for no worker"):
        _sync(_Answers(llm, {"refit_verify_session_close": []}), model, _weights(cfg, 2), version=7)
    llm.collective_rpc("refit_verify_session_close", args=(llm.collective_rpc("refit_verify_session_manifest")[0]["open"],))


def test_the_certificate_names_the_verified_version_until_the_engine_changes(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 3)
    r = _sync(llm, model, w, version=10)
    (rep,) = r.reports
    assert rep.ok and rep.state_digest is not None and rep.closed_at is not None
    (c,) = refit_verify.certificate(llm)
    assert c.ok and (c.session, c.version, c.state_digest, c.closed_at) == (r.session, 10, rep.state_digest, rep.closed_at)
    assert c.current_digest == rep.state_digest and c.unseen == []
    assert re.fullmatch(rf"worker rank 0 \(dp 0, tp 0, pp 0, {DEVICE}\S*\) holds version 10 \(session {r.session}, closed "
                        rf"\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC\), verified by this trainer; engine state {rep.state_digest}: current",
                        c.describe())
    norm = dict(model.named_parameters())["model.norm.weight"]
    with torch.no_grad():
        norm[0] += 1  # the engine's state changes outside any refit
    (c,) = refit_verify.certificate(llm)
    assert not c.ok and not c.current and c.version == 10 and c.current_digest != c.state_digest == rep.state_digest
    assert "NOT current: the engine's state changed after session" in c.describe() and "1 changed: model.norm.weight" in c.describe()
    with torch.no_grad():
        norm.copy_(w["model.norm.weight"])
    (c,) = refit_verify.certificate(llm)
    assert c.ok and c.current_digest == rep.state_digest


def test_selftest_names_the_corrupted_tensor_and_leaves_the_clean_weights(engine):
    llm, model, cfg = engine
    w = _weights(cfg, 4)
    res = refit_verify.selftest(llm, w, mode="enforce")
    assert res.passed and res.problems == () and res.workers == 1 and (res.tensors, res.bytes) == (21, 853248)
    assert res.target == "model.embed_tokens.weight" and res.caught == res.target  # the largest, the first of equals
    assert res.byte_index == 512 * 128  # the middle byte
    assert res.checked[0] == "the engine's worker verifies (refit-verify's plugin loaded, REFIT_VERIFY set there)"
    assert res.checked[1] == (f"a refit with byte {res.byte_index} of {res.target} flipped after the sender digested it was "
                              f"refused before loading and named {res.target}; 1 engine parameters kept their previous bytes")
    assert res.checked[2].startswith("a clean refit of 21 tensors verified at the model boundary on worker rank 0 (")
    (c,) = res.certificates
    assert res.checked[3] == f"the certificate: {c.describe()}" and c.ok and c.state_digest == res.report.state_digest
    assert set(res.timings) == {"workers", "corrupted", "clean", "certificate", "total"}
    assert all(0 < v <= res.timings["total"] for k, v in res.timings.items())
    assert _holds(model, w)


def test_selftest_raises_when_a_corruption_goes_unnoticed(engine, monkeypatch, caplog):
    """A comparison that passes everything (a broken check): the self-test says so, and the engine is
    still left holding the clean weights."""
    from refit_verify.report import VerificationReport
    from refit_verify.transport import sender

    def passes_everything(*args, **kwargs):
        return VerificationReport((), (), (), {"x": "0" * 32}, {"x": "0" * 32})

    llm, model, cfg = engine
    monkeypatch.setattr(sender, "receiver_report", passes_everything)
    w = _weights(cfg, 5)
    with pytest.raises(SelftestError) as ei:
        refit_verify.selftest(llm, w, mode="enforce")
    res = ei.value.result
    assert not res.passed and res.caught is None
    assert res.problems[0] == (f"a refit with byte {res.byte_index} of {res.target} flipped after the sender digested it "
                               "verified: the corruption was NOT caught")
    assert _holds(model, w)
    with caplog.at_level("WARNING", logger="refit_verify"):
        assert not refit_verify.selftest(llm, w, mode="log").passed
    assert "refit-verify selftest FAILED: a refit with byte" in caplog.text


def test_the_selftest_command_on_this_engine(engine, monkeypatch, capfd, tmp_path):
    """``refit-verify selftest`` (its engine start replaced by this module's engine)."""
    from refit_verify.cli import demo
    from refit_verify.cli.commands import main

    llm, model, cfg = engine
    monkeypatch.setattr(demo, "start_engine", lambda *a, **k: llm)
    monkeypatch.setattr(demo, "_shutdown", lambda *a, **k: None)
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    log = tmp_path / "selftest.log"
    assert main(["selftest", "--device", DEVICE, "--seed", "7", "--log-file", str(log)]) == 0
    out = " ".join(capfd.readouterr().out.split())
    target = "model.embed_tokens.weight"
    assert f"corrupted refit: byte 65536 of {target} flipped after the sender digested it: caught, named {target}" in out
    assert "clean refit: 21 tensors verified at the model boundary on worker rank 0 (" in out
    assert re.search(r"certificate: worker rank 0 \(dp 0, tp 0, pp 0, \S+\) holds an unversioned refit \(session [0-9a-f]{32}, "
                     r"closed [^)]+\), verified by this trainer; engine state [0-9a-f]{32}: current", out)
    assert re.search(r"PASS: selftest in \d+\.\d\d s", out)
    assert _holds(model, models.random_state_dict(cfg, seed=7, device=DEVICE))
