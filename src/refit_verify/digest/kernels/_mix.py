"""Triton helpers of digest v1: mixers, node combine, 16-leaf trees and the level-1 carry (§4-§6.1).

Every constant comes from :mod:`refit_verify.digest.reference` (``MIXERS``, ``ROT``, ``PHI``) as a
``tl.constexpr``, so the compiled code holds them as immediates. All values are ``tl.uint64``
(``>>`` is logical). Two node forms give the same value:

* :func:`_node`: ``M_c(left ^ tw) + ror(right, R_c)`` with the tweak as an operand (constexpr or
  run-time ``uint64``): the general leaf, upper and chain stages;
* :func:`_node_k`: the tweak of a compile-time height folded into the first xor-shift, and
  optional inline PTX that moves ALU-pipe work to the IMAD pipe (``ASM``): the FAST leaf.

Source: docs/digest-spec.md §4, §5, §6.1
"""

from __future__ import annotations

import triton
import triton.language as tl

from refit_verify.digest import reference as _ref

_PHI = tl.constexpr(_ref.PHI)
_M64 = tl.constexpr(_ref.MASK64)
(_XA0, _XB0, _XC0), (_MA0, _MB0) = ([tl.constexpr(v) for v in row] for row in _ref.MIXERS[0])
(_XA1, _XB1, _XC1), (_MA1, _MB1) = ([tl.constexpr(v) for v in row] for row in _ref.MIXERS[1])
_R0, _L0 = tl.constexpr(_ref.ROT[0]), tl.constexpr(64 - _ref.ROT[0])
_R1, _L1 = tl.constexpr(_ref.ROT[1]), tl.constexpr(64 - _ref.ROT[1])

# Work layout shared by the kernels and the host side (``digest._plan``).
_CHUNK = tl.constexpr(_ref.CHUNK_LANES)  # lanes per chunk
_SW = tl.constexpr(_ref.STRIDE)  # 256: max fold width W and row length of every tile
_BLK = tl.constexpr(_ref.GROUP * _ref.STRIDE)  # 4096 lanes: one full level-0 block
_SBLK = tl.constexpr(_ref.GROUP * _ref.GROUP * _ref.STRIDE)  # 65536 lanes: one leaf superblock
MID_N = _ref.GROUP * _ref.STRIDE  # 4096 slots per chunk and channel between leaf and upper
SCR_N = 2 * _ref.STRIDE  # 512 scratch slots per chunk and channel (ping-pong of 256)
_MID = tl.constexpr(MID_N)
_SCR = tl.constexpr(SCR_N)


@triton.jit
def _mix(x, C: tl.constexpr):
    """§4.1 mixer of channel C: M_0 (Moremur) or M_1 (SplitMix64 finaliser)."""
    x ^= x >> (_XA0 if C == 0 else _XA1)
    x *= _MA0 if C == 0 else _MA1
    x ^= x >> (_XB0 if C == 0 else _XB1)
    x *= _MB0 if C == 0 else _MB1
    x ^= x >> (_XC0 if C == 0 else _XC1)
    return x


@triton.jit
def _node(left, right, C: tl.constexpr, tw):
    """§5 ``M_c(left ^ tw) + ror(right, R_c)`` mod 2**64; ``tw`` = tweak(c, level) (constexpr or uint64)."""
    return _mix(left ^ tw, C) + ((right >> (_R0 if C == 0 else _R1)) | (right << (_L0 if C == 0 else _L1)))


@triton.jit
def _tree16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, C: tl.constexpr, t0, t1, t2, t3):
    """§6.1 ordered 4-level tree over 16 values (elementwise over the tile); t0..t3 = tweaks of its heights."""
    a0 = _node(x0, x1, C, t0)
    a1 = _node(x2, x3, C, t0)
    a2 = _node(x4, x5, C, t0)
    a3 = _node(x6, x7, C, t0)
    a4 = _node(x8, x9, C, t0)
    a5 = _node(x10, x11, C, t0)
    a6 = _node(x12, x13, C, t0)
    a7 = _node(x14, x15, C, t0)
    b0, b1, b2, b3 = _node(a0, a1, C, t1), _node(a2, a3, C, t1), _node(a4, a5, C, t1), _node(a6, a7, C, t1)
    return _node(_node(b0, b1, C, t2), _node(b2, b3, C, t2), C, t3)


