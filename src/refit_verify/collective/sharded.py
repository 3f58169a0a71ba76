"""Digest of a dim-0 sharded tensor without gathering its bytes (``docs/digest-spec.md`` §7.1).

Digest v1 splits a tensor's logical bytes into chunks of 2**20 lanes (8 MiB, ``CHUNK_BYTES``),
computes one root per chunk and channel (§6) from that chunk's lanes only, and chains the roots
in order from the metadata seed (§7). A rank holding a contiguous byte range of the full tensor
(a dim-0 shard: FSDP flat or row shards, TP row shards) can therefore compute the chunk roots of
its range locally; the roots of all ranks (16 bytes per 8 MiB) are gathered and chained with the
*full* tensor's seed (dtype, full shape, full byte length), giving exactly ``tensor_digest(full)``.

**The shard rule.** This is exact iff every cut between shards falls on a chunk boundary: every
non-empty shard starts at a byte offset that is a multiple of ``CHUNK_BYTES`` and every non-empty
shard except the last has a byte length that is a multiple of ``CHUNK_BYTES`` (the last one ends
at the tensor's end, anywhere). Empty shards contribute no chunks and are allowed anywhere.
Otherwise a chunk straddles two ranks and its root cannot be computed by either: the helper
falls back to gathering the shard bytes on the digesting rank (``fallback="gather"``, the
default; the result says ``path="gather"`` and the reason, and a WARNING is logged) or raises
:class:`ShardLayoutError` (``fallback="raise"``).

Public API:

* :func:`shard_chunk_roots` - the roots of one shard (any device; no communication);
* :func:`combine_chunk_roots` - chain roots with the full tensor's seed and finalise;
* :func:`check_shard_layout` / :func:`dim0_byte_ranges` - the rule, on byte ranges;
* :func:`digest_dim0_sharded` / :func:`sharded_digest` - the ``torch.distributed`` helper.

Source: ``docs/digest-spec.md`` §6, §7, §7.1 (sharded evaluation).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest import reference as _ref
from refit_verify.digest.batch import tensor_digest
from refit_verify.digest.tensors import dtype_name, logical_bytes
from refit_verify.errors import RefitProtocolError, ShardLayoutError
from refit_verify.wire.collective import (
    MAX_SHARD_MESSAGE_BYTES,
    ShardMeta,
    ShardRoots,
    all_gather_messages,
    comm_device,
    decode_shard_meta,
    decode_shard_roots,
    gather_messages,
)

__all__ = [
    "CHUNK_BYTES",
    "ShardLayoutError",
    "ShardedDigest",
    "check_shard_layout",
    "combine_chunk_roots",
    "digest_dim0_sharded",
    "dim0_byte_ranges",
    "shard_chunk_roots",
    "sharded_digest",
]

logger = logging.getLogger("refit_verify")

CHUNK_BYTES = _ref.CHUNK_LANES * _ref.LANE_BYTES
"""Bytes per chunk (8 MiB = 2**20 lanes × 8): the granularity of sharded evaluation."""



# ---------------------------------------------------------------------------------------------
# the rule


def check_shard_layout(byte_ranges: Sequence[tuple[int, int]], nbytes: int) -> str | None:
    """Check the shard rule for shards given as ``(byte_offset, byte_length)`` in shard order.

    Args:
        byte_ranges: one ``(offset, length)`` per shard, in the order their roots will be chained.
        nbytes: the full tensor's byte length ``N``.

    Returns:
        ``None`` if the roots of these shards chain to the full digest; otherwise the reason
        (a cut not on a chunk boundary).

    Raises:
        ShardLayoutError: the ranges do not tile ``[0, nbytes)`` in order (a gap, an overlap, a
            negative length): no layout of that kind describes one tensor.
    """
    pos = 0
    for i, (off, length) in enumerate(byte_ranges):
        if length < 0 or off < 0:
            raise ShardLayoutError(f"shard {i}: bad byte range (offset {off}, length {length})")
        if length == 0:
            continue
        if off != pos:
            raise ShardLayoutError(f"shard {i} starts at byte {off}, expected {pos}: shards must tile the tensor in order")
        pos = off + length
    if pos != nbytes:
        raise ShardLayoutError(f"shards cover {pos} bytes, the tensor has {nbytes}")
    nonempty = [(i, o, n) for i, (o, n) in enumerate(byte_ranges) if n > 0]
    for k, (i, off, length) in enumerate(nonempty):
        if off % CHUNK_BYTES:
            return f"shard {i} starts at byte {off}, not a multiple of {CHUNK_BYTES} (8 MiB)"
        if k < len(nonempty) - 1 and length % CHUNK_BYTES:
            return f"shard {i} is {length} bytes long, not a multiple of {CHUNK_BYTES} (8 MiB), and is not the last"
    return None


def dim0_byte_ranges(rows: Sequence[int], row_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of dim-0 shards holding ``rows[i]`` rows of ``row_bytes`` bytes each, in order."""
    out, off = [], 0
    for r in rows:
        out.append((off, r * row_bytes))
        off += r * row_bytes
    return out


