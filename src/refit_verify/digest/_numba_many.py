"""Digest v1 of many small CPU byte strings in one compiled call (numba), for ``DigestBatch``.

One call of :func:`refit_verify.digest._numba.digest_words` costs about 10 µs before it reads a byte
(DLPack, argument boxing, dispatch), most of the digest of a small tensor: the 310 tensors of the
Qwen3-0.6B-shaped set took 5 ms on 2 cores, 0.3 ms of it bandwidth. :func:`digest_many` digests a
table of (address, length, seeds) in one call, each string as one partial chunk (§6) folded on
the calling thread, then chained and finalised (§7, §8) exactly as ``digest_lanes`` does.

No parallel region is anywhere in this call graph, so it is cached on disk like ``digest_lanes``
(see the note on ``_numba_digest.chunk_roots_lanes`` for what a parallel callee does to the cache).

Source: ``docs/digest-spec.md`` §5-§8; the serial fold helpers are ``_numba_digest``'s.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from refit_verify.digest._numba import (
    _CHAIN,
    _F0,
    _F1,
    _I0,
    _U,
    _Z,
    PARALLEL_MIN_LANES,
    _jit,
    _finish,
    _level_buffers,
    _level_ser,
    _node0,
    _node1,
    _tweak,
    _upper_levels,
)
from refit_verify.errors import RefitInputError

__all__ = ["MANY_MAX_BYTES", "ManyPlan", "digest_arrays_many", "digest_many", "digest_words_many", "plan_many", "run_many"]


@_jit()
def _partial_root_ser(lanes, n, has_tail, tail):
    """``_numba_digest._partial_chunk_root`` of ``lanes[:n]`` (+ ``tail``) on the calling thread only."""
    n = n + (1 if has_tail else 0)
    if n == 1:
        return (tail, tail) if has_tail else (lanes[0], lanes[0])
    w, s0, s1 = _level_buffers(n)
    return _upper_levels(s0, s1, _level_ser(lanes, lanes, _I0, n, w, _F0, s0, s1, has_tail, tail), _F1)


@intrinsic
def _voidptr(typingctx, addr):
    """The integer ``addr`` as a ``void*`` (to view memory numba did not allocate with ``carray``)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(addr), codegen


@_jit()
def digest_many(addrs, nbytes, seeds0, seeds1, out0, out1):
    """Digest words of many byte strings of at most one chunk each, in one call (§5-§8).

    Args:
        addrs: ``uint64 [N]`` host addresses of the bytes, each 8-byte aligned; the memory must
            stay alive and unchanged for the call.
        nbytes: ``int64 [N]`` byte lengths, each below ``8 * CHUNK_LANES`` (one partial chunk).
        seeds0, seeds1: ``uint64 [N]`` §3 seeds of the tensors the bytes came from.
        out0, out1: ``uint64 [N]`` where the finalised channel values go.

    Equal, string by string, to :func:`digest_lanes` of the same bytes and seeds.
    """
    c0 = _tweak(0, _CHAIN)
    c1 = _tweak(1, _CHAIN)
    for i in range(addrs.shape[0]):
        nb = nbytes[i]
        nav = nb >> 3
        rem = nb & 7
        tail = _Z
        if rem:
            b = carray(_voidptr(addrs[i] + _U(nav * 8)), (rem,), np.uint8)
            for k in range(rem):
                tail |= _U(b[k]) << _U(8 * k)
        h0 = seeds0[i]
        h1 = seeds1[i]
        if nav > 0 or rem:
            r0, r1 = _partial_root_ser(carray(_voidptr(addrs[i]), (nav,), np.uint64), nav, rem > 0, tail)
            h0 = _node0(h0, r0, c0)
            h1 = _node1(h1, r1, c1)
        h0, h1 = _finish(h0, h1)
        out0[i] = h0
        out1[i] = h1


MANY_MAX_BYTES = 8 * PARALLEL_MIN_LANES
"""Bytes below which a CPU tensor goes to :func:`digest_words_many` (larger ones: :func:`digest_words`,
whose parallel region pays off; both are far below one chunk)."""


