"""Copy and digest in one pass over the source (numba), for ``DigestBatch.add_copy`` on CPU tensors.

:func:`copy_digest_many` copies each source's bytes into its destination and digests them (§2-§8)
while they are in cache: per fold-level-0 block (at most 4096 lanes, 32 KiB), the block's lanes are
copied from the source (the one read of the source's bytes) into the destination, then that
block of the destination, still in the core's cache, is folded as ``_numba._fold_block`` folds it.
The destination's last lane gets the source's partial last lane zero-padded (§2), so the digest is
of exactly the bytes written. A sender that copies into staging and digests thus reads the trainer's
tensor from memory once, not twice (copy, then digest).

Serial (no parallel region): cached on disk like ``_numba_many.digest_many`` (same serial callees).
Each string may span any number of chunks (each chunk folded as ``_partial_chunk_root`` folds one).

Source: ``docs/digest-spec.md`` §2-§8; the fold helpers are ``_numba``'s.
"""

from __future__ import annotations

import numpy as np
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic

from refit_verify.digest._numba import (
    _CHAIN,
    _CHUNK,
    _F0,
    _F1,
    _NO,
    _U,
    _Z,
    _finish,
    _fold_block,
    _jit,
    _last_block,
    _level_buffers,
    _node0,
    _node1,
    _tweak,
    _upper_levels,
)
from refit_verify.digest._numba_many import _voidptr
from refit_verify.digest.tensors import first_overlap
from refit_verify.errors import RefitInputError

__all__ = ["copy_digest_many", "copy_digest_arrays"]


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """``memcpy(dst, src, nbytes)`` of integer host addresses (LLVM's ``llvm.memcpy``: libc speed, any alignment)."""

    def codegen(context, builder, signature, args):
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, cgutils.voidptr_t), builder.inttoptr(s, cgutils.voidptr_t), n, 1)
        return context.get_dummy_value()

    return types.void(dst, src, nbytes), codegen


@_jit()
def _copy_lanes(src, nb, dst, lo, hi):
    """Copy lanes ``[lo, hi)`` of the ``nb``-byte source at address ``src`` to the destination at
    address ``dst``: whole lanes as they are, the partial last lane (if in range) zero-padded (§2)."""
    full = nb >> 3
    e = min(hi, full)
    if e > lo:
        _memcpy(dst + _U(8 * lo), src + _U(8 * lo), 8 * (e - lo))
    if hi > full and full * 8 < nb:  # the partial last lane: its bytes, then zeros
        last = carray(_voidptr(dst + _U(8 * full)), (8,), np.uint8)
        tail = carray(_voidptr(src + _U(8 * full)), (nb - 8 * full,), np.uint8)
        for b in range(8):
            last[b] = tail[b] if b < nb - 8 * full else 0


@_jit()
def _copy_chunk_root(src, nb, dst, dst64, start, n):
    """Root pair (§6) of the chunk of lanes ``[start, start + n)``, each level-0 block copied into the
    destination just before it is folded from there."""
    if n == 1:
        _copy_lanes(src, nb, dst, start, start + 1)
        return dst64[start], dst64[start]
    w, s0, s1 = _level_buffers(n)
    blk = 16 * w
    direct = n // blk
    for b in range(direct):
        lo = start + b * blk
        _copy_lanes(src, nb, dst, lo, lo + blk)
        _fold_block(dst64, dst64, lo, w, s0, s1, b * w, _F0)
    if direct * blk < n:  # the last block: copied, then folded zero-padded
        _copy_lanes(src, nb, dst, start + direct * blk, start + n)
    m = _last_block(dst64, dst64, start, n, w, _F0, s0, s1, _NO, _Z)
    return _upper_levels(s0, s1, m, _F1)


