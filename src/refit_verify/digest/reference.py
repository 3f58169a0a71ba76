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


# §4.1 Mixers, per channel: xs s1, × m1, xs s2, × m2, xs s3 (every implementation reads these).
MIXERS = (
    ((27, 33, 27), (0x3C79AC492BA7B653, 0x1C69B3F74AC4AE35)),  # M_0: Moremur (Pelle Evensen)
    ((30, 27, 31), (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)),  # M_1: SplitMix64 finaliser (Stafford Mix13)
)


def _mixer(channel: int):
    (s1, s2, s3), (m1, m2) = MIXERS[channel]

    def mix(x: int) -> int:
        x ^= x >> s1
        x = (x * m1) & MASK64
        x ^= x >> s2
        x = (x * m2) & MASK64
        return x ^ (x >> s3)

    mix.__name__ = mix.__qualname__ = f"mix{channel}"
    mix.__doc__ = f"§4.1 Channel {channel} mixer: xs {s1}, × {m1:#x}, xs {s2}, × {m2:#x}, xs {s3}."
    return mix


mix0 = _mixer(0)
mix1 = _mixer(1)
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


def chain_and_finalise(seeds: Sequence[int], roots: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """§7 chunk chain from the §3 seeds over the chunk roots in order, then §8 finalisation.

    Args:
        seeds: ``(seed_0, seed_1)`` from :func:`seed`.
        roots: one ``(root_0, root_1)`` per chunk (§6), in chunk order (ints in [0, 2**64)).

    Returns:
        tuple[int, int]: the finalised channel values ``(h_0, h_1)``.
    """
    out = []
    for c in range(2):
        h = seeds[c]
        for r in roots:
            h = node(c, h, r[c], CHAIN_LEVEL)
        for lv in FINAL_LEVELS:
            h = MIX[c](h ^ tweak(c, lv))
        out.append(h)
    return out[0], out[1]


def hexdigest(h0: int, h1: int) -> str:
    """§9 Output: channel 0 then channel 1, each 16 lowercase hex digits (big-endian)."""
    return f"{h0:016x}{h1:016x}"


def digest_bytes(data: bytes, dtype_name: str, shape: Sequence[int]) -> str:
    """§2–§9 Digest of ``data`` (the tensor's bytes in logical row-major order) as 32 hex chars."""
    ls = lanes(data)
    chunks = [ls[i : i + CHUNK_LANES] for i in range(0, len(ls), CHUNK_LANES)]
    roots = [(chunk_root(0, ch), chunk_root(1, ch)) for ch in chunks]
    return hexdigest(*chain_and_finalise(seed(dtype_name, shape, len(data)), roots))
