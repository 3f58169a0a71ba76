"""Digest v1 on numba-compiled uint64 loops: the fast CPU path.

Same contract as :func:`refit_verify.digest._torch.digest_u8` and bit-identical to
``reference.py``. The lanes are a zero-copy ``uint64`` view of the tensor's bytes (only a partial
last lane, or a misaligned start, is copied). One pass over the data computes both channels: each
16-lane group (16 loads, ``W`` lanes apart) is folded through its 4-level subtree for channel 0
and channel 1 while it is in registers, and the loop over the ``W`` groups of a block is
contiguous in memory, so LLVM vectorises it (AVX2/AVX-512 where the host has them).

Full chunks (2**20 lanes) all have the same shape: fold level ``f`` is then one uniform blocked
fold over the concatenation of every full chunk, with strides 256, 256, 256, 16, 1, and its
blocks are independent. Levels 0 and 1 are fused per 65536-lane unit (one level-1 block: the
level-0 values stay in cache) and the units are a ``prange``; levels 2-4 (1/256 of the work) run
on the calling thread. The last (partial) chunk, if any, takes the generic path that pads the
last block of each level with zeros (its level 0 a ``prange`` over blocks).

Tensors under ``PARALLEL_MIN_LANES`` lanes never open a parallel region. The parallel regions are
scheduled dynamically in pieces of ``PAR_CHUNK`` iterations (``set_parallel_chunksize``). On a
machine whose other core is busy, a parallel region can be slower than the serial path (its end
waits for a preempted thread); ``numba.set_num_threads(1)`` in the calling thread avoids that.

All arithmetic is ``uint64`` (``np.uint64`` constants and shift counts, wrapping multiply); the
mixer constants, rotations and roles come from ``reference.py`` (frozen into the compiled code).
Compiled with ``cache=True`` where a cache directory is writable (else without caching).

The module stays whole: its compiled functions are one numba call graph whose compile order and
on-disk cache (see ``chunk_roots_lanes``) are managed here, next to the entry points that call it.

Source: ``docs/digest-spec.md`` §2–§8.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from numba import njit, prange, set_parallel_chunksize

from refit_verify.digest import reference as ref

__all__ = ["digest_u8", "digest_words", "digest_lanes", "chunk_roots_u8", "chunk_roots_lanes"]

if sys.byteorder != "little":  # lanes are read as native uint64; the spec says little-endian
    raise ImportError("refit_verify.digest._numba needs a little-endian host")

_U = np.uint64

_PHI = _U(ref.PHI)
_STRIDE = ref.STRIDE
_CHUNK = ref.CHUNK_LANES
_CHAIN = ref.CHAIN_LEVEL
_FIN0, _FIN1 = ref.FINAL_LEVELS
_Z = _U(0)
# int64 (not literal) constants, so that each jitted helper is compiled once, not per literal.
_I0 = np.int64(0)
_NO = np.bool_(False)
_W1, _W16, _W256 = np.int64(1), np.int64(16), np.int64(256)
_F0, _F1, _F2, _F3, _F4 = (np.int64(i) for i in range(5))

# Below this many lanes a tensor is digested on the calling thread only (no parallel region).
PARALLEL_MIN_LANES = 1 << 17
# Iterations a thread takes at a time in a parallel region: small enough that an idle thread
# takes over the work of a preempted one (a shared or busy machine), large enough to amortise.
PAR_CHUNK = 4
# Cleared if a parallel region ever fails (e.g. no usable numba threading layer).
_parallel_ok = True


def _jit(**kw):
    """``njit(cache=True, nogil=True, fastmath=False)``; without caching if no cache dir is writable."""

    def deco(fn):
        try:
            return njit(cache=True, nogil=True, fastmath=False, **kw)(fn)
        except Exception:  # noqa: BLE001 - no writable cache locator (read-only install, no writable home)
            return njit(cache=False, nogil=True, fastmath=False, **kw)(fn)

    return deco


# ---------------------------------------------------------------------------------------------
# §4–§5 mixers and node combine (uint64 only). Constants from ``reference.MIXERS`` and
# ``reference.ROT``, one module-level function per channel: numba's on-disk cache names compiled
# functions by qualified name, and two closures of one factory would share a name (loading such a
# cache segfaulted with numba 0.65).

(_X01, _X02, _X03), (_M01, _M02) = ([_U(v) for v in row] for row in ref.MIXERS[0])
(_X11, _X12, _X13), (_M11, _M12) = ([_U(v) for v in row] for row in ref.MIXERS[1])
_R0, _L0 = _U(ref.ROT[0]), _U(64 - ref.ROT[0])
_R1, _L1 = _U(ref.ROT[1]), _U(64 - ref.ROT[1])


@_jit()
def _mix0(x):
    x ^= x >> _X01
    x *= _M01
    x ^= x >> _X02
    x *= _M02
    return x ^ (x >> _X03)


@_jit()
def _mix1(x):
    x ^= x >> _X11
    x *= _M11
    x ^= x >> _X12
    x *= _M12
    return x ^ (x >> _X13)


@_jit()
def _node0(left, right, tw):
    return _mix0(left ^ tw) + ((right >> _R0) | (right << _L0))


@_jit()
def _node1(left, right, tw):
    return _mix1(left ^ tw) + ((right >> _R1) | (right << _L1))


@_jit(inline="always")
def _tree0(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, t0, t1, t2, t3):
    b0 = _node0(a0, a1, t0)
    b1 = _node0(a2, a3, t0)
    b2 = _node0(a4, a5, t0)
    b3 = _node0(a6, a7, t0)
    b4 = _node0(a8, a9, t0)
    b5 = _node0(a10, a11, t0)
    b6 = _node0(a12, a13, t0)
    b7 = _node0(a14, a15, t0)
    c0 = _node0(b0, b1, t1)
    c1 = _node0(b2, b3, t1)
    c2 = _node0(b4, b5, t1)
    c3 = _node0(b6, b7, t1)
    return _node0(_node0(c0, c1, t2), _node0(c2, c3, t2), t3)


@_jit(inline="always")
def _tree1(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, t0, t1, t2, t3):
    b0 = _node1(a0, a1, t0)
    b1 = _node1(a2, a3, t0)
    b2 = _node1(a4, a5, t0)
    b3 = _node1(a6, a7, t0)
    b4 = _node1(a8, a9, t0)
    b5 = _node1(a10, a11, t0)
    b6 = _node1(a12, a13, t0)
    b7 = _node1(a14, a15, t0)
    c0 = _node1(b0, b1, t1)
    c1 = _node1(b2, b3, t1)
    c2 = _node1(b4, b5, t1)
    c3 = _node1(b6, b7, t1)
    return _node1(_node1(c0, c1, t2), _node1(c2, c3, t2), t3)


@_jit()
def _tweak(c, level):
    """§4.2 ``T(c, level) = PHI * (64c + level + 1)``."""
    return _PHI * _U(64 * c + level + 1)


@_jit()
def _finish(h0, h1):
    """Both channels' chain values through the final levels (``reference.FINAL_LEVELS``): the digest's words."""
    return _mix0(_mix0(h0 ^ _tweak(0, _FIN0)) ^ _tweak(0, _FIN1)), _mix1(_mix1(h1 ^ _tweak(1, _FIN0)) ^ _tweak(1, _FIN1))


# ---------------------------------------------------------------------------------------------
# §6.1 one block of one fold level, both channels


@_jit()
def _fold_block(s0, s1, sb, w, d0, d1, db, f):
    """Fold the block ``s[sb : sb + 16*w]`` (both channels; ``s0``/``s1`` may be one array) at
    fold level ``f`` into ``d[db : db + w]``."""
    p0 = _tweak(0, 4 * f)
    p1 = _tweak(0, 4 * f + 1)
    p2 = _tweak(0, 4 * f + 2)
    p3 = _tweak(0, 4 * f + 3)
    q0 = _tweak(1, 4 * f)
    q1 = _tweak(1, 4 * f + 1)
    q2 = _tweak(1, 4 * f + 2)
    q3 = _tweak(1, 4 * f + 3)
    x0 = s0[sb : sb + 16 * w]
    x1 = s1[sb : sb + 16 * w]
    y0 = d0[db : db + w]
    y1 = d1[db : db + w]
    w2 = 2 * w
    w3 = 3 * w
    w4 = 4 * w
    w5 = 5 * w
    w6 = 6 * w
    w7 = 7 * w
    w8 = 8 * w
    w9 = 9 * w
    w10 = 10 * w
    w11 = 11 * w
    w12 = 12 * w
    w13 = 13 * w
    w14 = 14 * w
    w15 = 15 * w
    for t in range(w):
        y0[t] = _tree0(
            x0[t], x0[w + t], x0[w2 + t], x0[w3 + t], x0[w4 + t], x0[w5 + t], x0[w6 + t], x0[w7 + t],
            x0[w8 + t], x0[w9 + t], x0[w10 + t], x0[w11 + t], x0[w12 + t], x0[w13 + t], x0[w14 + t],
            x0[w15 + t], p0, p1, p2, p3,
        )  # fmt: skip
        y1[t] = _tree1(
            x1[t], x1[w + t], x1[w2 + t], x1[w3 + t], x1[w4 + t], x1[w5 + t], x1[w6 + t], x1[w7 + t],
            x1[w8 + t], x1[w9 + t], x1[w10 + t], x1[w11 + t], x1[w12 + t], x1[w13 + t], x1[w14 + t],
            x1[w15 + t], q0, q1, q2, q3,
        )  # fmt: skip


@_jit(parallel=True)
def _blocks_par(s0, s1, sb, w, nblk, d0, d1, db, f):
    blk = 16 * w
    for b in prange(nblk):
        _fold_block(s0, s1, sb + b * blk, w, d0, d1, db + b * w, f)


@_jit()
def _blocks_ser(s0, s1, sb, w, nblk, d0, d1, db, f):
    blk = 16 * w
    for b in range(nblk):
        _fold_block(s0, s1, sb + b * blk, w, d0, d1, db + b * w, f)


@_jit()
def _level(s0, s1, sb, n, w, f, d0, d1, par, has_tail, tail):
    """Fold level ``f`` at stride ``w`` of the ``n`` values ``s[sb : sb + n]`` into ``d``.

    Writes ``ceil(n / 16w) * w`` values; the last block is zero-padded. With ``has_tail`` the
    last of the ``n`` values is not in ``s`` but is ``tail`` (the partial last lane).
    Returns the number of values written.
    """
    blk = 16 * w
    navail = n - 1 if has_tail else n
    direct = navail // blk  # blocks lying wholly inside ``s``
    if par and direct > 1:
        _blocks_par(s0, s1, sb, w, direct, d0, d1, _I0, f)
    else:
        _blocks_ser(s0, s1, sb, w, direct, d0, d1, _I0, f)
    return _last_block(s0, s1, sb, n, w, f, d0, d1, has_tail, tail)


@_jit()
def _level_ser(s0, s1, sb, n, w, f, d0, d1, has_tail, tail):
    """:func:`_level` on the calling thread only (no parallel region anywhere below it)."""
    blk = 16 * w
    navail = n - 1 if has_tail else n
    _blocks_ser(s0, s1, sb, w, navail // blk, d0, d1, _I0, f)
    return _last_block(s0, s1, sb, n, w, f, d0, d1, has_tail, tail)


@_jit()
def _last_block(s0, s1, sb, n, w, f, d0, d1, has_tail, tail):
    """The end of :func:`_level`: the block that does not lie wholly inside ``s`` (what is left of
    it, the tail lane, then zeros), if any. Returns the number of values the level wrote."""
    blk = 16 * w
    nblk = (n + blk - 1) // blk
    navail = n - 1 if has_tail else n
    direct = navail // blk
    if direct < nblk:  # the last block: what is left, the tail lane, then zeros
        m = navail - direct * blk
        p0 = np.zeros(blk, np.uint64)
        p1 = np.zeros(blk, np.uint64)
        p0[:m] = s0[sb + direct * blk : sb + navail]
        p1[:m] = s1[sb + direct * blk : sb + navail]
        if has_tail:
            p0[m] = tail
            p1[m] = tail
        _fold_block(p0, p1, _I0, w, d0, d1, direct * w, f)
    return nblk * w


# ---------------------------------------------------------------------------------------------
# §6 chunk roots


_UNIT = 16 * 4096  # lanes of one level-1 block of a full chunk (16 level-0 blocks)


@_jit()
def _unit(lanes, base, t0, t1, d0, d1, db):
    """Fold levels 0 and 1 of the 65536 lanes ``lanes[base : base + 65536]`` of a full chunk.

    Level 0 (16 blocks at stride 256) goes to the scratch ``t0``/``t1`` (4096 values each, in
    cache), level 1 (one block at stride 256) to ``d[db : db + 256]``.
    """
    for k in range(16):
        _fold_block(lanes, lanes, base + k * 4096, _W256, t0, t1, k * 256, _F0)
    _fold_block(t0, t1, _I0, _W256, d0, d1, db, _F1)


@_jit(parallel=True)
def _units_par(lanes, nunits, d0, d1):
    for u in prange(nunits):
        t0 = np.empty(4096, np.uint64)
        t1 = np.empty(4096, np.uint64)
        _unit(lanes, u * _UNIT, t0, t1, d0, d1, u * 256)


@_jit()
def _units_ser(lanes, nunits, d0, d1):
    t0 = np.empty(4096, np.uint64)
    t1 = np.empty(4096, np.uint64)
    for u in range(nunits):
        _unit(lanes, u * _UNIT, t0, t1, d0, d1, u * 256)


@_jit()
def _full_chunk_roots(lanes, nchunks, r0, r1, par):
    """Roots of the first ``nchunks`` full chunks of ``lanes`` into ``r0[:nchunks]``, ``r1[:nchunks]``."""
    # Every full chunk folds 2**20 → 65536 → 4096 → 256 → 16 → 1 with strides 256, 256, 256, 16, 1,
    # and chunk i's level-f values stay contiguous, so each level is one uniform blocked fold over
    # all full chunks. Levels 0 and 1 are fused per 65536-lane unit (one level-1 block), so the
    # level-0 values never leave the cache and no large buffer is allocated (and page-faulted).
    nunits = nchunks * 16
    b0 = np.empty(nunits * 256, np.uint64)
    b1 = np.empty(nunits * 256, np.uint64)
    if par:
        _units_par(lanes, nunits, b0, b1)
    else:
        _units_ser(lanes, nunits, b0, b1)
    a0 = np.empty(nchunks * 256, np.uint64)
    a1 = np.empty(nchunks * 256, np.uint64)
    # Levels 2-4 are 1/256 of the work: on this thread (a parallel region costs a barrier, and a
    # barrier waits for a preempted thread on a busy machine).
    n = _level(b0, b1, _I0, nunits * 256, _W256, _F2, a0, a1, _NO, _NO, _Z)
    n = _level(a0, a1, _I0, n, _W16, _F3, b0, b1, _NO, _NO, _Z)
    _level(b0, b1, _I0, n, _W1, _F4, r0, r1, _NO, _NO, _Z)


@_jit()
def _level_buffers(n):
    """The stride ``w`` of a fold level over ``n`` values and its two output buffers (uninitialised: the level writes every value)."""
    w = min(_STRIDE, (n + 15) // 16)
    m = (n + 16 * w - 1) // (16 * w) * w
    return w, np.empty(m, np.uint64), np.empty(m, np.uint64)


@_jit()
def _upper_levels(s0, s1, n, f):
    """Fold the ``n`` values of ``s0``/``s1`` at levels ``f``, ``f + 1``, ... down to the root pair
    (at most 1/16 of a chunk's work: on the calling thread)."""
    while n > 1:
        w, d0, d1 = _level_buffers(n)
        n = _level_ser(s0, s1, _I0, n, w, f, d0, d1, _NO, _Z)
        s0 = d0
        s1 = d1
        f += 1
    return s0[0], s1[0]


@_jit()
def _partial_chunk_root(lanes, start, navail, has_tail, tail, par):
    """Root pair of the chunk ``lanes[start : start + navail]`` (+ ``tail`` lane if ``has_tail``)."""
    n = navail + (1 if has_tail else 0)
    if n == 1:  # a one-lane chunk is its own root (no fold level)
        v = tail if has_tail else lanes[start]
        return v, v
    w, s0, s1 = _level_buffers(n)
    n = _level(lanes, lanes, start, n, w, _F0, s0, s1, par, has_tail, tail)
    return _upper_levels(s0, s1, n, _F1)


# ---------------------------------------------------------------------------------------------
# §7 chunk chain, §8 finalisation


@_jit()
def digest_lanes(lanes, has_tail, tail, seed0, seed1, par):
    """Digest words ``(h0, h1)`` of the lanes ``lanes`` followed, if ``has_tail``, by ``tail``.

    The compiled counterpart of ``reference.chain_and_finalise`` (§7, §8) over the chunk roots.

    Args:
        lanes: 1-D C-contiguous ``uint64`` array (little-endian lanes of the data).
        has_tail: whether a last, zero-padded lane ``tail`` follows ``lanes``.
        tail: that lane (``np.uint64``; ignored without ``has_tail``).
        seed0, seed1: the §3 metadata seed (``np.uint64``).
        par: allow a parallel region (``prange`` over blocks).
    """
    nav = lanes.shape[0]
    nfull = nav // _CHUNK
    rest = nav - nfull * _CHUNK
    nroots = nfull + (1 if (rest > 0 or has_tail) else 0)
    r0 = np.empty(nroots, np.uint64)
    r1 = np.empty(nroots, np.uint64)
    if nfull > 0:
        _full_chunk_roots(lanes, nfull, r0, r1, par)
    if nroots > nfull:
        r0[nfull], r1[nfull] = _partial_chunk_root(lanes, nfull * _CHUNK, rest, has_tail, tail, par)
    h0 = seed0
    h1 = seed1
    c0 = _tweak(0, _CHAIN)
    c1 = _tweak(1, _CHAIN)
    for i in range(nroots):
        h0 = _node0(h0, r0[i], c0)
        h1 = _node1(h1, r1[i], c1)
    h0, h1 = _finish(h0, h1)
    return h0, h1


# Not cached on disk (``cache=False``), and compiled only after ``digest_lanes`` (see
# ``_digest_path_first``): with numba 0.65, a cached function compiled in a process that had loaded
# its callees from the cache (they contain parallel regions) segfaulted when a later process loaded
# it from the cache (cf. numba issue #10128: symbol names depend on each process's compile order).
# The callees here are shared with ``digest_lanes``; keeping this entry out of the cache and
# resolving ``digest_lanes`` first keeps the on-disk cache exactly as ``digest_u8`` alone writes it.
# Compiling this small function costs about a second per process; its callees come from the cache.
# Its first lines repeat ``digest_lanes`` on purpose: sharing them through an ``inline="always"``
# helper (cached) made a later process segfault on loading the cache (numba 0.65, 2026-12-01).
@njit(cache=False, nogil=True, fastmath=False)
def chunk_roots_lanes(lanes, has_tail, tail, par):
    """Per-chunk roots ``(r0, r1)`` (§6) of the lanes ``lanes`` (+ ``tail`` if ``has_tail``), no chain.

    The roots-only half of :func:`digest_lanes`, for sharded evaluation (``refit_verify.collective.sharded``):
    two ``uint64`` arrays with one root per chunk of 2**20 lanes, in chunk order.
    """
    nav = lanes.shape[0]
    nfull = nav // _CHUNK
    rest = nav - nfull * _CHUNK
    nroots = nfull + (1 if (rest > 0 or has_tail) else 0)
    r0 = np.empty(nroots, np.uint64)
    r1 = np.empty(nroots, np.uint64)
    if nfull > 0:
        _full_chunk_roots(lanes, nfull, r0, r1, par)
    if nroots > nfull:
        r0[nfull], r1[nfull] = _partial_chunk_root(lanes, nfull * _CHUNK, rest, has_tail, tail, par)
    return r0, r1


# ---------------------------------------------------------------------------------------------
# Python entry points


def _host_view(u8: torch.Tensor) -> np.ndarray:
    """The bytes of CPU tensor ``u8`` as a numpy array, no copy. Through DLPack: ``Tensor.numpy()``
    would mark the tensor's storage as not resizable for good, and a trainer that frees it after a
    push (``untyped_storage().resize_(0)``, as FSDP does) would then fail."""
    return np.from_dlpack(u8)


def _lanes_and_tail(u8: torch.Tensor) -> tuple[np.ndarray, bool, np.uint64]:
    """Zero-copy ``uint64`` view of the whole lanes of ``u8`` plus the zero-padded tail lane."""
    buf = _host_view(u8)
    nb = buf.shape[0]
    rem = nb & 7
    if not rem and u8.data_ptr() & 7 == 0:  # the common case: whole lanes, aligned start
        return buf.view(np.uint64), False, _Z
    nfull = nb >> 3
    tail = _Z
    if rem:
        t = np.zeros(8, np.uint8)
        t[:rem] = buf[nfull * 8 :]
        tail = t.view("<u8")[0]
    if u8.data_ptr() % 8 == 0:
        lanes = buf[: nfull * 8].view(np.uint64)
    else:  # misaligned start: one aligned copy of the whole lanes
        lanes = np.empty(nfull, np.uint64)
        lanes.view(np.uint8)[:] = buf[: nfull * 8]
    return lanes, bool(rem), tail


def _call(fn, lanes: np.ndarray, *args):
    """``fn(lanes, *args, par)``: in a parallel region (small dynamic pieces) when ``lanes`` is big
    enough and parallel regions work here, else on the calling thread."""
    global _parallel_ok
    if _parallel_ok and lanes.shape[0] >= PARALLEL_MIN_LANES:
        try:
            # Dynamic scheduling in small pieces (set per calling thread, outside the jitted code,
            # which then stays cacheable).
            prev = set_parallel_chunksize(PAR_CHUNK)
            try:
                return fn(lanes, *args, True)
            finally:
                set_parallel_chunksize(prev)
        except Exception:  # noqa: BLE001 - any failure of the parallel path: the serial one is exact
            _parallel_ok = False  # e.g. no numba threading layer: stay on the calling thread
    return fn(lanes, *args, False)


def _check_u8(u8: torch.Tensor, what: str) -> None:
    if u8.dim() != 1 or u8.dtype != torch.uint8 or not u8.is_contiguous() or u8.device.type != "cpu":
        raise ValueError(f"{what} takes a 1-D contiguous CPU uint8 tensor")


def digest_words(u8: torch.Tensor, seeds: tuple[int, int]) -> tuple[int, int]:
    """Finalised channel values ``(h0, h1)`` of the bytes ``u8`` under the §3 ``seeds``.

    The per-tensor entry of ``DigestBatch``: no argument checks (``u8`` must be a 1-D contiguous
    CPU uint8 tensor), no hex formatting.

    Args:
        u8: the bytes (any storage offset and length); viewed, not copied, when its start is
            8-byte aligned (else its whole lanes are copied once to an aligned buffer).
        seeds: ``reference.seed(...)`` of the digested tensor (ints in [0, 2**64)).

    Returns:
        tuple[int, int]: equal to ``reference.chain_and_finalise`` of the reference's roots.
    """
    buf = _host_view(u8)
    if buf.shape[0] & 7 or u8.data_ptr() & 7:  # a partial last lane or a misaligned start
        lanes, has_tail, tail = _lanes_and_tail(u8)
    else:
        lanes, has_tail, tail = buf.view(np.uint64), False, _Z
    if lanes.shape[0] < PARALLEL_MIN_LANES:  # (inlined _call: the per-tensor path of small tensors)
        h0, h1 = digest_lanes(lanes, has_tail, tail, _U(seeds[0]), _U(seeds[1]), False)
    else:
        h0, h1 = _call(digest_lanes, lanes, has_tail, tail, _U(seeds[0]), _U(seeds[1]))
    return int(h0), int(h1)


def digest_u8(u8: torch.Tensor, dtype_name: str, shape: tuple[int, ...]) -> str:
    """Digest of a 1-D contiguous CPU uint8 tensor holding a tensor's logical bytes.

    Args:
        u8: the bytes (see :func:`digest_words`).
        dtype_name: the spec's dtype name of the digested tensor.
        shape: the digested tensor's shape.

    Returns:
        str: 32 lowercase hex characters, equal to ``reference.digest_bytes``.

    Raises:
        ValueError: ``u8`` is not a 1-D contiguous CPU uint8 tensor.
    """
    _check_u8(u8, "digest_u8")
    return ref.hexdigest(*digest_words(u8, ref.seed(dtype_name, shape, u8.numel())))


_digest_path_ready = False


def _digest_path_first() -> None:
    """Resolve ``digest_lanes`` (load it from the cache, or compile it with all its callees) before
    ``chunk_roots_lanes`` compiles against the same callees in this process."""
    global _digest_path_ready
    if not _digest_path_ready:
        digest_lanes(np.empty(0, np.uint64), False, _Z, _Z, _Z, False)
        _digest_path_ready = True


def chunk_roots_u8(u8: torch.Tensor) -> list[tuple[int, int]]:
    """Chunk roots (§6) of a 1-D contiguous CPU uint8 tensor, both channels, in chunk order.

    The bytes are treated as a standalone byte string: lanes from its first byte, the last lane
    zero-padded, chunks of 2**20 lanes. No seed, chain or finalisation (see
    ``refit_verify.collective.sharded.combine_chunk_roots``).

    Returns:
        list[tuple[int, int]]: ``(root_0, root_1)`` per chunk, as Python ints (``[]`` for 0 bytes).

    Raises:
        ValueError: ``u8`` is not a 1-D contiguous CPU uint8 tensor.
    """
    _check_u8(u8, "chunk_roots_u8")
    _digest_path_first()
    r0, r1 = _call(chunk_roots_lanes, *_lanes_and_tail(u8))
    return [(int(a), int(b)) for a, b in zip(r0, r1)]
