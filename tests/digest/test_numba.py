"""The numba CPU path of digest v1 (``_numba_digest``) is bit-identical to the reference and to
the torch CPU path, for every size class of the tree, odd offsets and every dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from refit_verify.digest import tensors  # noqa: E402
from refit_verify.digest import backends
from refit_verify import tensor_digest

from refit_verify.digest import _torch as _torch_digest

from refit_verify.digest import batch as digest

from refit_verify.digest import reference
from refit_verify.errors import RefitConfigError

nd = pytest.importorskip("refit_verify.digest._numba")

CHUNK = reference.CHUNK_LANES


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _numba(u8: torch.Tensor, name: str = "uint8", shape: tuple[int, ...] | None = None) -> str:
    return nd.digest_u8(u8, name, (u8.numel(),) if shape is None else shape)


def _torch(u8: torch.Tensor, name: str = "uint8", shape: tuple[int, ...] | None = None) -> str:
    return _torch_digest.digest_u8(u8, name, (u8.numel(),) if shape is None else shape)


def _ref(u8: torch.Tensor, name: str = "uint8", shape: tuple[int, ...] | None = None) -> str:
    return reference.digest_bytes(u8.numpy().tobytes(), name, (u8.numel(),) if shape is None else shape)


# Lane counts around every boundary of the tree: one lane, a group (16), a stride (256),
# a level-0 block (4096), a level-1 block / fused unit (65536).
SMALL_LANES = [0, 1, 2, 7, 8, 9, 15, 16, 17, 127, 128, 129, 255, 256, 257, 4095, 4096, 4097]
BIG_LANES = [65535, 65536, 65537]


@pytest.mark.parametrize("lanes", SMALL_LANES)
@pytest.mark.parametrize("extra", [0, -1, -7])
def test_small_vs_reference(lanes: int, extra: int) -> None:
    n = max(0, lanes * 8 + extra)
    u8 = _bytes(n, seed=lanes)
    want = _ref(u8)
    assert _numba(u8) == want
    assert _torch(u8) == want


@pytest.mark.parametrize("nbytes", [1, 2, 3, 4, 5, 6, 7, 8, 13, 8 * 4096 + 3])
def test_partial_tail_vs_reference(nbytes: int) -> None:
    u8 = _bytes(nbytes, seed=nbytes)
    assert _numba(u8) == _ref(u8)


@pytest.mark.parametrize("lanes", BIG_LANES)
def test_level1_boundaries_vs_reference(lanes: int) -> None:
    u8 = _bytes(lanes * 8 - (lanes % 3), seed=lanes)  # 65535: whole lanes; others: a partial tail
    assert _numba(u8) == _ref(u8)


@pytest.mark.parametrize(
    "nbytes",
    [
        (CHUNK - 1) * 8,
        CHUNK * 8 - 3,  # the tail lane completes the first chunk
        CHUNK * 8,
        (CHUNK + 1) * 8,
        CHUNK * 8 + 5,  # second chunk is only the tail lane
        2 * CHUNK * 8,
        (2 * CHUNK + 4097) * 8 + 1,  # two full chunks + a partial one with a tail
    ],
)
def test_chunk_boundaries_vs_torch(nbytes: int) -> None:
    u8 = _bytes(nbytes, seed=nbytes % 1000)
    assert _numba(u8) == _torch(u8)


def test_one_full_chunk_vs_reference() -> None:
    """One reference run over a whole chunk (the only check of the fused unit path vs the spec)."""
    u8 = _bytes(CHUNK * 8, seed=7)
    assert _numba(u8) == _ref(u8)


@pytest.mark.parametrize("offset", [1, 2, 3, 4, 5, 7, 8, 16])
@pytest.mark.parametrize("lanes", [0, 1, 9, 257, 4097])
def test_storage_offsets(offset: int, lanes: int) -> None:
    for extra in (0, -3):
        n = max(0, lanes * 8 + extra)
        big = _bytes(n + offset + 8, seed=offset)
        u8 = big[offset : offset + n]
        assert u8.storage_offset() == offset
        assert _numba(u8) == _ref(u8)


def test_misaligned_multi_chunk_vs_torch() -> None:
    n = (CHUNK + 70000) * 8 + 3
    big = _bytes(n + 3, seed=3)
    u8 = big[3:]
    assert u8.data_ptr() % 8 != 0
    assert _numba(u8) == _torch(u8)


def test_parallel_equals_serial() -> None:
    lanes = _bytes((2 * CHUNK + 3 * 65536 + 4100) * 8, seed=11).numpy().view(np.uint64)
    s0, s1 = np.uint64(0x0123456789ABCDEF), np.uint64(0xFEDCBA9876543210)
    for has_tail in (False, True):
        tail = np.uint64(0xA5)
        assert nd.digest_lanes(lanes, has_tail, tail, s0, s1, True) == nd.digest_lanes(
            lanes, has_tail, tail, s0, s1, False
        )


def test_serial_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    u8 = _bytes(CHUNK * 8 + 9, seed=5)
    want = _numba(u8)
    monkeypatch.setattr(nd, "PARALLEL_MIN_LANES", 1 << 62)
    assert _numba(u8) == want
    monkeypatch.setattr(nd, "PARALLEL_MIN_LANES", 0)
    assert _numba(_bytes(8 * 300, seed=1)) == _ref(_bytes(8 * 300, seed=1))


def test_metadata_enters_digest() -> None:
    u8 = _bytes(64)
    assert _numba(u8, "uint8", (64,)) == _ref(u8, "uint8", (64,))
    assert _numba(u8, "float32", (4, 4)) == _ref(u8, "float32", (4, 4))
    assert _numba(u8, "float32", (4, 4)) != _numba(u8, "float32", (16,))


DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.uint16, torch.uint32, torch.uint64,
    torch.complex64, torch.complex128,
    torch.float8_e4m3fn, torch.float8_e5m2,
]  # fmt: skip


def _make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        raw = raw & 1
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (5, 7), (33, 65), (2, 3, 129)])
def test_all_dtypes_via_tensor_digest(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _make(dtype, shape, seed=len(shape) * 31 + sum(shape))
    u8 = digest.logical_bytes(t)
    name = tensors.dtype_name(dtype)
    want = reference.digest_bytes(u8.numpy().tobytes(), name, tuple(t.shape))
    assert tensor_digest(t) == want
    assert _torch_digest.digest_u8(u8, name, tuple(t.shape)) == want


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.complex64], ids=str)
def test_views(dtype: torch.dtype) -> None:
    base = _make(dtype, (37, 41), seed=2)
    for v in (base[1:], base[:, 3:], base.t(), base[5:9, 7:30:3], base[3, 5]):
        assert tensor_digest(v) == tensor_digest(v.contiguous().clone())
        u8 = digest.logical_bytes(v)
        want = reference.digest_bytes(u8.numpy().tobytes(), tensors.dtype_name(dtype), tuple(v.shape))
        assert tensor_digest(v) == want


@pytest.mark.parametrize("nbytes, offset", [(0, 0), (5, 3), (64, 0), (8 * 4097 + 3, 1), (8 * 70000, 8)])
def test_digest_words_equal_reference_and_torch(nbytes: int, offset: int) -> None:
    """``digest_words`` (the DigestBatch entry of both CPU paths) gives ``reference.chain_and_finalise``
    of the reference's chunk roots; the hex of those words is ``digest_u8``."""
    u8 = _bytes(nbytes + offset, seed=nbytes)[offset:]
    seeds = reference.seed("uint8", (nbytes,), nbytes)
    lanes = reference.lanes(u8.numpy().tobytes())
    chunks = [lanes[i : i + CHUNK] for i in range(0, len(lanes), CHUNK)]
    want = reference.chain_and_finalise(seeds, [(reference.chunk_root(0, c), reference.chunk_root(1, c)) for c in chunks])
    assert nd.digest_words(u8, seeds) == want
    assert _torch_digest.digest_words(u8, seeds) == want
    assert reference.hexdigest(*want) == _numba(u8) == _ref(u8)


