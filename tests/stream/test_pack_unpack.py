"""The stream layer shared by the staged transport and the broadcast path (``refit_verify.stream.unpack``):
the packer's slot layout, group cuts and oversized path, digests taken before packing, the
receiver's per-entry checks; and the broadcast path's independence from ZMQ."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from refit_verify import tensor_digest
from refit_verify.config import VerifyMode
from refit_verify.digest.batch import DigestBatch
from refit_verify.errors import RefitInputError
from refit_verify.stream.pack import Packer
from refit_verify.stream.unpack import EntryChecker, ReceiveState, view_slots
from refit_verify.stream.items import SENT_TWICE, checked_item, round_up
from refit_verify.wire.fields import Entry


class RecordingSink:
    """A PackSink that keeps every posted group's entries and a copy of its bytes, then scribbles
    over the buffer (as a transport reusing it would)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buf: torch.Tensor | None = None
        self.posts: list[tuple[str, list[Entry], int, bytes]] = []

    def buffer(self, like):
        if self.buf is None:
            self.buf = torch.zeros(self.capacity, dtype=torch.uint8)
        return self.buf

    def post(self, entries, used):
        self.posts.append(("group", list(entries), used, self.buf[:used].numpy().tobytes()))
        self.buf.fill_(0xEE)  # the next group must not depend on what was here
        self.buf = None

    def post_alone(self, u8, entry, aligned, meanwhile=None):
        self.posts.append(("alone", [entry], aligned, u8.numpy().tobytes()))
        if meanwhile is not None:
            meanwhile()


