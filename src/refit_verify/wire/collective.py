"""Typed messages over ``torch.distributed`` collectives: the broadcast path and the sharded digest.

Nothing a peer of a process group sends is unpickled. Every control message is a tagged, array-like
:class:`msgspec.Struct` encoded with msgpack and moved as a ``uint8`` tensor, **length first**: an
``int64[1]`` tensor with the byte count, then the bytes. A receiving rank checks the announced
length against the message kind's bound before it allocates anything, and decodes the bytes only
into the union expected in that direction (:func:`refit_verify.wire.staged.decode_message`): a pickle,
garbage, a wrong tag, a message of the other direction or valid msgpack of the wrong shape raises
:class:`~refit_verify.errors.RefitProtocolError`.

Directions (one union each):

* broadcast, sender → receivers (:data:`BroadcastMessage`, by ``broadcast``): :class:`BroadcastHello`,
  :class:`Bucket`, :class:`BroadcastComplete`, :class:`BroadcastAbort`;
* broadcast, receivers → sender (by ``gather``): :class:`RankReport`;
* sharded digest, every rank → every rank (by ``all_gather``): :class:`ShardMeta`; every rank →
  the digesting rank (by ``gather``): :class:`ShardRoots`.

For ``gather`` / ``all_gather`` every rank first learns every rank's length (``all_gather`` of the
counts), so all ranks refuse an oversized message together and nobody waits on a half-finished
exchange; the bytes then travel padded to the longest. See ``docs/protocol.md`` (broadcast path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, TypeVar, Union

import msgspec
import torch

from refit_verify.errors import RefitProtocolError
from refit_verify.wire.fields import (
    MAX_ALIGNMENT,
    MAX_MESSAGE_BYTES,
    MIN_ALIGNMENT,
    STRUCT_OPTS,
    DType,
    Entry,
    Name,
    NonNeg,
    Shape,
    Text,
    decode_message,
    encode,
)

__all__ = [
    "BROADCAST_PROTOCOL", "MAX_SHARD_ROOTS", "MAX_SHARD_MESSAGE_BYTES", "BroadcastAbort", "BroadcastComplete",
    "BroadcastHello", "BroadcastMessage", "Bucket", "RankReport", "ShardMeta", "ShardRoots", "all_gather_messages",
    "broadcast_message", "comm_device", "decode_broadcast", "decode_rank_report", "decode_shard_meta",
    "decode_shard_roots", "gather_messages",
]

BROADCAST_PROTOCOL = 2
"""Version carried by :class:`BroadcastHello`. History: 1 — pickled dicts (``broadcast_object_list``,
``gather_object``). 2 — the typed messages of this module."""

MAX_SHARD_ROOTS = 1 << 20
"""Most chunk roots one rank may send for one shard (8 TiB of shard at 8 MiB per chunk)."""
MAX_SHARD_MESSAGE_BYTES = 32 << 20
"""Largest encoded sharded-digest message, bytes (a full :class:`ShardRoots` is ~20 MiB)."""

_U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack integers end at 2**64 - 1
_Mode = Literal["off", "log", "enforce"]
Digest = Annotated[str, msgspec.Meta(max_length=128)]


class BroadcastHello(msgspec.Struct, tag="broadcast_hello", **STRUCT_OPTS):
    """First message of a broadcast refit (sender → receivers).

    Attributes:
        protocol: :data:`BROADCAST_PROTOCOL`. refit_id: the refit's id (32 hex).
        mode: the sender's mode; receivers verify iff it is not ``"off"``.
        alignment: byte alignment of every slot in a bucket (power of two, 16..2**20).
        version: the weight version (the trainer's step, an int >= 0), or None (unversioned); a vLLM
            worker opens its session with it and reports a version not newer than one it already
            closed as stale. Optional and last: a header without it decodes as unversioned.
    """

    protocol: int
    refit_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    mode: _Mode
    alignment: Annotated[int, msgspec.Meta(ge=MIN_ALIGNMENT, le=MAX_ALIGNMENT)]
    version: Annotated[int, msgspec.Meta(ge=0)] | None = None

    def __post_init__(self) -> None:  # a ValueError here is a decode error (msgspec)
        if self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment {self.alignment} is not a power of two")


class Bucket(msgspec.Struct, tag="bucket", **STRUCT_OPTS):
    """One bucket's layout (sender → receivers); its ``used_bytes`` bytes follow as one broadcast.

    Attributes:
        seq: 0, 1, 2… in send order. entries: tensors at ascending aligned offsets.
        used_bytes: bytes broadcast next: the aligned total, or (one oversized tensor, broadcast
            from its own bytes) its exact size.
    """

    seq: NonNeg
    entries: list[Entry]
    used_bytes: NonNeg


class BroadcastComplete(msgspec.Struct, tag="broadcast_complete", **STRUCT_OPTS):
    """Last message of a refit (sender → receivers): ``n_tensors`` entries were sent in total."""

    n_tensors: NonNeg


class BroadcastAbort(msgspec.Struct, tag="broadcast_abort", **STRUCT_OPTS):
    """The sender gives up on the refit (its exception); receivers raise ``RefitAbortedError``."""

    reason: Text


class RankReport(msgspec.Struct, tag="rank_report", **STRUCT_OPTS):
    """One receiver's answer (receivers → sender, gathered after :class:`BroadcastComplete`).

    Attributes:
        rank: the receiver's label in reports (default its rank within the group).
        manifest: ``{name: 32-hex}`` of every accepted entry, ``None`` in ``off`` mode.
        error: errors that name no entry (``load`` raised, a count mismatch in ``off`` mode), or ``None``.
        rejected: ``{name: reason}`` of refused entries, or ``None``.
        tensors / bytes: entries accepted and their exact bytes. digest_s: seconds in digest code.
        stale: why the receiver's session is out of order (a vLLM worker that already closed this
            version or a newer one: :attr:`SessionManifest.stale <refit_verify.manifest.SessionManifest.stale>`),
            or None. Optional and last.
    """

    rank: int
    manifest: dict[Name, Digest] | None
    error: Text | None
    rejected: dict[Name, Annotated[str, msgspec.Meta(max_length=1024)]] | None
    tensors: NonNeg
    bytes: NonNeg
    digest_s: float
    stale: Text | None = None


class ShardMeta(msgspec.Struct, tag="shard_meta", **STRUCT_OPTS):
    """One rank's shard metadata (every rank → every rank): dtype name and shape."""

    dtype: DType
    shape: Shape


