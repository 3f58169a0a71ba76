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
        missing: names the sender digested that the receiver never loaded.
        unexpected: names the receiver loaded that the sender never sent.
        sender: the sender manifest. receiver: the receiver manifest.
        rank: receiving worker's rank, when known.
    """

    mismatched: tuple[str, ...]
    missing: tuple[str, ...]
    unexpected: tuple[str, ...]
    sender: Mapping[str, str] = field(repr=False)
    receiver: Mapping[str, str] = field(repr=False)
    rank: int | None = None

    @property
    def ok(self) -> bool:
        return not (self.mismatched or self.missing or self.unexpected)

    @property
    def verified(self) -> int:
        """Number of names whose digests are equal on both sides."""
        return sum(1 for k, v in self.sender.items() if self.receiver.get(k) == v)

    def describe(self, limit: int = 20) -> str:
        """Return a one-paragraph, human-readable summary naming the affected parameters."""
        where = f" on worker rank {self.rank}" if self.rank is not None else ""
        if self.ok:
            return f"refit verified{where}: {self.verified} tensors, bytes identical"
        parts = []
        for label, names in (("mismatched", self.mismatched), ("missing", self.missing), ("unexpected", self.unexpected)):
            if names:
                shown = ", ".join(names[:limit]) + (f", … (+{len(names) - limit})" if len(names) > limit else "")
                parts.append(f"{len(names)} {label}: {shown}")
        return f"refit verification failed{where} ({self.verified} of {len(self.sender)} verified): " + "; ".join(parts)


def compare_manifests(sender: Manifest, receiver: Manifest, *, rank: int | None = None) -> VerificationReport:
    """Compare a sender manifest with a receiver manifest over the union of their names.

    Args:
        sender: ``{name: 32-hex digest}`` of what the trainer exported.
        receiver: ``{name: 32-hex digest}`` of what one vLLM worker loaded.
        rank: the worker's rank, carried into the report.

    Returns:
        VerificationReport: ``ok`` is True only if both have the same names and equal digests.
    """
    mismatched = tuple(k for k, v in sender.items() if k in receiver and receiver[k] != v)
    missing = tuple(k for k in sender if k not in receiver)
    unexpected = tuple(k for k in receiver if k not in sender)
    return VerificationReport(mismatched, missing, unexpected, dict(sender), dict(receiver), rank)


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
