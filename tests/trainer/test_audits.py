"""refit_verify.certificate: every worker's answer with this trainer's verdict on its session. The
workers are toy ones (tests/support/toy_model.py) reached through a fake engine; no vLLM needed."""

from __future__ import annotations

import pytest
import torch

import refit_verify
from refit_verify import verdicts
from refit_verify.errors import RefitConfigError
from tests.support.toy_model import ToyEngine, toy_weights, toy_worker


@pytest.fixture
def engine(monkeypatch):
    from refit_verify.vllm_plugin import worker_sessions

    monkeypatch.setattr(worker_sessions, "attach_models", lambda *a, **k: None)  # the toy model is attached already
    worker, wb, model = toy_worker()
    return ToyEngine(worker), wb, model


def _refit(engine, model, version, seed=1):
    with refit_verify.refit(engine, mode="enforce", version=version) as r:
        w = toy_weights(seed)
        for n, t in w.items():
            r.add(n, t)
        model.load_weights(list(w.items()))
    return r


def test_a_certificate_joins_the_trainers_verdict(engine):
    eng, wb, model = engine
    (c,) = refit_verify.certificate(eng)
    assert c.session is None and not c.ok and "no refit session has closed" in c.describe()
    r = _refit(eng, model, 12)
    (rep,) = r.reports
    (c,) = refit_verify.certificate(eng)
    assert c.ok and c.verified is True and c.current and (c.session, c.version) == (r.session, 12)
    assert (c.state_digest, c.closed_at) == (rep.state_digest, rep.closed_at) and c.current_digest == rep.state_digest
    assert c.describe().startswith(f"worker rank 0 (dp 0, tp 0, pp 0, cpu) holds version 12 (session {r.session}, closed 20")
    assert c.describe().endswith(f"UTC), verified by this trainer; engine state {rep.state_digest}: current")
    verdicts.record(r.session, False, "its refit failed verification")
    (c,) = refit_verify.certificate(eng)
    assert not c.ok and c.verified is False and c.current
    assert c.problems == [f"session {r.session} its refit failed verification in this trainer"]
    assert c.describe().endswith("failed verification in this trainer; engine state "
                                 f"{rep.state_digest}: not certified: session {r.session} its refit failed verification in this trainer")
    verdicts.record(r.session, True)
    with torch.no_grad():
        model.qkv_proj[0, 0] += 1  # the engine's state changed after the verified refit: the old certificate is not current
    (c,) = refit_verify.certificate(eng)
    assert not c.ok and not c.current and c.verified is True and c.state_digest == rep.state_digest != c.current_digest
    assert "NOT current: the engine's state changed after session" in c.describe() and "1 changed: qkv_proj" in c.describe()


def test_a_certificate_of_a_session_this_trainer_never_saw_is_not_good(engine):
    eng, wb, model = engine
    wb.open("elsewhere", version=3)  # a refit another trainer process verified (or not)
    model.load_weights(list(toy_weights(2).items()))
    wb.close("elsewhere")
    (c,) = refit_verify.certificate(eng)
    assert c.current and c.verified is None and not c.ok
    assert c.describe().endswith(": not certified: verdict not known to this trainer process")


def test_a_worker_that_does_not_verify_answers_a_certificate_saying_so(engine):
    eng, wb, model = engine
    off = ToyEngine(answer={"refit_verify_certificate": [{"rank": 1, "verifying": False, "reason": "REFIT_VERIFY=off in this vLLM worker"}]})
    (c,) = refit_verify.certificate(off)
    assert c.worker.rank == 1 and c.session is None and not c.ok
    assert c.problems == ["this worker does not verify (REFIT_VERIFY=off in this vLLM worker): it cannot say what it holds"]
    with pytest.raises(RefitConfigError, match="answered for no worker"):
        refit_verify.certificate(ToyEngine(answer={"refit_verify_certificate": []}))
