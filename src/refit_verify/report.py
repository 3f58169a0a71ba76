"""Manifest comparison and the verification report."""

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
    """

    mismatched: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    sender: Mapping[str, str] = field(repr=False)
    receiver: Mapping[str, str] = field(repr=False)
    rank: int | None = None
    rejected: Mapping[str, str] = field(default_factory=dict)
    receiver_error: str | None = None

    @property
    def ok(self) -> bool:
        """True iff both sides have the same names with equal digests and nothing was rejected."""
        return not (self.mismatched or self.missing or self.unexpected or self.rejected)

    @property
    def verified(self) -> int:
        """Number of names whose digests are equal on both sides."""
        return sum(1 for k, v in self.sender.items() if self.receiver.get(k) == v)

    @property
    def affected(self) -> tuple[str, ...]:
        """Every name the report flags, once: sender order first, then receiver-only names."""
        flagged = set(self.mismatched) | set(self.missing) | set(self.unexpected) | set(self.rejected)
        out = [k for k in self.sender if k in flagged]
        seen = set(out)
        for k in (*self.unexpected, *self.rejected):
            if k not in seen:
                seen.add(k)
                out.append(k)
        return tuple(out)

    def describe(self, limit: int = 20) -> str:
        """Return a one-paragraph, human-readable summary naming the affected parameters."""
        where = f" on worker rank {self.rank}" if self.rank is not None else ""
        if self.ok:
            text = f"refit verified{where}: {self.verified} tensors, bytes identical"
            return text + (f"; receiver error: {self.receiver_error}" if self.receiver_error else "")
        parts = []
        for label, names in (("mismatched", self.mismatched), ("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(names[:limit]) + (f", … (+{len(names) - limit})" if len(names) > limit else "")
                parts.append(f"{len(names)} {label}: {shown}")
        if self.rejected:
            items = list(self.rejected.items())
            shown = "; ".join(f"{k} ({v})" for k, v in items[:limit]) + (f"; … (+{len(items) - limit})" if len(items) > limit else "")
            parts.append(f"{len(items)} rejected by the receiver: {shown}")
        if self.receiver_error:
            parts.append(f"receiver error: {self.receiver_error}")
        return f"refit verification failed{where} ({self.verified} of {len(self.sender)} verified): " + "; ".join(parts)


_HEX = frozenset("0123456789abcdef")


def _check_manifest(m: object, side: str) -> None:
    if not isinstance(m, Mapping):
        raise TypeError(f"{side} manifest must be a mapping of name to 32-hex digest, got {type(m).__name__}")
    for k, v in m.items():
        if not isinstance(k, str) or not (isinstance(v, str) and len(v) == 32 and _HEX.issuperset(v)):
            raise ValueError(f"{side} manifest entry {k!r}: {v!r} is not a 32-character lowercase hex digest")


def compare_manifests(sender: Manifest, receiver: Manifest, *, rank: int | None = None,
                      rejected: Mapping[str, str] | None = None, receiver_error: str | None = None) -> VerificationReport:
    """Compare a sender manifest with a receiver manifest over the union of their names.

    Args:
        sender: ``{name: 32-hex digest}`` of what the trainer exported.
        receiver: ``{name: 32-hex digest}`` of what one vLLM worker loaded.
        rank: the worker's rank, carried into the report.
        rejected: ``{name: reason}`` of entries the receiver refused (from ``Done.rejected``).
        receiver_error: the receiver's other errors (from ``Done.error``).

    Returns:
        VerificationReport: ``ok`` is True only if both have the same names and equal digests and
        the receiver rejected nothing.
    """
    _check_manifest(sender, "sender")
    _check_manifest(receiver, "receiver")
    mismatched = tuple(k for k, v in sender.items() if k in receiver and receiver[k] != v)
    missing = tuple(k for k in sender if k not in receiver)
    unexpected = tuple(k for k in receiver if k not in sender)
    return VerificationReport(mismatched, missing, unexpected, dict(sender), dict(receiver), rank,
                              dict(rejected or {}), receiver_error)


def act_on(report: VerificationReport, mode) -> VerificationReport:
    """Apply ``mode`` to ``report``: raise in ``enforce``, warn in ``log``.

    Raises:
        RefitVerificationError: ``mode`` is ``enforce`` and the report is not ok.
    """
    from refit_verify.config import VerifyMode
    from refit_verify.errors import RefitVerificationError

    if report.ok or mode is VerifyMode.OFF:
        return report
    if mode is VerifyMode.ENFORCE:
        raise RefitVerificationError(report)
    logger.warning("%s", report.describe())
    return report