def test_digesting_a_cpu_tensor_leaves_its_storage_resizable():
    """The CPU path reads the bytes through DLPack: Tensor.numpy() would pin the storage as not resizable,
    and a trainer that frees a pushed tensor's storage (resize_(0), as FSDP does) would fail after r.add."""
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.trainer.exports import StreamDigests

    t = torch.arange(1001, dtype=torch.uint8)
    want = tensor_digest(t.clone())
    s = StreamDigests()
    s.add("t", t)
    assert s.digests() == {"t": want}
    t.untyped_storage().resize_(0)  # raised "Trying to resize storage that is not resizable" before
    assert t.untyped_storage().nbytes() == 0


def test_stream_digests_holds_parameters_and_copies_the_rest():
    """StreamDigests(hold_parameters=True): an nn.Parameter is held (a write after the add is caught by
    its version counter and the name left out), any other tensor is taken as it was at the add, and
    the latest add of a name decides which of the two it is."""
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.trainer.exports import StreamDigests

    p = torch.nn.Parameter(torch.arange(64, dtype=torch.float32), requires_grad=False)
    t = torch.arange(64, dtype=torch.float32) * 3
    want_p, want_t = tensor_digest(p.detach().clone()), tensor_digest(t.clone())
    s = StreamDigests(hold_parameters=True)
    s.add("p", p)
    s.add("t", t)
    t.add_(1)  # copied (on CPU: digested) at the add
    assert s.digests() == {"p": want_p, "t": want_t} and s.changed == {}
    s.add("p", p)
    with torch.no_grad():
        p.add_(1)
    assert s.digests() == {"t": want_t}
    assert list(s.changed) == ["p"] and "modified in place" in s.changed["p"]
    s.add("p", p.detach().clone())  # the same name again, now a plain tensor: copied, and it wins
    assert s.digests() == {"p": tensor_digest(p.detach()), "t": want_t} and s.changed == {}
    s.add("q", torch.zeros(3))
    s.add("q", p)  # a plain tensor first, then a parameter: the held one is what counts
    assert s.digests()["q"] == tensor_digest(p.detach())


