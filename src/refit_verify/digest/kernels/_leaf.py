"""Leaf stage of the digest kernels: fold levels 0 and 1 of every chunk, straight from the lanes.

Two launches over the plan's leaf programs (``digest._plan``), both writing <= 4096 values per chunk
and channel to the work buffer (1/256 of the input for full chunks):

* **general** (``_digest_leaf_kernel``, FAST=False; 8 warps): every program that is not fast:
  unaligned views (funnel-shift loader), programs holding a partial last lane, chunks of <= 61440
  lanes (one level-0 block per program), one-lane chunks. FAST=True (aligned big-chunk programs,
  the v1 kernel) is kept as the baseline of ``benchmarks/bench_variants.py``.
* **fast** (``_leaf_fast_kernel``; ``FAST_LEAF``): aligned, tail-free programs of big chunks, the
  bulk of the bytes. Each program folds levels 0 and 1 of a ``COLS``-wide column slice of one
  65536-lane superblock (columns never mix below level 2): 32-bit lane offsets from a 64-bit base,
  tweaks folded into the first xor-shift, inline PTX pipe balancing (``ASM``), and no masks when
  the superblock lies wholly in the view. The variants it was chosen from (column widths,
  unrolling, prefetch, vector loads, a split level-0 pass) live in ``benchmarks/digest_variants.py``.

Source: docs/digest-spec.md §2, §6.1
"""

from __future__ import annotations

import triton
import triton.language as tl

from refit_verify.digest.kernels._mix import (
    _BLK,
    _CHUNK,
    _M64,
    _MID,
    _PHI,
    _SBLK,
    _SW,
    _node,
    _node_k,
    _tree16c,
    _tree16k,
)

# The production FAST launch: benchmarks/bench_variants.py "f128w4-full-asm6" (2980 GB/s on 1 GiB, H200; v1: 2604).
# copy_maxnreg: its register cap with COPY (sm_90, benchmarks/kernel_asm.py "fast_copy": 64 spills 88 bytes of
# stack, 72 spills 48, 80 none).
FAST_LEAF = dict(cols=128, warps=4, asm=6, maxnreg=64, copy_maxnreg=80)


# ---------------------------------------------------------------------------------------------
# Lane loader, level-0 block, the level-1 carry, level-0+1 superblock.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _lanes(pw, i, end, s, nbytes, SLOW: tl.constexpr):
    """§2 lanes ``i`` (int64 lane indices in the view) as uint64; 0 where ``i >= end``.

    ``pw`` points at the 8-byte-aligned word holding the view's first byte, ``s`` = that byte's
    offset in it (0..7). Fast path (SLOW=False): s == 0 and every lane < end is a full lane.
    """
    valid = i < end
    if SLOW:
        sb = (s * 8).to(tl.uint64)
        lo = tl.load(pw + i, mask=valid, other=0)
        hi = tl.load(pw + i + 1, mask=valid & (i * 8 + 8 < nbytes + s), other=0)  # word holds view bytes
        x = (lo >> sb) | ((hi << (63 - sb)) << 1)  # two shifts: never shift a uint64 by 64
        rem = nbytes - i * 8  # bytes of the view from lane i on
        keep = (tl.full(i.shape, 1, tl.uint64) << (8 * tl.minimum(tl.maximum(rem, 0), 7)).to(tl.uint64)) - 1
        x = tl.where(rem >= 8, x, x & keep)
    else:
        x = tl.load(pw + i, mask=valid, other=0, eviction_policy="evict_first")
    return x


@triton.jit
def _put(dw, i, x, end, COPY: tl.constexpr):
    """COPY: store lanes ``x`` to ``dw[i]`` (uint64 lanes of the destination), for ``i < end`` only."""
    if COPY:
        tl.store(dw + i, x, mask=i < end)


