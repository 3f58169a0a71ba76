"""Exception tree of refit-verify. Every error subclasses :class:`RefitVerifyError` and the
nearest builtin, so ``except ValueError`` / ``except TimeoutError`` keep working."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refit_verify.report import VerificationReport


class RefitVerifyError(Exception):
    """Base class of every error raised by refit-verify."""


class RefitConfigError(RefitVerifyError, ValueError):
    """A configuration value (``REFIT_VERIFY``, a keyword option, a config key) is not accepted."""


class RefitProtocolError(RefitVerifyError, RuntimeError):
    """A peer broke the refit protocol: bad message, wrong order, mode disagreement, layout mismatch."""


class RefitTimeoutError(RefitVerifyError, TimeoutError):
    """A bounded wait ran out. ``progress`` says how far the refit got and which side went silent."""

    def __init__(self, message: str, progress: dict | None = None) -> None:
        super().__init__(message)
        self.progress = dict(progress or {})


class RefitVerificationError(RefitVerifyError, RuntimeError):
    """Sender and receiver manifests differ (``enforce`` mode).

    Attributes:
        report (VerificationReport): mismatched, missing and unexpected names with both digests.
    """

    def __init__(self, report: VerificationReport) -> None:
        super().__init__(report.describe())
        self.report = report

    @property
    def mismatched(self) -> list[str]:
        return list(self.report.mismatched)

    @property
    def missing(self) -> list[str]:
        return list(self.report.missing)

    @property
    def unexpected(self) -> list[str]:
        return list(self.report.unexpected)