def test_digest_many_equals_one_call_per_string():
    """``digest_arrays_many``: one compiled call over many strings equals ``digest_words`` string by
    string (every length 0..80, lane and block edges, the largest length it takes), and it refuses a
    misaligned address or a length out of range before reading anything."""
    from refit_verify.digest import _numba_many as nm
    from refit_verify.digest.tensors import tensor_seed

    g = torch.Generator().manual_seed(5)
    lengths = [*range(81), 127, 128, 129, 4095, 4096, 4097, 16 * 256 * 8 + 8, nm.MANY_MAX_BYTES - 1]
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in lengths]
    items = [(t.data_ptr(), t.numel(), tensor_seed(torch.bfloat16, (t.numel(), 1), t.numel())) for t in ts]
    assert all(a % 8 == 0 for a, _, _ in items)
    assert nm.digest_words_many(items) == [nd.digest_words(t, s) for t, (_, _, s) in zip(ts, items)]
    assert nm.digest_words_many([]) == []
    big = torch.zeros(nm.MANY_MAX_BYTES, dtype=torch.uint8)
    with pytest.raises(ValueError, match="8-byte aligned"):
        nm.digest_words_many([(ts[20].data_ptr() + 1, 3, (0, 0))])
    with pytest.raises(ValueError, match="MANY_MAX_BYTES"):
        nm.digest_words_many([(big.data_ptr(), nm.MANY_MAX_BYTES, (0, 0))])


