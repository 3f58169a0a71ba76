"""What both halves of the stream share: checked ``(name, tensor)`` items, the slot layout, and the
types and limits both transports use.

Offsets and sizes are in bytes; an entry's cost is the bytes its description takes in a message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import add, attrgetter, gt, mul
from typing import NamedTuple, TypedDict

import torch

from refit_verify.config import VerifyMode
from refit_verify.digest.tensors import IS_META, PLAIN_SET, check_tensor
from refit_verify.errors import RefitInputError
from refit_verify.wire.fields import MAX_NAME_BYTES

__all__ = ["MAX_ERROR_CHARS", "Batch", "LoadFn", "Slot", "StreamResult", "StreamStats", "check_items", "checked_item", "entry_cost",
           "round_up"]

_IS_NESTED, _IS_QUANTIZED, _LAYOUT, _NBYTES = attrgetter("is_nested"), attrgetter("is_quantized"), attrgetter("layout"), attrgetter("nbytes")


Batch = list[tuple[str, torch.Tensor]]
"""What ``load`` receives: ``(wire name, tensor view of the group's bytes)`` in message order."""


LoadFn = Callable[[Batch], None]
"""A receiver's ``load(batch)``: called once per group; must copy what it keeps."""


MAX_ERROR_CHARS = 8192
"""Longest error text a receiver sends back (characters)."""


MAX_REASON_CHARS = 1000
"""Longest reason recorded for one rejected entry (characters)."""


SENT_TWICE = "sent twice in one refit"


def round_up(n: int, a: int) -> int:
    """Return ``n`` rounded up to a multiple of ``a`` (bytes)."""
    return (n + a - 1) // a * a


def entry_cost(name: str, dtype: str, ndim: int) -> int:
    """Upper estimate of one :class:`~refit_verify.wire.staged.Entry`'s msgpack size, bytes."""
    return len(name.encode()) + len(dtype) + 9 * ndim + 32


def checked_item(item: tuple[str, torch.Tensor], seen: set[str]) -> tuple[str, torch.Tensor]:
    """Validate one ``(name, tensor)`` of a refit stream and record its name in ``seen``.

    Raises:
        RefitInputError (a ``TypeError`` and a ``ValueError``): the item is not a ``(name, tensor)``
            pair, the name is not a str of 1..MAX_NAME_BYTES characters or was given before, or the
            tensor is not a ``torch.Tensor``.
    """
    try:
        name, t = item
    except (TypeError, ValueError):
        size = f" of {len(item)} items" if isinstance(item, (tuple, list)) else ""
        raise RefitInputError(f"each item of a refit must be a (name, tensor) pair, got {type(item).__name__}{size}") from None
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_BYTES:
        raise RefitInputError(f"tensor names must be str of 1..{MAX_NAME_BYTES} characters, got {name!r:.100}")
    if not isinstance(t, torch.Tensor):
        raise RefitInputError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if name in seen:
        raise RefitInputError(f"{name}: given twice in one refit (wire names must be unique)")
    seen.add(name)
    return name, t


_STRIDED_ONLY = frozenset((torch.strided,))


def _plain_items(items: Sequence) -> bool:
    """True iff every item is a ``(name, tensor)`` tuple with a unique str name of 1..MAX_NAME_BYTES
    characters and a plain contiguous tensor the digest can read (``torch.Tensor`` /
    ``nn.Parameter``, dense strided, not nested, quantized, meta or a ZeroTensor, at most 255
    dimensions, every element inside its storage): C-level passes over the list, no Python step per
    item (about 0.2 ms for 310 tensors on a CPU host). False means only "not all of the plain
    kinds": :func:`check_items` then checks them one by one."""
    if not items:
        return True
    if set(map(type, items)) != {tuple} or set(map(len, items)) != {2}:
        return False
    names, ts = zip(*items)
    if set(map(type, names)) != {str} or len(set(names)) != len(names):
        return False
    lengths = list(map(len, names))
    if min(lengths) < 1 or max(lengths) > MAX_NAME_BYTES or not set(map(type, ts)) <= PLAIN_SET:
        return False
    if (any(map(_IS_NESTED, ts)) or any(map(_IS_QUANTIZED, ts)) or any(map(IS_META, ts))
            or set(map(_LAYOUT, ts)) != _STRIDED_ONLY or any(map(torch.Tensor._is_zerotensor, ts))
            or max(map(torch.Tensor.dim, ts)) > 255 or not all(map(torch.Tensor.is_contiguous, ts))):
        return False
    # every element inside its storage (none freed or shrunk under its tensor, as FSDP does after a gather)
    spans = (map(add, map(mul, map(torch.Tensor.storage_offset, ts), map(torch.Tensor.element_size, ts)), map(_NBYTES, ts))
             if any(map(torch.Tensor.storage_offset, ts)) else map(_NBYTES, ts))  # parameters: each at offset 0
    return not any(map(gt, spans, map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, ts))))


