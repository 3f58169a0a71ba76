"""Triton digest kernels (``digest_views``, ``chunk_roots``) vs the pure-Python reference, the CPU
roots and the torch path for huge inputs.

Without CUDA the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set before
triton is imported) on CPU tensors; with CUDA every test runs the compiled kernels on the GPU, and
the ``gpu`` test adds a > 2**31-lane tensor. The one input over a chunk (8 MiB) is digested by the
interpreter once per module (``two_chunks``). Chunk roots feed sharded digests (spec §7.1): roots
of dim-0 shards cut on 8 MiB boundaries, combined, equal the full tensor's digest.

Source: docs/digest-spec.md §6, §7.1
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interp import kernel_module

kd, DEV, pytestmark = kernel_module()  # the interpreter on CPU (set before triton's import), CUDA compiled

from refit_verify.digest import _torch as td  # noqa: E402
from refit_verify.digest import reference as ref  # noqa: E402
from refit_verify.collective import sharded  # noqa: E402
from refit_verify.digest.kernels import _mix as mx  # noqa: E402

L = 8  # bytes per lane
CHUNK = ref.CHUNK_LANES * L  # 8 MiB
# Byte lengths around every structural boundary: lane, block (16*W lanes), W_0 = 256 (4096
# lanes), the level-1 fusion threshold (61440/61441 lanes), one leaf program (65536 lanes).
SIZES = [0, 1, 7, 8, 9, 15, 16, 17, 127, 255, 256, 257, 2047, 2048, 2049]
SIZES += [n * L for n in (4080, 4081, 4095, 4096, 4097, 61440, 61441, 65535, 65536, 65537)]
SIZES += [4097 * L + 5, 61441 * L + 1, 65537 * L + 3]


def _rand(n: int, seed: int, device: str = DEV) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(device)


def _expect(u: torch.Tensor) -> str:
    n = u.numel()
    return ref.digest_bytes(u.cpu().numpy().tobytes(), "uint8", (n,))


def _pairs(words: torch.Tensor) -> list[tuple[int, int]]:
    return [(a & ref.MASK64, b & ref.MASK64) for a, b in words.cpu().tolist()]


def _run(views: list[torch.Tensor]) -> list[str]:
    seeds = [ref.seed("uint8", (u.numel(),), u.numel()) for u in views]
    words = kd.digest_views(views, seeds)
    assert words.dtype == torch.int64 and tuple(words.shape) == (len(views), 2)
    assert words.device == views[0].device
    return kd.to_hex(words)


@pytest.mark.parametrize("nbytes", SIZES)
def test_sizes_match_reference(nbytes: int) -> None:
    u = _rand(nbytes, nbytes)
    assert _run([u]) == [_expect(u)]


def test_odd_storage_offsets_batched() -> None:
    buf = _rand(65537 * L + 2048, 7)
    cases = [(1, 13), (3, 2048 + 3), (8, 4097 * L), (517, 65537 * L + 1), (1, 0), (3, 7), (5, 61441 * L + 4)]
    views = [buf[o : o + n] for o, n in cases]
    assert [v.storage_offset() for v in views] == [o for o, _ in cases]
    assert _run(views) == [_expect(v) for v in views]


def test_many_views_one_call() -> None:
    g = torch.Generator().manual_seed(3)
    buf = _rand(1 << 16, 11)
    views = []
    for i in range(40):
        off = int(torch.randint(0, 4096, (1,), generator=g))
        n = int(torch.randint(0, 40000, (1,), generator=g)) if i % 3 else i
        views.append(buf[off : off + n])
    views += [views[5], _rand(300, 1), buf[:0]]  # a repeated view, a separate storage, empty
    assert _run(views) == [_expect(v) for v in views]


SB = kd.SB_BYTES  # 512 KiB: one leaf superblock (65536 lanes)


def _derived_of(u: torch.Tensor) -> list[torch.Tensor]:
    """Views read with ``u`` in one launch (``plan_views(derive=True)``): regions of ``u`` derived
    or not, and an unrelated view."""
    return [u[: CHUNK + 5],  # two chunks of its own: 16 superblocks from u, a 1-lane second chunk read
            u[SB : 3 * SB],  # at superblock 1, full superblocks only
            u[SB : 3 * SB + 1003],  # a partial last superblock (and a partial last lane)
            u[15 * SB : 16 * SB],  # u's last full superblock
            u[8 : 8 + SB],  # unaligned: read as any view
            u[3 * SB : 3 * SB + 5000],  # smaller than a superblock: read as any view
            _rand(70_000, 22)]  # unrelated


@pytest.fixture(scope="module")
def two_chunks_launch() -> tuple[torch.Tensor, list[str], list[tuple[int, int]], kd.Planned]:
    """A 2-chunk byte string with a tail (the last chunk takes the small-chunk path) and the views
    of ``_derived_of`` it, through one kept plan with derived views, once per module (the interpreter
    reads its 8 MiB once): ``(u, hex digests of u and its views, u's chunk roots, plan)``. The roots
    are those the leaf and upper kernels left in the work buffer, which ``chunk_roots`` returns (the
    same plan and launches, less the chain)."""
    u = _rand(CHUNK + 4097 * L + 3, 5)
    views = [u, *_derived_of(u)]
    works = []
    real_run = kd._run
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kd, "_run", lambda p, work, out, fast: (works.append((p.C, work)), real_run(p, work, out, fast))[1])
        p = kd.plan_views(views, [ref.seed("uint8", (v.numel(),), v.numel()) for v in views], derive=True)
        words = kd.run_plan(p)
    C, work = works[-1]
    roots = work[2 * C * (mx.MID_N + mx.SCR_N) : 2 * C * (mx.MID_N + mx.SCR_N + 1)].view(2, C).t()  # as run_plan(chain=False)
    return u, kd.to_hex(words), _pairs(roots[:2]), p  # u's chunks come first (view-major)


@pytest.fixture(scope="module")
def two_chunks(two_chunks_launch) -> tuple[torch.Tensor, list[str], list[tuple[int, int]], str]:
    """``(u, [hex digest], chunk roots, reference digest)`` of ``two_chunks_launch``'s string."""
    u, got, roots, _ = two_chunks_launch
    return u, got[:1], roots, _expect(u)


def test_two_chunks(two_chunks) -> None:
    """Chain over two chunks; last chunk takes the small-chunk path and has a byte tail."""
    u, got, _, want = two_chunks
    assert got == [want]
    assert got == [td.digest_u8(u, "uint8", (u.numel(),))]


def test_roots_match_cpu_roots_batched() -> None:
    """Small views of every leaf path (one lane, a block, a leaf program, a byte tail, odd
    offsets), batched in one call: rows in view order, empty views give none."""
    buf = _rand(65537 * L + 64, 3)
    views = [buf[:1], buf[:0], buf[5 : 5 + 4097 * L + 5], buf[:65537 * L], _rand(300, 4), buf[3:4]]
    got = kd.chunk_roots(views)
    assert got.dtype == torch.int64 and tuple(got.shape) == (5, 2) and got.device == views[0].device
    want = [r for v in views for r in td.chunk_roots_u8(v.cpu())]
    assert _pairs(got) == want
    assert tuple(kd.chunk_roots([]).shape) == (0, 2)
    with pytest.raises(TypeError):
        kd.chunk_roots([buf[::2]])


def test_two_chunks_roots_and_sharded_combine(two_chunks, monkeypatch) -> None:
    """A 2-chunk byte string with a tail: the kernel's roots equal the CPU roots; cut at 8 MiB, the
    second shard's kernel root (``sharded``'s route on CUDA, at its byte offset) and the first chunk's
    combine into the full tensor's digest."""
    full, _, got, want = two_chunks
    assert len(got) == 2 and got == td.chunk_roots_u8(full.cpu())
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))  # route sharded's roots to the kernels
    # shard 0 is exactly chunk 0, whose kernel root is got[0]; shard 1 goes through sharded's kernel route at its offset
    # (shard 0 through sharded: tests/collective/test_sharded.py; a second 8 MiB interpreter pass here adds nothing)
    roots = got[:1] + sharded.shard_chunk_roots(full[CHUNK:], byte_offset=CHUNK)
    assert roots == got
    n = full.numel()
    assert sharded.combine_chunk_roots(roots, torch.uint8, (n,), n) == want