def test_a_many_plan_reads_its_strings_where_they_are_now():
    """``plan_many`` checks the strings once; ``run_many`` reads them as they are at each call, at
    the planned addresses or at others given (copies of the same lengths), and refuses a wrong
    count or a misaligned address before reading anything."""
    from refit_verify.digest import _numba_many as nm

    g = torch.Generator().manual_seed(6)
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in (0, 5, 8, 13, 4096, 70_001)]
    items = [(t.data_ptr(), t.numel(), (i * 7919, i * 104_729)) for i, t in enumerate(ts)]
    plan = nm.plan_many(items)
    assert len(plan) == len(ts)

    def words(o):
        return list(zip(o[0].tolist(), o[1].tolist()))

    assert words(nm.run_many(plan)) == nm.digest_words_many(items)
    ts[3][0] ^= 1  # read as it is now
    assert words(nm.run_many(plan)) == [nd.digest_words(t, s) for t, (_, _, s) in zip(ts, items)]
    copies = [t.clone() for t in ts]
    copies[4][9] ^= 1
    want = [nd.digest_words(t, s) for t, (_, _, s) in zip(copies, items)]
    assert words(nm.run_many(plan, (t.data_ptr() for t in copies))) == want
    with pytest.raises(ValueError, match="6 addresses"):
        nm.run_many(plan, [t.data_ptr() for t in copies[:5]])
    with pytest.raises(ValueError, match="6 addresses"):  # one more than planned: refused, not cut
        nm.run_many(plan, (t.data_ptr() for t in copies + copies[:1]))
    with pytest.raises(ValueError, match="6 addresses"):
        nm.run_many(plan, [float(t.data_ptr()) for t in copies])
    with pytest.raises(ValueError, match=r"\[0, 2\*\*64\)"):
        nm.run_many(plan, [-8] + [t.data_ptr() for t in copies[1:]])
    with pytest.raises(ValueError, match="read-only"):
        plan.addrs[0] = 0
    with pytest.raises(ValueError, match="8-byte aligned"):
        nm.run_many(plan, [t.data_ptr() + (1 if i == 2 else 0) for i, t in enumerate(copies)])
    with pytest.raises(ValueError, match="8-byte aligned"):
        nm.plan_many([(ts[1].data_ptr() + 1, 3, (0, 0))])


def test_held_cpu_batch_reads_at_launch_and_matches_tensor_digest():
    """``DigestBatch(hold_cpu=True)`` gives ``tensor_digest`` of each tensor as it is at the launch,
    whatever the tensor (empty, odd length, misaligned view, strided, complex, conjugate, bool, one
    too big for the batched call, a name added twice); the default batch digests at ``add``."""
    from refit_verify.digest.batch import DigestBatch, tensor_digest

    ts = {"w": torch.randn(64, 32, dtype=torch.bfloat16), "odd": torch.arange(13, dtype=torch.uint8),
          "empty": torch.zeros(0), "mis": torch.arange(40, dtype=torch.uint8)[3:20],
          "strided": torch.arange(64.).reshape(8, 8).t(), "cplx": torch.randn(5, dtype=torch.complex64),
          "conj": torch.randn(5, dtype=torch.complex64).conj(), "bool": torch.tensor([True, False, True]),
          "big": torch.randn(1 << 18)}
    b = DigestBatch(hold_cpu=True)
    for n, t in ts.items():
        b.add(n, t)
    b.add("odd", ts["w"])  # the later add of a name is what counts
    ts["w"][0, 0] += 1  # read at the launch: the digest is of the tensor as it is then
    want = {n: tensor_digest(t) for n, t in ts.items()}
    want["odd"] = want["w"]
    assert b.hexdigests() == want
    now = DigestBatch()
    before = tensor_digest(ts["w"])
    now.add("w", ts["w"])
    ts["w"][0, 0] += 1
    assert now.hexdigests() == {"w": before}


def test_a_tensor_whose_storage_was_freed_is_refused_never_read():
    """A storage freed or shrunk under its tensor (``resize_(0)``, as FSDP does) leaves ``data_ptr`` at
    nothing: reading it digested other memory (numpy's DLPack import gave an array elsewhere). Refused
    with a clear error at add, and at the launch of a batch that queued the tensor before."""
    from refit_verify.digest.batch import DigestBatch, tensor_digest
    from refit_verify.errors import RefitInputError

    t = torch.randn(1000)
    t.untyped_storage().resize_(0)
    with pytest.raises(RefitInputError, match="freed or resized"):
        tensor_digest(t)
    v = torch.randn(64)[8:40]  # a view: its span ends inside the storage
    assert tensor_digest(v) == tensor_digest(v.clone())
    shrunk = torch.randn(64)
    view = shrunk[32:]
    shrunk.untyped_storage().resize_(32 * 4)  # the view's elements now lie past the storage's end
    with pytest.raises(RefitInputError, match="fewer than the 256"):
        tensor_digest(view)
    b = DigestBatch(hold_cpu=True)
    u = torch.randn(1000)
    b.add("u", u)
    u.untyped_storage().resize_(0)  # after the add, before the read
    with pytest.raises(RefitInputError, match="freed or resized"):
        b.hexdigests()
    assert tensor_digest(torch.zeros(3, 1).expand(3, 5)) == tensor_digest(torch.zeros(3, 5))  # stride 0 spans less


