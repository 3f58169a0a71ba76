"""Upper and chain stages of the digest kernels: chunk roots, then the chunk chain and finalisation.

* **upper** (``_digest_upper_kernel``, one program per chunk): the remaining <= 3 fold levels of a
  chunk on the <= 4096 values the leaf stage left (a single block per level), through a small
  scratch with CTA barriers; writes the chunk's root per channel.
* **gather** (``_digest_gather_kernel``): derived views' full superblocks, from their parents' leaf outputs.
* **chain** (``_digest_chain_kernel``, one program per view): the chunk chain from the metadata
  seed and the two finalisation mixes (the compiled ``reference.chain_and_finalise``).

Source: docs/digest-spec.md §6, §7, §8
"""

from __future__ import annotations

import triton
import triton.language as tl

from refit_verify.digest import reference as _ref
from refit_verify.digest.kernels._mix import _CHUNK, _MID, _PHI, _SCR, _SW, _mix, _node, _tree16

# §7/§8 tweaks of the chain and finalisation roles, per channel.
_T0_CHAIN, _T1_CHAIN = tl.constexpr(_ref.tweak(0, _ref.CHAIN_LEVEL)), tl.constexpr(_ref.tweak(1, _ref.CHAIN_LEVEL))
_T0_FIN0, _T1_FIN0 = tl.constexpr(_ref.tweak(0, _ref.FINAL_LEVELS[0])), tl.constexpr(_ref.tweak(1, _ref.FINAL_LEVELS[0]))
_T0_FIN1, _T1_FIN1 = tl.constexpr(_ref.tweak(0, _ref.FINAL_LEVELS[1])), tl.constexpr(_ref.tweak(1, _ref.FINAL_LEVELS[1]))


@triton.jit
def _upper_level(src, m, W, t, C: tl.constexpr, f):
    """One fold level over m <= 4096 values at ``src`` (a single block of width W) → [256]."""
    cols = t < W
    x0 = tl.load(src + t, mask=cols & (t < m), other=0)
    x1 = tl.load(src + W + t, mask=cols & (W + t < m), other=0)
    x2 = tl.load(src + 2 * W + t, mask=cols & (2 * W + t < m), other=0)
    x3 = tl.load(src + 3 * W + t, mask=cols & (3 * W + t < m), other=0)
    x4 = tl.load(src + 4 * W + t, mask=cols & (4 * W + t < m), other=0)
    x5 = tl.load(src + 5 * W + t, mask=cols & (5 * W + t < m), other=0)
    x6 = tl.load(src + 6 * W + t, mask=cols & (6 * W + t < m), other=0)
    x7 = tl.load(src + 7 * W + t, mask=cols & (7 * W + t < m), other=0)
    x8 = tl.load(src + 8 * W + t, mask=cols & (8 * W + t < m), other=0)
    x9 = tl.load(src + 9 * W + t, mask=cols & (9 * W + t < m), other=0)
    x10 = tl.load(src + 10 * W + t, mask=cols & (10 * W + t < m), other=0)
    x11 = tl.load(src + 11 * W + t, mask=cols & (11 * W + t < m), other=0)
    x12 = tl.load(src + 12 * W + t, mask=cols & (12 * W + t < m), other=0)
    x13 = tl.load(src + 13 * W + t, mask=cols & (13 * W + t < m), other=0)
    x14 = tl.load(src + 14 * W + t, mask=cols & (14 * W + t < m), other=0)
    x15 = tl.load(src + 15 * W + t, mask=cols & (15 * W + t < m), other=0)
    b = (64 * C + 4 * f + 1).to(tl.uint64)  # tweak(c, h) = PHI * (64c + h + 1), h = 4f .. 4f+3
    return _tree16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, C,
                   b * _PHI, (b + 1) * _PHI, (b + 2) * _PHI, (b + 3) * _PHI)


