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
    """A peer broke the refit protocol or could not take part: bad message, wrong order, mode
    disagreement at the handshake, a receiver-side error (``load`` raised), a stranger on the socket.

    Attributes:
        report (VerificationReport | None): the verification report, when one was made before the
            error (``log`` mode with a receiver error).
        progress (dict): how far the refit got, when known.
    """

    def __init__(self, message: str, *, report: VerificationReport | None = None, progress: dict | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.progress = dict(progress or {})


class RefitAbortedError(RefitVerifyError, RuntimeError):
    """The peer aborted the refit (the sender sent ``Abort`` after an exception on its side).

    Attributes:
        reason (str): the sender's reason (its exception type and message).
        progress (dict): how far the refit got on this side (buffers, tensors, last name).
    """

    def __init__(self, message: str, reason: str = "", progress: dict | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.progress = dict(progress or {})


class RefitTimeoutError(RefitVerifyError, TimeoutError):
    """A bounded wait ran out, or the peer's socket disconnected while this side waited for it.

    ``progress`` says how far the refit got and which side went silent (``progress["silent"]`` is
    ``"receiver"`` or ``"sender"``; ``progress["reason"]`` is e.g. ``"receiver went silent"`` or
    ``"sender disconnected"``).
    """

    def __init__(self, message: str, progress: dict | None = None) -> None:
        super().__init__(message)
        self.progress = dict(progress or {})


class RefitVerificationError(RefitVerifyError, RuntimeError):
    """Sender and receiver manifests differ (``enforce`` mode).

    Attributes:
        report (VerificationReport): mismatched, missing, unexpected and rejected names with both
            digests; ``report.affected`` lists every named parameter once.
    """

    def __init__(self, report: VerificationReport) -> None:
        super().__init__(report.describe())
        self.report = report

    def __reduce__(self):  # picklable (process pools, Ray): rebuilt from the report
        return type(self), (self.report,)

    @property
    def mismatched(self) -> list[str]:
        return list(self.report.mismatched)

    @property
    def missing(self) -> list[str]:
        return list(self.report.missing)

    @property
    def unexpected(self) -> list[str]:
        return list(self.report.unexpected)

    @property
    def rejected(self) -> dict[str, str]:
        return dict(self.report.rejected)

    @property
    def affected(self) -> list[str]:
        return list(self.report.affected)
