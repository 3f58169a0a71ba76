"""A worker's close records what its engine holds (state digest, close time, what a partial refit
left unchanged) and its certificate says whether the engine still holds it. No vLLM needed: a
WorkerBoundary around the toy model (tests/support/toy_model.py), as the plugin wires it."""

from __future__ import annotations

import time

import pytest
import torch

from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitConfigError, RefitProtocolError
from refit_verify.manifest import Certificate, from_wire
from refit_verify.vllm_plugin import worker_sessions as sessions
from tests.support.toy_model import toy_weights, toy_worker


def _full(wb, model, sid, seed, version):
    wb.open(sid, version=version)
    model.load_weights(list(toy_weights(seed).items()))
    return wb.close(sid)


def test_the_close_records_the_state_digest_and_when():
    _, wb, model = toy_worker()
    before = time.time()
    man = _full(wb, model, "s1", 1, 1)
    assert man.state_digest == wb.baseline.state_digest() and len(man.state_digest) == 32
    assert before <= man.closed_at <= time.time()
    assert man.unchanged == 0 and man.unchanged_since is None  # a first session: nothing earlier to compare with
    again = _full(wb, model, "s2", 1, 2)  # the same bytes: the same state
    assert again.state_digest == man.state_digest
    other = _full(wb, model, "s3", 2, 3)
    assert other.state_digest != man.state_digest


def test_a_partial_close_counts_the_parameters_it_found_unchanged():
    _, wb, model = toy_worker()
    _full(wb, model, "s1", 1, 1)
    wb.open("p", version=2, partial=True)
    model.load_weights([("norm", toy_weights(5)["norm"])])
    man = wb.close("p")
    assert (man.unchanged, man.unchanged_since) == (2, "s1")  # qkv_proj and embed, not the norm it wrote
    wb.open("e", version=3, partial=True)  # nothing written
    man = wb.close("e")
    assert (man.unchanged, man.unchanged_since, man.audits) == (3, "p", [])
    with torch.no_grad():
        model.embed[0, 0] += 1  # changed outside any load
    wb.open("e2", version=4, partial=True)
    man = wb.close("e2")
    assert man.unchanged == 2 and [a.changed for a in man.audits] == [["embed"]]


def test_a_certificate_holds_until_the_engine_state_changes():
    worker, wb, model = toy_worker()
    first = from_wire(sessions.refit_verify_certificate(worker)["certificate"], Certificate)
    assert first.session is None and not first.current and not first.ok
    assert first.problems == ["no refit session has closed on this worker: it holds the weights it was started with, never verified"]
    man = _full(wb, model, "s1", 1, 7)
    out = sessions.refit_verify_certificate(worker)
    assert (out["rank"], out["verifying"]) == (0, True)
    c = from_wire(out["certificate"], Certificate)
    assert (c.session, c.version, c.closed_at, c.state_digest) == ("s1", 7, man.closed_at, man.state_digest)
    assert c.current and c.current_digest == man.state_digest and c.problems == [] and c.unseen == []
    assert c.verified is None and not c.ok  # the worker does not know the trainer's verdict
    with torch.no_grad():
        model.norm[0] += 1
    c = wb.certificate()
    assert not c.current and c.current_digest != c.state_digest and c.state_digest == man.state_digest
    assert c.problems == ["the engine's state changed after session 's1' closed (audit (certificate) of worker rank 0 (dp 0, "
                          "tp 0, pp 0, cpu) failed since session s1 (version 7): 1 changed: norm)"]
    with torch.no_grad():
        model.norm[0] -= 1  # the same bytes again (same storage): current again
    assert wb.certificate().current
    wb.open("s2", version=8)
    c = wb.certificate()
    assert not c.current and c.problems == ["refit session 's2' is open: the engine is being refitted"]
    wb.close("s2")


def test_a_certificate_after_a_failed_snapshot_is_not_current(monkeypatch):
    _, wb, model = toy_worker()

    def broken(*a, **k):
        raise RuntimeError("device lost")

    good = wb.snapshotter
    wb.snapshotter = broken
    wb.open("s1", version=1)
    model.load_weights(list(toy_weights(1).items()))
    man = wb.close("s1")
    assert man.state_digest is None and any("snapshot failed" in e for e in man.errors)
    wb.snapshotter = good
    c = wb.certificate()
    assert not c.current and c.state_digest is None
    assert c.problems == ["the engine-state snapshot at the close of session 's1' failed: there is nothing to compare the engine with"]