def digest_arrays_many(items: list[tuple[int, int, tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Finalised channel values of many byte strings in one compiled call (:func:`digest_many`).

    The batched entry of ``DigestBatch`` for CPU tensors: one call instead of one per tensor, whose
    fixed cost (DLPack, argument boxing, dispatch: about 10 µs) dwarfs the bytes of a small tensor.

    Args:
        items: ``(address, nbytes, seeds)`` per string: a host address, 8-byte aligned, of bytes
            that stay alive and unchanged for the call; ``0 <= nbytes < MANY_MAX_BYTES``; the §3
            seeds (ints in [0, 2**64)).

    Returns:
        tuple[np.ndarray, np.ndarray]: ``uint64 [N]`` channel 0 and channel 1 values; string ``i``
        equal to :func:`digest_words` of the same bytes.

    Raises:
        RefitInputError: (a ``ValueError``) an address is not 8-byte aligned or a length is out of
            range; nothing is read.
    """
    return run_many(plan_many(items))


class ManyPlan:
    """The arguments of :func:`digest_many` for a fixed list of strings, checked once
    (:func:`plan_many`): ``uint64`` addresses, ``int64`` lengths, the two ``uint64`` seed columns."""

    __slots__ = ("addrs", "nbytes", "s0", "s1")

    def __init__(self, addrs: np.ndarray, nbytes: np.ndarray, s0: np.ndarray, s1: np.ndarray) -> None:
        for a in (addrs, nbytes, s0, s1):
            a.flags.writeable = False  # checked once: never changed after
        self.addrs, self.nbytes, self.s0, self.s1 = addrs, nbytes, s0, s1

    def __len__(self) -> int:
        return len(self.addrs)


def _aligned(addrs: np.ndarray) -> bool:
    return not len(addrs) or not int((addrs & _U(7)).max())


def plan_many(items: list[tuple[int, int, tuple[int, int]]]) -> ManyPlan:
    """The checked arguments of :func:`digest_many` for ``items`` (as :func:`digest_arrays_many`), to
    run again and again with :func:`run_many` (a kept digest set: no Python step per string per call).

    Raises:
        RefitInputError: as :func:`digest_arrays_many`.
    """
    n = len(items)
    addrs = np.fromiter((a for a, _, _ in items), np.uint64, n)
    nbytes = np.fromiter((b for _, b, _ in items), np.int64, n)
    if n and (not _aligned(addrs) or int(nbytes.min()) < 0 or int(nbytes.max()) >= MANY_MAX_BYTES):
        raise RefitInputError("digest_arrays_many takes 8-byte aligned addresses of fewer than MANY_MAX_BYTES bytes")
    s0 = np.fromiter((s[0] for _, _, s in items), np.uint64, n)
    s1 = np.fromiter((s[1] for _, _, s in items), np.uint64, n)
    return ManyPlan(addrs, nbytes, s0, s1)


def run_many(plan: ManyPlan, addrs: Iterable[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Channel values of a :func:`plan_many` plan's strings as they are now (:func:`digest_arrays_many`'s
    result); ``addrs``: the strings' addresses now, in order, when they moved (same lengths, seeds).

    Raises:
        RefitInputError: ``addrs`` has another count than the plan, holds something else than
            ints in [0, 2**64), or one is not 8-byte aligned; nothing is read.
    """
    n = len(plan.addrs)
    at = plan.addrs
    if addrs is not None:
        given = list(addrs)
        if len(given) != n or not set(map(type, given)) <= {int}:
            raise RefitInputError(f"run_many takes {n} addresses (ints), got {len(given)}")
        try:
            at = np.array(given, np.uint64)
        except OverflowError:  # below 0 or from 2**64 on
            raise RefitInputError("run_many takes addresses in [0, 2**64)") from None
        if not _aligned(at):
            raise RefitInputError("run_many takes 8-byte aligned addresses")
    o0 = np.empty(n, np.uint64)
    o1 = np.empty(n, np.uint64)
    if n:
        digest_many(at, plan.nbytes, plan.s0, plan.s1, o0, o1)
    return o0, o1


def digest_words_many(items: list[tuple[int, int, tuple[int, int]]]) -> list[tuple[int, int]]:
    """:func:`digest_arrays_many` as ``[(h0, h1)]``, one pair of Python ints in [0, 2**64) per string.

    Raises:
        RefitInputError: as :func:`digest_arrays_many`.
    """
    o0, o1 = digest_arrays_many(items)
    return list(zip(o0.tolist(), o1.tolist()))