def test_stream_digests_held_batches_launch_at_their_own_threshold(monkeypatch):
    """Held tensors (``copy=False``, and the parameters of ``hold_parameters=True``) launch every
    ``held_flush_bytes`` (default HELD_FLUSH_BYTES, 1 GiB: holding costs no memory of ours), copies
    every FLUSH_BYTES; the digests are the same whatever the threshold."""
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.digest.incremental import CopyingBatch, HeldBatch
    from refit_verify.trainer.exports import StreamDigests

    assert StreamDigests.HELD_FLUSH_BYTES == 1 << 30 and StreamDigests.FLUSH_BYTES == 256 << 20
    held = StreamDigests(copy=False)
    assert isinstance(held._batch, HeldBatch) and held._batch.flush_bytes == 1 << 30
    mixed = StreamDigests(hold_parameters=True)
    assert isinstance(mixed._batch, CopyingBatch) and mixed._batch.flush_bytes == 256 << 20
    assert mixed._held.flush_bytes == 1 << 30
    ts = {f"w{i}": torch.arange(100, dtype=torch.float32) + i for i in range(5)}  # 400 bytes each
    want = {n: tensor_digest(t.clone()) for n, t in ts.items()}
    launches = []
    raw = HeldBatch.launch

    def counting(self):
        launches.append(len(self._held))
        return raw(self)

    monkeypatch.setattr(HeldBatch, "launch", counting)
    for bad in (0, -1, "1", True, float("nan")):
        with pytest.raises(RefitConfigError, match="held_flush_bytes"):
            StreamDigests(copy=False, held_flush_bytes=bad)
    for flush, pending in ((1000, [3, 2]), (None, [5]), (math.inf, [5])):  # 3 adds reach 1000 bytes; the default holds all five
        launches.clear()
        s = StreamDigests(copy=False, held_flush_bytes=flush)
        for n, t in ts.items():
            s.add(n, t)
        assert s.digests() == want and s.changed == {}
        assert [k for k in launches if k] == pending


def test_a_copying_batch_reads_small_cpu_tensors_as_they_were_at_their_add_in_one_batched_call(monkeypatch):
    """refit(copy=True) on CPU: a small tensor (below the compiled batch's bound) is copied at its add
    and read at the flush with the others in one digest_many call; a large one is digested at once.
    Either way the digest is of the bytes at the add, whatever the trainer writes afterwards, and
    equals tensor_digest of them (contiguous, transposed, conjugate, empty, large)."""
    from refit_verify.digest.incremental import CopyingBatch

    be = backends.backend_for("cpu")
    if be.digest_many is None:
        pytest.skip("no compiled CPU batch on this machine")
    calls = []
    real = be.digest_many
    object.__setattr__(be, "digest_many", lambda many: (calls.append(len(many)), real(many))[1])  # a frozen dataclass
    try:
        g = torch.Generator().manual_seed(5)
        ts = {f"p{i}": torch.randn(7 + 13 * i, generator=g).to(torch.bfloat16) for i in range(6)}
        ts["t"] = torch.randn(6, 5, generator=g).t()
        ts["c"] = torch.randn(4, dtype=torch.complex64, generator=g).conj()
        ts["e"] = torch.empty(0, 3)
        ts["big"] = torch.randn(be.many_max_bytes // 4 + 1, generator=g)
        want = {n: tensor_digest(t) for n, t in ts.items()}
        b = CopyingBatch()
        for n, t in ts.items():
            b.add(n, t)
        for t in ts.values():  # the trainer reuses its memory right after the push
            t.zero_()
        assert all(not t.any() for t in ts.values())
        assert b.hexdigests() == want
        assert calls and calls[0] >= 6  # the small ones in one call
    finally:
        object.__setattr__(be, "digest_many", real)


def test_a_copying_batch_launches_its_small_cpu_copies_every_flush_bytes():
    from refit_verify.digest.incremental import CopyingBatch

    ts = {f"p{i}": torch.full((64,), float(i)) for i in range(10)}  # 256 bytes each
    b = CopyingBatch(flush_bytes=1024)
    for n, t in ts.items():
        b.add(n, t)
        assert b._pending < 1024  # launched when it reached the flush
    assert b.hexdigests() == {n: tensor_digest(t) for n, t in ts.items()}
