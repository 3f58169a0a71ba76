"""The stream layer under both refit transports: entry checks on the receiver, and what both sides share.

A refit is a stream of ``(name, tensor)`` pairs cut into groups; each group travels as one message
naming its tensors (:class:`~refit_verify.wire.staged.Entry`: name, dtype, shape, offset, nbytes) plus one
block of bytes holding them at aligned offsets. The staged ZMQ transport
(:mod:`refit_verify.transport`) puts a group in a shared staging buffer; the broadcast path
(:mod:`refit_verify.collective.broadcast`) puts it in a bucket broadcast over a ``torch.distributed`` group.
Everything that does not depend on how the bytes move is here, once:

* sender: :func:`checked_item` (names unique, tensors real), :func:`round_up` and
  :func:`entry_cost` (the slot layout and the entry-list estimate); the packing itself is
  :class:`refit_verify.stream.pack.Packer`;
* receiver: :class:`EntryChecker` (every entry validated on its own before any memory is touched:
  real dtype, ``nbytes == numel × itemsize``, aligned offset, no overlap with the previous accepted
  slot, within ``used_bytes``, name new in the refit), :func:`view_slots`, and
  :class:`ReceiveState` (counts, digests before ``load``, the manifest at the end);
* both: :func:`receiver_report` (one receiver's manifest or session manifest against the sender's).

Source: ``docs/protocol.md`` (sender and receiver steps, invariants).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from operator import add, attrgetter, gt, mul
from typing import NamedTuple, TypedDict

import torch

from refit_verify.config import VerifyMode
from refit_verify.digest.batch import DigestBatch, _check
from refit_verify.digest.incremental import _IS_META, _PLAIN_SET
from refit_verify.errors import RefitInputError, RefitProtocolError
from refit_verify.manifest import ExternalDigests, SessionManifest
from refit_verify.report import VerificationReport, compare_manifests
from refit_verify.wire.staged import MAX_NAME_BYTES, Entry, torch_dtype

__all__ = ["Batch", "LoadFn", "MAX_ERROR_CHARS", "EntryChecker", "ReceiveState", "Slot",
           "StreamResult", "StreamStats", "check_digest", "check_items", "checked_item", "entry_cost", "receiver_report", "round_up", "view_slots"]

logger = logging.getLogger("refit_verify")

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
_IS_NESTED, _IS_QUANTIZED, _LAYOUT, _NBYTES = attrgetter("is_nested"), attrgetter("is_quantized"), attrgetter("layout"), attrgetter("nbytes")


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
    if min(lengths) < 1 or max(lengths) > MAX_NAME_BYTES or not set(map(type, ts)) <= _PLAIN_SET:
        return False
    if (any(map(_IS_NESTED, ts)) or any(map(_IS_QUANTIZED, ts)) or any(map(_IS_META, ts))
            or set(map(_LAYOUT, ts)) != _STRIDED_ONLY or any(map(torch.Tensor._is_zerotensor, ts))
            or max(map(torch.Tensor.dim, ts)) > 255 or not all(map(torch.Tensor.is_contiguous, ts))):
        return False
    # every element inside its storage (none freed or shrunk under its tensor, as FSDP does after a gather)
    spans = (map(add, map(mul, map(torch.Tensor.storage_offset, ts), map(torch.Tensor.element_size, ts)), map(_NBYTES, ts))
             if any(map(torch.Tensor.storage_offset, ts)) else map(_NBYTES, ts))  # parameters: each at offset 0
    return not any(map(gt, spans, map(torch.UntypedStorage.nbytes, map(torch.Tensor.untyped_storage, ts))))


def check_items(items: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Validate every ``(name, tensor)`` of a refit given as a list, before any of it is sent: what
    :func:`checked_item` and the digest's own checks (:func:`~refit_verify.digest.batch._check`) would find
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
        _check(checked_item(item, seen)[1])


class StreamStats(TypedDict):
    """Numbers of a sender's last refit, common to both transports (a plain dict:
    ``sender.last_stats["digest_s"]``).

    Keys:
        refit_id: the refit's id (32 hex). mode: the mode it ran in (agreed at the handshake).
        tensors: tensors sent. bytes: their exact bytes (padding excluded).
        digest_s: seconds the sender spent in digest code (0.0 in ``off`` mode); on CUDA this
            includes waiting for earlier queued work at the synchronisation points.
        digest_shadow_s: of ``digest_s``, the seconds spent after the first group was sent, while
            the receivers check and load it (a refit given as a list: the digests of every tensor
            the first group could not hold; off the refit's critical path unless the receivers
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


# ------------------------------------------------------------------------------ receiver


class Slot(NamedTuple):
    """An accepted entry: where its bytes lie in the group's buffer."""

    name: str
    dtype: torch.dtype
    shape: list[int]
    offset: int
    nbytes: int
    digest: str | None = None  # the sender's digest, when it travelled ahead (DigestEntry)


class EntryChecker:
    """Receiver-side validation of a refit's entries, group by group (the names of the whole refit).

    Args:
        alignment: the refit's slot alignment (from the sender's hello).
        padded_tail: ``True`` (staged transport): every slot, padding included, ends within
            ``used_bytes``. ``False`` (broadcast): an entry's bytes end within ``used_bytes`` (an
            oversized tensor is broadcast from its own bytes, unpadded).

    Attributes:
        rejected (dict[str, str]): ``{name: reason}`` of every refused entry.
        seen (set[str]): every name received. received (int): entries received.
        expected_seq (int): the sequence number the next group must carry.
    """

    def __init__(self, alignment: int, *, padded_tail: bool = True) -> None:
        self.alignment, self.padded_tail = alignment, padded_tail
        self.seen: set[str] = set()
        self.rejected: dict[str, str] = {}
        self.received = 0
        self.expected_seq = 0

    def reject(self, name: str, reason: str) -> None:
        """Record ``name`` as refused (the first reason stays)."""
        self.rejected.setdefault(name, reason[:MAX_REASON_CHARS])

    def check(self, seq: int, entries: list[Entry], used_bytes: int) -> list[Slot]:
        """Validate the entries of group ``seq``; return the accepted ones, record the others.

        An entry is accepted when its dtype is a real torch dtype, ``nbytes == numel × itemsize``,
        its offset is a multiple of the alignment and not below the end of the previously accepted
        slot, it ends within ``used_bytes`` (see ``padded_tail``) and its name is new in this refit.
        A name given twice is refused in every copy (the earlier one is dropped from the manifest by
        :meth:`ReceiveState.finish`). A group out of sequence is refused whole.
        """
        align = self.alignment
        expected = self.expected_seq
        self.expected_seq = max(expected, seq) + 1
        self.received += len(entries)
        if seq != expected:
            for e in entries:
                self.reject(e.name, f"buffer seq {seq}, expected {expected}")
            self.seen.update(e.name for e in entries)
            return []
        out: list[Slot] = []
        end = 0
        for e in entries:
            why = None
            try:
                dtype = torch_dtype(e.dtype)
            except RefitProtocolError as err:
                dtype, why = None, str(err)
            if why is None:
                numel = math.prod(e.shape)
                slot = round_up(e.nbytes, align)
                stop = e.offset + (slot if self.padded_tail else e.nbytes)
                if e.nbytes != numel * dtype.itemsize:
                    why = f"nbytes {e.nbytes} != numel {numel} × itemsize {dtype.itemsize} ({e.dtype}{e.shape})"
                elif e.offset % align:
                    why = f"offset {e.offset} is not a multiple of the alignment {align}"
                elif e.offset < end:
                    why = f"offset {e.offset} overlaps the previous entry's slot (which ends at {end})"
                elif stop > used_bytes:
                    why = f"slot [{e.offset}, {stop}) extends past used_bytes {used_bytes}"
            if e.name in self.seen:
                self.rejected[e.name] = SENT_TWICE  # whatever else is wrong with this entry
                continue
            self.seen.add(e.name)
            if why is not None:
                self.reject(e.name, why)
                continue
            out.append(Slot(e.name, dtype, list(e.shape), e.offset, e.nbytes, getattr(e, "digest", None)))
            end = e.offset + slot
        return out


def view_slots(buf: torch.Tensor, slots: list[Slot]) -> Batch:
    """Views of ``buf`` (1-D uint8) as each slot's dtype and shape, in order (no copy)."""
    return [(s.name, buf[s.offset : s.offset + s.nbytes].view(s.dtype).view(s.shape)) for s in slots]


@dataclass
class ReceiveState:
    """One receiver's state during one refit (both transports).

    Attributes:
        mode: the agreed mode. refit_id: the sender's id. checker: the entry checks.
        batch: this receiver's digests (``None`` when not verifying or digesting elsewhere).
        external: where the digests are taken instead (a vLLM worker's model boundary), or ``None``.
        groups: groups handled. tensors / bytes: accepted entries and their exact bytes.
        digest_s: seconds in digest code. last_name: the last accepted name.
        errors: errors that name no entry (``load`` raised, a count mismatch in ``off`` mode).
        refused: ``{name: reason}`` of entries checked before loading and not loaded (their digest
            differs from the sender's, or none travelled with them): ``enforce`` only.
        landed: names handed to ``load`` (a load that raised excluded), when digests came first.
        kept: ``{parameter: why}`` of what still holds the previous version (with ``external``:
            the engine's parameters, as the model boundary reports them).
    """

    mode: VerifyMode
    refit_id: str
    checker: EntryChecker
    batch: DigestBatch | None = None
    external: ExternalDigests | None = None
    groups: int = 0
    tensors: int = 0
    bytes: int = 0
    digest_s: float = 0.0
    last_name: str | None = None
    errors: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)
    landed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    ahead: bool = False  # some group's digests came ahead of its bytes
    _hex: dict[str, str] = field(default_factory=dict)  # digests of the groups checked before loading

    @classmethod
    def start(cls, mode: VerifyMode, refit_id: str, alignment: int, digests: ExternalDigests | None, *,
              padded_tail: bool = True) -> ReceiveState:
        """The state of a refit just agreed: digests here (``batch``) unless ``digests`` takes them."""
        external = digests if mode.verifies else None
        return cls(mode=mode, refit_id=refit_id, checker=EntryChecker(alignment, padded_tail=padded_tail),
                   batch=DigestBatch() if mode.verifies and external is None else None, external=external)

    def deliver(self, views: Batch, load: LoadFn, *, sync_cuda: bool, expected: dict[str, str | None] | None = None) -> None:
        """Count ``views``, digest them (before ``load``), then ``load`` them.

        Args:
            views: ``[(name, view)]`` of the group's accepted entries.
            load: the receiver's ``load``.
            sync_cuda: finish CUDA digests before ``load`` (else only launch them; the caller
                synchronises before the group's memory is reused).
            expected: ``{name: the sender's 32-hex digest or None}`` when the digests travelled
                ahead of the bytes (protocol 3): every view is checked **before** ``load``, with
                one synchronisation per group on CUDA. In ``enforce`` a view whose digest differs
                (or that carries none) is refused, never loaded (:attr:`refused`); in ``log`` it
                is loaded and the verdict names it. With ``external`` digests (a model boundary)
                the check is the boundary's, in ``load_weights`` itself.

        Raises what ``load`` raises.
        """
        if not views:
            return
        self.tensors += len(views)
        self.bytes += sum(v.numel() * v.element_size() for _, v in views)
        self.last_name = views[-1][0]
        first = expected is not None and self.mode.verifies
        self.ahead |= first
        enforce = self.mode is VerifyMode.ENFORCE
        if first and self.external is not None:
            expect = getattr(self.external, "expect", None)
            if expect is not None:
                expect(expected, enforce)  # the boundary checks the tensors of the next load_weights call first
        elif first and self.batch is not None:
            t0 = time.perf_counter()
            group = DigestBatch(hold_cpu=True)  # read before anything is loaded
            for name, v in views:
                group.add(name, v)
            got = group.hexdigests()  # one synchronisation per group on CUDA, before anything is loaded
            self._hex.update(got)
            self.digest_s += time.perf_counter() - t0
            keep = []
            for name, v in views:
                why = check_digest(got[name], expected.get(name))
                if why is not None and enforce:
                    self.refused[name] = why
                    self.kept[name] = f"not loaded: {why}"
                    continue
                keep.append((name, v))
            views = keep
        elif self.batch is not None:
            t0 = time.perf_counter()
            for name, v in views:
                self.batch.add(name, v)
            if views[0][1].is_cuda:
                if sync_cuda:
                    self.batch.hexdigests()
                else:
                    self.batch.launch()
            self.digest_s += time.perf_counter() - t0
        if views:
            load(views)
            if first and self.external is None:
                self.landed.extend(n for n, _ in views)

    def all_rejected(self) -> dict[str, str]:
        """``{name: reason}`` of every entry not loaded: layout rejections and digest refusals."""
        out = dict(self.checker.rejected)
        for k, v in self.refused.items():
            out.setdefault(k, v)
        return out

    def finish(self, n_tensors: int) -> tuple[dict[str, str] | None, SessionManifest | None, str | None]:
        """End the refit after the sender's count ``n_tensors``: ``(manifest, session, error)``.

        A count that differs from the entries received is an error in ``off`` mode (the only signal
        there) and a warning when verifying (the manifests name the difference). Rejected names
        are left out of the manifest; a refused one keeps the digest of what arrived (so the
        verdict names it mismatched as well as rejected). A failure while finishing the digests
        is recorded, never raised.
        """
        got = self.checker.received
        if n_tensors != got:
            text = f"sender sent {n_tensors} tensors, receiver got {got} entries ({self.tensors} accepted)"
            if self.mode.verifies:
                logger.warning("refit %s: %s; the manifests name the difference", self.refit_id, text)
            else:
                self.errors.append(text)
        manifest = session = None
        if self.batch is not None or self.external is not None:
            t0 = time.perf_counter()
            try:
                if self.external is not None:
                    got_digests, session = self.external.finish()
                    for k, v in (getattr(self.external, "rejected", None) or {}).items():
                        self.refused.setdefault(k, v)
                    self.landed = list(getattr(self.external, "landed", None) or [])
                    self.kept = dict(getattr(self.external, "kept", None) or {})
                else:
                    got_digests = dict(self._hex)
                    got_digests.update(self.batch.hexdigests())
                manifest = {k: v for k, v in got_digests.items() if k not in self.checker.rejected}
            except Exception as e:  # noqa: BLE001 - the answer to the sender must still go out
                logger.exception("refit %s: finishing digests failed", self.refit_id)
                self.errors.append(f"digest: {type(e).__name__}: {e}")
                manifest = {}
            self.digest_s += time.perf_counter() - t0
        error = "; ".join(self.errors)[:MAX_ERROR_CHARS] if self.errors else None
        rejected = self.all_rejected()
        if error:
            logger.error("refit %s finished with errors: %s", self.refit_id, error)
        if rejected:
            logger.error("refit %s: %d entries rejected: %s", self.refit_id, len(rejected),
                         "; ".join(f"{k} ({v})" for k, v in list(rejected.items())[:20]))
        return manifest, session, error


