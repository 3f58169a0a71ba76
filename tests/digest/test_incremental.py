"""An add that raises never leaves an earlier add's digest answering for the name.

A caller that catches the error of a failed add (a tensor whose storage was freed, a digest that
ran out of memory) and goes on must not get, for that name, the digest of bytes it added earlier:
that digest matches an engine that kept the old bytes (a false pass). The name is left out of the
batch (:class:`DigestBatch`, :class:`CopyingBatch`) or named in ``changed`` (:class:`HeldBatch`,
:class:`StreamDigests`), as a deferred add found undigestible at the drain already was.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from refit_verify.digest import backends
from refit_verify.boundary.record import _each_readable
from refit_verify.digest.batch import DigestBatch, tensor_digest
from refit_verify.digest.incremental import CopyingBatch, HeldBatch, digest_now
from refit_verify.trainer.exports import StreamDigests
from refit_verify.errors import RefitInputError


@contextlib.contextmanager
def _digest_words_fails_once():
    """The CPU backend's ``digest_words`` raises at its next call (an allocation failing, say), then works."""
    be = backends.backend_for("cpu")
    real = be.digest_words
    calls = []

    def flaky(u8, seeds):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: digest_words failed")
        return real(u8, seeds)

    object.__setattr__(be, "digest_words", flaky)  # a frozen dataclass
    try:
        yield calls
    finally:
        object.__setattr__(be, "digest_words", real)


