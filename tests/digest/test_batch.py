"""DigestBatch's kernel path (queue, launch without sync, one hex conversion) against the CPU path.

Without CUDA the Triton kernels run in the interpreter on CPU tensors: the batch is pointed at them
by adding "cpu" to the kernel device types for these tests.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from refit_verify.digest import backends, tensors  # noqa: E402
from refit_verify.digest import batch as dg  # noqa: E402
from refit_verify.digest import incremental as ds  # noqa: E402
from refit_verify.digest import kept as hs  # noqa: E402
from refit_verify.digest import reference as ref  # noqa: E402
from refit_verify.digest.kernels import launch as kd  # noqa: E402
from tests.support.subclasses import RedirectingTensor  # noqa: E402

DEV = "cpu" if kd._INTERPRETED else "cuda"


@pytest.fixture
def kernel_batch(monkeypatch):
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
    return dg.DigestBatch()


def _cpu_digest(t: torch.Tensor) -> str:
    """``tensor_digest`` of ``t`` on the CPU path (numba or torch, bit-identical to the reference and tested
    against it) whatever the kernel device types are: an oracle that does not run the kernels under test."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset())
        return dg.tensor_digest(t.detach().cpu())


def _tensors():
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, 256, (40000,), dtype=torch.uint8, generator=g)
    return [
        ("w", base[:8192].view(torch.bfloat16).view(64, 64)),
        ("odd", base[3:3 + 999]),
        ("t", base[:4096].view(torch.float32).view(32, 32).t()),  # non-contiguous
        ("scalar", torch.tensor(1.5)),
        ("empty", torch.zeros(0, 3)),
        ("big", base[:32776].view(torch.int64)),
    ]


def test_launch_then_hex_matches_reference(kernel_batch):
    ts = [(n, t.to(DEV)) for n, t in _tensors()]
    for n, t in ts[:3]:
        kernel_batch.add(n, t)
    kernel_batch.launch()  # first group in flight; the batch holds no reference to it
    assert not kernel_batch._queued and len(kernel_batch._launched) == 1
    for n, t in ts[3:]:
        kernel_batch.add(n, t)
    got = kernel_batch.hexdigests()
    assert list(got) == [n for n, _ in ts]
    for n, t in ts:
        u8 = dg.logical_bytes(t.cpu())
        assert got[n] == ref.digest_bytes(bytes(u8.numpy()), tensors.dtype_name(t.dtype), tuple(t.shape)), n


def test_readd_replaces_and_keeps_first_position(kernel_batch):
    a, b = torch.arange(10, device=DEV), torch.arange(11, device=DEV)
    kernel_batch.add("x", a)
    kernel_batch.add("y", b)
    kernel_batch.launch()
    kernel_batch.add("x", b)
    got = kernel_batch.hexdigests()
    assert list(got) == ["x", "y"] and got["x"] == got["y"] == _cpu_digest(b)


def test_readd_on_the_cpu_path_replaces_a_pending_kernel_digest(kernel_batch, monkeypatch):
    """The latest add wins even when an earlier add of the name is still queued or in flight on
    the kernel path and the later one is computed at once on the CPU path."""
    a, b = torch.arange(10, device=DEV), torch.arange(11, device=DEV)
    kernel_batch.add("queued", a)
    kernel_batch.add("launched", a)
    kernel_batch.launch()  # "launched" is in flight; "queued" was launched with it
    kernel_batch.add("queued2", a)  # stays queued
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset())  # later adds take the CPU path
    for n in ("queued", "launched", "queued2"):
        kernel_batch.add(n, b.cpu())
    got = kernel_batch.hexdigests()
    assert got == {n: dg.tensor_digest(b.cpu()) for n in ("queued", "launched", "queued2")}


