"""Nothing checked is never a pass: the comparisons of refit-verify.compare on sessions that compared
no tensor, and the certificate fields a report carries. Manifests come from a real WorkerBoundary
around the toy model (tests/support/toy_model.py); no vLLM needed."""

from __future__ import annotations

import pytest

from refit_verify.compare import check_digest, compare_manifests, compare_session, receiver_report
from refit_verify.config import VerifyMode, act_on_all
from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitVerificationError
from refit_verify.report import VerificationReport
from tests.support.toy_model import toy_weights, toy_worker

NOTHING = "nothing was checked: the trainer stated no tensor and the worker loaded none (a refit that compares nothing verifies nothing)"


def _session(wb, model, sid, loads, *, version=1, partial=False):
    wb.open(sid, version=version, partial=partial)
    if loads:
        model.load_weights(list(loads.items()))
    return wb.close(sid)


def test_an_empty_full_refit_fails_saying_nothing_was_checked():
    _, wb, model = toy_worker()
    _session(wb, model, "s1", toy_weights(1))
    man = _session(wb, model, "s2", {}, version=2)
    r = compare_session({"model": {}}, man, session="s2", version=2)
    assert not r.ok and r.nothing_checked and r.unchanged == 0  # a full refit's unchanged parameters vouch for nothing
    assert r.describe() == ("refit session s2 version 2 verification failed on worker rank 0 (dp 0, tp 0, pp 0, cpu) (0 of 0 "
                            f"verified): {NOTHING}; 3 engine parameters not written: qkv_proj, embed, norm")


def test_an_empty_partial_refit_passes_only_on_what_the_last_session_left():
    _, wb, model = toy_worker()
    first = _session(wb, model, "p0", {}, partial=True)  # no earlier state: nothing at all to compare
    r = compare_session({"model": {}}, first, partial=True)
    assert not r.ok and r.nothing_checked and NOTHING in r.describe()
    _session(wb, model, "s1", toy_weights(1))
    man = _session(wb, model, "p1", {}, version=2, partial=True)
    r = compare_session({"model": {}}, man, session="p1", version=2, partial=True)
    assert r.ok and not r.nothing_checked and r.unchanged == 3 and r.verified == 0
    assert r.unchecked == ("no tensor was stated or loaded (an empty partial refit): nothing of the trainer's was compared; "
                           "the close found the engine's 3 parameters holding the bytes session 's1' left",)


def test_one_side_empty_names_which_side():
    _, wb, model = toy_worker()
    w = toy_weights(1)
    man = _session(wb, model, "s1", {}, partial=True)
    r = compare_session({"model": digest_tensors(w.items())}, man, partial=True)
    assert not r.ok and not r.nothing_checked and set(r.missing) == set(w)
    assert "the worker loaded no tensor in this session (pushed outside the refit, or into another engine?)" in r.describe()
    man = _session(wb, model, "s2", w, version=2)
    r = compare_session({"model": {}}, man)
    assert not r.ok and set(r.unexpected) == set(w)
    assert "the trainer stated no tensor (r.add never called?) but the worker loaded some" in r.describe()


def test_a_report_carries_the_certificate_fields_of_the_close():
    _, wb, model = toy_worker()
    w = toy_weights(2)
    man = _session(wb, model, "s1", w, version=4)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s1", version=4)
    assert r.ok and (r.session, r.version, r.state_digest, r.closed_at) == ("s1", 4, man.state_digest, man.closed_at)
    assert r.state_digest == wb.baseline.state_digest()


def test_empty_manifests_compare_nothing_on_every_path():
    assert compare_manifests({}, {}).nothing_checked
    rep = receiver_report({}, {}, None, refit_id="r", rejected={}, error=None, rank=0)  # the broadcast path
    assert not rep.ok and NOTHING in rep.describe()
    rep = compare_manifests({"a": "0" * 32}, {"a": "0" * 32})
    assert rep.ok and not rep.nothing_checked


def test_the_staged_path_keeps_the_session_errors_beside_the_receivers_error():
    """The staged transport's report (``receiver_report`` with the worker's session) keeps the errors of
    the session's close (a check that failed or found a fault: here a tied pair sent with different
    bytes) and adds ``Done.error`` after them: neither hides the other, and either fails the refit."""
    import msgspec

    _, wb, model = toy_worker()
    w = toy_weights(3)
    man = _session(wb, model, "s1", w, version=1)
    sent = digest_tensors(w.items())
    assert receiver_report(sent, {}, man, refit_id="s1", rejected={}, error=None, rank=0).ok
    bad = msgspec.structs.replace(man, errors=["model: embed, lm_head are one tensor in the engine (tied)"])
    rep = receiver_report(sent, {}, bad, refit_id="s1", rejected={}, error=None, rank=0)
    assert not rep.ok and rep.receiver_error == "model: embed, lm_head are one tensor in the engine (tied)"
    rep = receiver_report(sent, {}, bad, refit_id="s1", rejected={}, error="load_weights raised KeyError", rank=0)
    assert not rep.ok and rep.receiver_error == ("model: embed, lm_head are one tensor in the engine (tied); "
                                                 "load_weights raised KeyError")
    rep = receiver_report(sent, {}, man, refit_id="s1", rejected={}, error="load_weights raised KeyError", rank=0)
    assert not rep.ok and rep.receiver_error == "load_weights raised KeyError"