@triton.jit(do_not_specialize=["V", "C", "CV"])
def _digest_upper_kernel(tab_ptr, work_ptr, V, C, CV):
    """Upper stage, one program per chunk gc: fold the leaf output down to the chunk root.

    Leaf output: n == 1 → 1 value (the root); n > 61440 lanes → ceil(n/65536)*256 values at fold
    level 2; else ceil(n/(16*W0))*W0 values at level 1. Each level here is one block (m <= 4096).
    Levels ping-pong through scratch[gc] with a CTA barrier; root → roots[gc].
    """
    gc = tl.program_id(0).to(tl.int64)
    v = tl.load(tab_ptr + CV + gc)
    nbytes = tl.load(tab_ptr + V + v)
    k = gc - tl.load(tab_ptr + 3 * V + v)
    n = tl.minimum((nbytes + 7) // 8 - k * _CHUNK, _CHUNK)
    W0 = tl.minimum((n + 15) // 16, _SW)
    nb0 = (n + 16 * W0 - 1) // (16 * W0)
    fused = nb0 >= 16  # the leaf stage did levels 0 and 1
    m = tl.where(n == 1, 1, tl.where(fused, (nb0 + 15) // 16 * _SW, nb0 * W0))  # values left
    f = tl.where(fused, 2, 1)  # next fold level
    wk = work_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    src0 = wk + gc * _MID
    src1 = src0 + C * _MID
    scr0 = wk + 2 * C * _MID + gc * _SCR
    scr1 = scr0 + C * _SCR
    t = tl.arange(0, _SW)
    for it in range(3):  # 4096 → 256 → 16 → 1 at most
        if m > 1:
            W = (m + 15) // 16
            y0 = _upper_level(src0, m, W, t, 0, f)
            y1 = _upper_level(src1, m, W, t, 1, f)
            src0 = scr0 + (it % 2) * _SW
            src1 = scr1 + (it % 2) * _SW
            tl.store(src0 + t, y0, mask=t < W)
            tl.store(src1 + t, y1, mask=t < W)
            tl.debug_barrier()  # make this level's stores visible to the whole CTA
            m = W
            f += 1
    roots = wk + 2 * C * (_MID + _SCR)
    tl.store(roots + gc, tl.load(src0))
    tl.store(roots + C + gc, tl.load(src1))


@triton.jit(do_not_specialize=["C", "GO", "G"])
def _digest_gather_kernel(tab_ptr, work_ptr, C, GO, G):
    """Derived views (``launch._plan``), one program per gather entry g: copy the 256 leaf outputs
    (levels 0+1 of one full superblock, both channels) of source row plan[GO + G + g] to destination
    row plan[GO + g] of the work buffer (row r = mid values [256r, 256r + 256) of channel 0; channel
    1 at + C*4096). Runs after the leaf launches, before the upper one (stream order)."""
    g = tl.program_id(0).to(tl.int64)
    d = tl.load(tab_ptr + GO + g) * _SW
    s = tl.load(tab_ptr + GO + G + g) * _SW
    t = tl.arange(0, _SW)
    wk = work_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    w1 = wk + C * _MID
    tl.store(wk + d + t, tl.load(wk + s + t))
    tl.store(w1 + d + t, tl.load(w1 + s + t))


# ---------------------------------------------------------------------------------------------
# Chain stage: §7 chunk chain and §8 finalisation, one program per view.
# ---------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["V", "C"])
def _digest_chain_kernel(tab_ptr, work_ptr, out_ptr, V, C, RB: tl.constexpr):
    """h = seed[c]; h = node(h, root_k, CHAIN) over the view's chunks; h = M(h ^ T(FIN0)); h = M(h ^ T(FIN1)).

    Roots are read RB at a time (next block prefetched) and peeled off in registers, so the
    serial chain waits on the mixer latency, not on memory. Writes out[v] = (h0, h1) as int64 bits.
    """
    v = tl.program_id(0).to(tl.int64)
    nbytes = tl.load(tab_ptr + V + v)
    c0 = tl.load(tab_ptr + 3 * V + v)
    h0 = tl.load(tab_ptr + 4 * V + v).to(tl.uint64, bitcast=True)
    h1 = tl.load(tab_ptr + 5 * V + v).to(tl.uint64, bitcast=True)
    nch = ((nbytes + 7) // 8 + _CHUNK - 1) // _CHUNK
    wk = work_ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
    r0p = wk + 2 * C * (_MID + _SCR) + c0
    r1p = r0p + C
    i = tl.arange(0, RB)
    r0 = tl.load(r0p + i, mask=i < nch, other=0)
    r1 = tl.load(r1p + i, mask=i < nch, other=0)
    for k0 in range(0, nch, RB):
        nx = k0 + RB + i
        n0 = tl.load(r0p + nx, mask=nx < nch, other=0)
        n1 = tl.load(r1p + nx, mask=nx < nch, other=0)
        for ii in tl.static_range(RB):
            a0 = tl.sum(tl.where(i == ii, r0, 0))
            a1 = tl.sum(tl.where(i == ii, r1, 0))
            live = k0 + ii < nch
            h0 = tl.where(live, _node(h0, a0, 0, _T0_CHAIN), h0)
            h1 = tl.where(live, _node(h1, a1, 1, _T1_CHAIN), h1)
        r0 = n0
        r1 = n1
    # §8: two mixes, at the tweaks of the roles FINAL_LEVELS.
    h0 = _mix(_mix(h0 ^ _T0_FIN0, 0) ^ _T0_FIN1, 0)
    h1 = _mix(_mix(h1 ^ _T1_FIN0, 1) ^ _T1_FIN1, 1)
    tl.store(out_ptr + 2 * v, h0.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 2 * v + 1, h1.to(tl.int64, bitcast=True))
