"""What every message on the wire is built from: bounded field types, limits, the tensor ``Entry``,
and one encoder and decoder loop (msgpack through msgspec; nothing is ever unpickled).

Limits are in bytes, names in characters.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
import torch

from refit_verify.errors import RefitProtocolError

__all__ = ["MAX_ALIGNMENT", "MAX_ENTRIES_BYTES", "MAX_MESSAGE_BYTES", "MAX_NAME_BYTES", "MAX_NDIM", "MIN_ALIGNMENT", "STRUCT_OPTS", "Blob",
           "DType", "Digest", "DigestEntry", "Entry", "Name", "NonNeg", "Shape", "Text", "decode_message", "encode", "torch_dtype"]


MIN_ALIGNMENT = 16


MAX_ALIGNMENT = 1 << 20


MAX_MESSAGE_BYTES = 64 << 20
"""Largest encoded message accepted by the decoders, in bytes (64 MiB).

Large enough for a ``Done`` manifest of a few hundred thousand tensors (a DeepSeek-V3-sized MoE
state dict with FP8 scales is ~90k names, ~8 MB); the sender also cuts a ``Buffer`` message well
below this size (:data:`MAX_ENTRIES_BYTES`)."""


MAX_ENTRIES_BYTES = MAX_MESSAGE_BYTES // 4
"""Estimated encoded size (bytes) of a ``Buffer``'s entry list at which the sender cuts a group."""


MAX_NAME_BYTES = 4096
"""Longest tensor name accepted on the wire, in characters."""


MAX_NDIM = 64


NonNeg = Annotated[int, msgspec.Meta(ge=0)]


Name = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_BYTES)]


DType = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[a-z][a-z0-9_]*$")]


Shape = Annotated[list[NonNeg], msgspec.Meta(max_length=MAX_NDIM)]


Text = Annotated[str, msgspec.Meta(max_length=1 << 16)]


Blob = Annotated[bytes, msgspec.Meta(max_length=1 << 12)]


STRUCT_OPTS = dict(frozen=True, array_like=True, forbid_unknown_fields=True)


class Entry(msgspec.Struct, **STRUCT_OPTS):
    """One tensor inside a staging buffer.

    Attributes:
        name: wire name (the sender's state-dict key), 1..4096 characters.
        dtype: :func:`refit_verify.digest.tensors.dtype_name` of the tensor (``"bfloat16"``, ``"bool"``…).
        shape: logical shape; ``[]`` for a 0-dim tensor.
        offset: byte offset of the tensor's first byte in the buffer (a multiple of the alignment).
        nbytes: exact byte length, ``numel × itemsize`` (padding excluded).
    """

    name: Name
    dtype: DType
    shape: Shape
    offset: NonNeg
    nbytes: NonNeg


Digest = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{32}$")]


class DigestEntry(Entry, **STRUCT_OPTS):
    """An :class:`Entry` of a verifying refit, carrying the sender's digest of the tensor.

    Attributes:
        digest: the sender's 32-hex digest of the tensor (``refit_verify.tensor_digest``), taken
            before packing; the receiver compares the bytes it is about to load with it. ``None``
            (an entry the sender did not digest) is refused in ``enforce``.
    """

    digest: Digest | None = None


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    """Encode one message (of this module or :mod:`refit_verify.wire.collective`) to msgpack bytes."""
    return _encoder.encode(msg)


def decode_message(decoder: msgspec.msgpack.Decoder, data: bytes | bytearray | memoryview, what: str, max_bytes: int):
    """Decode ``data`` with ``decoder`` (a typed msgspec decoder), at most ``max_bytes`` long.

    Raises:
        RefitProtocolError: ``data`` is longer than ``max_bytes``, or is not exactly one valid
            message of the decoder's type (a pickle, garbage, truncated or trailing bytes, a
            message of another direction, an unknown tag, a field out of range). Nothing is
            unpickled and no type named by the data is built.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RefitProtocolError(f"undecodable {what}: expected bytes, got {type(data).__name__}")
    n = len(data) if not isinstance(data, memoryview) else data.nbytes
    if n > max_bytes:
        raise RefitProtocolError(f"{what} of {n} bytes exceeds the {max_bytes}-byte limit")
    try:
        return decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        head = bytes(data[:16]).hex()
        raise RefitProtocolError(f"undecodable {what} ({n} bytes, starts {head}): {e}") from None


def torch_dtype(name: str) -> torch.dtype:
    """Map a wire dtype name back to a ``torch.dtype`` (``"bfloat16"`` → ``torch.bfloat16``).

    Raises:
        RefitProtocolError: ``name`` is not the name of a real torch dtype.
    """
    if not isinstance(name, str) or not name or name.startswith("_"):
        raise RefitProtocolError(f"unknown dtype {name!r}")
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise RefitProtocolError(f"unknown dtype {name!r}")
    return d