class ShardRoots(msgspec.Struct, tag="shard_roots", **STRUCT_OPTS):
    """One rank's chunk roots ``[(root_0, root_1), ...]`` (every rank → the digesting rank)."""

    roots: Annotated[list[tuple[_U64, _U64]], msgspec.Meta(max_length=MAX_SHARD_ROOTS)]


BroadcastMessage = Union[BroadcastHello, Bucket, BroadcastComplete, BroadcastAbort]

_broadcast_decoder = msgspec.msgpack.Decoder(BroadcastMessage)
_report_decoder = msgspec.msgpack.Decoder(RankReport)
_meta_decoder = msgspec.msgpack.Decoder(ShardMeta)
_roots_decoder = msgspec.msgpack.Decoder(ShardRoots)


def decode_broadcast(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> BroadcastMessage:
    """Decode one sender → receivers broadcast message. Raises: RefitProtocolError (anything else)."""
    return decode_message(_broadcast_decoder, data, "broadcast message", max_bytes)


def decode_rank_report(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> RankReport:
    """Decode one receiver's :class:`RankReport`. Raises: RefitProtocolError (anything else)."""
    return decode_message(_report_decoder, data, "rank report", max_bytes)


def decode_shard_meta(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_SHARD_MESSAGE_BYTES) -> ShardMeta:
    """Decode one :class:`ShardMeta`. Raises: RefitProtocolError (anything else)."""
    return decode_message(_meta_decoder, data, "shard metadata", max_bytes)


def decode_shard_roots(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_SHARD_MESSAGE_BYTES) -> ShardRoots:
    """Decode one :class:`ShardRoots`. Raises: RefitProtocolError (anything else)."""
    return decode_message(_roots_decoder, data, "shard roots", max_bytes)


# ------------------------------------------------------------------------------ framing over collectives

M = TypeVar("M")
Run = Callable[..., Any]
"""``run(what, fn, *args, **kwargs)``: runs one collective (the broadcast path maps timeouts there)."""


def _direct(what: str, fn, *args, **kwargs):
    return fn(*args, **kwargs)


def _dist():
    import torch.distributed as dist

    return dist


def group_rank(group) -> int:
    """This process's rank within ``group`` (``None``: the default world)."""
    return _dist().get_rank() if group is None else group.rank()


def group_size(group) -> int:
    """Number of ranks of ``group`` (``None``: the default world)."""
    return _dist().get_world_size() if group is None else group.size()


def comm_device(group) -> torch.device:
    """Device of the bytes a collective of ``group`` moves: the current CUDA device for NCCL, else CPU."""
    dist = _dist()
    try:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
    except ValueError:
        # ``get_backend`` reads torch's global group map, which an unregistered (stateless) group is
        # not in; ask the group itself which devices its backends serve (torch's object collectives
        # pick their device the same way, ``_get_object_coll_device``).
        nccl = any(d.type == "cuda" for d in group._device_types)
    if nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _to_tensor(data: bytes, n: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(n, dtype=torch.uint8)
    if data:
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf.to(device)


def _bytes_of(t: torch.Tensor, n: int) -> memoryview:
    return memoryview(t[:n].cpu().numpy())


def broadcast_message(msg: msgspec.Struct | None, *, group, src: int, device: torch.device, decode: Callable[[memoryview], M],
                      max_bytes: int, what: str, run: Run = _direct) -> M:
    """Broadcast one message from group rank ``src``: its length (``int64[1]``), then its bytes.

    Args:
        msg: the message on ``src`` (ignored elsewhere). group: the process group (``None``: world).
        src: the sender's rank within ``group``. device: where the tensors live (CUDA for NCCL).
        decode: the receivers' typed decoder. max_bytes: the bound on the announced length.
        what: the message's name in errors. run: runs each collective.

    Returns:
        the message: ``msg`` on ``src``, the decoded one elsewhere.

    Raises:
        RefitProtocolError: on ``src``, ``msg`` encodes to more than ``max_bytes``; elsewhere, the
            announced length is not in ``1..max_bytes`` (nothing allocated) or the bytes are not one
            valid message of the expected union.
    """
    dist = _dist()
    if group_rank(group) == src:
        data = encode(msg)
        if len(data) > max_bytes:
            raise RefitProtocolError(f"{what}: {len(data)} bytes encoded, more than the {max_bytes}-byte limit")
        run(what, dist.broadcast, torch.tensor([len(data)], dtype=torch.int64, device=device), group_src=src, group=group)
        run(f"{what} (bytes)", dist.broadcast, _to_tensor(data, len(data), device), group_src=src, group=group)
        return msg
    n = torch.zeros(1, dtype=torch.int64, device=device)
    run(what, dist.broadcast, n, group_src=src, group=group)
    length = int(n.item())
    if not 0 < length <= max_bytes:
        raise RefitProtocolError(f"{what}: the sender announced {length} bytes; accepted 1..{max_bytes} (nothing allocated)")
    buf = torch.empty(length, dtype=torch.uint8, device=device)
    run(f"{what} (bytes)", dist.broadcast, buf, group_src=src, group=group)
    return decode(_bytes_of(buf, length))


def _lengths(n: int, *, group, world: int, device: torch.device, max_bytes: int, what: str, run: Run) -> list[int]:
    """Every rank's message length (``all_gather``); the same check, and error, on every rank."""
    dist = _dist()
    out = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    run(what, dist.all_gather, out, torch.tensor([n], dtype=torch.int64, device=device), group=group)
    lengths = [int(x.item()) for x in out]
    bad = {r: k for r, k in enumerate(lengths) if not 0 <= k <= max_bytes}
    if bad:
        raise RefitProtocolError(f"{what}: group ranks announced out-of-range lengths {bad} (accepted 0..{max_bytes} bytes; "
                                 "nothing allocated)")
    return lengths


def gather_messages(msg: msgspec.Struct | None, *, group, dst: int, device: torch.device, decode: Callable[[memoryview], M],
                    max_bytes: int, what: str, run: Run = _direct) -> list[M | None] | None:
    """Gather one message per rank on group rank ``dst`` (``dst`` itself sends none: ``msg=None``).

    Returns:
        on ``dst``: one decoded message per group rank (``None`` at ``dst``'s own place); elsewhere ``None``.

    Raises:
        RefitProtocolError: on every rank, a rank announced more than ``max_bytes`` (before any
            bytes move); on ``dst``, a rank's bytes are not one valid message (the error names it).
    """
    dist = _dist()
    world, me = group_size(group), group_rank(group)
    data = b"" if msg is None else encode(msg)
    lengths = _lengths(len(data), group=group, world=world, device=device, max_bytes=max_bytes, what=what, run=run)
    longest = max(lengths)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if me == dst else None
    if longest:  # every rank knows the lengths: all skip an empty gather alike
        run(f"{what} (bytes)", dist.gather, _to_tensor(data, longest, device), parts, group_dst=dst, group=group)
    if me != dst:
        return None
    out: list[M | None] = []
    for r, (p, n) in enumerate(zip(parts, lengths)):
        if r == dst:
            out.append(None)
            continue
        try:
            out.append(decode(_bytes_of(p, n)))
        except RefitProtocolError as e:
            raise RefitProtocolError(f"group rank {r}: {e}") from None
    return out


def all_gather_messages(msg: msgspec.Struct, *, group, device: torch.device, decode: Callable[[memoryview], M],
                        max_bytes: int, what: str, run: Run = _direct) -> list[M]:
    """Every rank's message on every rank, in group rank order.

    Raises:
        RefitProtocolError: on every rank alike, a rank announced more than ``max_bytes`` or sent
            bytes that are not one valid message (the error names the rank).
    """
    dist = _dist()
    world = group_size(group)
    data = encode(msg)
    lengths = _lengths(len(data), group=group, world=world, device=device, max_bytes=max_bytes, what=what, run=run)
    longest = max(lengths)
    parts = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    run(f"{what} (bytes)", dist.all_gather, parts, _to_tensor(data, longest, device), group=group)
    out = []
    for r, (p, n) in enumerate(zip(parts, lengths)):
        try:
            out.append(decode(_bytes_of(p, n)))
        except RefitProtocolError as e:
            raise RefitProtocolError(f"group rank {r}: {e}") from None
    return out