# ---------------------------------------------------------------------------------------------
# roots of one shard


def _roots_u8(u8: torch.Tensor) -> list[tuple[int, int]]:
    """Chunk roots of a 1-D contiguous uint8 tensor on its own device (a standalone byte string)."""
    if u8.numel() == 0:
        return []
    return _backends.backend_for(u8.device.type).chunk_roots_u8(u8)  # chosen once per device type (refit_verify.digest.backends)


def shard_chunk_roots(shard: torch.Tensor, *, byte_offset: int) -> list[tuple[int, int]]:
    """Chunk roots (both channels) of a shard that is a contiguous byte range of a larger tensor.

    Args:
        shard: the shard (any dtype, shape, strides; CPU or CUDA); its logical bytes are the bytes
            ``[byte_offset, byte_offset + nbytes)`` of the full tensor's logical bytes.
        byte_offset: where those bytes start in the full tensor; must be a multiple of
            :data:`CHUNK_BYTES` (8 MiB) unless the shard is empty. The caller also guarantees that
            the shard's length is a multiple of 8 MiB unless it ends the tensor
            (:func:`check_shard_layout` checks a whole layout).

    Returns:
        ``[(root_0, root_1), ...]``: one pair of 64-bit roots per chunk of the shard, in order
        (``ceil(nbytes / 8 MiB)`` pairs; ``[]`` for an empty shard).

    Raises:
        ShardLayoutError: ``byte_offset`` is negative or not on a chunk boundary.
    """
    u8 = logical_bytes(shard)
    if u8.numel() == 0:
        return []
    if byte_offset < 0 or byte_offset % CHUNK_BYTES:
        raise ShardLayoutError(f"byte_offset {byte_offset} is not a multiple of {CHUNK_BYTES} (8 MiB): the shard's "
                               f"chunk roots are not chunk roots of the full tensor")
    return _roots_u8(u8)


