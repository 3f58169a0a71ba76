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

import logging
import math
import time
from dataclasses import dataclass, field

import torch

from refit_verify.compare import check_digest
from refit_verify.config import VerifyMode
from refit_verify.digest.batch import DigestBatch
from refit_verify.errors import RefitProtocolError
from refit_verify.manifest import ExternalDigests, SessionManifest
from refit_verify.stream.items import MAX_ERROR_CHARS, MAX_REASON_CHARS, SENT_TWICE, Batch, LoadFn, Slot, round_up
from refit_verify.wire.fields import Entry, torch_dtype

__all__ = ["EntryChecker", "ReceiveState", "view_slots"]

logger = logging.getLogger("refit_verify")





# ------------------------------------------------------------------------------ receiver



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