def test_copying_batch_digests_what_each_tensor_held_when_added(monkeypatch):
    """CopyingBatch on the kernel path: contiguous tensors are copied, non-contiguous ones through
    logical_bytes' own copy; each digest is of the bytes at add time, however the original changes
    afterwards, across mid-way launches."""
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
    cb = ds.CopyingBatch(flush_bytes=10000)
    ts = [(n, t.to(DEV).clone()) for n, t in _tensors()]  # clones: their memory is ours to overwrite
    g = torch.Generator().manual_seed(9)
    ts += [(f"small{i}", torch.randint(0, 256, (97 + 211 * i,), dtype=torch.uint8, generator=g).to(DEV)) for i in range(12)]
    ts.append(("complex", torch.randn(5, 3, dtype=torch.complex64, generator=g).to(DEV)))
    want, nonzero = {}, []
    for n, t in ts:
        want[n] = ref.digest_bytes(bytes(dg.logical_bytes(t.cpu()).numpy()), tensors.dtype_name(t.dtype), tuple(t.shape))
        if t.numel() and bool(t.cpu().ne(0).any()):
            nonzero.append(n)
        cb.add(n, t)
        t.zero_()  # the original changes right after its add
    assert len(cb._batch._launched) >= 2  # flushed mid-way at least once
    got = cb.hexdigests()
    assert list(got) == [n for n, _ in ts]
    assert got == want
    assert len(nonzero) >= 17
    for n, t in ts:  # the originals did change after their adds
        now = ref.digest_bytes(bytes(dg.logical_bytes(t.cpu()).numpy()), tensors.dtype_name(t.dtype), tuple(t.shape))
        assert (now != want[n]) == (n in nonzero), n


def test_copying_batch_copies_the_own_bytes_of_a_redirecting_subclass(monkeypatch):
    """Every read of ``add`` is a plain tensor op: a subclass that redirects ``untyped_storage()``
    cannot make the "is it a view of t?" test fail and leave t's own memory uncopied."""
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
    own = torch.arange(16, dtype=torch.float32, device=DEV)
    t = own.as_subclass(RedirectingTensor)
    t._live = own.clone() + 100
    want = _cpu_digest(own.clone())  # the tensor's own bytes at add
    b = ds.CopyingBatch()
    b.add("t", t)
    own.fill_(-1)  # its own memory changes right after the add
    assert b.hexdigests() == {"t": want}


def test_kept_plan_reads_the_memory_as_it_is_at_each_launch(kernel_batch):
    """A launch over the same memory (same addresses, shapes, strides, dtypes) reuses its kept plan,
    and the plan holds addresses, not bytes: each launch digests what the memory holds then."""
    g = torch.Generator().manual_seed(11)
    ts = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(DEV) for n in (8192, 999, 17)]
    ts.append(ts[0][:4096].view(torch.bfloat16).view(32, 64))  # a view of another's memory
    def batch_hex():
        b = dg.DigestBatch()
        for i, t in enumerate(ts):
            b.add(f"t{i}", t)
        return b.hexdigests()
    def want():
        return {f"t{i}": ref.digest_bytes(bytes(dg.logical_bytes(t.cpu()).numpy()), tensors.dtype_name(t.dtype), tuple(t.shape))
                for i, t in enumerate(ts)}
    dg._PLANNED.clear()
    first = batch_hex()
    assert first == want() and len(dg._PLANNED) == 1
    plan = next(iter(dg._PLANNED.values()))
    ts[0][100:200] += 1  # same memory, other bytes (t3 is a view of them too)
    second = batch_hex()
    assert len(dg._PLANNED) == 1 and next(iter(dg._PLANNED.values())) is plan  # the kept plan ran
    assert second == want()
    assert second["t0"] != first["t0"] and second["t3"] != first["t3"] and second["t1"] == first["t1"]
    ts[2] = ts[2].view(torch.int8)  # same address, another dtype: another plan
    assert batch_hex() == want() and len(dg._PLANNED) == 2