def test_the_certificate_digest_covers_every_tensor_in_a_stable_order():
    _, wb, model = toy_worker()
    _full(wb, model, "s1", 3, 1)
    snap = wb.state()
    reordered = type(snap)(worker=snap.worker, session=snap.session, version=snap.version,
                           params=dict(reversed(list(snap.params.items()))), buffers=snap.buffers)
    assert reordered.state_digest() == snap.state_digest()
    assert snap.state_digest() == wb.last.state_digest
    assert set(digest_tensors((n, p.detach()) for n, p in model.named_parameters()).values()) == {
        t.digest for t in snap.params.values()}


def test_a_version_older_than_one_closed_is_out_of_order_a_repeat_and_unversioned_ones_never_are():
    _, wb, model = toy_worker()
    assert _full(wb, model, "v3", 1, 3).stale is None
    assert _full(wb, model, "v5", 2, 5).stale is None
    assert _full(wb, model, "u", 2, None).stale is None  # unversioned: no order, and it leaves the order as it is
    assert wb.max_version == 5
    again = _full(wb, model, "again", 2, 5)
    assert again.stale is None  # a repeat of the newest version (a retried sync) is in order
    late = _full(wb, model, "late", 1, 4)
    assert late.stale == "version 4 is older than version 5 already closed on this worker"
    assert wb.max_version == 5  # a late session never lowers the order
    assert _full(wb, model, "v6", 1, 6).stale is None


def test_restarting_the_version_order_puts_an_older_version_in_order_and_needs_a_reason_and_no_open_session():
    _, wb, model = toy_worker()
    assert wb.restart_versions("nothing closed yet") is None
    assert _full(wb, model, "v5", 1, 5).stale is None
    for bad in ("", "  ", None, 3):
        with pytest.raises(RefitConfigError, match="needs a reason"):
            wb.restart_versions(bad)
    assert wb.max_version == 5  # a refused restart changes nothing
    wb.open("open", version=7)
    with pytest.raises(RefitProtocolError, match="session 'open' is open"):
        wb.restart_versions("resumed from step 2")
    wb.close("open")
    assert wb.restart_versions("resumed from step 2") == 5
    assert _full(wb, model, "v2", 2, 2).stale is None and wb.max_version == 2
    assert _full(wb, model, "v1", 1, 1).stale == "version 1 is older than version 2 already closed on this worker"


def test_a_session_that_loaded_nothing_orders_nothing():
    """An aborted session (opened with a version, closed before any load) left the engine as it was:
    a later, lower version is still in order."""
    _, wb, model = toy_worker()
    assert _full(wb, model, "v5", 1, 5).stale is None
    wb.open("aborted", version=6000)
    wb.close("aborted")
    assert wb.max_version == 5
    assert _full(wb, model, "v6", 2, 6).stale is None and wb.max_version == 6


def test_a_late_older_session_leaves_a_certificate_of_the_older_version_that_does_not_hold():
    worker, wb, model = toy_worker()
    _full(wb, model, "v5", 2, 5)
    cert = from_wire(sessions.refit_verify_certificate(worker)["certificate"], Certificate)
    assert (cert.session, cert.version, cert.current, cert.problems) == ("v5", 5, True, [])
    late = _full(wb, model, "v3", 1, 3)
    cert = from_wire(sessions.refit_verify_certificate(worker)["certificate"], Certificate)
    assert (cert.session, cert.version, cert.state_digest) == ("v3", 3, late.state_digest)  # what the engine holds
    assert not cert.current and not cert.ok
    assert cert.problems == ["the last session closed on this worker, 'v3', was out of order (version 3 is older than "
                             "version 5 already closed on this worker)"]


def test_every_way_into_a_session_goes_through_the_order_check():
    from refit_verify.boundary.worker import SessionDigests

    _, wb, model = toy_worker()
    _full(wb, model, "v5", 2, 5)
    d = SessionDigests(wb, "transport")  # a transport's implicit session (push, RefitSender, broadcast)
    d.begin("r-late", None, 2)
    model.load_weights(list(toy_weights(1).items()))
    _, man = d.finish()
    assert (man.version, man.stale) == (2, "version 2 is older than version 5 already closed on this worker")
    d = SessionDigests(wb, "native")  # an implicit session a trainer's explicit open then takes over, with its version
    d.begin("r", None)
    wb.open("outer", version=4)
    model.load_weights(list(toy_weights(1).items()))
    man = wb.close("outer")
    assert (man.session, man.version, man.stale) == ("outer", 4, "version 4 is older than version 5 already closed on this "
                                                                 "worker")
    d = SessionDigests(wb, "transport")
    d.begin("r-ok", None, 9)
    model.load_weights(list(toy_weights(1).items()))
    assert d.finish()[1].stale is None and wb.max_version == 9


