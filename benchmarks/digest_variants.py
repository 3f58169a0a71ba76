"""The FAST-leaf variant lab of the digest kernels: the launches the production one was chosen from.

``refit_verify.digest.kernels.launch`` runs one FAST leaf launch (``_leaf.FAST_LEAF``, the variant
``f128w4-full-asm6`` below, specialised). This module keeps the general kernels behind that choice,
for ``bench_variants.py`` to time on a GPU and for ``tests/digest/kernels/test_variants.py`` to
check bit for bit under the Triton interpreter: :data:`LEAF_VARIANTS`, :func:`launch` (one
variant's FAST launch) and :func:`digest_views` (``kernels.digest.digest_views`` with that launch).
Shared pieces (mixers, ``_node_k``, row loads, the level-1 carry, the general leaf, upper and
chain kernels, the plan) are imported from the production modules, not copied.

Source: docs/digest-spec.md
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from refit_verify.digest.kernels import launch as kd
from refit_verify.digest.kernels._leaf import _digest_leaf_kernel, _fast_prologue, _l1_carry, _rows16
from refit_verify.digest.kernels._mix import _BLK, _SBLK, _SW, KM, MID_N, _node_k, _tree16k

__all__ = ["LEAF_VARIANTS", "PRODUCTION", "digest_views", "launch"]

# Knobs of the fused kernel. A variant replaces only the FAST launch (aligned big-chunk programs);
# the general launch, upper and chain stages are production's. Knobs:
#   cols     columns of the 256-wide fold per program: 256 (one program per 65536-lane
#            superblock) or 128/64 (2/4 programs per superblock, each owning a column slice
#            through levels 0 and 1: columns never mix below level 2);
#   unroll   blocks per static body: 1 = runtime loop over the 16 level-0 blocks (level-1 carry
#            branches at run time), 2/4 = runtime loop of 16/unroll bodies, 16 = fully static;
#   prefetch issue the next block's 16 row loads before folding the current one (registers);
#   vec      16-byte-aligned base (plan sends only 16-aligned views here) so a thread holding 2
#            adjacent lanes of a row loads them as one 16-byte vector (cols / (32*warps) == 2);
#   full     programs whose 65536 lanes all lie in the view (a uniform run-time test) run a copy
#            of the loop with no masks at all; a partial superblock runs the masked copy;
#   ilv      emit the two channels' trees node by node interleaved (else channel 0, channel 1);
#   mode     "fused" (levels 0+1 in one program) or "l0" (one program per level-0 block writes
#            2 x 256 values, a second launch folds level 1: more programs, +1/4 traffic; always
#            unmasked for full superblocks).
# All variants: 32-bit lane offsets from a 64-bit per-program base pointer, and the tweak XOR
# folded into the first xor-shift: (x ^ t) ^ ((x ^ t) >> s) == x ^ (x >> s) ^ (t ^ (t >> s)).
# FAST-launch variants (knobs above; timed by benchmarks/bench_variants.py).
# Keys: mode "v1" (``_digest_leaf_kernel`` FAST=True at num_warps=LEAF_WARPS) | "fused" | "l0";
# cols, warps, unroll (1/2/4/8/16), prefetch, vec, full, ilv, asm (bit mask 0..7), maxnreg and stages
# (launch options; None = compiler's choice). Names: f<cols>w<warps>[-knob...]; r<n> = maxnreg.
# Static sm_90 SASS of the hot loop (ptxas of Triton 3.6/3.9, per input lane, both channels):
# v1 ~36 ALU-pipe + ~24 IMAD-pipe ops, "full" ~27 + ~17, asm=6 ~23 + ~24. Not swept because
# the SASS does not change: num_stages (no pipelined loads in these loops) and ilv (ptxas emits
# the same instruction sequence for interleaved and sequential channels).
LEAF_VARIANTS: dict[str, dict] = {
    "v1": dict(mode="v1"),
    # v1's shape (256 columns, 8 warps, runtime loop): 32-bit offsets + folded tweaks, masks kept
    "f256w8": dict(mode="fused", cols=256, warps=8),
    "f256w8-full": dict(mode="fused", cols=256, warps=8, full=True),
    "f256w8-full-r40": dict(mode="fused", cols=256, warps=8, full=True, maxnreg=40),  # 6 CTAs/SM, no spills
    # asm: bit mask of inline-PTX moves from the ALU to the IMAD pipe (see _mix._node_k); hot-loop SASS
    # per 16 lanes x 2 channels, ALU/IMAD: asm0 543/402, asm2 501/436, asm6 463/476, asm3 473/504
    "f256w8-full-asm2": dict(mode="fused", cols=256, warps=8, full=True, asm=2, maxnreg=64),
    "f256w8-full-asm6": dict(mode="fused", cols=256, warps=8, full=True, asm=6, maxnreg=64),
    "f256w8-full-asm3": dict(mode="fused", cols=256, warps=8, full=True, asm=3, maxnreg=64),
    "f256w8-full-asm6-r40": dict(mode="fused", cols=256, warps=8, full=True, asm=6, maxnreg=40),
    "f128w4-full": dict(mode="fused", cols=128, warps=4, full=True),
    "f128w4-full-asm6": dict(mode="fused", cols=128, warps=4, full=True, asm=6, maxnreg=64),
    "f64w2-full": dict(mode="fused", cols=64, warps=2, full=True),
    "f256w4-full-vec": dict(mode="fused", cols=256, warps=4, full=True, vec=True),
    "f128w2-full-vec": dict(mode="fused", cols=128, warps=2, full=True, vec=True),
    "f256w8-full-pf": dict(mode="fused", cols=256, warps=8, full=True, prefetch=True),
    "f128w4-full-pf": dict(mode="fused", cols=128, warps=4, full=True, prefetch=True),
    "f256w8-full-u4": dict(mode="fused", cols=256, warps=8, full=True, unroll=4),
    "l0-128w4": dict(mode="l0", cols=128, warps=4),
}
# Supported but not swept: unroll=16 (fully static: ~200 KB of SASS, far past the instruction
# cache, and 15-40 s of ptxas per compile; unroll=4 stands for static unrolling) and ilv=True.

# The variant the production FAST launch specialises (``_leaf.FAST_LEAF``).
PRODUCTION = "f128w4-full-asm6"
# Supported knobs that bench_variants.py does not sweep (checked by the interpreter tests).
EXTRA_VARIANTS: dict[str, dict] = {
    "f256w8-full-u16": dict(mode="fused", cols=256, warps=8, full=True, unroll=16),
    "f128w4-u2-ilv": dict(mode="fused", cols=128, warps=4, unroll=2, ilv=True),
}


@triton.jit
def _ilv8(x0, x1, x2, x3, x4, x5, x6, x7, H: tl.constexpr, ASM: tl.constexpr, km0, km1):
    """Heights H and H+1 over 8 values, the two channels' nodes interleaved one by one."""
    a0 = _node_k(x0, x1, 0, H, ASM, km0)
    c0 = _node_k(x0, x1, 1, H, ASM, km1)
    a1 = _node_k(x2, x3, 0, H, ASM, km0)
    c1 = _node_k(x2, x3, 1, H, ASM, km1)
    a2 = _node_k(x4, x5, 0, H, ASM, km0)
    c2 = _node_k(x4, x5, 1, H, ASM, km1)
    a3 = _node_k(x6, x7, 0, H, ASM, km0)
    c3 = _node_k(x6, x7, 1, H, ASM, km1)
    b0 = _node_k(a0, a1, 0, H + 1, ASM, km0)
    d0 = _node_k(c0, c1, 1, H + 1, ASM, km1)
    b1 = _node_k(a2, a3, 0, H + 1, ASM, km0)
    d1 = _node_k(c2, c3, 1, H + 1, ASM, km1)
    return b0, b1, d0, d1