def test_no_report_at_all_is_a_failure(caplog):
    with pytest.raises(RefitVerificationError, match="no worker's report: no worker was checked, so nothing was verified"):
        act_on_all([], VerifyMode.ENFORCE)
    with caplog.at_level("WARNING", logger="refit_verify"):
        (r,) = act_on_all([], VerifyMode.LOG)
    assert not r.ok and "no worker was checked" in caplog.text
    assert act_on_all([], VerifyMode.OFF) == []
    r = VerificationReport.unchecked_because("worker rank 3 does not verify", session="s", version=2)
    assert not r.ok and r.describe() == ("refit session s version 2 verification failed (0 of 0 verified): "
                                         f"{NOTHING}; worker rank 3 does not verify")


def test_check_digest_says_why_a_tensor_must_not_load_and_names_both_causes_of_a_change() -> None:
    """A staged tensor whose digest is not the sender's: the reason names both digests and both ways the
    bytes can change after the sender's digest (staging or transit, or the trainer writing its tensor
    while it is sent: a CPU tensor of 1 MiB or more is copied and digested in two reads)."""
    a, b = "0" * 32, "f" * 32
    assert check_digest(a, a) is None
    why = check_digest(a, b)
    assert why.startswith(f"its digest {a} differs from the sender's {b}: ")
    assert "corrupted in staging or transit" in why and "the trainer's tensor written while it was being sent" in why
    assert check_digest(a, None) == "it carries no sender digest, so its bytes cannot be checked before loading"


def test_replicas_of_one_rank_that_do_not_hold_the_same_tensors_differ():
    """Data-parallel replicas of one (tp, pp) rank hold the same tensors: one a replica lacks is named
    with the replicas that lack it (it used to be compared among its holders only, and pass)."""
    from refit_verify.compare import compare_replicas
    from refit_verify.manifest import EngineSnapshot, TensorState, WorkerIdentity

    def ts(d):
        return TensorState(digest=d * 32, ptr=1, dtype="bfloat16", shape=[4, 4])

    a = EngineSnapshot(worker=WorkerIdentity(rank=0, dp=0), session="s", version=3, params={"w1": ts("a"), "w2": ts("b")})
    b = EngineSnapshot(worker=WorkerIdentity(rank=0, dp=1), session="s", version=3, params={"w1": ts("a")})
    r = compare_replicas([a, b])
    assert not r.ok and r.compared == 1
    assert r.differing == {"w2": f"missing on {b.worker.label()} (held by {a.worker.label()})"}
    same = compare_replicas([a, EngineSnapshot(worker=WorkerIdentity(rank=0, dp=1), session="s", version=3,
                                                 params={"w1": ts("a"), "w2": ts("b")})])
    assert same.ok and same.compared == 2 and same.differing == {}


def test_replicas_compare_buffers_and_nothing_compared_is_not_a_pass():
    """Persistent buffers are compared among replicas of one rank; one replica per rank (nothing that
    two of them must hold alike) is never a pass (it used to be ``ok`` with 0 compared)."""
    from refit_verify.compare import compare_replicas
    from refit_verify.manifest import EngineSnapshot, TensorState, WorkerIdentity

    def ts(d):
        return TensorState(digest=d * 32, ptr=1, dtype="bfloat16", shape=[4, 4])

    def snap(dp, tp=0, **buffers):
        return EngineSnapshot(worker=WorkerIdentity(rank=tp, dp=dp, tp=tp), session="s", version=3, params={"w": ts("a")},
                              buffers={n: ts(d) for n, d in buffers.items()})

    r = compare_replicas([snap(0, cos="c"), snap(1, cos="d")])
    assert not r.ok and r.compared == 2 and list(r.differing) == ["cos (buffer)"]
    assert compare_replicas([snap(0, cos="c"), snap(1, cos="c")]).ok
    lone = compare_replicas([snap(0, cos="c")])
    assert not lone.ok and lone.compared == 0 and lone.differing == {}
    assert "nothing compared" in lone.describe("replicas")
    ranks = compare_replicas([snap(0, tp=0), snap(0, tp=1)])  # two TP ranks, nothing replicated among them
    assert not ranks.ok and ranks.compared == 0