def test_a_payload_of_another_producer_than_the_one_that_must_feed_the_worker_is_named():
    from refit_verify.boundary.worker import SessionDigests
    from refit_verify.manifest import Producer

    _, wb, model = toy_worker()
    for i, (expect, producer, misrouted) in enumerate(((1, Producer(rank=1, device="cuda:1"), None),
                                        (None, Producer(rank=3, device="cpu"), None),  # no expectation: any producer
                                        (0, None, None),  # a sender that names no rank: nothing to compare
                                        (0, Producer(rank=1, device="cuda:1"),
                                         "worker rank 0 (tp 0, pp 0) received the payload of producer rank 1 (cuda:1); it "
                                         "must be fed by producer rank 0"))):
        d = SessionDigests(wb, "transport", expect_producer=expect)
        d.begin(f"r{i}", producer)  # a refit id names one refit
        model.load_weights(list(toy_weights(1).items()))
        assert d.finish()[1].misrouted == misrouted
    wb.open("outer", version=1)  # a transport joining a trainer's session: checked as it joins
    d = SessionDigests(wb, "transport", expect_producer=0)
    d.begin("r2", Producer(rank=2, device="cpu"))
    model.load_weights(list(toy_weights(1).items()))
    d.finish()
    assert wb.close("outer").misrouted.startswith("worker rank 0 (tp 0, pp 0) received the payload of producer rank 2")


def test_prepare_builds_what_the_first_close_keeps_and_changes_no_verdict():
    """``WorkerBoundary.prepare`` (the plugin runs it once the model is loaded): the model index and the
    engine-state kept set exist before any session, the first close uses them as they are, and its
    manifest is the one an unprepared worker's first close gives."""
    _, wb, model = toy_worker()
    b = wb.modules["model"]
    assert b._index is None or b._index.kept.get("set") is None
    assert wb.prepare() is True
    idx = b._index
    ds = idx.kept["set"][0]
    assert ds is not None and ds.valid()
    assert wb.baseline is None and wb.last is None and wb.manifests == {}  # no audit baseline, no session
    man = _full(wb, model, "s1", 1, 1)
    assert b._index is idx and idx.kept["set"][0] is ds  # built before the refit, not again in it
    _, plain_wb, plain_model = toy_worker()
    plain = _full(plain_wb, plain_model, "s1", 1, 1)
    assert man.state_digest == plain.state_digest and man.engine.params == plain.engine.params
    assert man.modules["model"].digests == plain.modules["model"].digests
    assert wb.prepare() is False  # a session closed: its close built them


def test_prepare_does_nothing_while_a_session_is_open():
    _, wb, model = toy_worker()
    wb.open("s1", version=1)
    assert wb.prepare() is False
    model.load_weights(list(toy_weights(1).items()))
    assert wb.close("s1").engine is not None


def _toy_specs():
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in toy_weights(1).items()}


def test_prepare_learns_the_placements_ahead_and_the_first_close_is_the_same():
    """``prepare(specs=...)``: the loaders' placements are learned before any refit (the model's own
    load_weights on placeholders, no write reaching the model); the first refit records nothing again
    and its manifest is an unprepared worker's."""
    _, wb, model = toy_worker()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    assert wb.prepare(specs={"model": _toy_specs()}) is True
    tap = wb.modules["model"].tap
    assert len(tap.ahead) == 5 and len(tap.placements) == 5  # q, k, v blocks, the padded embed, the norm
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())  # nothing written
    assert wb.baseline is None and wb.last is None and wb.manifests == {}
    learned = dict(tap.placements)
    man = _full(wb, model, "s1", 1, 1)
    assert tap.placements == learned and all(tap.placements[k] is learned[k] for k in learned)
    _, plain_wb, plain_model = toy_worker()
    plain = _full(plain_wb, plain_model, "s1", 1, 1)
    assert man.state_digest == plain.state_digest and man.engine.params == plain.engine.params
    assert man.modules["model"].digests == plain.modules["model"].digests