@triton.jit
def _leaf_block(pw, row0, W, end, s, nbytes, SLOW: tl.constexpr, dw, COPY: tl.constexpr):
    """Fold level 0 of one block: 16 rows ``row0 + r*W`` ([256] lane indices each) → (ch0, ch1) [256].

    COPY: each row's lanes (< ``end``) are also stored to ``dw`` at the same lane indices, from the
    same loads (a partial last lane as its zero-padded uint64)."""
    x0 = _lanes(pw, row0, end, s, nbytes, SLOW)
    x1 = _lanes(pw, row0 + W, end, s, nbytes, SLOW)
    x2 = _lanes(pw, row0 + 2 * W, end, s, nbytes, SLOW)
    x3 = _lanes(pw, row0 + 3 * W, end, s, nbytes, SLOW)
    x4 = _lanes(pw, row0 + 4 * W, end, s, nbytes, SLOW)
    x5 = _lanes(pw, row0 + 5 * W, end, s, nbytes, SLOW)
    x6 = _lanes(pw, row0 + 6 * W, end, s, nbytes, SLOW)
    x7 = _lanes(pw, row0 + 7 * W, end, s, nbytes, SLOW)
    x8 = _lanes(pw, row0 + 8 * W, end, s, nbytes, SLOW)
    x9 = _lanes(pw, row0 + 9 * W, end, s, nbytes, SLOW)
    x10 = _lanes(pw, row0 + 10 * W, end, s, nbytes, SLOW)
    x11 = _lanes(pw, row0 + 11 * W, end, s, nbytes, SLOW)
    x12 = _lanes(pw, row0 + 12 * W, end, s, nbytes, SLOW)
    x13 = _lanes(pw, row0 + 13 * W, end, s, nbytes, SLOW)
    x14 = _lanes(pw, row0 + 14 * W, end, s, nbytes, SLOW)
    x15 = _lanes(pw, row0 + 15 * W, end, s, nbytes, SLOW)
    _put(dw, row0, x0, end, COPY)
    _put(dw, row0 + W, x1, end, COPY)
    _put(dw, row0 + 2 * W, x2, end, COPY)
    _put(dw, row0 + 3 * W, x3, end, COPY)
    _put(dw, row0 + 4 * W, x4, end, COPY)
    _put(dw, row0 + 5 * W, x5, end, COPY)
    _put(dw, row0 + 6 * W, x6, end, COPY)
    _put(dw, row0 + 7 * W, x7, end, COPY)
    _put(dw, row0 + 8 * W, x8, end, COPY)
    _put(dw, row0 + 9 * W, x9, end, COPY)
    _put(dw, row0 + 10 * W, x10, end, COPY)
    _put(dw, row0 + 11 * W, x11, end, COPY)
    _put(dw, row0 + 12 * W, x12, end, COPY)
    _put(dw, row0 + 13 * W, x13, end, COPY)
    _put(dw, row0 + 14 * W, x14, end, COPY)
    _put(dw, row0 + 15 * W, x15, end, COPY)
    y0 = _tree16c(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, 0)
    y1 = _tree16c(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 1, 0)
    return y0, y1


@triton.jit
def _program(tab_ptr, V, LO, p):
    """Decode leaf program ``p`` of the plan: code = plan[LO + p] = (q << 24) | view, q = the view's
    leaf program index → (chunk k = q // 16, slot j = q % 16, view address, view bytes, global chunk)."""
    code = tl.load(tab_ptr + LO + p)
    v = code & 0xFFFFFF
    q = code >> 24
    k = q // 16
    j = q % 16
    addr = tl.load(tab_ptr + v)
    nbytes = tl.load(tab_ptr + V + v)
    gc = tl.load(tab_ptr + 3 * V + v) + k  # global chunk index
    return k, j, addr, nbytes, gc


@triton.jit
def _l1_node(left, right, C: tl.constexpr, H: tl.constexpr, K: tl.constexpr, ASM: tl.constexpr, km):
    """§5 node at compile-time height H: ``_node_k`` (K) or ``_node`` with the tweak as a constant."""
    if K:
        y = _node_k(left, right, C, H, ASM, km)
    else:
        y = _node(left, right, C, (_PHI * (64 * C + H + 1)) & _M64)
    return y