def test_held_batch_digests_at_the_flush_and_names_what_changed(monkeypatch):
    """HeldBatch copies nothing: what it digests is each tensor at the flush; a tensor modified in
    place through itself, given other memory or freed (FSDP1's resize to 0) is named, not read."""
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
    g = torch.Generator().manual_seed(12)
    ts = {n: torch.randint(0, 256, (k,), dtype=torch.uint8, generator=g).to(DEV) for n, k in
          (("kept", 333), ("bumped", 100), ("moved", 64), ("freed", 4096), ("late", 50), ("readded", 70))}
    hb = ds.HeldBatch()
    for n, t in ts.items():
        hb.add(n, t)
    ts["late"][1:][0] ^= 1  # a write through a view: views share their base's version counter
    ts["bumped"].add_(1)
    ts["moved"].data = torch.zeros(64, dtype=torch.uint8, device=DEV)
    ts["freed"].untyped_storage().resize_(0)
    again = torch.arange(70, dtype=torch.uint8, device=DEV)
    ts["readded"].add_(1)  # changed, but added again afterwards: the later add counts
    hb.add("readded", again)
    got = hb.hexdigests()
    assert set(hb.changed) == {"bumped", "moved", "freed", "late"}
    assert "modified in place" in hb.changed["bumped"] and "replaced" in hb.changed["moved"]
    assert "freed or resized" in hb.changed["freed"]
    assert got == {"kept": _cpu_digest(ts["kept"]), "readded": _cpu_digest(again)}


def test_a_tensor_made_non_contiguous_after_its_add_is_digested_as_it_is_and_its_copy_not_kept(kernel_batch):
    """A contiguous tensor queued as is, transposed in place before the launch: digested as it is at the
    launch (through a copy of its logical bytes), and no plan over that freed copy is kept for its memory."""
    t = torch.arange(64, dtype=torch.float32, device=DEV).view(8, 8).clone()
    dg._PLANNED.clear()
    for _ in range(2):
        b = dg.DigestBatch()
        b.add("t", t)
        t.t_()  # now non-contiguous, same memory
        want = ref.digest_bytes(bytes(dg.logical_bytes(t.cpu()).numpy()), tensors.dtype_name(t.dtype), tuple(t.shape))
        assert b.hexdigests() == {"t": want}
        assert not dg._PLANNED
        t.t_()  # back to contiguous for the next round


@pytest.mark.parametrize("kernel", [True, False], ids=["kernel-path", "cpu-path"])
def test_held_batch_keeps_a_set_per_flush_and_checks_every_tensor_again(monkeypatch, kernel):
    """A trainer exports the same memory at every refit: the first refit digests it the general way,
    the second keeps a set over its flushes' signatures, and from the third on each flush reads its
    kept set. New tensor objects over the same memory (a state_dict's) take it too; a tensor that
    moved, changed after its add or was freed is never read through it."""
    if kernel:
        monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
    dev = DEV if kernel else "cpu"
    monkeypatch.setattr(hs, "_HELD_SETS", type(hs._HELD_SETS)())
    g = torch.Generator().manual_seed(31)
    params = {f"p{i}": torch.nn.Parameter(torch.randn(40 + 17 * i, generator=g).to(torch.bfloat16).to(dev), requires_grad=False)
              for i in range(9)}

    def refit(named, flush_bytes=600):
        hb = ds.HeldBatch(flush_bytes)
        for n, t in named:
            hb.add(n, t)
        got = hb.hexdigests()
        return hb, got

    def want(named):
        return {n: _cpu_digest(t) for n, t in named}

    named = list(params.items())
    for r in range(4):
        sets = sum(isinstance(v, ds.DigestSet) for v in hs._HELD_SETS.values())
        hb, got = refit(named)
        assert got == want(named) and list(got) == list(params) and not hb.changed
        assert bool(hb._sets) is False  # collected
        if r == 0:
            assert sets == 0 and len(hs._HELD_SETS) >= 2  # signatures remembered, one entry per flush
        if r >= 2:
            assert sets == len(hs._HELD_SETS)  # every flush has its kept set
        with torch.no_grad():
            params["p3"].add_(1)  # other bytes, same memory: read again, never remembered
    kept = dict(hs._HELD_SETS)
    views = [(n, p.detach()) for n, p in named]  # new objects over the same memory
    hb, got = refit(views)
    assert got == want(views) and dict(hs._HELD_SETS) == kept
    for _ in range(3):  # one flush of all of them, kept from the third time on
        hb, got = refit(named, 1 << 30)
    assert got == want(named) and isinstance(hs._HELD_SETS[tuple(params)], ds.DigestSet)
    hb = ds.HeldBatch(1 << 30)
    for n, t in named:
        hb.add(n, t)
    with torch.no_grad():
        params["p2"].sub_(1)  # same memory, the kept set's signatures: only its version counter tells
    got = hb.hexdigests()
    assert list(hb.changed) == ["p2"] and "modified in place" in hb.changed["p2"] and "p2" not in got
    hb = ds.HeldBatch(1 << 30)
    for n, t in named:
        hb.add(n, t)
    with torch.no_grad():
        params["p1"].mul_(2)  # changed after its add, before its flush
    params["p7"].data = params["p7"].data.clone()  # given other memory
    got = hb.hexdigests()
    assert set(hb.changed) == {"p1", "p7"} and "modified in place" in hb.changed["p1"] and "replaced" in hb.changed["p7"]
    assert got == {n: h for n, h in want(named).items() if n not in ("p1", "p7")}
    hb, got = refit(named)  # p7 lives elsewhere now: the general path, then kept again
    assert got == want(named)
    params["p5"].untyped_storage().resize_(0)
    hb = ds.HeldBatch(600)
    for n, t in named:
        if n != "p5":
            hb.add(n, t)
    with pytest.raises(dg.RefitInputError, match="freed or resized"):
        hb.add("p5", params["p5"])


