"""Digest work in the shadow of a blocking call (``refit_verify.trainer.overlap``) and the deferred held adds
of :class:`~refit_verify.trainer.exports.StreamDigests` it runs."""

from __future__ import annotations

import threading

import pytest
import torch

from refit_verify import RefitInputError, RefitTimeoutError
from refit_verify.digest.batch import tensor_digest
from refit_verify.trainer.exports import StreamDigests
from refit_verify.trainer.overlap import run_in_shadow

WAIT_S = 10.0  # bound on every wait of these tests (each normally takes microseconds)


def test_work_runs_in_another_thread_while_the_call_blocks():
    """The call waits for an event only the work sets: it returns only if the work ran meanwhile."""
    started, seen = threading.Event(), {}

    def work():
        seen["work"] = threading.get_ident()
        started.set()

    def call():
        seen["call"] = threading.get_ident()
        assert started.wait(WAIT_S), "the work did not run while the call was blocked"
        return 42

    assert run_in_shadow(call, work) == 42
    assert seen["call"] == threading.get_ident() and seen["work"] != seen["call"]


def test_a_failing_call_propagates_unchanged_after_the_work_ends():
    ended = threading.Event()

    def work():
        ended.wait(0.05)
        ended.set()

    with pytest.raises(KeyError, match="vllm's own"):
        run_in_shadow(lambda: (_ for _ in ()).throw(KeyError("vllm's own")), work)
    assert ended.is_set()


def test_a_failing_work_is_raised_after_the_call_returned():
    calls = []
    with pytest.raises(RefitInputError, match="bad tensor"):
        run_in_shadow(lambda: calls.append("call"), lambda: (_ for _ in ()).throw(RefitInputError("bad tensor")))
    assert calls == ["call"]


def test_work_that_outlives_its_bound_times_out_and_the_next_runs_inline():
    release = threading.Event()
    with pytest.raises(RefitTimeoutError, match="did not end within 0.2 s") as ei:
        run_in_shadow(lambda: None, lambda: release.wait(WAIT_S), timeout_s=0.2)
    assert ei.value.progress["waiting_for"] == "shadow work"
    ran = {}
    run_in_shadow(lambda: None, lambda: ran.setdefault("thread", threading.get_ident()))
    assert ran["thread"] == threading.get_ident()  # the helper is still busy: inline, after the call
    release.set()
    for _ in range(200):  # the stuck job ends; the helper takes work again
        seen = {}
        run_in_shadow(lambda: None, lambda: seen.setdefault("thread", threading.get_ident()))
        if seen["thread"] != threading.get_ident():
            break
        threading.Event().wait(0.01)
    assert seen["thread"] != threading.get_ident()


def test_the_wait_after_the_call_is_reported():
    waits = []
    release = threading.Event()
    run_in_shadow(lambda: release.set(), lambda: release.wait(WAIT_S) and threading.Event().wait(0.05), on_wait=waits.append)
    assert len(waits) == 1 and 0.04 <= waits[0] < WAIT_S
    run_in_shadow(lambda: threading.Event().wait(0.05), lambda: None, on_wait=waits.append)
    assert waits[1] < 0.04  # the work ended during the call


def test_an_interrupt_of_the_call_is_not_held_up_by_the_work():
    release = threading.Event()
    t0 = __import__("time").perf_counter()
    with pytest.raises(KeyboardInterrupt):
        run_in_shadow(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), lambda: release.wait(WAIT_S))
    assert __import__("time").perf_counter() - t0 < WAIT_S / 2
    release.set()
    from refit_verify.trainer import overlap as shadow

    helper = shadow._LOCAL.helper  # its work ends now: the next test must find this thread's helper idle, not run inline
    for _ in range(500):
        if not helper.busy:
            break
        threading.Event().wait(0.01)
    assert not helper.busy


def test_a_work_error_beside_a_failed_call_is_logged(caplog):
    with pytest.raises(KeyError, match="vllm"), caplog.at_level("WARNING", logger="refit_verify"):
        run_in_shadow(lambda: (_ for _ in ()).throw(KeyError("vllm")), lambda: (_ for _ in ()).throw(ValueError("digest")))
    assert "shadow work failed beside a call that failed too: ValueError: digest" in caplog.text