@triton.jit
def _tree16c(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, C: tl.constexpr, H: tl.constexpr):
    """``_tree16`` at compile-time heights H..H+3 (tweaks folded to constants)."""
    return _tree16(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, C,
                   (_PHI * (64 * C + H + 1)) & _M64, (_PHI * (64 * C + H + 2)) & _M64,
                   (_PHI * (64 * C + H + 3)) & _M64, (_PHI * (64 * C + H + 4)) & _M64)


# ---------------------------------------------------------------------------------------------
# Pipe balancing (``ASM``, CUDA only). On sm_90 the integer ALU pipe (shifts, LOP3, IADD3) and the
# IMAD pipe each take a warp instruction every other cycle; the plain node is ~14 ALU + 9 IMAD per
# channel, so the ALU pipe binds. A 32x32->64-bit multiply by 2**k is a two-word shift on the
# IMAD pipe: hi32(h * 2**(32-s)) = h >> s, lo32(h * 2**(32-s)) = h << (32-s). The PTX below
# (tested against the reference by a small PTX model in tests/digest/kernels/test_launch.py):
#   xor-shift ``x ^ (x >> s)``: s < 32, the high word's shift through mul.wide (1 ALU -> 1 IMAD);
#       s > 32, lo ^= hi >> (s - 32) through mul.wide;
#   add-rotate ``m + ror(r, R)``: m + hi*2**k by one mad.wide, low word's shift added with carry,
#       the other word's shift-left by madc (3 ALU + 1 IMAD -> 2 ALU + 3 IMAD in SASS).
# Hot-loop SASS per 16 lanes and both channels, ALU/IMAD (ptxas of Triton 3.6 and 3.9): asm 0
# 543/402, 1 501/476, 2 501/436, 3 473/504, 6 463/476, 7 470/507. ptxas undoes other attempts
# (a literal power-of-two mad.wide becomes LEA; an all-IMAD add+rotate gets re-split).
def _ptx_xs(s: int) -> str:
    """PTX for ``$0 = $1 ^ ($1 >> s)`` on a 64-bit register, 1 <= s <= 63, s != 32."""
    assert 0 < s < 64 and s != 32
    if s > 32:
        return ("{ .reg .b32 l, h, pl, ph; .reg .b64 p; mov.b64 {l, h}, $1; "
                f"mul.wide.u32 p, h, {1 << (64 - s)}; mov.b64 {{pl, ph}}, p; xor.b32 l, l, ph; mov.b64 $0, {{l, h}}; }}")
    return ("{ .reg .b32 l, h, pl, ph, q; .reg .b64 p; mov.b64 {l, h}, $1; "
            f"mul.wide.u32 p, h, {1 << (32 - s)}; mov.b64 {{pl, ph}}, p; shr.b32 q, l, {s}; "
            "xor.b32 q, q, pl; xor.b32 l, l, q; xor.b32 h, h, ph; mov.b64 $0, {l, h}; }")


def _ptx_addror(rot: int) -> str:
    """PTX for ``$0 = $1 + ror($2, rot)``; ``$3`` must hold 2**(32 - rot % 32) as a *run-time* value
    (with a literal, ptxas turns the mad.wide into LEA shift-adds on the ALU pipe)."""
    assert 0 < rot < 64 and rot != 32
    halves = "{h, l}" if rot > 32 else "{l, h}"  # ror by 32 + r == ror of the swapped words by r
    r = rot % 32
    return ("{ .reg .b32 l, h, al, ah, s; .reg .b64 a; "
            f"mov.b64 {halves}, $2; mad.wide.u32 a, h, $3, $1; mov.b64 {{al, ah}}, a; shr.b32 s, l, {r}; "
            "add.cc.u32 al, al, s; madc.lo.u32 ah, l, $3, ah; mov.b64 $0, {al, ah}; }")