def test_held_sets_are_bounded_by_tensors_not_flushes(monkeypatch):
    """A large export goes through many flushes in the same order every refit: each keeps its set (a
    bound by entries would drop every flush's set just before it comes again); the bound counts the
    tensors over all entries, least recently used dropped first."""
    monkeypatch.setattr(hs, "_HELD_SETS", type(hs._HELD_SETS)())
    monkeypatch.setattr(hs, "_HELD_TENSORS", 0)
    launched = []
    orig = ds.DigestSet.launch
    monkeypatch.setattr(ds.DigestSet, "launch", lambda self, *a, **k: (launched.append(len(self)), orig(self, *a, **k))[1])
    params = [torch.nn.Parameter(torch.randn(64), requires_grad=False) for _ in range(40)]

    def refit(ps):
        hb = ds.HeldBatch(flush_bytes=256)  # one 256-byte parameter per flush
        for i, p in enumerate(ps):
            hb.add(f"p{i}", p)
        return hb.hexdigests()

    for r in range(4):
        launched.clear()
        got = refit(params)
        assert got == {f"p{i}": dg.tensor_digest(p) for i, p in enumerate(params)}
    assert len(launched) == 40 and len(hs._HELD_SETS) == 40 and hs._HELD_TENSORS == 40
    monkeypatch.setattr(hs, "KEPT_HELD_TENSORS", 10)
    refit(params[:3] + [torch.nn.Parameter(torch.randn(32), requires_grad=False)])  # a new flush (another layout): the bound applies
    assert len(hs._HELD_SETS) == hs._HELD_TENSORS == 10 and ("p3",) in hs._HELD_SETS and ("p0",) in hs._HELD_SETS


# ---------------------------------------------------------------- add_copy: copy and digest, one read


def _copy_cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    raw = torch.randint(0, 256, (4096 * 16 + 40,), dtype=torch.uint8, generator=g)
    f = torch.randn(40, 30, generator=g)
    out = [(f"u8.{n}", raw[:n].clone()) for n in (0, 1, 7, 8, 9, 4095, 4096 * 16 + 3)]
    out += [(f"offset.{o}", raw[o : o + 1000]) for o in (1, 3, 7)]  # sources off an 8-byte boundary
    out += [("transposed", f.t()), ("bf16", f.to(torch.bfloat16)[3:, 1:]), ("scalar", torch.tensor(2.5))]
    return out


def _lanes(n: int) -> int:
    return (n + 7) // 8 * 8