def test_a_helper_ends_after_its_calling_thread_and_keeps_nothing_alive(monkeypatch):
    import gc
    import weakref

    from refit_verify.trainer import overlap as shadow

    monkeypatch.setattr(shadow, "IDLE_POLL_S", 0.02)

    class Payload:
        pass

    refs, helpers = [], []

    def one():
        p = Payload()
        refs.append(weakref.ref(p))
        run_in_shadow(lambda: None, lambda p=p: p)
        helpers.append(shadow._LOCAL.helper.thread)

    threads = [threading.Thread(target=one) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    for h in helpers:
        h.join(WAIT_S)
    assert len(helpers) == 5 and not any(h.is_alive() for h in helpers)
    gc.collect()
    assert all(r() is None for r in refs)
    p = Payload()  # this thread lives on, and so does its helper: idle, it holds no job's work
    ref = weakref.ref(p)
    run_in_shadow(lambda: None, lambda p=p: p)
    del p
    gc.collect()
    assert ref() is None and shadow._LOCAL.helper.thread.is_alive()


def test_each_calling_thread_has_its_own_helper():
    idents, errors = {}, []

    def one(k):
        try:
            run_in_shadow(lambda: None, lambda: idents.setdefault(k, threading.get_ident()))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not errors and len(set(idents.values())) == 3


# ------------------------------------------------------------------------- deferred held adds


def _params(n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.nn.Parameter(torch.randn(64 + i, 16, generator=g).to(torch.bfloat16), requires_grad=False)
            for i in range(n)}


def _deferring(ps: dict[str, torch.Tensor]) -> StreamDigests:
    """A trainer's StreamDigests with deferred held adds, ``ps`` added."""
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    for n, p in ps.items():
        s.add(n, p)
    return s


def test_deferred_parameters_digest_as_inline_ones():
    ps = _params()
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    temp = torch.arange(100, dtype=torch.float32)  # a temporary of the export: copied at its add, never deferred
    for n, p in ps.items():
        s.add(n, p)
    s.add("temp", temp)
    assert s.deferred == len(ps)
    temp.zero_()  # the copy taken at its add is what counts
    s.drain(shadow=True)
    assert s.deferred == 0 and s.drain_s > 0 and s.digest_s >= s.drain_s
    got = s.digests()
    assert got == {**{n: tensor_digest(p) for n, p in ps.items()}, "temp": tensor_digest(torch.arange(100, dtype=torch.float32))}


def test_a_parameter_written_after_its_deferred_add_is_named_changed():
    """The version counter is read at the add: an in-place write before the drain is found."""
    ps = _params(3)
    s = _deferring(ps)
    with torch.no_grad():
        ps["layers.1.w"].add_(1)
    got = s.digests()  # drains, then reads
    assert set(got) == {"layers.0.w", "layers.2.w"} and set(s.changed) == {"layers.1.w"}
    assert got["layers.2.w"] == tensor_digest(ps["layers.2.w"])


def test_a_later_copied_add_of_a_deferred_name_wins():
    ps = _params(2)
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("layers.0.w", ps["layers.0.w"])
    replacement = torch.ones(8)
    s.add("layers.0.w", replacement)  # a plain tensor: copied now
    s.add("layers.1.w", ps["layers.1.w"])
    assert s.digests() == {"layers.0.w": tensor_digest(torch.ones(8)), "layers.1.w": tensor_digest(ps["layers.1.w"])}


def test_deferred_parameters_freed_moved_or_undigestible_are_named_changed_never_raised():
    """What an inline add finds at once or at its flush, a deferred one finds at the drain: a storage
    freed under the parameter (FSDP1 after a gather), memory swapped in through ``.data`` (no version
    bump), a tensor with no bytes (meta). None is digested, each is named with why, the rest are."""
    ps = _params(4)
    meta = torch.nn.Parameter(torch.empty(8, 8, device="meta"), requires_grad=False)
    s = _deferring(ps)
    s.add("meta", meta)
    assert s.deferred == 5
    ps["layers.1.w"].untyped_storage().resize_(0)
    ps["layers.2.w"].data = torch.zeros_like(ps["layers.2.w"])
    s.drain(shadow=True)  # does not raise
    assert s.deferred == 0
    got = s.digests()
    assert got == {"layers.0.w": tensor_digest(ps["layers.0.w"]), "layers.3.w": tensor_digest(ps["layers.3.w"])}
    assert set(s.changed) == {"layers.1.w", "layers.2.w", "meta"}
    assert "freed or resized" in s.changed["layers.1.w"]
    assert "memory was replaced" in s.changed["layers.2.w"]
    assert "cannot be digested" in s.changed["meta"] and "meta tensor" in s.changed["meta"]


def test_a_valid_add_after_a_changed_one_of_the_same_name_wins():
    ps = _params(2)
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("layers.0.w", ps["layers.0.w"])
    with torch.no_grad():
        ps["layers.0.w"].add_(1)  # the first add is now stale
    s.drain()
    assert "layers.0.w" in s._held.changed
    s.add("layers.0.w", ps["layers.0.w"])  # exported again, as it is now
    assert s.digests() == {"layers.0.w": tensor_digest(ps["layers.0.w"])} and s.changed == {}


def test_deferred_bytes_past_the_budget_drain_at_once():
    """With no shadow to run them, deferred adds launch every DEFER_BYTES, as inline adds flush."""
    ps = _params(6)
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.defer_bytes = 3 * ps["layers.0.w"].untyped_storage().nbytes()
    for i, (n, p) in enumerate(ps.items()):
        s.add(n, p)
        assert s.deferred == [1, 2, 0, 1, 2, 0][i]
    assert s.drain_s == 0.0 and s.digests() == {n: tensor_digest(p) for n, p in ps.items()}


def test_launch_and_len_count_deferred_adds():
    ps = _params(4)
    s = _deferring(ps)
    assert len(s) == 4 and s.deferred == 4
    s.launch()  # the inline path's launch drains first
    assert s.deferred == 0 and s.drain_s == 0.0
    assert s.digests() == {n: tensor_digest(p) for n, p in ps.items()}


def test_a_drain_that_timed_out_in_the_shadow_blocks_every_other_drain_until_it_ends(monkeypatch):
    """A caller that catches the shadow's timeout and reads the digests while the timed-out drain still
    runs gets a clear error, not the digests of the names that drain reached so far (the rest silently
    missing from the digests and from ``changed``); once it ends, the digests are all there and right."""
    from refit_verify.digest.incremental import HeldBatch
    from refit_verify.errors import RefitProtocolError

    params = {f"p{i}": torch.nn.Parameter(torch.full((64,), float(i)), requires_grad=False) for i in range(40)}
    s = StreamDigests(hold_parameters=True)
    s.defer_held, s.defer_bytes = True, float("inf")
    for n, p in params.items():
        s.add(n, p)
    release, reached = threading.Event(), threading.Event()
    real, seen = HeldBatch.add, []

    def stalling(self, *a, **k):  # the tenth deferred add of the shadow drain stalls (a device that stopped answering)
        if threading.current_thread().name == "refit-verify-shadow":
            seen.append(1)
            if len(seen) == 10:
                reached.set()
                release.wait(WAIT_S)
        return real(self, *a, **k)

    monkeypatch.setattr(HeldBatch, "add", stalling)
    with pytest.raises(RefitTimeoutError):
        run_in_shadow(lambda: None, lambda: s.drain(shadow=True), timeout_s=0.2)
    assert reached.is_set() and len(seen) == 10
    for read in (s.digests, s.launch, lambda: s.drain(collect=True)):
        with pytest.raises(RefitProtocolError, match="still running in another thread"):
            read()
    release.set()
    for _ in range(int(WAIT_S / 0.01)):  # the stalled drain ends and lets go
        if not s._draining.locked():
            break
        threading.Event().wait(0.01)
    assert s.digests() == {n: tensor_digest(p) for n, p in params.items()} and s.changed == {}
