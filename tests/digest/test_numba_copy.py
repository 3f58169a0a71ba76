"""The fused numba copy+digest (``_numba_copy``) and ``DigestBatch.add_copy`` on CPU through it: the
destination gets the logical bytes and the lane padding, the digest is bit-identical to the reference
(small sizes) and to ``digest_u8`` (several chunks), every refusal leaves nothing copied or digested."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refit_verify.digest import backends
from refit_verify.digest import batch as dg
from refit_verify.digest import reference as ref
from refit_verify.digest.tensors import dtype_name, logical_bytes
from refit_verify.errors import RefitInputError

nc = pytest.importorskip("refit_verify.digest._numba_copy")
nd = pytest.importorskip("refit_verify.digest._numba")


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _run(src: torch.Tensor, dst: torch.Tensor, seeds: tuple[int, int]) -> str:
    h0, h1 = nc.copy_digest_arrays([(src.data_ptr(), dst.data_ptr(), src.numel(), seeds)])
    return ref.hexdigest(int(h0[0]), int(h1[0]))


def _round8(n: int) -> int:
    return (n + 7) // 8 * 8


@pytest.mark.parametrize("offset", [0, 1, 3, 7])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096 + 3, 16 * 256 * 8 + 5])
def test_copy_digest_equals_the_reference_and_copies_the_bytes(n, offset):
    """Sizes around a lane, a level-0 block and a second block, from sources at every alignment: the
    digest is the reference's, the destination holds the bytes, zeros to the lane's end, and nothing past."""
    raw = _bytes(n + 8, seed=n)
    src = raw[offset : offset + n]
    dst = torch.full((_round8(n) + 16,), 0xA5, dtype=torch.uint8)
    seeds = ref.seed("uint8", (n,), n)
    assert _run(src, dst, seeds) == ref.digest_bytes(bytes(src.tolist()), "uint8", (n,))
    assert torch.equal(dst[:n], src)
    assert bool((dst[n : _round8(n)] == 0).all()) and bool((dst[_round8(n) :] == 0xA5).all())


@pytest.mark.parametrize("n", [8 * ref.CHUNK_LANES, 8 * ref.CHUNK_LANES + 9, 2 * 8 * ref.CHUNK_LANES + 3])
def test_copy_digest_of_several_chunks_equals_digest_u8(n):
    """Whole chunks, a partial one after them, two chunks and a partial lane, from an odd address."""
    raw = _bytes(n + 1, seed=1)
    src = raw[1:]
    dst = torch.empty(_round8(n), dtype=torch.uint8)
    seeds = ref.seed("uint8", (n,), n)
    assert _run(src, dst, seeds) == nd.digest_u8(src, "uint8", (n,))
    assert torch.equal(dst[:n], src)


def test_many_strings_in_one_call_equal_digest_many():
    """One call over strings of many lengths into one staging buffer equals the batched digest of the same bytes."""
    raw = _bytes(70000, seed=2)
    lens = [0, 1, 7, 8, 9, 31, 4095, 4099, 60000]
    dst = torch.zeros(sum(_round8(n) for n in lens) + 8, dtype=torch.uint8)
    items, o = [], 0
    for i, n in enumerate(lens):
        items.append((raw.data_ptr() + i, dst.data_ptr() + o, n, ref.seed("uint8", (n,), n)))
        o += _round8(n)
    h0, h1 = nc.copy_digest_arrays(items)
    from refit_verify.digest import _numba_many as nm

    want = nm.digest_words_many([(d, n, s) for _, d, n, s in items])
    assert list(zip(h0.tolist(), h1.tolist())) == want
    o = 0
    for i, n in enumerate(lens):
        assert torch.equal(dst[o : o + n], raw[i : i + n])
        o += _round8(n)


def test_copy_digest_refuses_misaligned_and_overlapping_destinations_before_anything():
    buf = torch.zeros(256, dtype=torch.uint8)
    src = _bytes(40)
    s = ref.seed("uint8", (40,), 40)
    a = buf.data_ptr()
    bad = {
        "aligned": [(src.data_ptr(), a + 4, 40, s)],
        "overlaps destination": [(src.data_ptr(), a, 40, s), (src.data_ptr(), a + 32, 40, s)],
        "overlaps a source": [(a + 100, a + 128, 40, s), (src.data_ptr(), a + 96, 16, s)],
        ">= 0": [(src.data_ptr(), a, -1, s)],
    }
    for why, items in bad.items():
        with pytest.raises(RefitInputError, match=why):
            nc.copy_digest_arrays(items)
    assert bool((buf == 0).all())


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    f = torch.randn(33, 17, generator=g)
    out = [(f"f32.{n}", f.flatten()[:n].clone()) for n in (0, 1, 2, 3)]
    for dt in (torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int32, torch.int64, torch.bool,
               torch.complex64, torch.float8_e4m3fn):
        out.append((f"{dt}", (f * 8).to(dt)))
    out += [("transposed", f.t()), ("every-other", f[:, ::2]), ("bf16-slice", f.to(torch.bfloat16)[3:, 1:]),
            ("scalar", torch.tensor(2.5)), ("odd-offset", _bytes(1003)[3:])]
    return out


def test_add_copy_on_cpu_is_fused_and_equals_the_reference():
    """Many dtypes, non-contiguous sources and a source at an odd address, packed into one buffer at
    8-byte aligned slots: one compiled call at the launch; each digest is the reference's and each slot
    holds the logical bytes and the lane padding."""
    if backends.cpu_backend().copy_many is None:
        pytest.skip("no numba backend here")
    cases = _cases()
    offs, used = [], 0
    for _, t in cases:
        offs.append(used)
        used += _round8(t.numel() * t.element_size()) + 8
    buf = torch.full((used,), 0xA5, dtype=torch.uint8)
    b = dg.DigestBatch()
    for (name, t), o in zip(cases, offs):
        assert dg.fuses(t)
        b.add_copy(name, t, buf[o : o + _round8(t.numel() * t.element_size())])
    assert buf.eq(0xA5).all()  # queued: the copy runs at the launch
    got = b.hexdigests()
    for (name, t), o in zip(cases, offs):
        u = logical_bytes(t)
        n = u.numel()
        assert got[name] == ref.digest_bytes(bytes(u.tolist()), dtype_name(t.dtype), tuple(t.shape)), name
        assert torch.equal(buf[o : o + n], u), name
        assert bool((buf[o + n : o + _round8(n)] == 0).all()) and bool((buf[o + _round8(n) : o + _round8(n) + 8] == 0xA5).all())


def test_add_copy_on_cpu_above_the_bound_copies_then_digests(monkeypatch):
    """A CPU tensor of ``many_max_bytes`` or more is not fused (its digest's parallel region is faster):
    copied at the add, digested as ``add`` does, the same digest."""
    b0 = backends.cpu_backend()
    if b0.copy_many is None:
        pytest.skip("no numba backend here")
    monkeypatch.setattr(backends, "_CPU", [dataclasses.replace(b0, many_max_bytes=64)])
    small, big = _bytes(63), _bytes(64)
    assert dg.fuses(small) and not dg.fuses(big)
    buf = torch.zeros(136, dtype=torch.uint8)
    b = dg.DigestBatch()
    b.add_copy("big", big, buf[:64])
    assert torch.equal(buf[:64], big)  # copied at the add
    b.add_copy("small", small, buf[64:128])
    assert bool((buf[64:128] == 0).all())  # queued
    got = b.hexdigests()
    assert got == {"big": nd.digest_u8(big, "uint8", (64,)), "small": nd.digest_u8(small, "uint8", (63,))}
    assert torch.equal(buf[64:127], small)


def test_add_copy_on_cpu_refuses_a_storage_freed_before_the_launch():
    """A source whose storage was freed after its add (FSDP's ``resize_(0)``) is never read: the launch
    raises, the batch's copies are dropped, and no destination byte is written."""
    if backends.cpu_backend().copy_many is None:
        pytest.skip("no numba backend here")
    t, keep = _bytes(100), _bytes(16)
    buf = torch.zeros(128, dtype=torch.uint8)
    b = dg.DigestBatch()
    b.add_copy("keep", keep, buf[:16])
    b.add_copy("t", t, buf[16:120])
    t.untyped_storage().resize_(0)
    with pytest.raises(RefitInputError, match="freed"):
        b.launch()
    assert b.hexdigests() == {} and bool((buf == 0).all())


def test_the_cpu_warmup_compiles_the_fused_copy():
    """``warmup_cpu`` leaves the fused op compiled (or loaded from the cache) for the types the batch
    passes: a later ``add_copy`` compiles no other specialisation."""
    backends.warmup_cpu()
    warm = list(nc.copy_digest_many.signatures)
    assert len(warm) == 1
    if backends.cpu_backend().copy_many is None:
        pytest.skip("no numba backend here")
    buf = torch.zeros(64, dtype=torch.uint8)
    b = dg.DigestBatch()
    b.add_copy("a", _bytes(13), buf[:16])
    b.add_copy("b", torch.arange(6.0)[::2], buf[16:32])
    b.hexdigests()
    assert nc.copy_digest_many.signatures == warm


def test_discard_queued_drops_queued_copies_and_adds_unrun():
    """A batch abandoned mid-refit (``Packer.release``): its queued copies never run, its queued names
    get no digest, and it holds none of their tensors (a staging buffer can be unmapped)."""
    if backends.cpu_backend().copy_many is None:
        pytest.skip("no numba backend here")
    import weakref

    buf = torch.zeros(64, dtype=torch.uint8)
    slot = buf[:16]
    gone = weakref.ref(slot)
    b = dg.DigestBatch(hold_cpu=True)
    b.add("held", _bytes(40))
    b.add_copy("copied", _bytes(13), slot)
    b.add("done", torch.zeros(3))  # hold_cpu queues it too
    del slot
    b.discard_queued()
    assert gone() is None and b.hexdigests() == {} and len(b) == 0 and bool((buf == 0).all())
    b.add_copy("again", _bytes(13), buf[:16])
    assert b.hexdigests() == {"again": nd.digest_u8(_bytes(13), "uint8", (13,))}