def _cpu_path(monkeypatch, path: str) -> None:
    """Point CPU ``add_copy`` at ``path``: ``kernels`` (the Triton op, interpreted on CPU), ``numba`` (the
    fused numba op), ``copy-then-digest`` (a numba backend without it: copies, then digests)."""
    if path == "kernels":
        monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))
        return
    if torch.device(DEV).type != "cpu":
        pytest.skip("on a kernel device the fused kernels are the path: the CPU paths are the CPU's")
    b = backends.cpu_backend()
    if b.copy_many is None:
        pytest.skip("no numba backend here")
    if path == "copy-then-digest":
        monkeypatch.setattr(backends, "_CPU", [dataclasses.replace(b, copy_many=None)])


@pytest.mark.parametrize("path", ["kernels", "numba", "copy-then-digest"])
def test_add_copy_digests_and_copies_the_logical_bytes(monkeypatch, path):
    """Every case into slots of one buffer in one launch: each digest is the tensor's (CPU oracle) and
    each slot holds its logical bytes (a non-contiguous tensor's in row-major order), zeros in the last
    lane's padding, and the bytes past it untouched (see :func:`_cpu_path` for the paths)."""
    _cpu_path(monkeypatch, path)
    fused = path != "copy-then-digest"
    cases = [(n, t.to(DEV)) for n, t in _copy_cases()]
    offs, used = [], 0
    for _, t in cases:
        offs.append(used)
        used += (t.numel() * t.element_size() + 15) // 16 * 16
    buf = torch.full((used + 16,), 0xA5, dtype=torch.uint8, device=DEV)
    b = dg.DigestBatch()
    for (name, t), o in zip(cases, offs):
        b.add_copy(name, t, buf[o : o + _lanes(t.numel() * t.element_size())])
    assert dg.fuses(cases[0][1]) is fused
    got = b.hexdigests()
    assert got == {name: _cpu_digest(t) for name, t in cases}
    for (name, t), o in zip(cases, offs):
        n = t.numel() * t.element_size()
        assert torch.equal(buf[o : o + n].cpu(), tensors.logical_bytes(t).cpu()), name
        assert bool((buf[o + n : o + _lanes(n)] == 0).all()), name
        assert bool((buf[o + _lanes(n) : o + (n + 15) // 16 * 16] == 0xA5).all()), name


@pytest.mark.parametrize("path", ["kernels", "numba", "copy-then-digest"])
def test_add_copy_refuses_bad_destinations_and_keeps_no_digest(monkeypatch, path):
    _cpu_path(monkeypatch, path)
    fused = path != "copy-then-digest"
    t = torch.arange(100, dtype=torch.uint8, device=DEV)
    buf = torch.zeros(512, dtype=torch.uint8, device=DEV)
    src = buf[200:300]
    bad = [
        ("needs 104", t, buf[:100]),  # no room for the last lane
        ("not 8-byte aligned", t, buf[4:120]),
        ("uint8", t, buf.view(torch.int64)),
        ("is on meta", t, torch.empty(128, dtype=torch.uint8, device="meta")),
        ("overlaps the tensor", src, buf[256:360]),
    ]
    b = dg.DigestBatch()
    for why, x, dst in bad:
        b.add("x", t)
        with pytest.raises(dg.RefitInputError, match=why):
            b.add_copy("x", x, dst)
        assert len(b) == 0 and b.hexdigests() == {}, why  # the earlier digest of the name is dropped too
    assert bool((buf == 0).all())  # nothing was copied
    if fused:  # two queued destinations that overlap: refused at the launch, those names dropped
        b.add_copy("a", t, buf[0:104])
        b.add_copy("b", t.clone(), buf[96:200])
        with pytest.raises(dg.RefitInputError, match="overlaps destination"):
            b.launch()
        assert b.hexdigests() == {}
        b.add_copy("c", buf[300:340], buf[0:40])  # a destination over another copy's source
        b.add_copy("d", t, buf[296:400])
        with pytest.raises(dg.RefitInputError, match="overlaps a"):
            b.launch()
        assert b.hexdigests() == {} and bool((buf == 0).all())  # refused before anything was copied