@pytest.mark.slow
def test_one_lane_last_chunk_unaligned() -> None:
    buf = _rand((ref.CHUNK_LANES + 1) * L + 16, 9)
    u = buf[3 : 3 + (ref.CHUNK_LANES + 1) * L]
    assert _run([u]) == [td.digest_u8(u, "uint8", (u.numel(),))]


def test_plan_memo_and_errors() -> None:
    u = _rand(100, 2)
    assert _run([u]) == _run([u]) == [_expect(u)]
    assert tuple(kd.digest_views([], []).shape) == (0, 2)
    with pytest.raises(ValueError):
        kd.digest_views([u], [])
    with pytest.raises(TypeError):
        kd.digest_views([u.view(torch.int8)], [(1, 2)])
    with pytest.raises(TypeError):
        kd.digest_views([u[::2]], [(1, 2)])


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs a CUDA GPU (compiled kernels)")
def test_cuda_matches_reference_and_torch_path() -> None:
    """Compiled kernels on CUDA: small sizes/offsets vs reference, batched; a > 2**31-lane view
    (> 16 GiB) vs the torch path on CUDA; tensor_digest CUDA == CPU."""
    dev = "cuda"
    buf = _rand(65537 * L + 4096, 13, dev)
    views = [_rand(n, n, dev) for n in SIZES]
    views += [buf[o : o + n] for o, n in [(1, 13), (3, 2051), (8, 4097 * L), (517, 65537 * L + 1)]]
    assert _run(views) == [_expect(v) for v in views]

    from refit_verify.digest.batch import tensor_digest

    t = torch.randn(3072, 1023, dtype=torch.bfloat16, device=dev)
    assert tensor_digest(t) == tensor_digest(t.cpu())
    assert tensor_digest(t[:, 1:]) == tensor_digest(t[:, 1:].cpu())

    n = ((1 << 31) + 65536 + 4097) * L  # > 2**31 lanes, aligned length: the torch path won't copy
    free, _ = torch.cuda.mem_get_info()
    if free < 4 * n:
        pytest.skip(f"needs {4 * n / 2**30:.0f} GiB free GPU memory for the >2**31-lane case")
    big = torch.empty(n, dtype=torch.uint8, device=dev)
    big.view(torch.int64).random_()
    got = _run([big, big[5 : 5 + 4097 * L]])
    expect = td.digest_u8(big, "uint8", (n,))
    assert got[0] == expect
    assert got[1] == _expect(big[5 : 5 + 4097 * L])