def test_prepare_builds_the_first_closes_state_and_regions_set_and_reads_them_again_at_the_close():
    """With ``specs`` the prepare also plans the regions a close of such a refit reads inside fused
    parameters (q, k, v rows of ``qkv_proj``; the padded ``embed``'s rows) and builds the close's one kept
    set over the state and them: the first close launches that set as it is (no set built in it) and
    reads every byte then. The digests differ from what the prepare saw (the refit wrote new bytes)."""
    _, wb, model = toy_worker()
    assert wb.prepare(specs={"model": _toy_specs()}) is True
    idx = wb.modules["model"]._index
    ahead = idx.kept["close_extra"]
    assert {p for p, _ in ahead[1]} == {"qkv_proj", "embed"} and len(ahead[1]) == 5 and ahead[2] is not None
    man = _full(wb, model, "s1", 1, 1)
    assert idx.kept["close_extra"] is ahead  # built at the prepare, launched by the first close
    assert man.reads.passes == 1 and man.reads.why == []
    _, plain_wb, plain_model = toy_worker()
    plain = _full(plain_wb, plain_model, "s1", 1, 1)
    assert man.state_digest == plain.state_digest and man.engine.params == plain.engine.params
    assert man.reads == plain.reads and all(p.status == "verified" for p in man.engine.params.values())


def test_a_first_refit_that_writes_other_regions_than_prepared_plans_them_at_its_close():
    """Prepared for a checkpoint without ``k_proj``: the set built ahead lacks k's rows. The real first
    refit writes them too, so its close plans its own regions and builds its set (as unprepared), and a
    wrong byte in k's rows is still found."""
    _, wb, model = toy_worker()
    specs = {n: v for n, v in _toy_specs().items() if "k_proj" not in n}
    assert wb.prepare(specs={"model": specs}) is True
    idx = wb.modules["model"]._index
    ahead = idx.kept["close_extra"]
    assert len(ahead[1]) == 4
    man = _full(wb, model, "s1", 1, 1)
    assert idx.kept["close_extra"] is not ahead and len(idx.kept["close_extra"][1]) == 5
    assert man.reads.passes == 1 and all(p.status == "verified" for p in man.engine.params.values())
    from refit_verify.compare import compare_session

    w = toy_weights(2)
    wb.open("s2", version=2)
    model.load_weights(list(w.items()))
    with torch.no_grad():
        model.qkv_proj.view(-1)[64 + 3] += 1  # inside k's rows, after the load
    r = compare_session({"model": digest_tensors(w.items())}, wb.close("s2"), version=2)
    assert not r.ok and list(r.engine_mismatched) == ["qkv_proj"]


def test_a_placement_learned_ahead_that_the_real_load_contradicts_fails_the_refit():
    """The loader writes k into v's rows and v into k's from the first real load on, unlike during the
    dry learn: the placements learned ahead say where k and v should be, the read-back finds the other
    block's bytes there, and the refit fails naming qkv_proj (never a pass)."""
    from refit_verify.compare import compare_session

    _, wb, model = toy_worker()
    assert wb.prepare(specs={"model": _toy_specs()}) is True
    model.swap_halves_after = model.qkv_loads
    w = toy_weights(1)
    wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    man = wb.close("s1")
    r = compare_session({"model": digest_tensors(w.items())}, man, version=1)
    assert not r.ok and list(r.engine_mismatched) == ["qkv_proj"]


def test_an_audit_of_the_state_a_session_with_errors_left_fails_and_an_automatic_one_is_not_kept():
    """A session marked with an error while open (``fail_open``: a native send that raised) closes with
    it; an audit asked for fails on that baseline whoever asks, an automatic one (a wake) is not kept
    for the next refit (which rewrites the state), and a clean session after it audits clean."""
    _, wb, model = toy_worker()
    w = toy_weights(1)
    assert not wb.fail_open("s1", "not open")
    sid = wb.open("s1")
    model.load_weights(list(w.items())[:2])
    assert wb.fail_open("s1", "the trainer's send into this update raised before it finished (RuntimeError: x)")
    assert wb.close(sid).errors == ["the trainer's send into this update raised before it finished (RuntimeError: x)"]
    a = wb.audit()
    assert not a.ok and a.problems == ["its baseline is the state session 's1' left, which recorded errors (the trainer's send "
                                       "into this update raised before it finished (RuntimeError: x)): it is not verified"]
    assert wb.audit("wake_up").ok and wb.pending_audits == []
    sid = wb.open("s2")
    model.load_weights(list(w.items()))
    assert wb.close(sid).errors == [] and wb.audit().ok
