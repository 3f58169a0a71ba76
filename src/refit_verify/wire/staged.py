"""Typed, versioned wire messages of the refit protocol (msgpack through msgspec).

Every message is a tagged, array-like :class:`msgspec.Struct`; the first array element is the tag
(``"hello"``, ``"buffer"``, ``"complete"``, ``"abort"``, ``"welcome"``, ``"ack"``, ``"done"``,
``"reject"``). Requests travel sender → receiver (:data:`Request`), replies receiver → sender
(:data:`Reply`). Bytes read from a
socket are only ever decoded by :func:`decode_request` / :func:`decode_reply`, which accept exactly
one message of the expected union and nothing else: nothing is ever unpickled.

See ``docs/protocol.md`` for the sequence and invariants.
"""

from __future__ import annotations

from typing import Annotated, Union

import msgspec

from refit_verify.manifest import SessionManifest
from refit_verify.wire.fields import (
    MAX_ALIGNMENT,
    MAX_MESSAGE_BYTES,
    MAX_NDIM,
    MIN_ALIGNMENT,
    STRUCT_OPTS,
    Blob,
    DigestEntry,
    DType,
    Entry,
    Name,
    NonNeg,
    Shape,
    Text,
    decode_message,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ShmHandle",
    "CudaIpcHandle",
    "Hello",
    "Buffer",
    "DigestBuffer",
    "Complete",
    "Abort",
    "Welcome",
    "Ack",
    "Done",
    "CheckedDone",
    "Reject",
    "Request",
    "Reply",
    "decode_request",
    "decode_reply",
]

PROTOCOL_VERSION = 3
"""Version carried by :class:`Hello`; a receiver rejects any other value.

History: 1 — ``Hello(protocol, refit_id, mode)`` answered by ``Ack(-1)``. 2 — ``Hello`` also carries
the alignment and is answered by :class:`Welcome` (mode agreement); :class:`Abort`; ``Done.rejected``.
3 — in a verifying refit the sender's digests travel ahead of the bytes (:class:`DigestBuffer`,
:class:`DigestEntry`) and the receiver checks each tensor before loading it; the answer is
:class:`CheckedDone` (which parameters hold the new version, which kept the previous one). An
``off`` refit sends exactly the version-2 messages (only ``Hello.protocol`` differs). A receiver of
another version answers ``Reject``, which the sender turns into an error naming both versions."""

ABORT_SEQ = -2
"""``Ack.seq`` of the reply to :class:`Abort`."""


class ShmHandle(msgspec.Struct, tag="shm", **STRUCT_OPTS):
    """A CPU staging buffer: a POSIX shared-memory object (``/dev/shm/<name>``) of ``nbytes`` bytes."""

    name: Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,200}$")]
    nbytes: Annotated[int, msgspec.Meta(gt=0)]


class CudaIpcHandle(msgspec.Struct, tag="cuda_ipc", **STRUCT_OPTS):
    """A CUDA staging buffer: the fields of ``torch.multiprocessing.reductions.reduce_tensor(t)[1]``
    needed by ``rebuild_cuda_tensor`` (class arguments and ``requires_grad`` are implied).

    Attributes:
        handle: CUDA IPC memory handle of the allocation holding the storage (bytes).
        storage_size_bytes: size of the storage, bytes.
        storage_offset_bytes: offset of the storage inside the allocation, bytes.
        dtype: dtype name of the exported tensor (always ``"uint8"`` for staging buffers).
        size, stride: the exported tensor's size and stride (``[n]`` and ``[1]``).
        tensor_offset: the exported tensor's storage offset, in elements.
        ref_counter_handle, ref_counter_offset: torch's shared IPC reference counter slot.
        event_handle, event_sync_required: CUDA IPC event the consumer waits on, if required.
        device: the sender's device index; informational only, the receiver rebuilds on its own.
    """

    handle: Blob
    storage_size_bytes: NonNeg
    storage_offset_bytes: NonNeg
    dtype: DType
    size: Shape
    stride: Annotated[list[int], msgspec.Meta(max_length=MAX_NDIM)]
    tensor_offset: NonNeg
    ref_counter_handle: Blob
    ref_counter_offset: NonNeg
    event_handle: Blob | None
    event_sync_required: bool
    device: NonNeg


class Hello(msgspec.Struct, tag="hello", **STRUCT_OPTS):
    """First request of every refit. Reply: :class:`Welcome` or ``Reject``.

    Attributes:
        protocol: :data:`PROTOCOL_VERSION` of the sender.
        refit_id: random id of this refit (32 hex characters from the sender).
        mode: the sender's requested :class:`~refit_verify.config.VerifyMode` value.
        alignment: byte alignment of every entry offset (a power of two, 16..2**20); the receiver
            validates offsets against it (no receiver-side setting to keep in sync).
        producer_rank, producer_device: the sender's trainer rank and staging device, when it has
            one (``RefitSender(rank=)``): the worker records them in its session manifest, so a
            worker that received another producer's payload is named.
        version: the weight version of this refit (the trainer's step, an int >= 0), or None
            (unversioned). A vLLM worker opens its session with it: a version not newer than one the
            worker already closed is reported as stale (:meth:`WorkerBoundary.open
            <refit_verify.boundary.worker.WorkerBoundary.open>`). Optional and last: a Hello without
            it decodes as unversioned.
    """

    protocol: int
    refit_id: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    mode: Annotated[str, msgspec.Meta(max_length=16)]
    alignment: Annotated[int, msgspec.Meta(ge=MIN_ALIGNMENT, le=MAX_ALIGNMENT)]
    producer_rank: Annotated[int, msgspec.Meta(ge=0)] | None = None
    producer_device: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    version: Annotated[int, msgspec.Meta(ge=0)] | None = None