def test_known_answer_vectors_batched() -> None:
    """docs/digest-spec.md §10 vectors (those up to 512 KiB), all in one call."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "vectors" / "digest_vectors.json"
    if not path.exists():
        pytest.skip("tests/vectors/digest_vectors.json not present")
    vecs = [v for v in json.loads(path.read_text())["vectors"] if v["nbytes"] <= 524296]
    views, seeds = [], []
    for v in vecs:
        b = (torch.arange(v["nbytes"], dtype=torch.int64) * 7 + 3) % 251
        views.append((b % 2 if v["dtype"] == "bool" else b).to(torch.uint8).to(DEV))
        seeds.append(ref.seed(v["dtype"], tuple(v["shape"]), v["nbytes"]))
    assert kd.to_hex(kd.digest_views(views, seeds)) == [v["digest"] for v in vecs]


def test_plan_fast_classification_align() -> None:
    """``align=16`` (the lab's ``vec`` variants) sends views off a 16-byte boundary to the general launch."""
    sb = 65536 * L
    sizes = [2 * sb, sb + 4097 * L, 2 * sb, 3 * sb + 5]
    addrs = [1 << 20, 2 << 20, (3 << 20) + 8, 4 << 20]
    seeds = [(1, 2)] * 4
    # programs: 2, 2, 2, 4 (the last one holds the 5-byte tail: never fast); chunks: 1 each
    assert kd._plan(addrs, sizes, seeds)[1:] == (10, 9, 4)
    assert kd._plan(addrs, sizes, seeds, align=16)[1:] == (10, 7, 4)


def _ptx_eval(ptx: str, args: list[int]) -> int:
    """Tiny model of the PTX subset used by ``_mix._node_k``'s ``ASM`` bits ($0 = result, $1.. = args)."""
    m32, m64 = (1 << 32) - 1, (1 << 64) - 1
    regs: dict[str, int] = {f"${i + 1}": a for i, a in enumerate(args)}
    carry = 0

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0)

    body = ptx.strip().strip("{}")
    for ins in (s.strip() for s in body.split(";")):
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op == "mov.b64" and rest.startswith("{"):  # unpack {lo, hi}, src
            pair, src = rest.split("},")
            lo, hi = (t.strip() for t in pair.strip("{ ").split(","))
            v = val(src.strip())
            regs[lo], regs[hi] = v & m32, v >> 32
            continue
        if op == "mov.b64":  # pack dst, {lo, hi}
            dst, pair = rest.split(",", 1)
            lo, hi = (t.strip() for t in pair.strip(" {}").split(","))
            regs[dst.strip()] = regs[lo] | (regs[hi] << 32)
            continue
        ops = [t.strip() for t in rest.split(",")]
        d, a = ops[0], [val(t) for t in ops[1:]]
        if op == "mul.wide.u32":
            regs[d] = (a[0] * a[1]) & m64
        elif op == "mad.wide.u32":
            regs[d] = (a[0] * a[1] + a[2]) & m64
        elif op == "shr.b32":
            regs[d] = a[0] >> a[1]
        elif op == "xor.b32":
            regs[d] = a[0] ^ a[1]
        elif op == "add.cc.u32":
            s = a[0] + a[1]
            regs[d], carry = s & m32, s >> 32
        elif op == "madc.lo.u32":
            regs[d] = ((a[0] * a[1]) + a[2] + carry) & m32
        else:
            raise AssertionError(f"unmodelled PTX op {op}")
    return regs["$0"]


