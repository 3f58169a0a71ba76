"""Pure-Python reference implementation of digest v1 (``docs/digest-spec.md``).

Dependency-free and written for reading and testing, not speed: every function names the spec
section it implements. All arithmetic is on Python ints reduced modulo 2**64.

Source: ``docs/digest-spec.md`` (refit-verify digest v1).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

MASK64 = (1 << 64) - 1

# §4 Constants.
DOMAIN_TAG = b"refit-verify/digest/v1\x00"
LANE_BYTES = 8
GROUP = 16  # lanes folded by one 4-level subtree (fan-in of one fold level)
STRIDE = 256  # leaf stride W: a group's lanes lie W apart
CHUNK_LANES = 1 << 20  # lanes per chunk (8 MiB)
PHI = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, odd
ROT = (23, 41)  # right-rotation of the right child, per channel
CHAIN_LEVEL = 48
FINAL_LEVELS = (49, 50)


def _xs(x: int, s: int) -> int:
    return x ^ (x >> s)


def mix0(x: int) -> int:
    """§4.1 Channel 0 mixer (Moremur, Pelle Evensen)."""
    x = _xs(x, 27)
    x = (x * 0x3C79AC492BA7B653) & MASK64
    x = _xs(x, 33)
    x = (x * 0x1C69B3F74AC4AE35) & MASK64
    return _xs(x, 27)


def mix1(x: int) -> int:
    """§4.1 Channel 1 mixer (SplitMix64 finaliser, Stafford Mix13)."""
    x = _xs(x, 30)
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x = _xs(x, 27)
    x = (x * 0x94D049BB133111EB) & MASK64
    return _xs(x, 31)


MIX = (mix0, mix1)


def tweak(channel: int, level: int) -> int:
    """§4.2 Tweak of ``channel`` at tree height (or role) ``level``."""
    return (PHI * (64 * channel + level + 1)) & MASK64


def ror(x: int, r: int) -> int:
    """Rotate a 64-bit value right by ``r`` (1..63)."""
    return ((x >> r) | (x << (64 - r))) & MASK64


def node(channel: int, left: int, right: int, level: int) -> int:
    """§5 Node combine: ``M_c(left ^ T(c, level)) + ror(right, R_c)`` mod 2**64."""
    return (MIX[channel](left ^ tweak(channel, level)) + ror(right, ROT[channel])) & MASK64


def seed(dtype_name: str, shape: Sequence[int], nbytes: int) -> tuple[int, int]:
    """§3 Metadata seed: two 64-bit chain values from BLAKE2b-128 over the metadata record."""
    name = dtype_name.encode("ascii")
    rec = DOMAIN_TAG + bytes([len(name)]) + name + bytes([len(shape)])
    rec += b"".join(struct.pack("<Q", int(d)) for d in shape)
    rec += struct.pack("<Q", nbytes)
    h = hashlib.blake2b(rec, digest_size=16).digest()
    return struct.unpack("<QQ", h)


def lanes(data: bytes) -> list[int]:
    """§2 Little-endian 64-bit lanes; the last lane is zero-padded."""
    pad = (-len(data)) % LANE_BYTES
    data = data + b"\x00" * pad
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


def fold_level(channel: int, seq: list[int], f: int) -> list[int]:
    """§6.1 One fold level ``f``: groups of 16 values W_f apart, each folded by a 4-level tree."""
    n = len(seq)
    w = min(STRIDE, -(-n // GROUP))
    block = GROUP * w
    nblocks = -(-n // block)
    seq = seq + [0] * (nblocks * block - n)
    out = []
    for b in range(nblocks):
        for t in range(w):
            vals = [seq[b * block + j * w + t] for j in range(GROUP)]
            for k in range(4):  # binary heights 4f .. 4f+3
                vals = [node(channel, vals[i], vals[i + 1], 4 * f + k) for i in range(0, len(vals), 2)]
            out.append(vals[0])
    return out


def chunk_root(channel: int, chunk: list[int]) -> int:
    """§6 Root of one chunk (1..CHUNK_LANES lanes): fold levels until one value is left."""
    seq, f = chunk, 0
    while len(seq) > 1:
        seq = fold_level(channel, seq, f)
        f += 1
    return seq[0]


def digest_bytes(data: bytes, dtype_name: str, shape: Sequence[int]) -> str:
    """§2–§8 Digest of ``data`` (the tensor's bytes in logical row-major order) as 32 hex chars."""
    seeds = seed(dtype_name, shape, len(data))
    ls = lanes(data)
    out = []
    for c in range(2):
        h = seeds[c]
        for i in range(0, len(ls), CHUNK_LANES):  # §7 chunk chain
            h = node(c, h, chunk_root(c, ls[i : i + CHUNK_LANES]), CHAIN_LEVEL)
        for lv in FINAL_LEVELS:  # §8 finalisation
            h = MIX[c](h ^ tweak(c, lv))
        out.append(h)
    return f"{out[0]:016x}{out[1]:016x}"