def check_items(items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Validate every ``(name, tensor)`` of a refit given as a list, before any of it is sent: what
    :func:`checked_item` and the digest's own checks (:func:`~refit_verify.digest.tensors.check_tensor`) would find
    item by item, in C-level passes over the list when every item is of the plain kinds (the common
    case: a trainer's contiguous parameters), else item by item.

    Raises:
        RefitInputError (a ``TypeError`` and a ``ValueError``): the first bad item: not a ``(name,
            tensor)`` pair, a bad or repeated name, a tensor the digest cannot read (sparse, nested,
            quantized, meta, its storage freed or shrunk under it).
    """
    if _plain_items(items):
        return
    seen: set[str] = set()
    for item in items:
        check_tensor(checked_item(item, seen)[1])


class StreamStats(TypedDict):
    """Numbers of a sender's last refit, common to both transports (a plain dict:
    ``sender.last_stats["digest_s"]``).

    Keys:
        refit_id: the refit's id (32 hex). mode: the mode it ran in (agreed at the handshake).
        tensors: tensors sent. bytes: their exact bytes (padding excluded).
        digest_s: seconds the sender spent in digest code (0.0 in ``off`` mode); on CUDA this
            includes waiting for earlier queued work at the synchronisation points, and the copy
            of the CUDA tensors packed into groups (their copy and digest are one op, launched
            with the group's digests and waited for before the group is sent).
        digest_shadow_s: of ``digest_s``, the seconds spent after the first group was sent, while
            the receivers check and load it (a refit given as a list: the digests of every tensor
            the first group could not hold, except those copied and digested by the fused op as
            they are packed; off the refit's critical path unless the receivers
            finish that group first; after an oversized first tensor sent alone: while the
            receivers read it, before the sender waits for their acknowledgement).
        wall_s: seconds from the first message to the receivers' answer.
        receiver_digest_s: the receivers' digest seconds (the largest, with several receivers).
    """

    refit_id: str
    mode: str
    tensors: int
    bytes: int
    digest_s: float
    digest_shadow_s: float
    wall_s: float
    receiver_digest_s: float


@dataclass(kw_only=True)
class StreamResult:
    """Outcome of one receive, common to both transports.

    Attributes:
        manifest: ``{name: 32-hex digest}`` of every accepted entry (``None`` when the agreed mode
            is ``off``). tensors: entries accepted. bytes: their exact bytes. digest_s: seconds in
            digest code. refit_id: the sender's refit id. mode: the agreed mode.
        error: errors recorded during the refit that name no entry (also sent to the sender), or ``None``.
        rejected: ``{name: reason}`` of refused entries (also sent to the sender).
    """

    manifest: dict[str, str] | None
    tensors: int
    bytes: int
    digest_s: float
    refit_id: str = ""
    mode: VerifyMode = VerifyMode.OFF
    error: str | None = None
    rejected: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when nothing was rejected and no error was recorded."""
        return self.error is None and not self.rejected


class Slot(NamedTuple):
    """An accepted entry: where its bytes lie in the group's buffer."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    offset: int
    nbytes: int
    digest: str | None = None  # the sender's digest, when it travelled ahead (DigestEntry)