def test_ptx_sequences_match_reference() -> None:
    """The inline-PTX pieces of ``_node_k`` (``ASM``; the production FAST launch uses bits 2 and 4)
    equal the spec's xor-shifts and ``m + ror(r, R_c)`` of each channel, with the multipliers ``KM``."""
    g = torch.Generator().manual_seed(17)
    vals = [0, 1, (1 << 64) - 1, 1 << 63, (1 << 32) - 1, 1 << 32]
    vals += [int(x) & ref.MASK64 for x in torch.randint(-(1 << 63), (1 << 63) - 1, (200,), generator=g, dtype=torch.int64)]
    pieces = [(mx._PTX_MID0, ref.MIXERS[0][0][1]), (mx._PTX_LAST0, ref.MIXERS[0][0][2]),
              (mx._PTX_MID1, ref.MIXERS[1][0][1]), (mx._PTX_LAST1, ref.MIXERS[1][0][2])]
    assert [s for _, s in pieces] == [33, 27, 27, 31]
    for x in vals:
        for ptx, s in pieces:
            assert _ptx_eval(ptx.value, [x]) == x ^ (x >> s)
    assert mx.KM == (1 << 9, 1 << 23)
    for m, r in zip(vals, reversed(vals)):
        assert _ptx_eval(mx._PTX_ADDROR0.value, [m, r, mx.KM[0]]) == (m + ref.ror(r, ref.ROT[0])) & ref.MASK64
        assert _ptx_eval(mx._PTX_ADDROR1.value, [m, r, mx.KM[1]]) == (m + ref.ror(r, ref.ROT[1])) & ref.MASK64


# ---------------------------------------------------------------------------------------------
# Derived views (plan_views(derive=True)): a region of a view at a 512 KiB multiple takes its full
# superblocks' leaf outputs from that view's.
# ---------------------------------------------------------------------------------------------