@triton.jit
def _l1_pair(l0, l1, y0, y1, H: tl.constexpr, K: tl.constexpr, ASM: tl.constexpr, km0, km1, DONE: tl.constexpr,
             dst0, dst1, t):
    """Both channels' node at height H (pending left operands l0, l1); DONE: then store both."""
    y0 = _l1_node(l0, y0, 0, H, K, ASM, km0)
    y1 = _l1_node(l1, y1, 1, H, K, ASM, km1)
    if DONE:
        tl.store(dst0 + t, y0)
        tl.store(dst1 + t, y1)
    return y0, y1


@triton.jit
def _l1_carry(i, y0, y1, c, H: tl.constexpr, D: tl.constexpr, dst0, dst1, t, STORE: tl.constexpr,
              K: tl.constexpr, ASM: tl.constexpr, km0, km1):
    """Enter ``y`` (both channels), the value of subtree ``i`` of ``2**D`` at height ``H``, into the
    ordered binary tree over them (heights H .. H+D-1), through pending left operands.

    ``c`` = (c0, c1, .., c7): the pending left operand of each height and channel. ``i`` is the
    run-time loop index or a compile-time one (then the branches resolve when compiled). Returns
    ``(y0, y1, c)``; once ``i == 2**D - 1``, ``y`` is the root, also stored to ``dst[t]`` if STORE.
    """
    if D == 0:
        if STORE:
            tl.store(dst0 + t, y0)
            tl.store(dst1 + t, y1)
    elif i % 2 == 0:
        c = (y0, y1, c[2], c[3], c[4], c[5], c[6], c[7])
    else:
        y0, y1 = _l1_pair(c[0], c[1], y0, y1, H, K, ASM, km0, km1, STORE and D == 1, dst0, dst1, t)
        if D > 1:
            if i % 4 == 1:
                c = (c[0], c[1], y0, y1, c[4], c[5], c[6], c[7])
            else:
                y0, y1 = _l1_pair(c[2], c[3], y0, y1, H + 1, K, ASM, km0, km1, STORE and D == 2, dst0, dst1, t)
                if D > 2:
                    if i % 8 == 3:
                        c = (c[0], c[1], c[2], c[3], y0, y1, c[6], c[7])
                    else:
                        y0, y1 = _l1_pair(c[4], c[5], y0, y1, H + 2, K, ASM, km0, km1, STORE and D == 3, dst0, dst1, t)
                        if D > 3:
                            if i == 7:
                                c = (c[0], c[1], c[2], c[3], c[4], c[5], y0, y1)
                            else:  # the root (each store right after its node, as before the split)
                                y0 = _l1_node(c[6], y0, 0, H + 3, K, ASM, km0)
                                if STORE:
                                    tl.store(dst0 + t, y0)
                                y1 = _l1_node(c[7], y1, 1, H + 3, K, ASM, km1)
                                if STORE:
                                    tl.store(dst1 + t, y1)
    return y0, y1, c


@triton.jit
def _leaf_super(pw, sb0, t, end, s, nbytes, dst0, dst1, SLOW: tl.constexpr, dw, COPY: tl.constexpr):
    """Fold levels 0 and 1 of the 16 level-0 blocks of 65536 lanes from lane ``sb0`` → dst0/dst1 [256].

    One block per loop iteration (16 row loads in flight, low register use); its level-0 column
    results enter the level-1 tree (heights 4..7) through ``_l1_carry``. A block that starts at or
    past ``end`` is a zero *value* (§6.1 padding), not a fold of zeros. COPY: as :func:`_leaf_block`.
    """
    z = tl.zeros([_SW], tl.uint64)
    c = (z, z, z, z, z, z, z, z)
    for b in range(16):
        b0 = sb0 + b * _BLK
        y0, y1 = _leaf_block(pw, b0 + t, _SW, end, s, nbytes, SLOW, dw, COPY)
        y0 = tl.where(b0 < end, y0, 0)
        y1 = tl.where(b0 < end, y1, 0)
        y0, y1, c = _l1_carry(b, y0, y1, c, 4, 4, dst0, dst1, t, True, False, 0, 0, 0)


