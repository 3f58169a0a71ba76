"""Independent numpy reimplementation of digest v1, written from ``docs/digest-spec.md`` only.

It does not import or copy ``refit_verify.digest.reference``: agreement between the two on every test
vector is evidence that the spec is complete. Everything is numpy ``uint64`` arithmetic (wrapping
under ``np.errstate(over="ignore")``); every constant is an ``np.uint64`` so nothing is promoted to
float64. Batched: ``digest_lanes`` folds many inputs of the same metadata at once.

Source: ``docs/digest-spec.md`` §2–§9.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

U64 = np.uint64

# §4 Constants.
_TAG = b"refit-verify/digest/v1" + b"\x00"
_GROUP = 16
_STRIDE = 256
_CHUNK = 1 << 20
_PHI = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
_MIXERS = (
    # (xs1, mul1, xs2, mul2, xs3)   §4.1
    (27, 0x3C79AC492BA7B653, 33, 0x1C69B3F74AC4AE35, 27),  # M_0 Moremur
    (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31),  # M_1 SplitMix64 / Mix13
)
_ROT = (23, 41)  # §4.3
_CHAIN = 48
_FINAL = (49, 50)


def tweak(c: int, role: int) -> np.uint64:
    """§4.2 ``T_c(λ) = PHI × (64c + λ + 1) mod 2^64``."""
    return U64((_PHI * (64 * c + role + 1)) & _MASK)


def mix(c: int, x: np.ndarray) -> np.ndarray:
    """§4.1 Mixer ``M_c`` on a uint64 array (returns a new array)."""
    s1, m1, s2, m2, s3 = _MIXERS[c]
    with np.errstate(over="ignore"):
        x = x ^ (x >> U64(s1))
        x = x * U64(m1)
        x = x ^ (x >> U64(s2))
        x = x * U64(m2)
        return x ^ (x >> U64(s3))


def ror(x: np.ndarray, r: int) -> np.ndarray:
    """Rotate right by ``r`` (1..63)."""
    return (x >> U64(r)) | (x << U64(64 - r))


def node(c: int, left: np.ndarray, right: np.ndarray, role: int) -> np.ndarray:
    """§5 ``node_c(l, r, λ) = M_c(l ^ T_c(λ)) + ror(r, R_c)``."""
    with np.errstate(over="ignore"):
        return mix(c, left ^ tweak(c, role)) + ror(right, _ROT[c])


def seeds(dtype_name: str, shape: Sequence[int], nbytes: int) -> tuple[int, int]:
    """§3 Metadata record → BLAKE2b-128 → two little-endian 64-bit seeds."""
    name = dtype_name.encode("ascii")
    record = bytearray(_TAG)
    record += bytes([len(name)]) + name
    record += bytes([len(shape)])
    for d in shape:
        record += int(d).to_bytes(8, "little")
    record += int(nbytes).to_bytes(8, "little")
    s = hashlib.blake2b(bytes(record), digest_size=16).digest()
    return int.from_bytes(s[:8], "little"), int.from_bytes(s[8:], "little")


def to_lanes(data: bytes | np.ndarray) -> np.ndarray:
    """§2 Bytes → little-endian uint64 lanes, the last zero-padded."""
    if isinstance(data, np.ndarray):
        b = data.reshape(-1).view(np.uint8)
    else:
        b = np.frombuffer(bytes(data), dtype=np.uint8)
    n = b.size
    padded = np.zeros((n + 7) // 8 * 8, dtype=np.uint8)
    padded[:n] = b
    return padded.view("<u8").astype(U64)


def fold(c: int, v: np.ndarray, f: int) -> np.ndarray:
    """§6.1 One fold level over a batch ``v`` of shape ``[B, n]`` → ``[B, m·W]``."""
    bsz, n = v.shape
    w = min(_STRIDE, -(-n // _GROUP))
    bl = _GROUP * w
    m = -(-n // bl)
    if m * bl != n:
        v = np.concatenate([v, np.zeros((bsz, m * bl - n), dtype=U64)], axis=1)
    g = v.reshape(bsz, m, _GROUP, w)  # g[:, b, j, t] = v[b·BL + j·W + t]
    for k in range(4):
        g = node(c, g[:, :, 0::2, :], g[:, :, 1::2, :], 4 * f + k)
    return g.reshape(bsz, m * w)


def chunk_root(c: int, v: np.ndarray) -> np.ndarray:
    """§6 Step 5: roots of a batch of chunks ``[B, n]`` (n ≥ 1) → ``[B]``."""
    f = 0
    while v.shape[1] > 1:
        v = fold(c, v, f)
        f += 1
    return v[:, 0]


def digest_lanes(lanes: np.ndarray, dtype_name: str, shape: Sequence[int], nbytes: int) -> np.ndarray:
    """§7–§8 Digests of a batch of lane vectors ``[B, L]`` sharing one metadata → ``[B, 2]`` uint64.

    ``L`` must equal ``⌈nbytes / 8⌉``; row i is the lanes of input i.
    """
    lanes = np.ascontiguousarray(lanes, dtype=U64)
    if lanes.ndim == 1:
        lanes = lanes[None, :]
    bsz, n = lanes.shape
    assert n == -(-nbytes // 8), (n, nbytes)
    out = np.empty((bsz, 2), dtype=U64)
    s = seeds(dtype_name, shape, nbytes)
    for c in range(2):
        h = np.full(bsz, s[c], dtype=U64)
        for j in range(0, n, _CHUNK):  # §7 chain, chunk roots in order
            h = node(c, h, chunk_root(c, lanes[:, j : j + _CHUNK]), _CHAIN)
        for role in _FINAL:  # §8
            h = mix(c, h ^ tweak(c, role))
        out[:, c] = h
    return out


def hexdigest(words: np.ndarray) -> str:
    """§9 ``[h0, h1]`` → 32 hex characters, channel 0 then channel 1, each big-endian."""
    return f"{int(words[0]):016x}{int(words[1]):016x}"


def digest(data: bytes | np.ndarray, dtype_name: str, shape: Sequence[int]) -> str:
    """Digest v1 of a tensor given its logical bytes, dtype name and shape (32 hex)."""
    lanes = to_lanes(data)
    nbytes = len(data) if not isinstance(data, np.ndarray) else data.nbytes
    return hexdigest(digest_lanes(lanes[None, :], dtype_name, shape, nbytes)[0])


if __name__ == "__main__":  # pragma: no cover - spec Appendix A.1
    print(digest(bytes([3, 10, 17]), "uint8", (3,)))