def _n_chunks(nbytes: int) -> int:
    return -(-nbytes // CHUNK_BYTES)


def combine_chunk_roots(roots_in_order: Sequence[tuple[int, int]], dtype: torch.dtype | str,
                        shape: Sequence[int], nbytes: int | None = None) -> str:
    """Chain chunk roots with the full tensor's seed and finalise (§7, §8): the full digest.

    Args:
        roots_in_order: every chunk's ``(root_0, root_1)`` of the full tensor, in chunk order
            (the concatenation of each shard's :func:`shard_chunk_roots`, in shard order).
        dtype: the full tensor's dtype (``torch.bfloat16`` or the spec name ``"bfloat16"``).
        shape: the full tensor's shape.
        nbytes: the full tensor's byte length (default: ``numel(shape) × itemsize``).

    Returns:
        str: 32 hex characters, equal to ``tensor_digest`` of the full tensor.

    Raises:
        ShardLayoutError: the number of roots is not ``ceil(nbytes / 8 MiB)``.
    """
    name = dtype if isinstance(dtype, str) else dtype_name(dtype)
    if nbytes is None:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        item = torch.empty((), dtype=dtype).element_size()
        nbytes = math.prod(int(d) for d in shape) * item
    roots = list(roots_in_order)
    if len(roots) != _n_chunks(nbytes):
        raise ShardLayoutError(f"{len(roots)} chunk roots for {nbytes} bytes, expected {_n_chunks(nbytes)}")
    seeds = _ref.seed(name, tuple(int(d) for d in shape), nbytes)
    return _ref.hexdigest(*_ref.chain_and_finalise(seeds, [(int(a) & _ref.MASK64, int(b) & _ref.MASK64) for a, b in roots]))


# ---------------------------------------------------------------------------------------------
# torch.distributed helper


@dataclass(frozen=True)
class ShardedDigest:
    """Outcome of :func:`sharded_digest` on one rank.

    Attributes:
        digest: the full tensor's digest on the digesting rank (``dst``), ``None`` on the others.
        path: ``"roots"`` (only chunk roots travelled, 16 bytes per 8 MiB) or ``"gather"`` (the
            shard rule did not hold: the shard bytes were gathered on ``dst`` and digested there).
        reason: why the gather fallback ran (``None`` on the roots path).
        bytes_gathered: bytes this call moved to ``dst`` in the fallback (0 on the roots path).
    """

    digest: str | None
    path: Literal["roots", "gather"]
    reason: str | None = None
    bytes_gathered: int = 0


def sharded_digest(shard: torch.Tensor, full_shape: Sequence[int], group=None, dst: int = 0, *,
                   fallback: Literal["gather", "raise"] = "gather") -> ShardedDigest:
    """Digest of a tensor split along dim 0 over the ranks of ``group``, evaluated where it lies.

    Collective: every rank of ``group`` calls it with its own shard, in rank order along dim 0
    (group rank 0 holds the first rows). One all-gather of each shard's metadata (a typed
    :class:`~refit_verify.wire.collective.ShardMeta`: dtype, shape) lets every rank check the layout and
    take the same path; then

    * **roots path** (the shard rule holds, :func:`check_shard_layout`): each rank computes the
      chunk roots of its rows on its own device, a gather of typed
      :class:`~refit_verify.wire.collective.ShardRoots` brings them to ``dst``, which chains them with
      the full tensor's seed (:func:`combine_chunk_roots`);
    * **gather path** (it does not, and ``fallback="gather"``): the shard bytes are padded to the
      largest shard and gathered on ``dst`` with ``torch.distributed.gather`` (on the shard's
      device: CUDA for NCCL), which digests the reassembled tensor. A WARNING names the reason.

    Args:
        shard: this rank's rows, shape ``[rows_i, *full_shape[1:]]``, the same dtype on every rank.
            With NCCL it must be a CUDA tensor on this rank's current device.
        full_shape: the full tensor's shape (``sum(rows_i) == full_shape[0]``).
        group: the process group (default: the world).
        dst: global rank that receives the digest.
        fallback: ``"gather"`` (default) or ``"raise"`` (:class:`ShardLayoutError` on every rank,
            before any data moved) when the shard rule does not hold.

    Returns:
        ShardedDigest: the digest on ``dst`` (``None`` elsewhere), the path taken and why.

    Raises:
        ShardLayoutError: shards disagree on dtype or trailing dims, their rows do not add up to
            ``full_shape[0]``, or the rule fails with ``fallback="raise"`` (raised on every rank).
        RefitProtocolError: a rank's metadata is malformed or oversized (on every rank), or its
            roots are malformed or not one per chunk of its rows (on ``dst``). Nothing a rank sends
            is unpickled (:mod:`refit_verify.wire.collective`).

    Waits are bounded by the process group's ``timeout`` (``init_process_group(timeout=...)``).
    """
    import torch.distributed as dist

    if fallback not in ("gather", "raise"):
        raise ValueError(f"fallback must be 'gather' or 'raise', got {fallback!r}")
    full_shape = tuple(int(d) for d in full_shape)
    if len(full_shape) == 0:
        raise ShardLayoutError("a 0-dim tensor cannot be sharded along dim 0")
    world = dist.get_world_size(group)
    me = dist.get_rank(group)
    is_dst = dist.get_rank() == dst
    group_dst = dst if group is None else dist.get_group_rank(group, dst)
    device = comm_device(group)
    name = dtype_name(shard.dtype)
    metas = all_gather_messages(ShardMeta(dtype=name, shape=[int(d) for d in shard.shape]), group=group, device=device,
                                decode=decode_shard_meta, max_bytes=MAX_SHARD_MESSAGE_BYTES, what="shard metadata")

    # Every rank runs the same checks on the same metadata, so all raise or all go on.
    for r, m in enumerate(metas):
        if m.dtype != name:
            raise ShardLayoutError(f"group rank {r} holds {m.dtype}, group rank {me} holds {name}")
        if len(m.shape) != len(full_shape) or tuple(m.shape[1:]) != full_shape[1:]:
            raise ShardLayoutError(f"group rank {r}'s shard has shape {list(m.shape)}, not [rows, *{list(full_shape[1:])}]")
    rows = [m.shape[0] for m in metas]
    if sum(rows) != full_shape[0]:
        raise ShardLayoutError(f"shards hold {sum(rows)} rows in all, full_shape[0] is {full_shape[0]}")
    row_bytes = math.prod(full_shape[1:]) * shard.element_size()
    nbytes = full_shape[0] * row_bytes
    ranges = dim0_byte_ranges(rows, row_bytes)
    reason = check_shard_layout(ranges, nbytes)

    if reason is None:
        roots = shard_chunk_roots(shard, byte_offset=ranges[me][0])
        mine = ShardRoots(roots=roots)
        gathered = gather_messages(None if is_dst else mine, group=group, dst=group_dst, device=device,
                                   decode=decode_shard_roots, max_bytes=MAX_SHARD_MESSAGE_BYTES, what="shard roots")
        if not is_dst:
            return ShardedDigest(None, "roots")
        gathered[group_dst] = mine
        for r, (part, (_, length)) in enumerate(zip(gathered, ranges)):
            if len(part.roots) != _n_chunks(length):
                raise RefitProtocolError(f"group rank {r} sent {len(part.roots)} chunk roots for its {length} bytes, "
                                         f"expected {_n_chunks(length)}")
        flat = [r for part in gathered for r in part.roots]
        return ShardedDigest(combine_chunk_roots(flat, name, full_shape, nbytes), "roots")

    if fallback == "raise":
        raise ShardLayoutError(f"shard rule does not hold: {reason}")
    if me == 0:
        logger.warning("sharded digest of %s %s falls back to gathering %d bytes on rank %d: %s",
                       name, list(full_shape), nbytes, dst, reason)
    u8 = logical_bytes(shard)
    longest = max(n for _, n in ranges)
    buf = torch.zeros(longest, dtype=torch.uint8, device=u8.device)
    buf[: u8.numel()].copy_(u8)
    parts = [torch.empty_like(buf) for _ in range(world)] if is_dst else None
    dist.gather(buf, parts, dst=dst, group=group)
    if not is_dst:
        return ShardedDigest(None, "gather", reason, 0)
    full_u8 = torch.cat([p[:n] for p, (_, n) in zip(parts, ranges)]) if nbytes else buf[:0]
    full = full_u8.view(shard.dtype).reshape(full_shape)
    return ShardedDigest(tensor_digest(full), "gather", reason, nbytes)


def digest_dim0_sharded(shard: torch.Tensor, full_shape: Sequence[int], group=None, dst: int = 0, *,
                        fallback: Literal["gather", "raise"] = "gather") -> str | None:
    """:func:`sharded_digest`, returning only the digest (on ``dst``; ``None`` on other ranks).

    Use :func:`sharded_digest` to learn whether the gather fallback ran.
    """
    return sharded_digest(shard, full_shape, group, dst, fallback=fallback).digest