@_jit()
def copy_digest_many(srcs, dsts, nbytes, seeds0, seeds1, out0, out1):
    """Copy each byte string into its destination and digest it (§2-§8), reading each source once.

    Args:
        srcs: ``uint64 [N]`` host addresses of the sources (any alignment); alive, unchanged and
            overlapping no destination for the call.
        dsts: ``uint64 [N]`` host addresses of the destinations, 8-byte aligned, each
            ``round_up(nbytes, 8)`` bytes, overlapping no other destination.
        nbytes: ``int64 [N]`` byte lengths (>= 0).
        seeds0, seeds1: ``uint64 [N]`` §3 seeds of the tensors the bytes came from.
        out0, out1: ``uint64 [N]`` where the finalised channel values go.

    Writes destination ``i``'s bytes ``[0, nbytes)`` (the source's) and ``[nbytes, round_up(nbytes, 8))``
    (zeros); its channel values equal ``_numba.digest_lanes`` of the same bytes and seeds.
    """
    c0 = _tweak(0, _CHAIN)
    c1 = _tweak(1, _CHAIN)
    for i in range(srcs.shape[0]):
        nb = nbytes[i]
        nl = (nb + 7) >> 3
        dst64 = carray(_voidptr(dsts[i]), (nl,), np.uint64)
        h0 = seeds0[i]
        h1 = seeds1[i]
        for start in range(0, nl, _CHUNK):
            r0, r1 = _copy_chunk_root(srcs[i], nb, dsts[i], dst64, start, min(_CHUNK, nl - start))
            h0 = _node0(h0, r0, c0)
            h1 = _node1(h1, r1, c1)
        h0, h1 = _finish(h0, h1)
        out0[i] = h0
        out1[i] = h1


def copy_digest_arrays(items: list[tuple[int, int, int, tuple[int, int]]]) -> tuple[np.ndarray, np.ndarray]:
    """Copy and digest many byte strings in one compiled call (:func:`copy_digest_many`).

    Args:
        items: ``(source address, destination address, nbytes, seeds)`` per string, as
            :func:`copy_digest_many` takes them (the caller keeps the memory alive for the call).

    Returns:
        tuple[np.ndarray, np.ndarray]: ``uint64 [N]`` channel 0 and channel 1 values.

    Raises:
        RefitInputError: a destination is not 8-byte aligned, a length is negative, or two
            destinations, or a destination and a source, overlap; nothing is copied or read.
    """
    n = len(items)
    srcs = np.fromiter((s for s, _, _, _ in items), np.uint64, n)
    dsts = np.fromiter((d for _, d, _, _ in items), np.uint64, n)
    nbytes = np.fromiter((b for _, _, b, _ in items), np.int64, n)
    if n and (int((dsts & _U(7)).max()) or int(nbytes.min()) < 0):
        raise RefitInputError("copy_digest_arrays takes 8-byte aligned destinations and lengths >= 0")
    _check_overlaps(items)
    s0 = np.fromiter((s[0] for *_, s in items), np.uint64, n)
    s1 = np.fromiter((s[1] for *_, s in items), np.uint64, n)
    o0 = np.empty(n, np.uint64)
    o1 = np.empty(n, np.uint64)
    if n:
        copy_digest_many(srcs, dsts, nbytes, s0, s1, o0, o1)
    return o0, o1


def _check_overlaps(items: list[tuple[int, int, int, tuple[int, int]]]) -> None:
    """Raise :class:`RefitInputError` if two destinations (``round_up(nbytes, 8)`` bytes each) overlap,
    or a destination overlaps a source (``nbytes`` bytes)."""
    hit = first_overlap([(d, d + (b + 7) // 8 * 8, i) for i, (_, d, b, _) in enumerate(items) if b],
                        [(s, s + b) for s, _, b, _ in items if b])
    if hit is not None and hit[1] >= 0:
        raise RefitInputError(f"add_copy: destination {hit[0]} overlaps destination {hit[1]}")
    if hit is not None:
        raise RefitInputError(f"add_copy: destination {hit[0]} overlaps a source: a copy destination may overlap no source")