def check_digest(got: str | None, want: str | None) -> str | None:
    """Why a tensor whose digest is ``got`` must not be loaded against the sender's ``want`` (None: it may)."""
    if want is None:
        return "it carries no sender digest, so its bytes cannot be checked before loading"
    if got != want:
        return f"its digest {got} differs from the sender's {want}: corrupted between the sender's digest and this load"
    return None


def receiver_report(sender_manifest: dict[str, str] | None, manifest: dict[str, str], session: SessionManifest | None, *,
                    refit_id: str, rejected: dict[str, str], error: str | None, rank: int | None,
                    producer_rank: int | None = None, landed: list[str] | None = None,
                    kept: dict[str, str] | None = None) -> VerificationReport:
    """Compare one receiver's answer with the sender's manifest (not yet acted on).

    With a ``session`` (the receiver loaded into a vLLM model and digested at its boundary), the
    comparison is :func:`refit_verify.trainer.refit.compare_session` (coverage, identity and read-back
    too); else :func:`refit_verify.report.compare_manifests`. ``rejected`` and ``error`` are
    carried into the report; ``rank`` labels it; ``landed`` / ``kept`` (what the receiver's engine
    holds, when the digests came ahead of the bytes) become ``report.landed`` / ``report.kept``.
    """
    extra = {"landed": tuple(landed or ()), "kept": dict(kept or {})}
    if session is not None:
        from refit_verify.trainer.refit import compare_session

        base = compare_session({"model": sender_manifest or {}}, session, session=refit_id, producer_rank=producer_rank)
        return dataclasses.replace(base, rejected=dict(rejected), receiver_error=error, rank=rank if rank is not None else base.rank,
                                   **extra)
    return dataclasses.replace(compare_manifests(sender_manifest, manifest, rejected=dict(rejected), receiver_error=error, rank=rank),
                               **extra)