@triton.jit
def _tree16k2(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, H: tl.constexpr, ILV: tl.constexpr,
              ASM: tl.constexpr, km0, km1):
    """Both channels' 16-leaf trees at heights H..H+3: node-interleaved (ILV) or one after the other."""
    if ILV:
        b0, b1, d0, d1 = _ilv8(x0, x1, x2, x3, x4, x5, x6, x7, H, ASM, km0, km1)
        b2, b3, d2, d3 = _ilv8(x8, x9, x10, x11, x12, x13, x14, x15, H, ASM, km0, km1)
        e0 = _node_k(b0, b1, 0, H + 2, ASM, km0)
        f0 = _node_k(d0, d1, 1, H + 2, ASM, km1)
        e1 = _node_k(b2, b3, 0, H + 2, ASM, km0)
        f1 = _node_k(d2, d3, 1, H + 2, ASM, km1)
        y0 = _node_k(e0, e1, 0, H + 3, ASM, km0)
        y1 = _node_k(f0, f1, 1, H + 3, ASM, km1)
    else:
        y0 = _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, H, ASM, km0)
        y1 = _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 1, H, ASM, km1)
    return y0, y1


@triton.jit
def _fused_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS: tl.constexpr, UNROLL: tl.constexpr,
                 LOGU: tl.constexpr, PREFETCH: tl.constexpr, FULL: tl.constexpr, ILV: tl.constexpr,
                 ASM: tl.constexpr):
    """Levels 0 and 1 of one superblock's column slice. Level-1 tree over the 16 block results:
    heights 4..3+LOGU inside each static body of UNROLL blocks (compile-time carries ``q``),
    heights 4+LOGU..7 across the runtime loop (``p``), both through ``_leaf._l1_carry``. Not FULL:
    lanes at offsets >= ``bound`` are 0, and a block starting at or past ``rb`` is a zero value (§6.1).
    """
    z = tl.zeros([COLS], tl.uint64)
    q = (z, z, z, z, z, z, z, z)
    p = (z, z, z, z, z, z, z, z)
    z0, z1 = z, z
    if PREFETCH:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(base, t, bound, None, FULL)
    for o in range(16 // UNROLL):
        for i in tl.static_range(UNROLL):
            b = o * UNROLL + i
            if PREFETCH:
                n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15 = _rows16(
                    base, (b + 1) * _BLK + t, bound, (tl.zeros([COLS], tl.int32) + b) < 15, FULL)
            else:
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(
                    base, b * _BLK + t, bound, None, FULL)
            y0, y1 = _tree16k2(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, ILV, ASM, KM0, KM1)
            if PREFETCH:
                x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = (
                    n0, n1, n2, n3, n4, n5, n6, n7, n8, n9, n10, n11, n12, n13, n14, n15)
            if not FULL:
                y0 = tl.where(b * _BLK < rb, y0, 0)
                y1 = tl.where(b * _BLK < rb, y1, 0)
            # compile-time part of the level-1 tree (block index bits below LOGU are static)
            y0, y1, q = _l1_carry(i, y0, y1, q, 4, LOGU, dst0, dst1, t, False, True, ASM, KM0, KM1)
        z0, z1 = y0, y1  # the height 4+LOGU subtree of this body
        # run-time part: z enters heights 4+LOGU .. 7
        z0, z1, p = _l1_carry(o, z0, z1, p, 4 + LOGU, 4 - LOGU, dst0, dst1, t, True, True, ASM, KM0, KM1)


@triton.jit(do_not_specialize=["V", "C", "LO", "KM0", "KM1"])
def _leaf_fused_kernel(tab_ptr, work_ptr, V, C, LO, KM0, KM1, COLS: tl.constexpr, UNROLL: tl.constexpr, LOGU: tl.constexpr,
                       PREFETCH: tl.constexpr, VEC: tl.constexpr, FULL: tl.constexpr, ILV: tl.constexpr,
                       ASM: tl.constexpr):
    """FAST launch variant: program pid folds levels 0 and 1 of columns [c0, c0+COLS) of one
    superblock (16 level-0 blocks of 4096 lanes) → dst[c0 .. c0+COLS) per channel.

    FULL: a program whose 65536 lanes all lie in the view (a uniform run-time test) runs a copy
    of the loop without any masks; a partial superblock (at most one per view) a masked copy
    with unroll=1 and no prefetch.
    """
    S: tl.constexpr = _SW // COLS
    pid = tl.program_id(0)
    base, dst0, dst1, rb = _fast_prologue(tab_ptr, work_ptr, V, C, LO, (pid // S).to(tl.int64), (pid % S) * COLS, VEC)
    t = tl.arange(0, COLS)
    bound = rb - (pid % S) * COLS  # lane offsets from base below this are in the chunk
    if FULL:
        if rb == _SBLK:
            _fused_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS, UNROLL, LOGU, PREFETCH, True, ILV, ASM)
        else:  # cold path: plain runtime loop (keeps code size and compile time down)
            _fused_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS, 1, 0, False, False, ILV, ASM)
    else:
        _fused_super(base, dst0, dst1, t, bound, rb, KM0, KM1, COLS, UNROLL, LOGU, PREFETCH, False, ILV, ASM)


@triton.jit(do_not_specialize=["V", "C", "LO", "F", "KM0", "KM1"])
def _leaf_l0_kernel(tab_ptr, work_ptr, l0_ptr, V, C, LO, F, KM0, KM1, COLS: tl.constexpr, VEC: tl.constexpr, ILV: tl.constexpr,
                    ASM: tl.constexpr):
    """mode "l0", pass 1: program = (fast program p, block b, column slice) folds level 0 of one
    block's column slice → l0[ch][(16p + b)*256 + c0 + t]; a block past the chunk writes zero
    values (§6.1), a partial one takes a masked copy (uniform run-time branch)."""
    S: tl.constexpr = _SW // COLS
    pid = tl.program_id(0)
    p = (pid // (16 * S)).to(tl.int64)
    b = (pid // S) % 16
    c0 = (pid % S) * COLS
    base, dst0, dst1, rb = _fast_prologue(tab_ptr, work_ptr, V, C, LO, p, c0, VEC)
    t = tl.arange(0, COLS)
    o = b * _BLK + t
    if rb == _SBLK:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(base, o, rb, None, True)
        y0, y1 = _tree16k2(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, ILV, ASM, KM0, KM1)
    else:
        x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(base, o, rb - c0, None, False)
        y0, y1 = _tree16k2(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, ILV, ASM, KM0, KM1)
        y0 = tl.where(b * _BLK < rb, y0, 0)
        y1 = tl.where(b * _BLK < rb, y1, 0)
    d = l0_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + (p * 16 + b) * _SW + c0
    tl.store(d + t, y0)
    tl.store(d + F.to(tl.int64) * _BLK + t, y1)


@triton.jit(do_not_specialize=["V", "C", "LO", "F", "KM0", "KM1"])
def _leaf_l1_kernel(tab_ptr, work_ptr, l0_ptr, V, C, LO, F, KM0, KM1, COLS: tl.constexpr, ASM: tl.constexpr):
    """mode "l0", pass 2: program = (fast program p, column slice) folds level 1 (heights 4..7)
    of its superblock's 16 level-0 results per column → dst (the fused programs' output)."""
    S: tl.constexpr = _SW // COLS
    pid = tl.program_id(0)
    p = (pid // S).to(tl.int64)
    c0 = (pid % S) * COLS
    base, dst0, dst1, rb = _fast_prologue(tab_ptr, work_ptr, V, C, LO, p, c0, False)
    t = tl.arange(0, COLS)
    s0 = l0_ptr.to(tl.pointer_type(tl.uint64), bitcast=True) + p * _BLK + c0
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(s0, t, rb, None, True)
    tl.store(dst0 + t, _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 0, 4, ASM, KM0))
    s1 = s0 + F.to(tl.int64) * _BLK
    x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15 = _rows16(s1, t, rb, None, True)
    tl.store(dst1 + t, _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, 1, 4, ASM, KM1))


def _align(lf: dict) -> int:
    """View alignment a fast program of ``lf`` needs (16-byte vector loads for ``vec``)."""
    return 16 if lf.get("vec") else 8


def launch(lf: dict, plan: torch.Tensor, work: torch.Tensor, V: int, C: int, LO: int, F: int) -> list:
    """The FAST leaf launch(es) of variant ``lf`` (:data:`LEAF_VARIANTS`) over plan entries [LO, LO+F).

    Returns the launched kernels (compiled-kernel objects on CUDA: n_regs, n_spills)."""
    mode = lf.get("mode", "v1")
    opts = {}
    if lf.get("stages") is not None:
        opts["num_stages"] = lf["stages"]
    if lf.get("maxnreg") is not None and not kd._INTERPRETED:
        opts["maxnreg"] = lf["maxnreg"]
    if mode == "v1":
        warps = lf.get("warps") or kd.LEAF_WARPS
        return [_digest_leaf_kernel[(F,)](plan, work, V, C, LO, FAST=True, num_warps=warps, **opts)]
    cols, warps = lf.get("cols", 256), lf.get("warps", 8)
    S = _SW // cols  # column slices per superblock
    vec, ilv = bool(lf.get("vec")), bool(lf.get("ilv"))
    asm = 0 if kd._INTERPRETED else lf.get("asm", 0)  # inline PTX is GPU-only: the interpreter runs asm=0
    if mode == "fused":
        unroll = lf.get("unroll", 1)
        logu = {1: 0, 2: 1, 4: 2, 8: 3, 16: 4}[unroll]
        k = _leaf_fused_kernel[(F * S,)](plan, work, V, C, LO, *KM, COLS=cols, UNROLL=unroll, LOGU=logu,
                                         PREFETCH=bool(lf.get("prefetch")), VEC=vec, FULL=bool(lf.get("full")),
                                         ILV=ilv, ASM=asm, num_warps=warps, **opts)
        return [k]
    if mode == "l0":
        l0 = torch.empty(2 * F * MID_N, dtype=torch.int64, device=work.device)  # freed in stream order
        k0 = _leaf_l0_kernel[(F * 16 * S,)](plan, work, l0, V, C, LO, F, *KM, COLS=cols, VEC=vec, ILV=ilv,
                                            ASM=asm, num_warps=warps, **opts)
        k1 = _leaf_l1_kernel[(F * S,)](plan, work, l0, V, C, LO, F, *KM, COLS=cols, ASM=asm, num_warps=warps)
        return [k0, k1]
    raise ValueError(f"unknown LEAF mode {mode!r}")


def digest_views(views: list[torch.Tensor], seeds: list[tuple[int, int]], lf: dict) -> torch.Tensor:
    """``kernels.digest.digest_views`` with variant ``lf``'s FAST launch: the same bits, other speed.

    Raises:
        ValueError / TypeError: as ``kernels.digest.digest_views``; ValueError for an unknown mode.
    """
    if len(views) != len(seeds):
        raise ValueError(f"{len(views)} views but {len(seeds)} seeds")
    if not views:
        return torch.empty((0, 2), dtype=torch.int64)
    return kd._launch(views, seeds, chain=True, fast=(_align(lf), functools.partial(launch, lf)))


def device_plan(dev: torch.device, u8: torch.Tensor, seeds: list[tuple[int, int]], lf: dict):
    """Plan of one view for a direct :func:`launch` (register counts, leaf-only timing):
    ``(plan, work, C, F)``."""
    plan, _, F, C = kd._device_plan(dev, [u8.data_ptr()], [u8.numel()], seeds, _align(lf))
    work = torch.empty(2 * C * (MID_N + kd.SCR_N + 1), dtype=torch.int64, device=dev)
    return plan, work, C, F