def _t(n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _freed(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage freed under it (as FSDP does after a gather)."""
    t.untyped_storage().resize_(0)
    return t


def test_packer_layout_cuts_and_oversized_path():
    align, cap = 64, 256
    tensors = [("a", _t(10, 0)), ("b", _t(3, 1, torch.bfloat16)), ("big", _t(100, 2)), ("c", _t(40, 3)), ("d", torch.zeros(0)),
               ("e", _t(1, 4)), ("f", _t(30, 5))]
    sink = RecordingSink(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch())
    p.add_all(tensors)
    layout = [(kind, [(e.name, e.offset, e.nbytes) for e in ents], used) for kind, ents, used, _ in sink.posts]
    assert layout == [
        ("group", [("a", 0, 40), ("b", 64, 6)], 128),  # "big" (400 B > 256) flushes the pending group first
        ("alone", [("big", 0, 400)], 448),
        ("group", [("c", 0, 160), ("d", 192, 0), ("e", 192, 4)], 256),  # 0 bytes take no slot; e fills the group
        ("group", [("f", 0, 120)], 128),
    ]
    sent = dict(tensors)
    for _, ents, _, data in sink.posts:
        for e in ents:
            assert data[e.offset : e.offset + e.nbytes] == sent[e.name].contiguous().view(torch.uint8).numpy().tobytes(), e.name
    assert p.tensors == 7 and p.bytes == 40 + 6 + 400 + 160 + 0 + 4 + 120
    assert p.manifest() == {n: tensor_digest(t) for n, t in tensors}


def test_packer_digests_before_packing_and_off_runs_no_digest():
    """What the digest covers is the tensor as given, not the staged bytes: a sink that corrupts a
    slot after packing leaves the sender's manifest unchanged."""
    t = _t(16, 9)

    class Corrupting(RecordingSink):
        def post(self, entries, used):
            self.buf[0] ^= 1
            super().post(entries, used)

    p = Packer(Corrupting(1024), capacity=1024, alignment=16, digests=DigestBatch())
    p.add_all([("w", t)])
    assert p.manifest() == {"w": tensor_digest(t)}
    off = Packer(RecordingSink(1024), capacity=1024, alignment=16, digests=None)
    off.add_all([("w", t)])
    assert off.manifest() is None and off.digest_s == 0.0


@pytest.fixture
def unfused(monkeypatch):
    """CPU tensors without the fused copy+digest (a device where ``add_copy`` copies, then digests):
    what ``digest_first`` digests ahead is then every tensor, not only the oversized ones."""
    import dataclasses

    from refit_verify.digest import backends

    monkeypatch.setattr(backends, "_CPU", [dataclasses.replace(backends.cpu_backend(), copy_many=None)])


def test_packer_digest_first_gives_every_entry_its_digest_and_validates_before_sending(unfused):
    """digest_first (our transport's sender with a list): the refit is digested ahead of its groups;
    every entry of every group carries its tensor's digest, as without it; a bad item of the first
    group raises before anything is posted; a tensor changed after the digest keeps its earlier
    digest (the receiver then refuses the changed bytes: a failure, never a pass)."""
    align, cap = 64, 256
    tensors = [("a", _t(10, 0)), ("b", _t(3, 1, torch.bfloat16)), ("big", _t(100, 2)), ("c", _t(40, 3)), ("f", _t(30, 5))]
    want = {n: tensor_digest(t) for n, t in tensors}
    for first in (False, True):
        sink = RecordingSink(cap)
        p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
        if first:
            p.digest_first(tensors)
            assert set(p._known) == {"a", "b"}  # what the first group can hold; the rest after it is sent
        p.add_all(tensors)
        assert {e.name: e.digest for _, ents, _, _ in sink.posts for e in ents} == want and p.manifest() == want
        assert p._known == (want if first else {})
        assert (p.digest_shadow_s > 0) == first and p.digest_shadow_s <= p.digest_s
    sink = RecordingSink(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        p.digest_first([("a", _t(4, 0)), ("b", [1, 2])])
    with pytest.raises(ValueError, match="given twice"):
        p.digest_first([("a", _t(4, 0)), ("a", _t(4, 1))])
    assert sink.posts == []
    changed = [("x", _t(8, 7)), ("y", _t(8, 8))]
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(changed)
    before = tensor_digest(changed[0][1])
    changed[0][1].add_(1)
    p.add_all(changed)
    (_, ents, _, data), = sink.posts
    assert ents[0].digest == before != tensor_digest(changed[0][1])  # the staged bytes are the changed ones
    assert data[: ents[0].nbytes] == changed[0][1].view(torch.uint8).numpy().tobytes()


def test_packer_digest_first_digests_the_first_group_now_and_the_rest_after_it_is_sent(unfused):
    """digest_first digests only what the first group can hold before anything is sent; the rest
    is digested right after the first group is posted (while the receiver loads it), before any of
    it is packed, and its seconds are counted in digest_shadow_s (after an oversized first tensor:
    inside post_alone, between its send and the wait for the receivers; out of the shadow, after
    post_alone returns, when a sink does not run it). Every item is validated before anything is sent: a
    bad item anywhere raises with nothing posted; only a storage freed under a tensor of the rest
    after the call is found once the first group went. A tensor of the rest changed before that
    post keeps the digest of its bytes as packed."""
    align, cap = 64, 256
    tensors = [("a", _t(10, 0)), ("b", _t(12, 1)), ("c", _t(30, 3)), ("big", _t(100, 2)), ("f", _t(30, 5)), ("g", _t(3, 6))]
    want = {n: tensor_digest(t) for n, t in tensors}
    seen_at_post: list[set[str]] = []

    class Watching(RecordingSink):
        def post(self, entries, used):
            seen_at_post.append(set(p._known))
            super().post(entries, used)

        def post_alone(self, u8, entry, aligned, meanwhile=None):
            seen_at_post.append(set(p._known))
            super().post_alone(u8, entry, aligned, meanwhile)
            seen_at_post.append(("after the receivers' wait", set(p._known)))

    sink = Watching(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(tensors)
    assert set(p._known) == {"a", "b", "c"}  # 64 + 64 + 128 aligned bytes fill the 256-byte group
    assert p.digest_shadow_s == 0.0 < p.digest_s
    p.add_all(tensors)
    assert seen_at_post[0] == {"a", "b", "c"} and seen_at_post[1] == set(want)
    assert [ents[0].name for _, ents, _, _ in sink.posts] == ["a", "big", "f"]
    assert {e.name: e.digest for _, ents, _, _ in sink.posts for e in ents} == want and p.manifest() == want
    assert 0.0 < p.digest_shadow_s < p.digest_s
    # an oversized first tensor is the first part alone; the rest follows its post
    seen_at_post.clear()
    sink = Watching(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(tensors[3:])
    assert set(p._known) == {"big"}
    p.add_all(tensors[3:])
    # the rest is digested inside post_alone, once the tensor is sent and before the sink waits for the receivers
    assert seen_at_post == [{"big"}, ("after the receivers' wait", {"big", "f", "g"}), {"big", "f", "g"}]
    assert p.manifest() == {n: want[n] for n in ("big", "f", "g")}
    assert 0.0 < p.digest_shadow_s < p.digest_s
    # a sink that does not run meanwhile: the rest is digested after post_alone returns, out of the shadow
    class Ignoring(RecordingSink):
        def post_alone(self, u8, entry, aligned, meanwhile=None):
            super().post_alone(u8, entry, aligned)

    p = Packer(Ignoring(cap), capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(tensors[3:])
    p.add_all(tensors[3:])
    assert p._rest is None and p.manifest() == {n: want[n] for n in ("big", "f", "g")}
    assert p.digest_shadow_s == 0.0 < p.digest_s
    # everything fits the first group: nothing is left for after it
    sink = Watching(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(tensors[:2])
    p.add_all(tensors[:2])
    assert p._rest is None and p.digest_shadow_s == 0.0 and p.manifest() == {n: want[n] for n in ("a", "b")}
    # a bad item of the rest raises before anything is sent, whatever kind of bad it is
    for bad_item, err, match in ((("c", [1, 2]), TypeError, "expected a torch.Tensor"), (("a", _t(3, 9)), ValueError, "given twice"),
                                 (("", _t(3, 9)), ValueError, "tensor names must be str"), (42, RefitInputError, "a \\(name, tensor\\) pair, got int"),
                                 (("x", _t(3, 9), 1), RefitInputError, "pair, got tuple of 3 items"),
                                 (("m", torch.empty(4, device="meta")), RefitInputError, "meta tensor"),
                                 (("s", torch.eye(3).to_sparse()), RefitInputError, "dense strided"),
                                 (("f", _freed(_t(8, 3))), RefitInputError, "freed or resized"),
                                 (("v", _freed(_t(8, 3)[2:])), RefitInputError, "freed or resized")):
        sink = RecordingSink(cap)
        p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
        bad = [("a", _t(40, 0)), ("b", _t(40, 1)), bad_item]
        with pytest.raises(err, match=match):
            p.digest_first(bad)
        assert sink.posts == [] and p._known == {}
    # a tensor of the rest whose storage is freed after digest_first: found at its digest, once the first group went
    sink = RecordingSink(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    freed = [("a", _t(40, 0)), ("b", _t(40, 1)), ("c", _t(40, 2))]
    p.digest_first(freed)
    freed[2][1].untyped_storage().resize_(0)
    with pytest.raises(RefitInputError, match="freed or resized"):
        p.add_all(freed)
    assert [ents[0].name for _, ents, _, _ in sink.posts] == ["a"]
    # a tensor of the rest changed before the first post: its digest is of the changed bytes, as packed
    sink = RecordingSink(cap)
    p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
    later = [("x", _t(40, 7)), ("y", _t(40, 8))]
    p.digest_first(later)
    later[1][1].add_(1)
    p.add_all(later)
    assert {e.name: e.digest for _, ents, _, _ in sink.posts for e in ents} == {n: tensor_digest(t) for n, t in later}


def test_packer_cuts_a_group_when_its_entry_list_would_grow_too_large():
    sink = RecordingSink(1 << 20)
    p = Packer(sink, capacity=1 << 20, alignment=16, digests=None, max_entries_bytes=200)
    p.add_all([(f"layers.{i}.weight", _t(2, i)) for i in range(10)])
    assert [len(ents) for _, ents, _, _ in sink.posts] == [3, 3, 3, 1]  # ~50 B per entry estimate


def test_checked_item_names_and_types():
    seen: set[str] = set()
    assert checked_item(("a", torch.ones(1)), seen)[0] == "a"
    with pytest.raises(ValueError, match="given twice"):
        checked_item(("a", torch.ones(1)), seen)
    with pytest.raises(ValueError, match="1..4096 characters"):
        checked_item(("", torch.ones(1)), seen)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        checked_item(("b", [1.0]), seen)


def E(name, dtype, shape, offset, nbytes):
    return Entry(name=name, dtype=dtype, shape=shape, offset=offset, nbytes=nbytes)


def test_entry_checker_refuses_each_bad_entry_alone():
    c = EntryChecker(64)
    entries = [E("ok", "float32", [4], 0, 16), E("dtype", "tensor", [4], 64, 16), E("size", "float32", [4], 64, 20),
               E("misaligned", "float32", [4], 72, 16), E("overlap", "float32", [4], 0, 16), E("past", "float32", [20], 64, 80),
               E("ok2", "bfloat16", [2, 3], 64, 12)]
    slots = c.check(0, entries, 128)
    assert [s.name for s in slots] == ["ok", "ok2"] and slots[1].dtype is torch.bfloat16 and slots[1].shape == [2, 3]
    assert c.rejected == {
        "dtype": "unknown dtype 'tensor'",
        "size": "nbytes 20 != numel 4 × itemsize 4 (float32[4])",
        "misaligned": "offset 72 is not a multiple of the alignment 64",
        "overlap": "offset 0 overlaps the previous entry's slot (which ends at 64)",
        "past": "slot [64, 192) extends past used_bytes 128",
    }
    assert c.received == 7 and c.expected_seq == 1


def test_entry_checker_names_twice_sequence_and_unpadded_tail():
    c = EntryChecker(64)
    assert [s.name for s in c.check(0, [E("a", "int8", [4], 0, 4)], 64)] == ["a"]
    assert c.check(1, [E("a", "int8", [4], 0, 4), E("b", "int8", [4], 64, 4)], 128)[0].name == "b"
    assert c.rejected == {"a": SENT_TWICE}
    assert c.check(5, [E("c", "int8", [4], 0, 4)], 64) == [] and c.rejected["c"] == "buffer seq 5, expected 2"
    padded = EntryChecker(64).check(0, [E("t", "int8", [10], 0, 10)], 10)
    unpadded = EntryChecker(64, padded_tail=False).check(0, [E("t", "int8", [10], 0, 10)], 10)
    assert padded == [] and [s.name for s in unpadded] == ["t"]


def test_receive_state_digests_before_load_and_drops_rejected_names():
    state = ReceiveState.start(VerifyMode.ENFORCE, "r1", 16, None)
    buf = torch.arange(64, dtype=torch.uint8)
    slots = state.checker.check(0, [E("x", "uint8", [16], 0, 16), E("y", "uint8", [16], 8, 16), E("z", "uint8", [4, 4], 16, 16)], 64)
    seen: list[str] = []

    def load(batch):
        for n, v in batch:
            v.zero_()  # load may do anything with the views: the digests were taken before
            seen.append(n)

    state.deliver(view_slots(buf, slots), load, sync_cuda=True)
    manifest, session, error = state.finish(3)
    assert seen == ["x", "z"] and session is None and error is None
    assert manifest == {"x": tensor_digest(torch.arange(16, dtype=torch.uint8)),
                        "z": tensor_digest(torch.arange(16, 32, dtype=torch.uint8).view(4, 4))}
    assert state.checker.rejected == {"y": "offset 8 is not a multiple of the alignment 16"}
    off = ReceiveState.start(VerifyMode.OFF, "r2", 16, None)
    assert off.batch is None and off.finish(1) == (None, None, "sender sent 1 tensors, receiver got 0 entries (0 accepted)")


def test_round_up():
    assert [round_up(n, 512) for n in (0, 1, 512, 513)] == [0, 512, 512, 1024]


def test_broadcast_path_imports_neither_zmq_nor_the_transport():
    code = ("import sys, refit_verify.collective.broadcast, refit_verify.collective.sharded, refit_verify.wire.collective\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'zmq' or m.startswith('refit_verify.transport')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_a_sink_without_meanwhile_still_takes_oversized_tensors():
    """A PackSink written before ``post_alone`` took ``meanwhile`` (three arguments) still gets
    every oversized tensor: the packer passes the keyword only when it has a list's rest to digest
    (a refit given as an iterable, or one that verifies nothing, never has one)."""
    align, cap = 64, 256

    class OldSink(RecordingSink):
        def post_alone(self, u8, entry, aligned):
            self.posts.append(("alone", [entry], aligned, u8.numpy().tobytes()))

    tensors = [("big", _t(100, 2)), ("a", _t(10, 0))]
    for digests in (None, DigestBatch()):
        sink = OldSink(cap)
        p = Packer(sink, capacity=cap, alignment=align, digests=digests)
        p.add_all(iter(tensors))
        assert [(kind, [e.name for e in ents]) for kind, ents, _, _ in sink.posts] == [("alone", ["big"]), ("group", ["a"])]
    assert p.manifest() == {n: tensor_digest(t) for n, t in tensors}


@pytest.mark.parametrize("path", ["kernels", "numba"])
def test_packer_fuses_the_copy_and_digest_of_grouped_tensors(monkeypatch, path):
    """Verifying, with a fused op (``kernels``: the Triton ones, interpreted here on CPU tensors;
    ``numba``: the CPU's own): a grouped tensor is copied into its slot and digested by one op
    (``DigestBatch.add_copy``: no separate digest, no separate copy); digest_first still validates every
    item first, digests ahead only what is not fused (the oversized tensor, sent alone), and every
    entry carries its tensor's digest. A slot corrupted after packing leaves the digests those of the
    tensors as given."""
    if path == "kernels":
        import os

        if not torch.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
        pytest.importorskip("triton")
        from refit_verify.digest.kernels import launch as kd

        if not kd._INTERPRETED:
            pytest.skip("triton was imported without the interpreter on a CUDA machine (see tests/gpu/)")
        monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    else:
        from refit_verify.digest import backends

        if backends.cpu_backend().copy_many is None:
            pytest.skip("no numba backend here")
    fused, plain = [], []
    monkeypatch.setattr(DigestBatch, "add_copy", _spy(DigestBatch.add_copy, fused))
    monkeypatch.setattr(DigestBatch, "add", _spy(DigestBatch.add, plain))
    align, cap = 64, 256
    raw = _t(80, 6)
    tensors = [("a", _t(10, 0)), ("b", _t(3, 1, torch.bfloat16)), ("big", _t(100, 2)), ("c", _t(40, 3).view(8, 5).t()),
               ("d", torch.zeros(0)), ("odd", raw.view(torch.uint8)[3:16]), ("f", _t(30, 5))]
    want = {n: tensor_digest(t) for n, t in tensors}

    class Corrupting(RecordingSink):
        def post(self, entries, used):
            self.buf[0] ^= 1  # after packing: the sender's digest is of the tensor, not of the slot
            super().post(entries, used)

    for sink in (RecordingSink(cap), Corrupting(cap)):
        fused.clear(), plain.clear()
        p = Packer(sink, capacity=cap, alignment=align, digests=DigestBatch(), digests_ahead=True)
        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            p.digest_first([*tensors, ("bad", [1])])  # validated before anything is digested or sent
        assert sink.posts == [] and fused == [] and plain == []
        p.digest_first(tensors)
        assert p._known == {} and [n for n, _ in p._rest] == ["big"]  # only what is not fused, after the first group
        p.add_all(tensors)
        assert fused == ["a", "b", "c", "d", "odd", "f"] and p.fused == 6 and set(p._known) == {"big"}
        assert not set(plain) & set(fused)  # a fused tensor is never digested by a separate read
        assert {e.name: e.digest for _, ents, _, _ in sink.posts for e in ents} == want and p.manifest() == want
        sent = dict(tensors)
        for kind, ents, _, data in sink.posts:
            for e in ents:
                got = data[e.offset : e.offset + e.nbytes]
                exp = sent[e.name].contiguous().view(torch.uint8).numpy().tobytes()
                if isinstance(sink, Corrupting) and kind == "group" and e.offset == 0 and e.nbytes:
                    assert got != exp and got[1:] == exp[1:], e.name  # the corrupted first byte, caught by the receiver
                else:
                    assert got == exp, e.name
        assert p.digest_s > 0.0


def _spy(fn, names: list):
    def wrapped(self, name, *a, **k):
        names.append(name)
        return fn(self, name, *a, **k)

    return wrapped


def test_the_digest_warm_up_runs_a_verifying_packer_on_throwaway_tensors(monkeypatch):
    """The CPU digest warm-up (``backends.warm_paths``) packs a few throwaway tensors through a
    verifying Packer, with and without digests ahead, into a buffer of its own: the first refit's
    sender does not run those paths for the first time. The digests it takes are tensor_digest's."""
    from refit_verify.digest import backends
    from refit_verify.digest.batch import fuses
    from refit_verify.stream import pack

    seen = []
    real = pack.Packer.manifest

    def manifest(self):
        out = real(self)
        seen.append((self.tensors, self.fused, self.ahead, out))
        return out

    monkeypatch.setattr(pack.Packer, "manifest", manifest)
    backends.warm_paths("cpu")
    fused = 6 if fuses(torch.zeros(4, 8, dtype=torch.bfloat16)) else 0
    assert [s[:3] for s in seen] == [(6, fused, True), (6, fused, False)]
    zeros = {f"{i}.{j}": tensor_digest(torch.zeros(shape, dtype=dt)) for i, dt in enumerate((torch.bfloat16, torch.float16, torch.float32))
             for j, shape in enumerate(((4, 8), (8,)))}
    assert seen[0][3] == zeros and seen[1][3] == zeros
