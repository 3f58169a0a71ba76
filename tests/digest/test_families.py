"""Collision-family regression tests: every structural or metadata change must change the digest.

Each family here either killed an earlier design (commutative, position-salted wraparound sums:
permutations, absorbed salts, top-bit pair cancellation) or is a refit failure class (swapped
tensors, relabelled dtypes, reshapes, trailing padding, NaN/±0.0). Where the spec guarantees it
(§5.2: any change confined to one lane), both 64-bit channels are required to change.

Source: ``docs/digest-spec.md`` §5; ``ipc-refit-protocol`` notes (collision families).
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

from refit_verify import compare_manifests, tensor_digest
from refit_verify.digest import reference as ref

M64 = (1 << 64) - 1
TOP = 1 << 63
CHUNK = 1 << 20
BLOCK = 16 * 256  # lanes in one stride block


def lanes_tensor(vals) -> torch.Tensor:
    """int64 tensor whose lanes are the given unsigned 64-bit values."""
    a = np.asarray([v & M64 for v in vals], dtype=np.uint64)
    return torch.from_numpy(a.view(np.int64).copy())


def rand_lanes(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(64) for _ in range(n)]


def d(vals_or_tensor) -> str:
    t = vals_or_tensor if isinstance(vals_or_tensor, torch.Tensor) else lanes_tensor(vals_or_tensor)
    return tensor_digest(t)


def both_differ(a: str, b: str) -> bool:
    """Both channels (the two 16-hex halves) differ."""
    return a[:16] != b[:16] and a[16:] != b[16:]


def flipped(vals: list[int], *positions: int, mask: int = TOP) -> list[int]:
    out = list(vals)
    for p in positions:
        out[p] ^= mask
    return out


# --------------------------------------------------------------------------------------------
# Models of the designs that failed (commutative wraparound sums), to show the constructions work.
# --------------------------------------------------------------------------------------------


def linear_sum(vals: list[int], weights: list[int]) -> int:
    """Linear design: Σ w_i·x_i mod 2^64 with odd weights."""
    return sum(w * x for w, x in zip(weights, vals)) & M64


def _mixk(c: int, x: int) -> int:
    """Channel-c mixer for the k-channel model: SplitMix64/Moremur alternated, channel tweak first."""
    return ref.MIX[c % 2](x ^ ((0xD1B54A32D192ED03 * (c + 1)) & M64))


def commutative_digest(vals: list[int], salts: list[list[int]], op: str = "xor") -> tuple[int, ...]:
    """Earlier design: channel c = Σ_i mix_c(x_i ⊙ s_c(i)) mod 2^64, ⊙ = xor or +."""
    out = []
    for c, s in enumerate(salts):
        if op == "xor":
            out.append(sum(_mixk(c, x ^ si) for x, si in zip(vals, s)) & M64)
        else:
            out.append(sum(_mixk(c, (x + si) & M64) for x, si in zip(vals, s)) & M64)
    return tuple(out)


def absorbed_salt_move(vals: list[int], salt: list[int], i: int, j: int) -> list[int]:
    """Closed form: swap slots i and j, pre-adjusting each value by the salt difference (xor salts).

    Salted terms are x_i ^ s(i); afterwards slot i holds x_j ^ s(j) ^ s(i), whose salted term is
    x_j ^ s(j): the multiset of salted terms is unchanged, so every commutative reduction over them
    (and every channel sharing the position salt) collides.
    """
    out = list(vals)
    out[i] = vals[j] ^ salt[j] ^ salt[i]
    out[j] = vals[i] ^ salt[i] ^ salt[j]
    return out


def _cycles(p: list[int]) -> int:
    seen, c = set(), 0
    for i in range(len(p)):
        if i not in seen:
            c += 1
            while i not in seen:
                seen.add(i)
                i = p[i]
    return c


def two_channel_collision(n: int, s0: list[int], s1: list[int], op: str, seed: int) -> tuple[list[int], list[int]]:
    """Solve for x ≠ x' (n lanes) that collide two commutative channels with independent salts.

    Channel c's salted terms are x_i ⊙ s_c(i) (⊙ = xor or +). Require
    x'_i ⊙ s_0(i) = x_{π0 i} ⊙ s_0(π0 i) and x'_i ⊙ s_1(i) = x_{π1 i} ⊙ s_1(π1 i): each channel's
    multiset of salted terms is only permuted, so both sums collide. Eliminating x' leaves
    x_{π0 i} = x_{π1 i} ⊙ K_i. With τ = π0∘π1^{-1} a single n-cycle this is a walk around τ that
    closes by itself (the K_i telescope), so x_0 is free. If cycles(π0) + cycles(π1) = n + 1 every
    solution has x' = x (trivial); with n − 1 the trivial solutions are over-determined and x' ≠ x.
    Such permutation pairs exist from n = 3; the notes' example had six lanes.
    """
    rng = random.Random(seed)
    while True:
        pi0, pi1 = rng.sample(range(n), n), rng.sample(range(n), n)
        inv1 = {v: i for i, v in enumerate(pi1)}
        tau = [pi0[inv1[v]] for v in range(n)]
        if _cycles(tau) == 1 and _cycles(pi0) + _cycles(pi1) == n - 1:
            break
    x = [0] * n
    v = 0
    x[0] = rng.getrandbits(64)
    for _ in range(n - 1):
        i = inv1[v]
        if op == "xor":
            x[tau[v]] = x[v] ^ s0[pi0[i]] ^ s0[i] ^ s1[pi1[i]] ^ s1[i]
        else:
            x[tau[v]] = (x[v] + s1[pi1[i]] - s1[i] - s0[pi0[i]] + s0[i]) & M64
        v = tau[v]
    if op == "xor":
        xp = [x[pi0[i]] ^ s0[pi0[i]] ^ s0[i] for i in range(n)]
    else:
        xp = [(x[pi0[i]] + s0[pi0[i]] - s0[i]) & M64 for i in range(n)]
    return x, xp


# --------------------------------------------------------------------------------------------
# Top-bit pairs.
# --------------------------------------------------------------------------------------------


class TestTopBitPairs:
    """Flipping bit 63 of two lanes (cancels in any linear mod-2^64 combine) changes both channels."""

    def test_linear_design_cancels(self):
        """Sanity: the construction collides a linear combine with odd weights."""
        vals = rand_lanes(64, 1)
        w = [x | 1 for x in rand_lanes(64, 2)]
        for i, j in [(0, 1), (3, 40), (0, 63)]:
            assert linear_sum(flipped(vals, i, j), w) == linear_sum(vals, w)

    @pytest.mark.parametrize(
        "n, pairs",
        [
            # n ≤ 16: W = 1, siblings are lanes 2i, 2i+1.
            (16, [(0, 1), (14, 15), (0, 2), (1, 3), (7, 8), (0, 15), (3, 12)]),
            # one stride block: W = 256, siblings are t and t+256, the 16 lanes of a group are 256 apart.
            (BLOCK, [(0, 256), (5, 261), (0, 512), (0, 1), (255, 256), (0, 3840), (0, BLOCK - 1), (4000, 4095)]),
            # two blocks at level 0: the same slot in both blocks, first/last.
            (2 * BLOCK, [(0, BLOCK), (100, BLOCK + 100), (0, 2 * BLOCK - 1), (BLOCK - 1, BLOCK)]),
            # multi-level with padding.
            (4097, [(0, 4096), (4095, 4096), (1, 257), (2048, 4096)]),
        ],
        ids=["16", "block", "2blocks", "4097"],
    )
    def test_pairs_by_layout(self, n, pairs):
        """Siblings, cousins, other groups/blocks, first and last lane: both channels change."""
        for base in (rand_lanes(n, n), [0] * n):
            b = d(base)
            for i, j in pairs:
                assert both_differ(d(flipped(base, i, j)), b), (n, i, j)

    def test_all_pairs_64_lanes(self):
        """Every pair among 64 lanes (2016 pairs; W = 4, four 16-groups, two levels)."""
        base = rand_lanes(64, 7)
        seen = {d(base)}
        for i, j in itertools.combinations(range(64), 2):
            seen.add(d(flipped(base, i, j)))
        assert len(seen) == 1 + 2016

    def test_pair_across_chunks(self):
        """First lane of chunk 0 and chunk 1, and the lone lane of a 1-lane last chunk."""
        n = CHUNK + 1
        t = torch.arange(n, dtype=torch.int64) * 0x9E3779B97F4A7C15
        b = tensor_digest(t)
        for i, j in [(0, CHUNK), (CHUNK - 1, CHUNK), (17, CHUNK)]:
            u = t.clone()
            u[i] ^= -TOP
            u[j] ^= -TOP
            assert both_differ(tensor_digest(u), b), (i, j)


# --------------------------------------------------------------------------------------------
# Permutations: lanes, leaves, blocks, chunks, reversal, shifts.
# --------------------------------------------------------------------------------------------


class TestPermutations:
    """Moving values around (a commutative design's blind spot) changes the digest."""

    def test_swap_any_two_lanes_exhaustive(self):
        """All 2016 transpositions of 64 distinct lanes give 2016 distinct digests, none the original."""
        base = list(range(1, 65))  # small distinct values: the hardest case for sums
        seen = {d(base)}
        for i, j in itertools.combinations(range(64), 2):
            v = list(base)
            v[i], v[j] = v[j], v[i]
            seen.add(d(v))
        assert len(seen) == 1 + 2016

    def test_swap_leaves(self):
        """Swap two 16-lane leaf groups: strided groups of a block, and contiguous 16-lane runs."""
        n = BLOCK
        base = list(range(n))
        b = d(base)
        for t1, t2 in [(0, 1), (0, 255), (17, 200)]:  # group t = lanes t, t+256, …, t+15·256
            v = list(base)
            for j in range(16):
                v[t1 + 256 * j], v[t2 + 256 * j] = v[t2 + 256 * j], v[t1 + 256 * j]
            assert d(v) != b
        for r1, r2 in [(0, 1), (0, 255), (3, 100)]:  # contiguous runs of 16
            v = list(base)
            v[16 * r1 : 16 * r1 + 16], v[16 * r2 : 16 * r2 + 16] = v[16 * r2 : 16 * r2 + 16], v[16 * r1 : 16 * r1 + 16]
            assert d(v) != b
        small = list(range(100, 132))  # 32 lanes, W = 2: swap the two contiguous halves
        assert d(small[16:] + small[:16]) != d(small)

    def test_swap_stride_blocks(self):
        """Three 4096-lane blocks: swap any two."""
        t = torch.arange(3 * BLOCK, dtype=torch.int64)
        b = tensor_digest(t)
        blocks = list(t.split(BLOCK))
        seen = {b}
        for i, j in [(0, 1), (0, 2), (1, 2)]:
            p = list(blocks)
            p[i], p[j] = p[j], p[i]
            seen.add(tensor_digest(torch.cat(p)))
        assert len(seen) == 4

    def test_swap_two_chunks(self):
        """Two full chunks (16 MiB) swapped."""
        t = torch.arange(2 * CHUNK, dtype=torch.int64)
        a, b = t[:CHUNK], t[CHUNK:]
        assert tensor_digest(torch.cat([b, a])) != tensor_digest(t)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
    def test_reverse(self, dtype):
        """Reversed 1-D tensors, reversed rows and columns of 2-D tensors."""
        t = (torch.arange(1, 3001) % 97 + torch.arange(1, 3001) // 97).to(dtype)
        assert tensor_digest(t.flip(0)) != tensor_digest(t)
        m = t[:3000].reshape(60, 50)
        assert len({tensor_digest(m), tensor_digest(m.flip(0)), tensor_digest(m.flip(1))}) == 3

    def test_cyclic_shift(self):
        """Rotating a tensor by one lane or one element."""
        t = torch.arange(1000, dtype=torch.int64)
        u = torch.arange(1000, dtype=torch.int16)
        assert tensor_digest(t.roll(1)) != tensor_digest(t)
        assert tensor_digest(u.roll(1)) != tensor_digest(u)

    def test_random_permutations_distinct(self):
        """200 random permutations of 256 small lanes: 200 distinct digests."""
        rng = random.Random(3)
        base = list(range(256))
        seen = set()
        for _ in range(200):
            v = list(base)
            rng.shuffle(v)
            seen.add(d(v))
        assert len(seen) == 200


# --------------------------------------------------------------------------------------------
# The commutative-sum constructions from the notes.
# --------------------------------------------------------------------------------------------


class TestCommutativeConstructions:
    """Inputs built to collide commutative multi-channel sums are separated by the ordered tree."""

    @pytest.mark.parametrize("k", [1, 2, 4, 8])
    def test_k_channel_permutation_freedom(self, k):
        """Unsalted k-channel sums collide on every permutation; so do k channels sharing an
        absorbable position salt (closed-form move). Both inputs differ under digest v1."""
        n = 16
        vals = rand_lanes(n, 10 + k)
        rng = random.Random(k)
        perm = list(vals)
        rng.shuffle(perm)
        zero = [[0] * n for _ in range(k)]
        assert commutative_digest(perm, zero) == commutative_digest(vals, zero)
        assert both_differ(d(perm), d(vals))

        salt = rand_lanes(n, 99)  # s_c(i) = s(i): one position salt for all channels (+ channel tweak)
        salts = [salt] * k
        for i, j in [(0, 1), (2, 13), (0, 15)]:
            moved = absorbed_salt_move(vals, salt, i, j)
            assert moved != vals and sorted(moved) != sorted(vals)  # not a mere permutation
            assert commutative_digest(moved, salts) == commutative_digest(vals, salts)
            assert both_differ(d(moved), d(vals)), (k, i, j)

    @pytest.mark.parametrize("op", ["xor", "add"])
    @pytest.mark.parametrize("n", [3, 4, 6, 8])
    def test_two_channel_independent_salts(self, n, op):
        """The n-lane (notes: six-lane) vectors colliding both channels with independent salts."""
        s0 = rand_lanes(n, 1000 + n)
        s1 = rand_lanes(n, 2000 + n)
        for seed in range(5):
            x, xp = two_channel_collision(n, s0, s1, op, seed)
            assert xp != x
            assert commutative_digest(xp, [s0, s1], op) == commutative_digest(x, [s0, s1], op)
            assert both_differ(d(xp), d(x))


# --------------------------------------------------------------------------------------------
# Single-lane changes: the §5.2 guarantee, every position.
# --------------------------------------------------------------------------------------------


class TestSingleLane:
    """Any change confined to one lane changes both channels (spec §5.2)."""

    CHANGES = [
        ("xor bit 0", lambda v, rng: v ^ 1),
        ("xor bit 63", lambda v, rng: v ^ TOP),
        ("xor random bit", lambda v, rng: v ^ (1 << rng.randrange(64))),
        ("set zero", lambda v, rng: 0 if v else 1),
        ("set ones", lambda v, rng: M64 if v != M64 else 0),
        ("add one", lambda v, rng: (v + 1) & M64),
        ("random", lambda v, rng: v ^ (rng.getrandbits(64) | 1)),
    ]

    @pytest.mark.parametrize("n", [1, 5, 16, 17, 64, 300])
    def test_every_position(self, n):
        rng = random.Random(n)
        for base in (rand_lanes(n, n + 500), [0] * n):
            b = d(base)
            for pos in range(n):
                for name, fn in self.CHANGES:
                    v = list(base)
                    v[pos] = fn(v[pos], rng)
                    assert both_differ(d(v), b), (n, pos, name)

    def test_positions_in_large_tensor(self):
        """4097 lanes (2 blocks at level 0, padding): every position, one bit each."""
        n = 4097
        base = torch.from_numpy(np.asarray(rand_lanes(n, 77), dtype=np.uint64).view(np.int64))
        b = tensor_digest(base)
        rng = random.Random(5)
        for pos in range(n):
            u = base.clone()
            bit = rng.randrange(64)
            u[pos] ^= (1 << bit) if bit < 63 else -TOP
            assert both_differ(tensor_digest(u), b), pos

    def test_element_changes_bf16(self):
        """Every element of a 257-element bf16 tensor (partial last lane), sign flip and +1 ulp."""
        t = torch.linspace(-3, 3, 257, dtype=torch.bfloat16)
        b = tensor_digest(t)
        raw = t.view(torch.int16)
        for i in range(257):
            for delta in (-0x8000, 1):
                u = raw.clone()
                u[i] = ((int(u[i]) + delta + 0x8000) % 0x10000) - 0x8000
                assert both_differ(tensor_digest(u.view(torch.bfloat16)), b), i


# --------------------------------------------------------------------------------------------
# Metadata, padding, zeros, float bit patterns, manifests.
# --------------------------------------------------------------------------------------------


class TestMetadata:
    """Same bytes under other metadata; appended zeros; zero tensors; floats; manifest swaps."""

    def test_transposed_shape_equal_numel(self):
        """[3,5] vs the same bytes as [5,3]; vs the transposed copy; every shape of 24 elements."""
        t = torch.arange(15, dtype=torch.float32).reshape(3, 5)
        assert both_differ(tensor_digest(t), tensor_digest(t.reshape(5, 3)))
        assert tensor_digest(t.T) == tensor_digest(t.T.contiguous())  # logical order, not storage
        assert tensor_digest(t.T) != tensor_digest(t)
        u = torch.arange(24, dtype=torch.float32)
        shapes = [(24,), (1, 24), (24, 1), (2, 12), (12, 2), (3, 8), (8, 3), (4, 6), (6, 4), (2, 3, 4), (4, 3, 2),
                  (3, 2, 4), (2, 2, 6), (1, 2, 3, 4), (4, 3, 2, 1), (1, 1, 24)]  # fmt: skip
        assert len({tensor_digest(u.reshape(s)) for s in shapes}) == len(shapes)

    def test_dtype_relabel(self):
        """bf16 bytes read as fp16; int16; fp32 read as int32 / uint8; fp8 e4m3 vs e5m2."""
        x = torch.randn(1024, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        ds = {tensor_digest(x.view(dt)) for dt in (torch.bfloat16, torch.float16, torch.int16)}
        assert len(ds) == 3
        assert both_differ(tensor_digest(x), tensor_digest(x.view(torch.float16)))
        f = torch.randn(64, generator=torch.Generator().manual_seed(1))
        assert len({tensor_digest(f), tensor_digest(f.view(torch.int32)), tensor_digest(f.view(torch.uint8))}) == 3
        b = torch.arange(64, dtype=torch.uint8)
        assert tensor_digest(b.view(torch.float8_e4m3fn)) != tensor_digest(b.view(torch.float8_e5m2))

    @pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.int64, torch.bool])
    def test_trailing_zeros_appended(self, dtype):
        """t vs t followed by k zero elements (k = 1..17), and the zero-padded-lane ambiguity."""
        for n in (0, 1, 3, 7, 8, 16, 100):
            t = (torch.arange(n) % 5 + 1).to(dtype)
            seen = {tensor_digest(t)}
            for k in range(1, 18):
                seen.add(tensor_digest(torch.cat([t, torch.zeros(k, dtype=dtype)])))
            assert len(seen) == 18, (dtype, n)

    def test_zero_tensors(self):
        """All-zero tensors of every size 0..64 elements in 9 dtypes, 1-D and 2-D: all distinct."""
        dtypes = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.float16, torch.bfloat16, torch.float32,
                  torch.int64, torch.float64]  # fmt: skip
        seen = {}
        for dt in dtypes:
            for n in range(65):
                seen[(dt, (n,))] = tensor_digest(torch.zeros(n, dtype=dt))
                if n and n % 4 == 0:
                    seen[(dt, (4, n // 4))] = tensor_digest(torch.zeros(4, n // 4, dtype=dt))
        assert len(set(seen.values())) == len(seen)
        # The same zero bytes, relabelled, also differ in both channels.
        z = torch.zeros(64, dtype=torch.uint8)
        assert both_differ(tensor_digest(z), tensor_digest(z.view(torch.int64)))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
    def test_signed_zero_and_nan_payloads(self, dtype):
        """+0.0 vs −0.0 and NaNs with different payloads/sign are different bytes, different digests."""
        bits = {torch.float16: 16, torch.bfloat16: 16, torch.float32: 32, torch.float64: 64}[dtype]
        idt = {16: torch.int16, 32: torch.int32, 64: torch.int64}[bits]
        base = torch.ones(33, dtype=dtype)
        pz, nz = base.clone(), base.clone()
        pz[17], nz[17] = 0.0, -0.0
        assert both_differ(tensor_digest(pz), tensor_digest(nz))
        exp_mask = {16: 0x7C00 if dtype == torch.float16 else 0x7F80, 32: 0x7F800000, 64: 0x7FF0000000000000}[bits]
        sign = -(1 << (bits - 1))
        quiet = {torch.float16: 1 << 9, torch.bfloat16: 1 << 6, torch.float32: 1 << 22, torch.float64: 1 << 51}[dtype]
        payloads = [exp_mask | 1, exp_mask | 2, exp_mask | quiet, exp_mask | quiet | 3]  # signalling, quiet
        nans = []
        for p in payloads + [sign | exp_mask | 1]:
            r = base.view(idt).clone()
            r[5] = p
            assert torch.isnan(r.view(dtype)[5])
            nans.append(tensor_digest(r.view(dtype)))
        assert len(set(nans)) == len(nans)
        assert all(both_differ(a, b) for a, b in itertools.combinations(nans, 2))

    def test_manifest_swap_names_both(self):
        """Two equal-size tensors delivered under each other's names: both names reported."""
        a = torch.randn(128, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        b = torch.randn(128, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
        sender = {"layers.0.q_proj.weight": tensor_digest(a), "layers.0.k_proj.weight": tensor_digest(b),
                  "norm.weight": tensor_digest(torch.ones(64))}  # fmt: skip
        q, k = "layers.0.q_proj.weight", "layers.0.k_proj.weight"
        receiver = dict(sender)
        receiver[q], receiver[k] = sender[k], sender[q]
        rep = compare_manifests(sender, receiver)
        assert not rep.ok
        assert set(rep.mismatched) == {"layers.0.q_proj.weight", "layers.0.k_proj.weight"}
        assert not rep.missing and not rep.unexpected and rep.verified == 1
        assert "q_proj" in rep.describe() and "k_proj" in rep.describe()


def test_one_element_view_with_non_unit_stride():
    """A one-element view whose stride is not 1 (``x[1::2][:1]``) digests like its value."""
    x = torch.arange(10.0)
    assert tensor_digest(x[1::2][:1]) == tensor_digest(torch.tensor([1.0]))
    assert tensor_digest(x[3::4][:1].view(1, 1)) == tensor_digest(torch.tensor([[3.0]]))


def test_conjugate_and_negative_views_digest_their_values():
    z = torch.randn(3, dtype=torch.complex64)
    assert tensor_digest(z.conj()) == tensor_digest(z.conj().resolve_conj())
    x = torch.randn(4)
    assert tensor_digest(torch._neg_view(x)) == tensor_digest(-x)


@pytest.mark.parametrize("bad, err", [(torch.empty(4, device="meta"), TypeError), (torch.zeros([1] * 300), ValueError)])
def test_undigestable_inputs_raise_documented_errors(bad, err):
    with pytest.raises(err):
        tensor_digest(bad)
