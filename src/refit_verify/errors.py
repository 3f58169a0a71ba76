"""Exception tree of refit-verify. Every error subclasses :class:`RefitError` and the nearest
builtin, so ``except ValueError`` / ``except TimeoutError`` keep working.

``RefitError``                       base of everything
├── ``RefitConfigError``             (ValueError) a setting, option or argument is not accepted
│   └── ``ShardLayoutError``         a shard layout breaks the shard rule
├── ``RefitInputError``              (TypeError, ValueError) a value handed in (a tensor, a name, a manifest) cannot be used
├── ``RefitProtocolError``           (RuntimeError) a peer broke the protocol or sent malformed data
├── ``RefitReceiveError``            (RuntimeError) the receiver failed to load what it received
├── ``RefitAbortedError``            (RuntimeError) the sender aborted the refit
├── ``RefitTimeoutError``            (TimeoutError) a bounded wait ran out
├── ``RefitVerificationError``       (RuntimeError) manifests differ (``enforce``)
│   └── ``BroadcastVerificationError``  ... on a receiving rank of a broadcast
├── ``AuditError``                   (RuntimeError) engine tensors changed since the last refit
├── ``ReplicaDisagreement``          (RuntimeError) replicas (or a canary) hold different bytes
└── ``SelftestError``                (RuntimeError) the self-test against a live engine failed (``enforce``)

``RefitVerifyError`` is the former name of :class:`RefitError` (kept as an alias; it was too close to
``RefitVerificationError`` to be caught reliably).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from refit_verify.report import VerificationReport


class RefitError(Exception):
    """Base class of every error raised by refit-verify."""


RefitVerifyError = RefitError
"""Deprecated alias of :class:`RefitError` (kept for existing ``except`` clauses)."""


class RefitConfigError(RefitError, ValueError):
    """A configuration value (``REFIT_VERIFY``, a keyword option, a config key) is not accepted."""


class RefitInputError(RefitError, TypeError, ValueError):
    """A value handed to refit-verify cannot be used: not a tensor, a tensor with no bytes to digest
    (sparse, nested, meta), a name that is not a str, a manifest that is not a mapping."""


class RefitProtocolError(RefitError, RuntimeError):
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


class RefitReceiveError(RefitError, RuntimeError):
    """The receiving side failed to load what it received (``load`` / ``load_weights`` raised): the
    bytes arrived, the engine did not take them.

    Attributes:
        report (VerificationReport | None): the verification report, when one was made (``log``).
        progress (dict): how far the refit got, when known.
    """

    def __init__(self, message: str, *, report: VerificationReport | None = None, progress: dict | None = None) -> None:
        super().__init__(message)
        self.report = report
        self.progress = dict(progress or {})


class RefitAbortedError(RefitError, RuntimeError):
    """The peer aborted the refit (the sender sent ``Abort`` after an exception on its side).

    Attributes:
        reason (str): the sender's reason (its exception type and message).
        progress (dict): how far the refit got on this side (buffers, tensors, last name).
    """

    def __init__(self, message: str, reason: str = "", progress: dict | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.progress = dict(progress or {})


class RefitTimeoutError(RefitError, TimeoutError):
    """A bounded wait ran out, or the peer's socket disconnected while this side waited for it.

    ``progress`` says how far the refit got and which side went silent (``progress["silent"]`` is
    ``"receiver"`` or ``"sender"``; ``progress["reason"]`` is e.g. ``"receiver went silent"`` or
    ``"sender disconnected"``).
    """

    def __init__(self, message: str, progress: dict | None = None) -> None:
        super().__init__(message)
        self.progress = dict(progress or {})


class RefitVerificationError(RefitError, RuntimeError):
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


class BroadcastVerificationError(RefitVerificationError):
    """Manifests differ on at least one receiving rank of a broadcast refit (``enforce``).

    Attributes:
        reports (dict[int, VerificationReport]): every receiving rank's report, failing and clean,
            keyed by rank, in group order.
        report (VerificationReport): the first failing rank's report (``RefitVerificationError``'s
            attribute; ``mismatched``/``missing``/``affected`` read it).
    """

    def __init__(self, reports: Mapping[int, VerificationReport]) -> None:
        self.reports = dict(reports)
        failing = [r for r in self.reports.values() if not r.ok]
        if not failing:
            raise ValueError("BroadcastVerificationError needs at least one failing report")
        super().__init__(failing[0])
        self.args = (self.describe(),)

    def __reduce__(self):  # picklable (process pools, Ray): rebuilt from the reports
        return type(self), (self.reports,)

    @property
    def failed_ranks(self) -> list[int]:
        return [r for r, rep in self.reports.items() if not rep.ok]

    @property
    def clean_ranks(self) -> list[int]:
        return [r for r, rep in self.reports.items() if rep.ok]

    def describe(self) -> str:
        """One line per receiving rank: the failing ranks' findings, then the clean ranks."""
        lines = [f"refit verification failed on {len(self.failed_ranks)} of {len(self.reports)} receiving ranks "
                 f"(failed: {self.failed_ranks}, clean: {self.clean_ranks})"]
        lines += [f"  {rep.describe()}" for rep in self.reports.values()]
        return "\n".join(lines)


class ShardLayoutError(RefitConfigError):
    """A shard layout breaks the shard rule (a cut between shards is not on an 8 MiB chunk
    boundary), the shards do not tile the tensor, or their metadata disagree."""


class AuditError(RefitError, RuntimeError):
    """An audit found engine tensors changed or moved since the last refit session (``enforce``).

    Attributes:
        audits (list[AuditResult]): every worker's result; ``failed``: the failing ones.
    """

    def __init__(self, audits: list) -> None:
        self.audits = list(audits)
        self.failed = [a for a in self.audits if not a.ok]
        super().__init__("; ".join(a.describe() for a in self.failed) or "audit failed")

    def __reduce__(self):  # picklable (process pools, Ray)
        return type(self), (self.audits,)

    @property
    def changed(self) -> list[str]:
        """Every tensor named changed by a failing worker, sorted."""
        return sorted({n for a in self.failed for n in a.changed})


class ReplicaDisagreement(RefitError, RuntimeError):
    """Engine states that must be identical are not: replicas, or a refitted engine and a cold load
    of the same weights (``enforce``).

    Attributes:
        comparison (StateComparison): ``differing`` names each tensor and the ranks or engines.
    """

    def __init__(self, comparison, what: str = "replicas") -> None:
        self.comparison = comparison
        self.what = what
        super().__init__(comparison.describe(what))

    def __reduce__(self):
        return type(self), (self.comparison, self.what)


class SelftestError(RefitError, RuntimeError):
    """:func:`refit_verify.selftest` found that verification does not work on this engine (``enforce``):
    a worker does not verify, the clean refit did not verify, a corrupted byte was not named, or the
    engine does not hold the clean refit's state after it.

    Attributes:
        result (SelftestResult): what was checked, what failed (``result.problems``) and the timings.
    """

    def __init__(self, result) -> None:
        self.result = result
        super().__init__("refit-verify selftest failed: " + "; ".join(result.problems))

    def __reduce__(self):  # picklable (process pools, Ray)
        return type(self), (self.result,)