def _freed_parameter(values: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(values.clone(), requires_grad=False)
    p.untyped_storage().resize_(0)  # as FSDP frees a gathered parameter
    return p


T1 = torch.arange(16, dtype=torch.float32)
T2 = torch.arange(16, dtype=torch.float32) + 100


@pytest.mark.parametrize("hold_cpu", [False, True])
def test_digest_batch_failed_readd_leaves_the_name_out(hold_cpu):
    b = DigestBatch(hold_cpu=hold_cpu)
    b.add("w", T1)
    b.add("v", T2)
    with _digest_words_fails_once() as calls, pytest.raises(RuntimeError, match="injected"):
        b.add("w", T2.view(4, 4).t())  # non-contiguous: digested at the add, through digest_words
    assert calls == [1]
    assert len(b) == 1
    assert b.hexdigests() == {"v": tensor_digest(T2)}  # not the earlier add's digest of w
    b.add("w", T2)
    assert b.hexdigests() == {"v": tensor_digest(T2), "w": tensor_digest(T2)}


def test_digest_batch_failed_checks_leave_a_collected_name_out():
    b = DigestBatch()
    b.add("w", T1)
    assert b.hexdigests() == {"w": tensor_digest(T1)}
    with pytest.raises(RefitInputError):
        b.add("w", torch.empty(4, device="meta"))
    assert b.hexdigests() == {}


def test_digest_batch_failed_first_add_is_no_key_error():
    b = DigestBatch()
    with _digest_words_fails_once(), pytest.raises(RuntimeError, match="injected"):
        b.add("x", T2.view(4, 4).t())
    b.add("y", T1)
    assert len(b) == 1 and b.hexdigests() == {"y": tensor_digest(T1)}


def test_each_readable_leaves_out_only_the_region_that_failed():
    base = torch.arange(64, dtype=torch.float32).view(8, 8)
    items = [("0:a", base.t()), ("0:b", base[::2].t()), ("0:c", torch.arange(8.0))]
    with _digest_words_fails_once():
        got = _each_readable(items)
    assert got == {"0:b": tensor_digest(base[::2].t()), "0:c": tensor_digest(torch.arange(8.0))}


def test_copying_batch_failed_readd_of_a_cpu_tensor_leaves_the_name_out():
    b = CopyingBatch()
    b.add("w", T1)
    with pytest.raises(RefitInputError):
        b.add("w", _freed_parameter(T2))
    assert "w" not in b and b.hexdigests() == {}


def test_held_batch_failed_readd_is_named_changed():
    hb = HeldBatch()
    hb.add("w", T1)
    hb.add("v", T2)
    with pytest.raises(RefitInputError):
        hb.add("w", _freed_parameter(T2))
    assert hb.hexdigests() == {"v": tensor_digest(T2)}
    assert "cannot be digested" in hb.changed["w"] and "freed or resized" in hb.changed["w"]
    hb.add("w", T2)  # a later add that succeeds counts again
    assert hb.hexdigests() == {"v": tensor_digest(T2), "w": tensor_digest(T2)} and hb.changed == {}


def _shrunk_parameter(values: torch.Tensor) -> torch.nn.Parameter:
    """A parameter whose storage was reallocated at half its bytes: it has an address, but not all its bytes."""
    p = torch.nn.Parameter(values.clone(), requires_grad=False)
    p.untyped_storage().resize_(values.numel() * values.element_size() // 2)
    assert p.data_ptr() != 0
    return p


def test_a_held_add_whose_storage_no_longer_holds_it_is_named_at_the_launch_and_never_read():
    """A held add takes a plain tensor with an address at once and leaves the other checks (layout,
    dimensions, its storage holding every byte) to the launch, in passes over the flush: one that fails
    them there is named in ``changed`` with why, never read, and no earlier add's digest answers for it.
    ``digest_now`` (nothing runs between its adds and its launch) raises instead."""
    hb = HeldBatch()
    hb.add("w", T1)
    assert hb.hexdigests() == {"w": tensor_digest(T1)}  # collected: an earlier add's digest is known
    hb.add("v", T2)
    shrunk = _shrunk_parameter(T2)
    hb.add("w", shrunk)  # an address: taken, not checked yet
    assert hb.hexdigests() == {"v": tensor_digest(T2)}
    assert hb.changed["w"].startswith("it cannot be digested: ") and "storage" in hb.changed["w"]
    with pytest.raises(RefitInputError, match="'w'"):
        digest_now([("v", T2), ("w", shrunk)])
    s = StreamDigests(copy=False)
    s.add("v", T2)
    s.add("w", shrunk)
    assert s.digests() == {"v": tensor_digest(T2)} and list(s.changed) == ["w"]


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_held_view_of_a_freed_storage_is_refused_at_its_add_at_any_offset(device):
    """FSDP1 frees a flat buffer under its views: a view at offset 0 has address 0, one further in has
    its offset for an address; both are refused at the add (review of the fast add)."""
    flat = torch.arange(96, dtype=torch.float32, device=device)
    views = {"a": flat[:32], "b": flat[32:96]}
    flat.untyped_storage().resize_(0)
    hb = HeldBatch()
    for name, v in views.items():
        with pytest.raises(RefitInputError, match="freed or resized"):
            hb.add(name, v)
    assert hb.hexdigests() == {} and set(hb.changed) == {"a", "b"}


def test_digest_now_checks_every_pair_before_reading_any_a_pair_given_again_too():
    """The check before loading reads a call's pairs at once: a bad pair raises before anything is
    read, also when a later pair of the same name is good (review of the fast add: the later pair
    would otherwise stand for the name and the bad one reach the model)."""
    good = T2.clone()
    deep = torch.ones((1,) * 256)
    for bad in (_shrunk_parameter(T1), deep):
        with pytest.raises(RefitInputError, match="'w'"):
            digest_now([("w", bad), ("w", good)])


def test_an_expanded_held_tensor_given_other_memory_is_named_replaced_not_freed():
    t = torch.nn.Parameter(torch.ones(1).expand(64), requires_grad=False)
    hb = HeldBatch()
    hb.add("e", t)
    t.data = torch.zeros(1).expand(64)
    assert hb.hexdigests() == {} and hb.changed["e"] == "its memory was replaced after it was added"


def test_a_held_tensor_freed_after_its_add_is_named_freed():
    """The fast add reads no storage size; a tensor freed between its add and the launch (FSDP1's
    resize to 0) is still named for what happened to it, not as replaced memory."""
    hb = HeldBatch()
    p = torch.nn.Parameter(T1.clone(), requires_grad=False)
    hb.add("p", p)
    p.untyped_storage().resize_(0)
    assert hb.hexdigests() == {}
    assert "freed or resized" in hb.changed["p"]


@pytest.mark.parametrize("mode", ["copy", "held", "hold_parameters"])
@pytest.mark.parametrize("collected", [False, True])
def test_stream_digests_failed_readd_is_named_changed_never_stale(mode, collected):
    s = StreamDigests(copy=mode != "held", hold_parameters=mode == "hold_parameters")
    first = torch.nn.Parameter(T1.clone(), requires_grad=False)
    s.add("w", first)
    s.add("v", T2)
    if collected:  # the earlier add's digest already taken into the stream's own map
        assert s.digests() == {"w": tensor_digest(T1), "v": tensor_digest(T2)}
    with pytest.raises(RefitInputError):
        s.add("w", _freed_parameter(T2))
    assert s.digests() == {"v": tensor_digest(T2)}
    assert list(s.changed) == ["w"] and s.changed["w"].startswith("it cannot be digested: ")
    s.add("w", T2.clone())
    assert s.digests() == {"v": tensor_digest(T2), "w": tensor_digest(T2)} and s.changed == {}


@pytest.mark.parametrize("first_held", [True, False])
def test_stream_digests_failed_readd_through_the_other_batch_is_named_changed(first_held):
    """hold_parameters: a name held then re-added as a copy (or the other way round) whose add raised
    is named in ``changed``, not silently missing from both."""
    s = StreamDigests(hold_parameters=True)
    s.add("w", torch.nn.Parameter(T1.clone(), requires_grad=False) if first_held else T1.clone())
    bad = torch.empty(4, device="meta") if first_held else _freed_parameter(T2)
    with pytest.raises(RefitInputError):
        s.add("w", bad)
    assert s.digests() == {} and list(s.changed) == ["w"]


def test_deferred_and_inline_failed_adds_say_the_same():
    got = {}
    for defer in (False, True):
        s = StreamDigests(hold_parameters=True)
        s.defer_held = defer
        s.add("w", torch.nn.Parameter(T1.clone(), requires_grad=False))
        with contextlib.suppress(RefitInputError):
            s.add("w", _freed_parameter(T2))
        got[defer] = (s.digests(), dict(s.changed))
    assert got[False] == got[True] and got[False][0] == {} and "freed or resized" in got[False][1]["w"]


def test_a_failed_inline_add_after_a_deferred_one_of_the_same_name_is_never_drained_over():
    """defer_held: a deferred add of ``w``, then an add of ``w`` that cannot be deferred (no storage to
    record) and raises inline; the drain must not run the earlier deferred add over the failure."""
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("w", torch.nn.Parameter(T1.clone(), requires_grad=False))
    s.add("v", torch.nn.Parameter(T2.clone(), requires_grad=False))
    assert s.deferred == 2
    sparse = torch.nn.Parameter(torch.sparse_coo_tensor([[0]], [1.0], (16,)), requires_grad=False)
    with pytest.raises(RefitInputError):
        s.add("w", sparse)
    assert s.digests() == {"v": tensor_digest(T2)} and list(s.changed) == ["w"]


def test_a_drain_that_raises_keeps_the_adds_it_did_not_reach(monkeypatch):
    """A deferred add whose checks raise something other than RefitInputError (a device error) stops the
    drain; the adds after it stay deferred and are digested by the next read, none silently lost."""
    import refit_verify.digest.incremental as ds

    freed = _freed_parameter(T1)
    real = ds.check_tensor

    def check(t):
        if t is freed:
            raise RuntimeError("injected: a device error in the checks")
        return real(t)

    monkeypatch.setattr(ds, "check_tensor", check)
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("a", torch.nn.Parameter(T1.clone(), requires_grad=False))
    s.add("w", freed)
    s.add("b", torch.nn.Parameter(T2.clone(), requires_grad=False))
    with pytest.raises(RuntimeError, match="injected"):
        s.digests()
    assert s.deferred == 1  # b, not reached
    assert s.digests() == {"a": tensor_digest(T1), "b": tensor_digest(T2)} and list(s.changed) == ["w"]


def test_each_readable_leaves_out_a_queued_region_whose_read_failed():
    """A contiguous region is queued and read at the batch's launch, outside the per-add guard: its
    failure leaves that region out, the others read one by one."""
    be = backends.backend_for("cpu")
    real = be.digest_words
    bad = torch.full((8,), 7.0)

    def words(u8, seeds):
        if u8.data_ptr() == bad.data_ptr():
            raise RuntimeError("injected: this region cannot be read")
        return real(u8, seeds)

    items = [("0:a", bad), ("0:b", torch.arange(8.0)), ("0:c", torch.arange(8.0) + 1)]
    object.__setattr__(be, "digest_words", words)
    try:
        got = _each_readable(items)
    finally:
        object.__setattr__(be, "digest_words", real)
    assert got == {"0:b": tensor_digest(torch.arange(8.0)), "0:c": tensor_digest(torch.arange(8.0) + 1)}


def test_an_inline_held_add_after_defer_held_was_turned_off_wins_over_the_deferred_one():
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("w", torch.nn.Parameter(T1.clone(), requires_grad=False))
    s.defer_held = False
    s.add("w", torch.nn.Parameter(T2.clone(), requires_grad=False))
    assert s.digests() == {"w": tensor_digest(T2)} and s.changed == {}


def test_a_failed_copied_add_after_a_deferred_held_one_of_the_same_name_is_never_drained_over():
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("w", torch.nn.Parameter(T1.clone(), requires_grad=False))
    with pytest.raises(RefitInputError):
        s.add("w", torch.empty(4, device="meta"))  # a plain tensor: the copied batch, raises
    assert s.deferred == 0
    assert s.digests() == {} and list(s.changed) == ["w"]


def test_an_add_that_raised_something_else_says_so_in_changed(monkeypatch):
    """Only an input the digest cannot read is reported as "cannot be digested"; any other error of an
    add (here a device error injected into the copied batch) is named as what it was."""
    s = StreamDigests()
    s.add("w", T1.clone())

    def failing(self, name, t):
        raise RuntimeError("injected: CUDA error")

    monkeypatch.setattr(CopyingBatch, "add", failing)
    with pytest.raises(RuntimeError, match="injected"):
        s.add("w", T2.clone())
    assert s.changed == {"w": "its add raised RuntimeError: injected: CUDA error"}
    monkeypatch.undo()
    assert s.digests() == {}


def test_a_drain_that_raises_in_its_own_check_names_that_add_changed(monkeypatch):
    """The deferred add a drain stopped at is named in ``changed`` even when the drain's own
    changed-since-add check raised (not only when the held batch's add did)."""
    import refit_verify.digest.incremental as ds

    w = torch.nn.Parameter(T2.clone(), requires_grad=False)
    real = ds._changed

    def changed(t, *rest):
        if t is w:
            raise RuntimeError("injected: the storage cannot be read")
        return real(t, *rest)

    monkeypatch.setattr(ds, "_changed", changed)
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    s.add("a", torch.nn.Parameter(T1.clone(), requires_grad=False))
    s.add("w", w)
    with pytest.raises(RuntimeError, match="injected"):
        s.digests()
    assert s.digests() == {"a": tensor_digest(T1)}
    assert s.changed == {"w": "its add raised RuntimeError: injected: the storage cannot be read"}


def test_a_wrapper_subclass_without_memory_of_its_own_is_refused_everywhere():
    """A __torch_dispatch__ wrapper (TwoTensor here; DTensor is one) has elements but address 0: its
    bytes are in the tensors it wraps. Digesting its own address read nothing of them (six of
    different values once shared one digest) or, batched on the CPU, address 0 itself (a crash).
    Every entry point refuses it with RefitInputError (review of 2f161ce)."""
    two = pytest.importorskip("torch.testing._internal.two_tensor")
    ts = [two.TwoTensor(torch.full((4,), float(i)), torch.full((4,), float(-i))) for i in range(6)]
    assert ts[0].data_ptr() == 0
    with pytest.raises(RefitInputError, match="no memory of its own"):
        tensor_digest(ts[0])
    for batch in (CopyingBatch(), HeldBatch(), StreamDigests(copy=True), StreamDigests(copy=False)):
        for i, t in enumerate(ts):
            with pytest.raises(RefitInputError, match="no memory of its own"):
                batch.add(f"t{i}", t)
    with pytest.raises(RefitInputError, match="no memory of its own"):
        digest_now([(f"t{i}", t) for i, t in enumerate(ts)])


def test_a_digest_that_fails_at_the_closing_flush_still_closes_the_workers_session():
    """refit(copy=True) on CPU reads its small copies at the flush, which may be the with-exit's: a
    digest failing there raises, and the workers' session is closed all the same (the next refit's
    open would find it still open otherwise; review of 2f161ce)."""
    import refit_verify

    class Engine:
        def __init__(self):
            self.calls = []

        def collective_rpc(self, method, args=(), timeout=None):
            self.calls.append(method)
            return [{"verifying": True, "rank": 0}] if method.endswith("open") else [{"rank": 0, "manifest": None}]

    be = backends.backend_for("cpu")
    if be.digest_many is None:
        pytest.skip("no compiled CPU batch on this machine")
    real, seen = be.digest_many, []

    def fails_once(many):
        seen.append(1)
        if len(seen) == 1:
            raise RuntimeError("injected: digest_many failed")
        return real(many)

    eng = Engine()
    object.__setattr__(be, "digest_many", fails_once)  # a frozen dataclass
    try:
        with pytest.raises(RuntimeError, match="injected"):
            with refit_verify.refit(eng, mode="enforce") as r:
                for i in range(8):
                    r.add(f"w{i}", torch.randn(32))
    finally:
        object.__setattr__(be, "digest_many", real)
    assert [c.rsplit("_", 1)[-1] for c in eng.calls] == ["open", "close"]


def test_a_copying_batch_flushes_many_small_or_empty_copies_within_flush_bytes():
    """Each queued CPU copy counts its bytes and a fixed cost, so flush_bytes bounds the queue even
    for empty tensors or one name added again and again (review of 2f161ce)."""
    b = CopyingBatch(flush_bytes=8192)
    for _ in range(100):
        b.add("w", torch.empty(0))
        assert sum(map(len, b._batch._queued.values())) <= 16
    assert b.hexdigests() == {"w": tensor_digest(torch.empty(0))}


def _held_check():
    """A ``refit(copy=False)`` with no engine, made to record (what its adds do does not need one)."""
    import refit_verify

    r = refit_verify.refit(None, mode="off", copy=False)
    r.mode = refit_verify.VerifyMode.LOG
    return r


def test_taken_adds_and_full_adds_of_one_name_keep_their_order():
    """``refit(copy=False)``'s add only takes a plain tensor (name, tensor, version) and hands what it
    took to the stream in one loop later: an add that goes through the stream at once (a subclass,
    here) after a taken add of the same name wins, and a taken add after it wins again."""

    class Sub(torch.Tensor):
        pass

    r = _held_check()
    a, b, c = (torch.full((8,), float(i)) for i in range(3))
    r.add("x", torch.ones(2))  # the first add makes the stream (at once)
    r.add("w", a)  # taken
    sub = b.clone().as_subclass(Sub)
    r.add("w", sub)  # every check at once: the taken adds go first
    assert r.expected()["model"] == {"x": tensor_digest(torch.ones(2)), "w": tensor_digest(sub)}
    r.add("w", c)  # taken again, after it
    r.add("v", a)
    assert r.expected()["model"] == {"x": tensor_digest(torch.ones(2)), "w": tensor_digest(c), "v": tensor_digest(a)}


def test_a_taken_add_written_or_freed_before_the_feed_is_named_and_never_raised():
    r = _held_check()
    r.add("first", T1)
    written = torch.nn.Parameter(T1.clone(), requires_grad=False)
    freed = torch.nn.Parameter(T2.clone(), requires_grad=False)
    r.add("written", written)
    r.add("freed", freed)
    moved = torch.nn.Parameter(T2.clone(), requires_grad=False)
    r.add("moved", moved)
    r.add("kept", T2)
    with torch.no_grad():
        written.add_(1)
    freed.untyped_storage().resize_(0)
    moved.data = T2.clone()  # the same bytes elsewhere: not what was pushed from
    assert r.expected()["model"] == {"first": tensor_digest(T1), "kept": tensor_digest(T2)}
    changed = r._streams["model"].changed
    assert "modified in place" in changed["written"] and "freed or resized" in changed["freed"]
    assert changed["moved"] == "its memory was replaced after it was added"
    problems, labels = r._sender_problems()
    assert sorted(labels) == ["freed", "moved", "written"] and len(problems) >= 1


def test_taken_adds_are_fed_as_they_reach_the_held_flush_and_an_inference_tensor_takes_the_full_add(monkeypatch):
    monkeypatch.setattr(StreamDigests, "HELD_FLUSH_BYTES", 1024)
    r = _held_check()
    ts = [torch.full((128,), float(i)) for i in range(7)]  # 512 bytes each: fed every second add
    fed = []
    for i, t in enumerate(ts):
        r.add(f"t{i}", t)
        fed.append(r._streams["model"].uncollected)
    assert fed == [1, 1, 3, 3, 5, 5, 7]
    with torch.inference_mode():
        inf = torch.full((4,), 7.0)
    r.add("inf", inf)  # its version counter cannot be read: the stream's own add, at once
    got = r.expected()["model"]
    assert got == {**{f"t{i}": tensor_digest(t) for i, t in enumerate(ts)}, "inf": tensor_digest(inf)}


def test_a_launch_that_raises_at_a_taken_flush_raises_from_that_add_and_the_close_refuses(monkeypatch):
    """The add whose taken bytes reach the held flush launches the digests: a launch that raises
    (a device error) raises from that add, as the stream's own add would, and the batch refuses
    every later read (review of the taken adds: the error was swallowed and the tensor added twice)."""
    from refit_verify.errors import RefitError

    monkeypatch.setattr(StreamDigests, "HELD_FLUSH_BYTES", 1024)
    real, calls = HeldBatch._launch, []

    def flaky(self, held):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        return real(self, held)

    monkeypatch.setattr(HeldBatch, "_launch", flaky)
    r = _held_check()
    r.add("first", torch.ones(2))  # makes the stream
    r.add("a", torch.full((128,), 1.0))  # 512 bytes: taken
    with pytest.raises(RuntimeError, match="illegal memory access"):
        r.add("b", torch.full((128,), 2.0))  # 1024: fed, launched
    assert calls == [1]
    with pytest.raises(RefitError, match="failed earlier"):
        r.expected()


def test_a_module_equal_to_model_but_not_a_plain_str_adds_to_the_same_stream():
    """``numpy.str_("model")`` or a str subclass names the model: it must not start a new stream (which
    dropped every earlier add, the taken ones too; found in review, older than the taken adds)."""
    np = pytest.importorskip("numpy")

    class Name(str):
        pass

    r = _held_check()
    r.add("x", torch.ones(2))
    r.add("w", torch.full((8,), 1.0))  # taken
    r.add("v", torch.full((8,), 2.0), module=np.str_("model"))
    r.add("u", torch.full((8,), 3.0), module=Name("model"))
    r.add("d", torch.full((8,), 4.0), module=Name("drafter"))
    got = r.expected()
    assert set(got) == {"model", "drafter"} and all(type(k) is str for k in got)
    assert set(got["model"]) == {"x", "w", "v", "u"} and set(got["drafter"]) == {"d"}
