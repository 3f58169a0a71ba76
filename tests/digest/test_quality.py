"""Statistical quality batteries for digest v1: strict avalanche, sparse keys, lane permutations.

Digests of millions of small inputs are computed by a numba copy of the algorithm (below), which
is first checked bit for bit against the independent numpy reimplementation and the test vectors.
The default run is a fast subset (CI); ``-m slow`` runs the full batteries whose figures are in
``docs/digest-spec.md`` §11 (about four minutes on 2 cores).

Acceptance rules:

* **Strict avalanche.** Over F single-bit flips, each of the 128 output bits must flip with a
  frequency within 0.5 ± 0.01. For an ideal hash the frequency of one bit is Binomial(F, 1/2)/F
  with σ = 1/(2√F); the maximum over 128 bits stays below 0.01 with probability ≥ 1 − 10^-6 only
  if 0.01 ≥ 5.9σ, i.e. F ≥ 87,000. The fast run uses 2^17 flips per set (0.01 = 7.2σ), the slow
  run 2^20 (20σ) and also reports the worst bias of the full per-(input bit, output bit) matrix of
  1- and 2-lane inputs against its binomial expectation.
* **Collisions.** Zero 128-bit and zero 64-bit (per-channel) collisions among the keys; 32-bit
  slices must show the birthday count n − 2^32·(1 − (1 − 2^-32)^n) within 6σ (Poisson).

Source: ``docs/digest-spec.md`` §11; batteries after SMHasher3 (Avalanche, Sparse, Permutation).
"""

from __future__ import annotations

import math
import os
from itertools import permutations
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")
from numba import njit, prange  # noqa: E402

from tests.support import numpy_reference as npref  # noqa: E402

U = np.uint64
_PHI = U(0x9E3779B97F4A7C15)
_A0, _B0 = U(0x3C79AC492BA7B653), U(0x1C69B3F74AC4AE35)
_A1, _B1 = U(0xBF58476D1CE4E5B9), U(0x94D049BB133111EB)
_CHUNK = 1 << 20
_REPORT = os.environ.get("REFIT_QUALITY_REPORT")  # optional path: append battery figures as text


# --------------------------------------------------------------------------------------------
# numba copy of digest v1 (spec §4–§8), batched and parallel over inputs.
# --------------------------------------------------------------------------------------------


@njit(cache=True, inline="always")
def _mix(c, x):
    if c == 0:
        x ^= x >> U(27)
        x *= _A0
        x ^= x >> U(33)
        x *= _B0
        x ^= x >> U(27)
    else:
        x ^= x >> U(30)
        x *= _A1
        x ^= x >> U(27)
        x *= _B1
        x ^= x >> U(31)
    return x


@njit(cache=True, inline="always")
def _node(c, left, right, role):
    t = _PHI * U(64 * c + role + 1)
    r = U(23) if c == 0 else U(41)
    return _mix(c, left ^ t) + ((right >> r) | (right << (U(64) - r)))