@triton.jit
def _copy_dst(tab_ptr, V, LO, p):
    """The uint64 lane pointer of leaf program ``p``'s view's copy destination (plan row 2)."""
    code = tl.load(tab_ptr + LO + p)
    return tl.load(tab_ptr + 2 * V + (code & 0xFFFFFF)).to(tl.pointer_type(tl.uint64))


@triton.jit(do_not_specialize=["V", "C", "LO"])
def _digest_leaf_kernel(tab_ptr, work_ptr, V, C, LO, FAST: tl.constexpr, COPY: tl.constexpr = False):
    """Leaf stage. Program p reads code = plan[LO + p] = (q << 24) | view; q = the view's leaf
    program index → chunk k = q // 16, slot j = q % 16 (see ``_plan``).

    Chunk with n > 15*4096 lanes: program j folds lanes [k*2^20 + j*65536, +65536) through levels
    0 and 1 → mid[gc*4096 + j*256 + t]. Smaller chunk: program j folds level-0 block j
    (W0 = min(256, ceil(n/16))) → mid[gc*4096 + j*W0 + t]; a 1-lane chunk copies its lane.
    FAST=True: only aligned, tail-free programs of big chunks (plain 64-bit loads; compiled
    alone so its register budget stays small); FAST=False: every other program.
    COPY: every lane read is also stored, once, to the same lane of the view's destination (plan
    row 2, 8-byte aligned, room for every lane: a partial last lane is stored zero-padded).
    """
    k, j, addr, nbytes, gc = _program(tab_ptr, V, LO, tl.program_id(0).to(tl.int64))
    lo = k * _CHUNK
    n = tl.minimum((nbytes + 7) // 8 - lo, _CHUNK)  # lanes in this chunk
    end = lo + n
    s = addr % 8
    pw = (addr - s).to(tl.pointer_type(tl.uint64))
    wk = work_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    dst0 = wk + gc * _MID
    dst1 = dst0 + C * _MID
    t = tl.arange(0, _SW)
    if COPY:
        dw = _copy_dst(tab_ptr, V, LO, tl.program_id(0).to(tl.int64))
    else:
        dw = pw  # unused
    if FAST:
        _leaf_super(pw, lo + j * _SBLK, t, end, s, nbytes, dst0 + j * _SW, dst1 + j * _SW, False, dw, COPY)
    elif n > 15 * _BLK:  # W_1 = 256: levels 0+1 in registers
        _leaf_super(pw, lo + j * _SBLK, t, end, s, nbytes, dst0 + j * _SW, dst1 + j * _SW, True, dw, COPY)
    elif n == 1:  # §6: a one-lane chunk is its own root
        x = _lanes(pw, lo + t, lo + 1, s, nbytes, True)
        _put(dw, lo + t, x, lo + 1, COPY)
        tl.store(dst0 + t, x, mask=t == 0)
        tl.store(dst1 + t, x, mask=t == 0)
    else:  # one level-0 block of width W0 <= 256
        W = tl.minimum((n + 15) // 16, _SW)
        cols = t < W
        y0, y1 = _leaf_block(pw, lo + j * 16 * W + t, W, tl.where(cols, end, lo), s, nbytes, True, dw, COPY)
        tl.store(dst0 + j * W + t, y0, mask=cols)
        tl.store(dst1 + j * W + t, y1, mask=cols)


# ---------------------------------------------------------------------------------------------
# FAST leaf: column slices of whole superblocks.
# ---------------------------------------------------------------------------------------------
@triton.jit
def _row(base, o, bound, pred, FULL: tl.constexpr):
    """One row of lanes ``base[o]`` (int32 offsets). FULL: no lane mask; ``pred``: None or a
    row-uniform mask (the prefetch of a block past the superblock). Else lanes ``o >= bound`` are 0."""
    if FULL:
        if pred is None:
            x = tl.load(base + o, eviction_policy="evict_first")
        else:
            x = tl.load(base + o, mask=pred, other=0, eviction_policy="evict_first")
    else:
        m = o < bound
        if pred is not None:
            m = m & pred
        x = tl.load(base + o, mask=m, other=0, eviction_policy="evict_first")
    return x


@triton.jit
def _rows16(base, o, bound, pred, FULL: tl.constexpr):
    """16 rows ``base[o + r*256]``, r = 0..15 (one level-0 block's column slice)."""
    x0 = _row(base, o, bound, pred, FULL)
    x1 = _row(base, o + 256, bound, pred, FULL)
    x2 = _row(base, o + 512, bound, pred, FULL)
    x3 = _row(base, o + 768, bound, pred, FULL)
    x4 = _row(base, o + 1024, bound, pred, FULL)
    x5 = _row(base, o + 1280, bound, pred, FULL)
    x6 = _row(base, o + 1536, bound, pred, FULL)
    x7 = _row(base, o + 1792, bound, pred, FULL)
    x8 = _row(base, o + 2048, bound, pred, FULL)
    x9 = _row(base, o + 2304, bound, pred, FULL)
    x10 = _row(base, o + 2560, bound, pred, FULL)
    x11 = _row(base, o + 2816, bound, pred, FULL)
    x12 = _row(base, o + 3072, bound, pred, FULL)
    x13 = _row(base, o + 3328, bound, pred, FULL)
    x14 = _row(base, o + 3584, bound, pred, FULL)
    x15 = _row(base, o + 3840, bound, pred, FULL)
    return x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15


@triton.jit
def _fast_prologue(tab_ptr, work_ptr, V, C, LO, p, c0, VEC: tl.constexpr):
    """Decode fast program ``p`` (plan code) → (lane base pointer of its superblock + c0, dst0,
    dst1 of its level-2 slots + c0, lanes of the superblock that lie in the chunk (<= 65536))."""
    k, j, addr, nbytes, gc = _program(tab_ptr, V, LO, p)
    lo = k * _CHUNK
    sb0 = lo + j * _SBLK
    rb = tl.minimum(tl.minimum((nbytes + 7) // 8 - lo, _CHUNK) - j * _SBLK, _SBLK).to(tl.int32)
    base = addr.to(tl.pointer_type(tl.uint64)) + (sb0 + c0)  # one addptr: keeps the hint below
    if VEC:
        base = tl.multiple_of(base, 16)  # plan: 16-byte aligned view (sb0 and c0 are even)
    wk = work_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    dst0 = wk + gc * _MID + j * _SW + c0
    return base, dst0, dst0 + C * _MID, rb


@triton.jit
def _store16(d, o, bound, FULL: tl.constexpr, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15):
    """Store 16 rows to ``d[o + r*256]``, r = 0..15, masked as :func:`_row` loads them (FULL: no mask)."""
    if FULL:
        tl.store(d + o, x0)
        tl.store(d + (o + 256), x1)
        tl.store(d + (o + 512), x2)
        tl.store(d + (o + 768), x3)
        tl.store(d + (o + 1024), x4)
        tl.store(d + (o + 1280), x5)
        tl.store(d + (o + 1536), x6)
        tl.store(d + (o + 1792), x7)
        tl.store(d + (o + 2048), x8)
        tl.store(d + (o + 2304), x9)
        tl.store(d + (o + 2560), x10)
        tl.store(d + (o + 2816), x11)
        tl.store(d + (o + 3072), x12)
        tl.store(d + (o + 3328), x13)
        tl.store(d + (o + 3584), x14)
        tl.store(d + (o + 3840), x15)
    else:
        tl.store(d + o, x0, mask=o < bound)
        tl.store(d + (o + 256), x1, mask=o + 256 < bound)
        tl.store(d + (o + 512), x2, mask=o + 512 < bound)
        tl.store(d + (o + 768), x3, mask=o + 768 < bound)
        tl.store(d + (o + 1024), x4, mask=o + 1024 < bound)
        tl.store(d + (o + 1280), x5, mask=o + 1280 < bound)
        tl.store(d + (o + 1536), x6, mask=o + 1536 < bound)
        tl.store(d + (o + 1792), x7, mask=o + 1792 < bound)
        tl.store(d + (o + 2048), x8, mask=o + 2048 < bound)
        tl.store(d + (o + 2304), x9, mask=o + 2304 < bound)
        tl.store(d + (o + 2560), x10, mask=o + 2560 < bound)
        tl.store(d + (o + 2816), x11, mask=o + 2816 < bound)
        tl.store(d + (o + 3072), x12, mask=o + 3072 < bound)
        tl.store(d + (o + 3328), x13, mask=o + 3328 < bound)
        tl.store(d + (o + 3584), x14, mask=o + 3584 < bound)
        tl.store(d + (o + 3840), x15, mask=o + 3840 < bound)


@triton.jit
def _fast_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS: tl.constexpr, FULL: tl.constexpr, ASM: tl.constexpr,
                dbase, COPY: tl.constexpr):
    """Levels 0 and 1 of one superblock's column slice: a run-time loop over its 16 level-0
    blocks, each folded (both channels) and entered into the level-1 tree (heights 4..7). Not FULL:
    lanes at offsets >= ``bound`` are 0, and a block starting at or past ``rb`` is a zero value (§6.1).
    COPY: the rows loaded are also stored to ``dbase`` at the same offsets and masks (:func:`_store16`).
    """
    z = tl.zeros([COLS], tl.uint64)
    c = (z, z, z, z, z, z, z, z)
    for b in range(16):
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(base, b * _BLK + t, bound, None, FULL)
        if COPY:
            _store16(dbase, b * _BLK + t, bound, FULL, x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15)
        y0 = _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, 0, ASM, KM0)
        y1 = _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 1, 0, ASM, KM1)
        if not FULL:  # (rb on the left: under the interpreter b * _BLK is a constexpr)
            y0 = tl.where(rb > b * _BLK, y0, 0)
            y1 = tl.where(rb > b * _BLK, y1, 0)
        y0, y1, c = _l1_carry(b, y0, y1, c, 4, 4, dst0, dst1, t, True, True, ASM, KM0, KM1)


@triton.jit(do_not_specialize=["V", "C", "LO", "KM0", "KM1"])
def _leaf_fast_kernel(tab_ptr, work_ptr, V, C, LO, KM0, KM1, COLS: tl.constexpr, ASM: tl.constexpr,
                      COPY: tl.constexpr = False):
    """FAST launch: program pid folds levels 0 and 1 of columns [c0, c0+COLS) of one superblock
    (16 level-0 blocks of 4096 lanes) → dst[c0 .. c0+COLS) per channel.

    A program whose 65536 lanes all lie in the view (a uniform run-time test) runs a copy of the
    loop without any masks; a partial superblock (at most one per view) the masked copy.
    KM0/KM1: ``_mix.KM`` (run-time multipliers of the ASM & 1 add-rotate). COPY: the lanes loaded
    are also stored to the same lanes of the view's destination (plan row 2), same masks.
    """
    S: tl.constexpr = _SW // COLS
    pid = tl.program_id(0)
    base, dst0, dst1, rb = _fast_prologue(tab_ptr, work_ptr, V, C, LO, (pid // S).to(tl.int64), (pid % S) * COLS, False)
    t = tl.arange(0, COLS)
    bound = rb - (pid % S) * COLS  # lane offsets from base below this are in the chunk
    if COPY:  # the destination lane of base's lane: same view lane index (sb0 + c0) from the dst address
        code = tl.load(tab_ptr + LO + (pid // S).to(tl.int64))
        q = code >> 24
        daddr = tl.load(tab_ptr + 2 * V + (code & 0xFFFFFF))
        dbase = daddr.to(tl.pointer_type(tl.uint64)) + ((q // 16) * _CHUNK + (q % 16) * _SBLK + (pid % S) * COLS)
    else:
        dbase = base  # unused
    if rb == _SBLK:
        _fast_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS, True, ASM, dbase, COPY)
    else:
        _fast_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS, False, ASM, dbase, COPY)