def test_derived_plan_rows_and_fallbacks() -> None:
    """The plan of derived views (host only, no kernel): which views are derived, the leaf programs
    they keep (only a partial last superblock) and each gather row (destination = the view's chunk
    and slot, source = the parent's superblock ``o + s``, across the parent's chunk boundary)."""
    base = 1 << 40
    # 0: parent, 34 superblocks + 3 bytes (chunks 0, 1: 16 full each; chunk 2: 2 full + a 1-lane tail)
    sizes = [34 * SB + 3, 2 * SB, 2 * SB + 1003, 17 * SB + 5, SB, SB - 8, 3 * SB, 4 * SB, 100]
    offs = [0, 0, SB, 15 * SB, 8, 4 * SB, 33 * SB, SB, 0]
    addrs = [base + o for o in offs]
    addrs[-1] = 7 << 40  # an unrelated view
    seeds = [(1, 2)] * len(sizes)
    # 1: aligned, full superblocks only; 2: partial last superblock with a partial lane; 3: spans two
    # chunks of its own, its superblocks cross the parent's chunk boundary; 4: unaligned offset; 5: less
    # than a superblock; 6: runs past the parent's end; 7: names a derived view as its parent; 8: unrelated
    parents = [-1, 0, 0, 0, 0, 0, 0, 1, -1]
    plain, P0, F0, C0 = kd._plan(addrs, sizes, seeds)
    plan, P, F, C = kd._plan(addrs, sizes, seeds, parents=parents)
    V = len(sizes)
    G = (len(plan) - 8 * V - P - C) // 2
    assert C == C0 and G == 2 + 2 + 17
    assert P == P0 - G  # each derived full superblock's leaf program is gone, nothing else
    assert (plan[: 8 * V] == plain[: 8 * V]).all()  # rows: addresses, lengths, chunks, seeds unchanged
    first = plan[3 * V : 4 * V]
    dst, src = plan[8 * V + P + C : 8 * V + P + C + G], plan[8 * V + P + C + G :]
    want = [(first[1] * 16 + s, first[0] * 16 + s) for s in range(2)]
    want += [(first[2] * 16 + s, first[0] * 16 + 1 + s) for s in range(2)]
    want += [(first[3] * 16 + s, first[0] * 16 + 15 + s) for s in range(17)]  # s=1: parent chunk 1 slot 0
    assert list(zip(dst.tolist(), src.tolist())) == want
    codes = plan[8 * V : 8 * V + P]
    kept = sorted((int(c) & 0xFFFFFF, int(c) >> 24) for c in codes)
    assert [q for v, q in kept if v == 2] == [2]  # view 2: only its partial third superblock
    assert [q for v, q in kept if v == 3] == [17]  # view 3: only its 5-byte tail (chunk 1, program 1)
    assert [q for v, q in kept if v == 1] == []
    before = sorted((int(c) & 0xFFFFFF, int(c) >> 24) for c in plain[8 * V : 8 * V + P0])
    for v in (0, 4, 5, 6, 7, 8):  # not derived: every leaf program, as without parents
        assert [q for w, q in kept if w == v] == [q for w, q in before if w == v]
    assert kd._parents(addrs, sizes) == [-1, 0, 0, 0, -1, -1, -1, 0, -1]  # by address: 7 lies in 0 too
    assert kd._parents([base, base], [SB, SB]) == [-1, 0]  # the same bytes twice: the second from the first


def test_derived_views_equal_the_reference(two_chunks_launch) -> None:
    """Regions of a 2-chunk string read in its launch: derived ones (full superblocks only, a
    partial last one, one spanning two chunks of its own, u's last superblock) and ones read as any
    view (unaligned, small), beside an unrelated view: every digest is the reference's."""
    u, got, _, p = two_chunks_launch
    views = _derived_of(u)
    assert p.G == 16 + 2 + 2 + 1 and p.saved == p.G * SB
    assert got[1:] == [_expect(v) for v in views]


def test_derived_views_read_what_the_memory_holds_now() -> None:
    """A kept plan with derived views, run again after a byte of the parent changed inside a derived
    region's superblock: the region's digest follows (the gather takes this run's leaf outputs)."""
    buf = _rand(2 * SB + 5, 23)
    views = [buf, buf[SB : 2 * SB], buf[: SB]]
    p = kd.plan_views(views, [ref.seed("uint8", (u.numel(),), u.numel()) for u in views], derive=True)
    assert p.G == 2
    got = kd.to_hex(kd.run_plan(p))
    assert got == [_expect(u) for u in views]
    buf[SB + 5] += 1
    again = kd.to_hex(kd.run_plan(p))
    assert again[1] == _expect(views[1]) != got[1] and again[2] == got[2] and again[0] != got[0]