# Per channel: PTX of the mixer's middle and last xor-shifts, of the node's add-rotate, and the
# run-time multiplier the add-rotate needs (passed to kernels as KM0 / KM1).
_PTX_MID0, _PTX_LAST0 = tl.constexpr(_ptx_xs(_ref.MIXERS[0][0][1])), tl.constexpr(_ptx_xs(_ref.MIXERS[0][0][2]))
_PTX_MID1, _PTX_LAST1 = tl.constexpr(_ptx_xs(_ref.MIXERS[1][0][1])), tl.constexpr(_ptx_xs(_ref.MIXERS[1][0][2]))
_PTX_ADDROR0, _PTX_ADDROR1 = tl.constexpr(_ptx_addror(_ref.ROT[0])), tl.constexpr(_ptx_addror(_ref.ROT[1]))
KM = (1 << (32 - _ref.ROT[0] % 32), 1 << (32 - _ref.ROT[1] % 32))


@triton.jit
def _asm1(ptx: tl.constexpr, x):
    return tl.inline_asm_elementwise(ptx, "=l,l", [x], dtype=tl.uint64, is_pure=True, pack=1)


@triton.jit
def _asm3(ptx: tl.constexpr, m, r, k):
    return tl.inline_asm_elementwise(ptx, "=l,l,l,r", [m, r, k], dtype=tl.uint64, is_pure=True, pack=1)


@triton.jit
def _node_k(left, right, C: tl.constexpr, H: tl.constexpr, ASM: tl.constexpr, km):
    """§5 node at compile-time height H, tweak folded into the first xor-shift (same value as
    ``_node``): (x ^ t) ^ ((x ^ t) >> s) == x ^ (x >> s) ^ (t ^ (t >> s)). ASM, a bit mask, moves
    ALU-pipe work to the IMAD pipe (PTX above): 1 the final add + rotation, 2 each mixer's last
    xor-shift, 4 its middle one. ``km``: the run-time uint32 ``KM[C]`` (only read when ASM & 1)."""
    TW: tl.constexpr = (_PHI * (64 * C + H + 1)) & _M64
    XA: tl.constexpr = _XA0 if C == 0 else _XA1
    x = left ^ (left >> XA) ^ (TW ^ (TW >> XA))
    x *= _MA0 if C == 0 else _MA1
    if ASM & 4:
        x = _asm1(_PTX_MID0 if C == 0 else _PTX_MID1, x)
    else:
        x ^= x >> (_XB0 if C == 0 else _XB1)
    x *= _MB0 if C == 0 else _MB1
    if ASM & 2:
        x = _asm1(_PTX_LAST0 if C == 0 else _PTX_LAST1, x)
    else:
        x ^= x >> (_XC0 if C == 0 else _XC1)
    if ASM & 1:
        y = _asm3(_PTX_ADDROR0 if C == 0 else _PTX_ADDROR1, x, right, km)
    else:
        y = x + ((right >> (_R0 if C == 0 else _R1)) | (right << (_L0 if C == 0 else _L1)))
    return y


@triton.jit
def _tree16k(x0, x1, x2, x3, x4, x5, x6, x7, x8, x9, x10, x11, x12, x13, x14, x15, C: tl.constexpr, H: tl.constexpr,
             ASM: tl.constexpr, km):
    """§6.1 16-leaf tree of one channel at heights H..H+3 (``_node_k``)."""
    a0 = _node_k(x0, x1, C, H, ASM, km)
    a1 = _node_k(x2, x3, C, H, ASM, km)
    a2 = _node_k(x4, x5, C, H, ASM, km)
    a3 = _node_k(x6, x7, C, H, ASM, km)
    a4 = _node_k(x8, x9, C, H, ASM, km)
    a5 = _node_k(x10, x11, C, H, ASM, km)
    a6 = _node_k(x12, x13, C, H, ASM, km)
    a7 = _node_k(x14, x15, C, H, ASM, km)
    b0 = _node_k(a0, a1, C, H + 1, ASM, km)
    b1 = _node_k(a2, a3, C, H + 1, ASM, km)
    b2 = _node_k(a4, a5, C, H + 1, ASM, km)
    b3 = _node_k(a6, a7, C, H + 1, ASM, km)
    return _node_k(_node_k(b0, b1, C, H + 2, ASM, km), _node_k(b2, b3, C, H + 2, ASM, km), C, H + 3, ASM, km)