class Welcome(msgspec.Struct, tag="welcome", **STRUCT_OPTS):
    """Reply to ``Hello``: the mode agreement.

    Attributes:
        protocol: the receiver's :data:`PROTOCOL_VERSION`.
        mode: the mode the receiver will run this refit in: the requested one, or ``"off"`` when it
            cannot verify (then ``reason`` says why). Never a verifying mode when ``"off"`` was requested.
        reason: why ``mode`` differs from the request, else ``None``.
    """

    protocol: int
    mode: Annotated[str, msgspec.Meta(max_length=16)]
    reason: Annotated[str, msgspec.Meta(max_length=4096)] | None


class Buffer(msgspec.Struct, tag="buffer", **STRUCT_OPTS):
    """One staging buffer ready to read. Reply: ``Ack(seq)`` (always, also after a receiver error).

    Attributes:
        seq: 0, 1, 2… in send order within a refit.
        handle: where the bytes are.
        entries: tensors in ascending offset order, offsets re-derivable from the entries alone.
        used_bytes: aligned total, ``sum(round_up(e.nbytes, alignment))``.
    """

    seq: NonNeg
    handle: Union[ShmHandle, CudaIpcHandle]
    entries: list[Entry]
    used_bytes: NonNeg


class DigestBuffer(Buffer, tag="buffer_digests"):
    """A :class:`Buffer` of a verifying refit (``log`` / ``enforce``): each entry carries the
    sender's digest (:class:`DigestEntry`), so the receiver checks every tensor **before** it is
    loaded. ``off`` refits send plain :class:`Buffer` messages (the wire of protocol 2)."""

    entries: list[DigestEntry]


class Complete(msgspec.Struct, tag="complete", **STRUCT_OPTS):
    """Last request of a refit: ``n_tensors`` entries were sent in total. Reply: ``Done``."""

    n_tensors: NonNeg


class Abort(msgspec.Struct, tag="abort", **STRUCT_OPTS):
    """The sender gives up on the current refit (an exception on its side, a failed mode agreement).
    Reply: ``Ack(seq=ABORT_SEQ)``; the receiver then raises
    :class:`~refit_verify.errors.RefitAbortedError` at once instead of waiting for its timeout."""

    reason: Text


class Ack(msgspec.Struct, tag="ack", **STRUCT_OPTS):
    """Reply to ``Buffer(seq)`` (all receiver work reading that buffer is finished) or, with
    ``seq=ABORT_SEQ`` (-2), to ``Abort``."""

    seq: Annotated[int, msgspec.Meta(ge=ABORT_SEQ)]


class Done(msgspec.Struct, tag="done", **STRUCT_OPTS):
    """Reply to ``Complete``.

    Attributes:
        manifest: ``{name: 32-hex digest}`` of every staged slice the receiver saw, or ``None``
            when the refit's mode is ``off``.
        error: receiver-side errors of this refit that name no entry (``load`` raised, a count
            mismatch in ``off`` mode), or ``None``.
        rejected: ``{name: reason}`` of entries the receiver refused (bad layout, name sent twice,
            past ``used_bytes``, unreadable buffer): not loaded, not in ``manifest``; ``None`` if none.
        tensors: entries accepted. bytes: their exact bytes (padding excluded).
        digest_s: seconds the receiver spent in digest code.
        session: the worker's model-boundary session manifest, when the receiver loads into a vLLM
            model (its digests are then ``manifest``; coverage and read-back travel here).
    """

    manifest: dict[Name, Annotated[str, msgspec.Meta(max_length=128)]] | None
    error: Text | None
    rejected: dict[Name, Annotated[str, msgspec.Meta(max_length=1024)]] | None
    tensors: NonNeg
    bytes: NonNeg
    digest_s: float
    session: SessionManifest | None = None


class CheckedDone(Done, tag="checked_done"):
    """The :class:`Done` of a verifying refit: also what the receiver's engine holds now.

    Attributes:
        landed: the parameters this refit wrote (a vLLM worker: engine parameter names, fused and
            sharded as vLLM stores them; a plain receiver: the names handed to ``load``).
        kept: ``{parameter: why}`` of parameters that still hold the previous version because a
            tensor meant for them was refused before loading (its digest differs from the
            sender's), or a fused sibling was (its parts land together or not at all).
    """

    landed: list[Name] = []
    kept: dict[Name, Annotated[str, msgspec.Meta(max_length=1024)]] = {}


class Reject(msgspec.Struct, tag="reject", **STRUCT_OPTS):
    """Reply to a request the receiver cannot accept (undecodable, out of order, wrong version)."""

    reason: Text


Request = Union[Hello, Buffer, DigestBuffer, Complete, Abort]
Reply = Union[Welcome, Ack, Done, CheckedDone, Reject]

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)



def decode_request(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Request:
    """Decode one request (``Hello | Buffer | Complete | Abort``).

    Raises:
        RefitProtocolError: ``data`` is longer than ``max_bytes``, or is not exactly one valid
            request (a pickle, garbage, a reply, truncated or trailing bytes, a field out of range).
    """
    return decode_message(_request_decoder, data, "request", max_bytes)


def decode_reply(data: bytes | bytearray | memoryview, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Reply:
    """Decode one reply (``Welcome | Ack | Done | Reject``).

    Raises:
        RefitProtocolError: as :func:`decode_request`.
    """
    return decode_message(_reply_decoder, data, "reply", max_bytes)