@njit(cache=True)
def _root(c, lanes, start, n, a, b, g):
    """Chunk root of lanes[start:start+n] (spec §6), using scratch a, b (≥ padded size) and g[16]."""
    for i in range(n):
        a[i] = lanes[start + i]
    f = 0
    while n > 1:
        w = min(256, (n + 15) // 16)
        bl = 16 * w
        nb = (n + bl - 1) // bl
        for i in range(n, nb * bl):
            a[i] = U(0)
        for blk in range(nb):
            base = blk * bl
            for t in range(w):
                for j in range(16):
                    g[j] = a[base + j * w + t]
                for k in range(4):
                    for i in range(8 >> k):
                        g[i] = _node(c, g[2 * i], g[2 * i + 1], 4 * f + k)
                b[blk * w + t] = g[0]
        a, b = b, a
        n = nb * w
        f += 1
    return a[0]


@njit(cache=True)
def _digest_row(lanes, s0, s1, out, a, b, g):
    n = lanes.shape[0]
    for c in range(2):
        h = s0 if c == 0 else s1
        for start in range(0, n, _CHUNK):
            m = min(_CHUNK, n - start)
            h = _node(c, h, _root(c, lanes, start, m, a, b, g), 48)
        h = _mix(c, h ^ (_PHI * U(64 * c + 50)))
        h = _mix(c, h ^ (_PHI * U(64 * c + 51)))
        out[c] = h


def _scratch_size(n: int) -> int:
    m = min(max(n, 1), _CHUNK)
    return max(16, (m + 4095) // 4096 * 4096)


@njit(cache=True, parallel=True)
def _digest_batch(rows, s0, s1, nscratch):
    out = np.empty((rows.shape[0], 2), dtype=np.uint64)
    for r in prange(rows.shape[0]):
        a = np.empty(nscratch, dtype=np.uint64)
        b = np.empty(nscratch, dtype=np.uint64)
        g = np.empty(16, dtype=np.uint64)
        _digest_row(rows[r], s0, s1, out[r], a, b, g)
    return out


@njit(cache=True, parallel=True)
def _digest_flips(bases, base_idx, lane_idx, bit_idx, s0, s1, nscratch):
    """Digests of ``bases[base_idx[i]]`` with bits ``(lane_idx[i, k], bit_idx[i, k])`` flipped,
    for each i; a lane index of -1 means no flip. ``bases`` is [B, n], the index arrays [F, k]."""
    out = np.empty((lane_idx.shape[0], 2), dtype=np.uint64)
    for r in prange(lane_idx.shape[0]):
        x = bases[base_idx[r]].copy()
        for k in range(lane_idx.shape[1]):
            if lane_idx[r, k] >= 0:
                x[lane_idx[r, k]] ^= U(1) << U(bit_idx[r, k])
        a = np.empty(nscratch, dtype=np.uint64)
        b = np.empty(nscratch, dtype=np.uint64)
        g = np.empty(16, dtype=np.uint64)
        _digest_row(x, s0, s1, out[r], a, b, g)
    return out


@njit(cache=True, parallel=True)
def _digest_perms(values, perms, s0, s1):
    """Digests of ``values[perms[i]]`` for each row of ``perms`` (small inputs)."""
    n = values.shape[0]
    out = np.empty((perms.shape[0], 2), dtype=np.uint64)
    ns = max(16, (n + 4095) // 4096 * 4096)
    for r in prange(perms.shape[0]):
        x = np.empty(n, dtype=np.uint64)
        for i in range(n):
            x[i] = values[perms[r, i]]
        a = np.empty(ns, dtype=np.uint64)
        b = np.empty(ns, dtype=np.uint64)
        g = np.empty(16, dtype=np.uint64)
        _digest_row(x, s0, s1, out[r], a, b, g)
    return out


def seeds_for(nlanes: int, dtype: str = "uint64") -> tuple[np.uint64, np.uint64]:
    """Seeds of a 1-D tensor of ``nlanes`` 8-byte elements (the metadata all battery keys share)."""
    s = npref.seeds(dtype, (nlanes,), 8 * nlanes)
    return U(s[0]), U(s[1])


def digest_rows(rows: np.ndarray) -> np.ndarray:
    """numba digests of ``[B, L]`` uint64 lane rows, all with metadata uint64 ``(L,)``."""
    s0, s1 = seeds_for(rows.shape[1])
    return _digest_batch(np.ascontiguousarray(rows, dtype=U), s0, s1, _scratch_size(rows.shape[1]))


# --------------------------------------------------------------------------------------------
# Statistics helpers.
# --------------------------------------------------------------------------------------------


def collisions(d: np.ndarray) -> dict:
    """Count collisions among digests [n, 2]: full 128-bit, each channel, and 32-bit slices."""
    n = d.shape[0]
    res = {"n": n}
    order = np.lexsort((d[:, 1], d[:, 0]))
    s = d[order]
    res["full128"] = int(np.count_nonzero((s[1:, 0] == s[:-1, 0]) & (s[1:, 1] == s[:-1, 1])))
    for c in range(2):
        h = np.sort(d[:, c])
        res[f"ch{c}_64"] = int(np.count_nonzero(h[1:] == h[:-1]))
    expected = n - 2.0**32 * (1 - math.exp(n * math.log1p(-(2.0**-32))))
    worst = 0.0
    slices = []
    for c in range(2):
        for shift in (0, 32):
            v = np.sort((d[:, c] >> U(shift)) & U(0xFFFFFFFF))
            k = int(np.count_nonzero(v[1:] == v[:-1]))
            slices.append(k)
            worst = max(worst, abs(k - expected) / math.sqrt(max(expected, 1.0)))
    res["slices32"] = slices
    res["slices32_expected"] = expected
    res["slices32_worst_sigma"] = worst
    return res


def check_collisions(name: str, d: np.ndarray) -> dict:
    res = collisions(d)
    report(f"{name}: {res}")
    assert res["full128"] == 0 and res["ch0_64"] == 0 and res["ch1_64"] == 0, res
    assert res["slices32_worst_sigma"] < 6.0, res
    return res


def report(line: str) -> None:
    print(line)
    if _REPORT:
        with open(_REPORT, "a") as fh:
            fh.write(line + "\n")


# --------------------------------------------------------------------------------------------
# The numba copy is the digest.
# --------------------------------------------------------------------------------------------


class TestNumbaCopy:
    """The battery's numba copy agrees with the numpy reimplementation and the vectors."""

    def test_matches_numpy_reference(self):
        rng = np.random.default_rng(0)
        for n in (1, 2, 15, 16, 17, 255, 257, 4095, 4097, 8192, 65537):
            rows = rng.integers(0, 2**64, size=(3, n), dtype=U)
            want = npref.digest_lanes(rows, "uint64", (n,), 8 * n)
            assert np.array_equal(digest_rows(rows), want), n

    def test_matches_vectors(self):
        import json

        data = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "digest_vectors.json").read_text())
        for v in data["vectors"]:
            if v["nbytes"] == 0 or v["nbytes"] > (1 << 21) or v["dtype"] == "bool":
                continue
            raw = ((np.arange(v["nbytes"], dtype=np.int64) * 7 + 3) % 251).astype(np.uint8)
            lanes = npref.to_lanes(raw)
            s = npref.seeds(v["dtype"], v["shape"], v["nbytes"])
            got = _digest_batch(lanes[None, :], U(s[0]), U(s[1]), _scratch_size(lanes.size))[0]
            assert npref.hexdigest(got) == v["digest"], v


# --------------------------------------------------------------------------------------------
# Strict avalanche.
# --------------------------------------------------------------------------------------------


def _flip_positions(n: int, count: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """``count`` distinct flip positions (lane, bit) in an n-lane input: a quarter on every lane next
    to a group, block or chunk edge (and the first/last lanes), the rest uniform."""
    special = {0, 1, n - 1, n - 2}
    for e in (16, 256, 4096, 65536):
        for m in range(e, n, e):
            special.update({m - 1, m})
    special = np.array(sorted(p for p in special if 0 <= p < n), dtype=np.int64)
    nsp = min(count // 4, special.size * 64)
    pos_sp = special[rng.permutation(special.size * 64)[:nsp] // 64] * 64 + rng.integers(0, 64, size=nsp)
    pos = np.unique(np.concatenate([pos_sp, rng.choice(64 * n, size=min(count, 64 * n), replace=False)]))
    pos = np.concatenate([np.unique(pos_sp), np.setdiff1d(pos, pos_sp)])[:count]
    return (pos // 64).astype(np.int64), (pos % 64).astype(np.int64)


def avalanche(n: int, flips: int, seed: int) -> tuple[np.ndarray, int]:
    """Per-output-bit flip frequency over ``flips`` single-bit flips of random n-lane inputs.

    Each input gets at most min(64n, 8192) flips at distinct positions, so that no (input, bit)
    trial repeats; small inputs therefore use many random inputs.
    """
    rng = np.random.default_rng(seed)
    s0, s1 = seeds_for(n)
    ns = _scratch_size(n)
    per = min(64 * n, 8192)
    nbases = -(-flips // per)
    counts = np.zeros(128, dtype=np.int64)
    total = 0
    step = max(1, (1 << 16) // per)  # bases per batch
    for b0 in range(0, nbases, step):
        bases = rng.integers(0, 2**64, size=(min(step, nbases - b0), n), dtype=U)
        bd = _digest_batch(bases, s0, s1, ns)
        idx, lanes, bits = [], [], []
        for k in range(bases.shape[0]):
            lane, bit = _flip_positions(n, per, rng)
            idx.append(np.full(lane.size, k, dtype=np.int64))
            lanes.append(lane)
            bits.append(bit)
        idx = np.concatenate(idx)
        dg = _digest_flips(bases, idx, np.concatenate(lanes)[:, None], np.concatenate(bits)[:, None], s0, s1, ns)
        counts += np.unpackbits((dg ^ bd[idx]).view(np.uint8).reshape(-1, 16), axis=1, bitorder="little").sum(
            axis=0, dtype=np.int64
        )
        total += idx.size
    return counts / total, total


def check_avalanche(name: str, n: int, flips: int, seed: int) -> float:
    freq, total = avalanche(n, flips, seed)
    worst = float(np.max(np.abs(freq - 0.5)))
    sigma = 0.5 / math.sqrt(total)
    report(f"SAC {name}: {total} flips of {n}-lane inputs, worst |p - 0.5| = {worst:.5f} ({worst / sigma:.2f} sigma)")
    assert worst <= 0.01, (name, worst)
    return worst


def test_avalanche_fast():
    """2^17 flips over 4097-lane inputs (2 blocks, 4 fold levels) and 2^17 over 1..64-lane inputs."""
    check_avalanche("4097 lanes", 4097, 1 << 17, seed=1)
    for n in (1, 2, 17):
        check_avalanche(f"{n} lanes", n, 1 << 17, seed=n)


@pytest.mark.slow
def test_avalanche_full():
    """2^20 flips over 8193-lane (64 KiB + 1 lane) inputs and 2^20 over 65537-lane inputs (4/5 folds)."""
    check_avalanche("8193 lanes", 8193, 1 << 20, seed=11)
    check_avalanche("65537 lanes", 65537, 1 << 18, seed=12)
    for n in (1, 2, 5, 16, 17, 256, 257):
        check_avalanche(f"{n} lanes", n, 1 << 20, seed=100 + n)


@pytest.mark.slow
def test_avalanche_matrix_full():
    """Full SAC matrix (every input bit × every output bit) of 1- and 2-lane inputs, 2^16 trials per input bit."""
    rng = np.random.default_rng(21)
    for n in (1, 2):
        s0, s1 = seeds_for(n)
        trials = 1 << 16
        worst = 0.0
        for lane in range(n):
            for bit in range(64):
                bases = rng.integers(0, 2**64, size=(trials, n), dtype=U)
                bd = _digest_batch(bases, s0, s1, 16)
                fl = bases.copy()
                fl[:, lane] ^= U(1) << U(bit)
                fd = _digest_batch(fl, s0, s1, 16)
                freq = np.unpackbits((bd ^ fd).view(np.uint8).reshape(-1, 16), axis=1, bitorder="little").mean(axis=0)
                worst = max(worst, float(np.max(np.abs(freq - 0.5))))
        cells = 64 * n * 128
        sigma = 0.5 / math.sqrt(trials)
        # expected maximum of `cells` |N(0, σ)|: σ·√(2 ln(2·cells)) roughly
        expect = sigma * math.sqrt(2 * math.log(2 * cells))
        report(f"SAC matrix {n} lane(s): {cells} cells x {trials} trials, worst |p - 0.5| = {worst:.5f} "
               f"(sigma {sigma:.5f}, expected max about {expect:.5f})")  # fmt: skip
        assert worst <= 0.01 and worst < 1.6 * expect


# --------------------------------------------------------------------------------------------
# Sparse keys.
# --------------------------------------------------------------------------------------------


def sparse_keys(nlanes: int, max_keys: int | None, two_bits: bool) -> tuple[np.ndarray, np.ndarray]:
    """(lane, bit) pairs for every key with one (and, if two_bits, two) set bits in an n-lane zero input."""
    nbits = 64 * nlanes
    one = np.arange(nbits)
    lane = [np.stack([one // 64, np.full(nbits, -1)], axis=1)]
    bit = [np.stack([one % 64, np.zeros(nbits, dtype=np.int64)], axis=1)]
    if two_bits:
        i, j = np.triu_indices(nbits, k=1)
        lane.append(np.stack([i // 64, j // 64], axis=1))
        bit.append(np.stack([i % 64, j % 64], axis=1))
    lane = np.concatenate(lane).astype(np.int64)
    bit = np.concatenate(bit).astype(np.int64)
    if max_keys is not None and lane.shape[0] > max_keys:
        sel = np.random.default_rng(5).choice(lane.shape[0], size=max_keys, replace=False)
        lane, bit = lane[sel], bit[sel]
    return lane, bit


def sparse_digests(nlanes: int, max_keys: int | None, two_bits: bool) -> np.ndarray:
    lane, bit = sparse_keys(nlanes, max_keys, two_bits)
    s0, s1 = seeds_for(nlanes)
    ns = _scratch_size(nlanes)
    zero = np.zeros((1, nlanes), dtype=U)
    d = _digest_flips(zero, np.zeros(lane.shape[0], dtype=np.int64), lane, bit, s0, s1, ns)
    return np.concatenate([d, _digest_batch(zero, s0, s1, ns)])  # plus the all-zero key


def test_sparse_fast():
    """~1e4 sparse keys: all 1- and 2-bit keys of a 2-lane input, and 1-bit keys of a 4097-lane input (sampled)."""
    check_collisions("sparse 2 lanes <=2 bits", sparse_digests(2, None, True))
    check_collisions("sparse 4097 lanes 1 bit (sampled)", sparse_digests(4097, 4000, False))


@pytest.mark.slow
def test_sparse_full():
    """All keys with ≤ 2 set bits in 256 zero bytes (2,098,177) and all 1-bit keys of 64 KiB (524,289)."""
    check_collisions("sparse 32 lanes <=2 bits", sparse_digests(32, None, True))
    check_collisions("sparse 8192 lanes 1 bit", sparse_digests(8192, None, False))
    check_collisions("sparse 4097 lanes 2 bits (10^6 sampled)", sparse_pairs_sampled(4097, 1_000_000, seed=9))


def sparse_pairs_sampled(nlanes: int, count: int, seed: int) -> np.ndarray:
    """Digests of ``count`` distinct random keys with exactly two set bits in an n-lane zero input."""
    rng = np.random.default_rng(seed)
    nbits = 64 * nlanes
    i = rng.integers(0, nbits, size=2 * count)
    j = rng.integers(0, nbits, size=2 * count)
    a, b = np.minimum(i, j), np.maximum(i, j)
    key = np.unique(a[a != b] * nbits + b[a != b])
    key = key[rng.permutation(key.size)[:count]]
    a, b = key // nbits, key % nbits
    lane = np.stack([a // 64, b // 64], axis=1).astype(np.int64)
    bit = np.stack([a % 64, b % 64], axis=1).astype(np.int64)
    s0, s1 = seeds_for(nlanes)
    zero = np.zeros((1, nlanes), dtype=U)
    return _digest_flips(zero, np.zeros(count, dtype=np.int64), lane, bit, s0, s1, _scratch_size(nlanes))


# --------------------------------------------------------------------------------------------
# Lane permutations.
# --------------------------------------------------------------------------------------------


def all_permutations(n: int) -> np.ndarray:
    return np.array(list(permutations(range(n))), dtype=np.int64)


def perm_digests(values: np.ndarray, perms: np.ndarray | None = None, count: int = 0, seed: int = 0,
                 run: int = 1) -> np.ndarray:  # fmt: skip
    """Digests of ``values`` permuted by each row of ``perms``, or by ``count`` random permutations.

    With ``run > 1`` the permutation acts on contiguous runs of ``run`` lanes (leaf-level moves).
    Random permutations are drawn in batches (seeded), so memory stays small.
    """
    s0, s1 = seeds_for(values.size)
    out = []
    if perms is not None:
        for i in range(0, perms.shape[0], 1 << 18):
            out.append(_digest_perms(values, perms[i : i + (1 << 18)], s0, s1))
        return np.concatenate(out)
    rng = np.random.default_rng(seed)
    units = values.size // run
    batch = max(1, (1 << 22) // values.size)
    for i in range(0, count, batch):
        p = np.argsort(rng.random((min(batch, count - i), units)), axis=1)
        if run > 1:
            p = (p[:, :, None] * run + np.arange(run)[None, None, :]).reshape(p.shape[0], -1)
        out.append(_digest_perms(values, p.astype(np.int64), s0, s1))
    return np.concatenate(out)


def test_permutations_fast():
    """All 7! permutations of 7 small lanes; 1e4 random permutations of 64 counter lanes."""
    check_collisions("perm 7 lanes all", perm_digests(np.arange(1, 8, dtype=U), all_permutations(7)))
    check_collisions("perm 64 lanes random", perm_digests(np.arange(64, dtype=U), count=10_000, seed=1))


@pytest.mark.slow
def test_permutations_full():
    """All 10! = 3,628,800 permutations of lanes 1..10; 10^6 random permutations of 64 and of 256
    counter lanes; all 8! permutations of 8 lanes that differ mainly in one top bit each; 10^5
    random permutations of the 256 16-lane runs of one 4096-lane stride block."""
    check_collisions("perm 10 lanes all (10!)", perm_digests(np.arange(1, 11, dtype=U), all_permutations(10)))
    check_collisions("perm 64 lanes random", perm_digests(np.arange(64, dtype=U), count=1_000_000, seed=2))
    check_collisions("perm 256 lanes random", perm_digests(np.arange(256, dtype=U), count=1_000_000, seed=3))
    top = np.array([(U(1) << U(63 - i)) | U(i) for i in range(8)], dtype=U)
    check_collisions("perm 8 top-bit lanes all (8!)", perm_digests(top, all_permutations(8)))
    runs = perm_digests(np.arange(4096, dtype=U), count=100_000, seed=4, run=16)
    check_collisions("perm 16-lane runs of a 4096-lane block", runs)


# --------------------------------------------------------------------------------------------
# Top-bit differential of the mixers (spec §5.3): the paired-change cancellation is a coincidence.
# --------------------------------------------------------------------------------------------


def _np_mix(c: int, x: np.ndarray) -> np.ndarray:
    return npref.mix(c, x)


def top_bit_differential(c: int, samples: int, seed: int) -> dict:
    """For random x: D(x) = M_c(x ^ 2^63) − M_c(x), the left-child change of a top-bit flip.

    Returns the number of repeated D values and their largest multiplicity, the number of x with
    D = ±2^(63 − R_c) (the value that a top-bit flip of the right child cancels), and for k = 16, 20
    the frequency of D's low k bits being 0 and of its high k bits equalling those of ±2^(63 − R_c)
    (both targets' necessary conditions; uniform would be 2^-k and 2·2^-k), and P(|D| < 2^44)
    relative to uniform. The frequencies are returned divided by their uniform value.
    """
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 2**64, size=samples, dtype=U)
    with np.errstate(over="ignore"):
        dd = _np_mix(c, x ^ U(1 << 63)) - _np_mix(c, x)
    t = 1 << (63 - (23, 41)[c])
    res = {"cancel": int(np.count_nonzero((dd == U(t)) | (dd == U((1 << 64) - t))))}
    for k in (16, 20):
        res[f"low{k}"] = np.count_nonzero((dd & U((1 << k) - 1)) == U(0)) / samples * 2**k
        hi = dd >> U(64 - k)
        hit = (hi == U(t >> (64 - k))) | (hi == U(((1 << 64) - t) >> (64 - k)))
        res[f"high{k}"] = np.count_nonzero(hit) / samples * 2 ** (k - 1)
    with np.errstate(over="ignore"):
        mag = np.minimum(dd, U(0) - dd)  # |D| as a signed 64-bit value
    res["small44"] = np.count_nonzero(mag < U(1 << 44)) / samples / 2.0 ** (44 - 63)
    dd.sort()
    eq = dd[1:] == dd[:-1]
    res["repeated"] = int(np.count_nonzero(eq))
    runs = np.flatnonzero(np.diff(np.concatenate([[0], eq.astype(np.int8), [0]])))
    res["multiplicity"] = int(np.max(runs[1::2] - runs[::2])) + 1 if res["repeated"] else 1
    return res


@pytest.mark.parametrize("c", [0, 1])
def test_top_bit_differential_fast(c):
    """2^20 samples: no sample cancels a top-bit flip of the right child; differences all distinct."""
    res = top_bit_differential(c, 1 << 20, seed=c)
    assert res["cancel"] == 0 and res["multiplicity"] <= 2


@pytest.mark.slow
@pytest.mark.parametrize("c", [0, 1])
def test_top_bit_differential_full(c):
    """2^25 samples per channel (figures in spec §11.4)."""
    samples = 1 << 25
    res = top_bit_differential(c, samples, seed=100 + c)
    pairs = samples * (samples - 1) / 2
    report(f"top-bit differential M_{c}: {samples} samples, {res['repeated']} repeated differences "
           f"(max multiplicity {res['multiplicity']}), sum p^2 ~ 2^{math.log2(max(res['repeated'], 1) / pairs):.1f}, "
           f"cancelling values {res['cancel']}; low/high-bit frequencies relative to uniform: "
           f"low16 {res['low16']:.3f}, high16 {res['high16']:.3f}, "
           f"low20 {res['low20']:.3f}, high20 {res['high20']:.3f}, "
           f"|D| < 2^44 {res['small44']:.2f}")  # fmt: skip
    assert res["cancel"] == 0 and res["multiplicity"] <= 3
    assert 0.75 < res["low16"] < 1.25 and 0.75 < res["high16"] < 1.25, res  # ±25 % ≥ 5.6σ at 512+ expected
