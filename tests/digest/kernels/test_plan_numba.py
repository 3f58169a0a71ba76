"""The compiled launch plan (``kernels._plan_numba``) against the numpy one (``launch._plan_numpy``),
entry for entry: views around every structural boundary (empty, one byte, partial lanes, the fast
threshold, one chunk and one over, many chunks), addresses anywhere in 64 bits and off every
alignment, with and without copy destinations, for both alignments the launches use.

Source: the plan's layout in ``launch._plan_numpy``'s docstring.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.support.triton_interp import kernel_module

kd, DEV, pytestmark = kernel_module()  # the interpreter on CPU (set before triton's import), CUDA compiled

from refit_verify.digest import reference as ref  # noqa: E402
from refit_verify.digest.kernels import _plan_numba as pn  # noqa: E402

CHUNK = ref.CHUNK_LANES * 8
SIZES = [0, 1, 7, 8, 9, 4096 * 8, 61440 * 8, 61441 * 8, 61441 * 8 + 3, 65536 * 8, 65537 * 8 + 5,
         CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK + 9, 16 * CHUNK + 65536 * 8 + 1]


def _case(rng: random.Random, views: int) -> tuple[list[int], list[int], list[tuple[int, int]], list[int] | None]:
    sizes = [rng.choice(SIZES + [rng.randrange(0, 3 * CHUNK)]) for _ in range(views)]
    addrs = [rng.choice([rng.randrange(0, 1 << 64), rng.randrange(0, 1 << 47) * 16, rng.randrange(0, 1 << 47) * 8 + rng.randrange(8)])
             for _ in range(views)]
    seeds = [(rng.randrange(0, 1 << 64), rng.randrange(0, 1 << 64)) for _ in range(views)]
    dsts = None if rng.random() < 0.5 else [rng.randrange(0, 1 << 64) for _ in range(views)]
    return addrs, sizes, seeds, dsts


@pytest.mark.parametrize("align", [8, 16])
def test_compiled_plan_is_the_numpy_plan(align: int) -> None:
    rng = random.Random(align)
    for views in [0, 1, 2, 3, 21, 64, 310]:
        for _ in range(12 if views < 100 else 2):
            addrs, sizes, seeds, dsts = _case(rng, views)
            want = kd._plan_numpy(addrs, sizes, seeds, align, None, dsts)
            got = pn.plan(addrs, sizes, seeds, align, dsts)
            assert got is not None
            assert got[1:] == want[1:]
            assert got[0].dtype == np.int64 and np.array_equal(got[0], want[0])


def test_plan_takes_the_compiled_path_without_parents_only() -> None:
    """``_plan`` gives the numpy plan's entries either way; with ``parents`` it derives views (numpy only)."""
    sb = kd.SB_BYTES
    addrs, sizes = [1 << 30, (1 << 30) + sb], [4 * sb, 2 * sb]
    seeds = [(1, 2), (3, 4)]
    plain = kd._plan(addrs, sizes, seeds)
    assert np.array_equal(plain[0], kd._plan_numpy(addrs, sizes, seeds)[0]) and plain[1:] == kd._plan_numpy(addrs, sizes, seeds)[1:]
    derived = kd._plan(addrs, sizes, seeds, parents=kd._parents(addrs, sizes))
    assert derived[1] < plain[1]  # the derived view's two full superblocks have no leaf program
    assert np.array_equal(derived[0], kd._plan_numpy(addrs, sizes, seeds, parents=kd._parents(addrs, sizes))[0])


def test_negative_int64_addresses_are_their_bit_patterns() -> None:
    """Addresses handed as int64 values (negative above 2**63) plan as their unsigned patterns."""
    a = [(1 << 63) + 4096, (1 << 64) - 4096]
    signed = [x - (1 << 64) for x in a]
    got = pn.plan(signed, [64, 64], [(1, 2), (3, 4)], 8, None)
    assert np.array_equal(got[0], pn.plan(a, [64, 64], [(1, 2), (3, 4)], 8, None)[0])
    assert got[0][0] == signed[0] and got[0][1] == signed[1]


def test_a_plan_that_cannot_compile_falls_back_to_numpy_once(monkeypatch, caplog) -> None:
    """numba compiles at the first call: one that raises there leaves every later plan to numpy (logged once)."""
    def broken(*args):
        raise RuntimeError("no LLVM here")

    monkeypatch.setattr(pn, "_BUILD", [broken])
    assert pn.plan([4096], [64], [(1, 2)], 8, None) is None
    assert pn._BUILD == [None] and "made with numpy" in caplog.text
    want = kd._plan_numpy([4096], [64], [(1, 2)], 8)
    got = kd._plan([4096], [64], [(1, 2)], 8)
    assert got[1:] == want[1:] and np.array_equal(got[0], want[0])


def test_bad_lists_are_refused_before_the_compiled_call() -> None:
    """The compiled loop does no bounds checks: lists of other lengths, a seed that is no pair, or a
    value outside 64 bits raise here (as the numpy plan raises), never read or write past an array."""
    with pytest.raises(ValueError, match="one address, seed pair and destination per view"):
        pn.plan([4096], [64, 64], [(1, 2), (3, 4)], 8, None)
    with pytest.raises(ValueError, match="one address, seed pair and destination per view"):
        pn.plan([4096, 8192], [64, 64], [(1, 2), (3, 4)], 8, [0])
    with pytest.raises(ValueError, match="one address, seed pair and destination per view"):
        pn.plan([4096], [64], [(1, 2, 3)], 8, None)
    for bad in (1 << 64, -(1 << 63) - 1):
        with pytest.raises(OverflowError):
            pn.plan([bad], [64], [(1, 2)], 8, None)
