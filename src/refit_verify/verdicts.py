"""The verdicts this trainer process reached, by worker session id (read by :func:`refit_verify.audit`
and :func:`refit_verify.certificate`).

An audit compares a worker's engine state with the state its last refit session left. That state is
the trainer's weights only if that refit verified. Workers do not learn the trainer's verdict (it
would cost a round trip per refit), so every path that reaches one records it here:
:func:`refit_verify.refit`, :func:`refit_verify.push` and :class:`~refit_verify.transport.RefitSender`
(a send that fails after its handshake too: the worker may hold part of it), vLLM's native weight
transfer (a closed worker session compared whole) and the broadcast path (failures only: its reports
hold no engine-side check of the receivers' sessions).
An audit whose baseline is a session recorded as failed fails, with the reason; a certificate is
only good for a session recorded as passed. A later verdict on the same session id replaces the
earlier one. A refit that writes only some parameters vouches for the others only as far as this
process verified the writes of the sessions whose bytes they hold (:func:`writes`); a failure may
name the parameters whose bytes it found wrong (the others it wrote are the trainer's).
"""

from __future__ import annotations

import threading

__all__ = ["MAX_KEPT", "claim", "failed", "passed", "record", "writes"]

MAX_KEPT = 1024
"""Failed sessions remembered, and passed ones (the oldest of each are forgotten first)."""

_FAILED: dict[str, str] = {}
_PASSED: dict[str, None] = {}
_BAD: dict[str, frozenset[str] | None] = {}  # failed session -> the parameters it wrote wrong (None: unknown, all)
_CLAIMED: dict[str, None] = {}  # session ids refits of this process opened (the latest MAX_KEPT)
_LOCK = threading.Lock()


def claim(session: str) -> bool:
    """Take ``session`` for a refit about to open its sessions; False when a refit of this process
    took it before (or a verdict on it is kept): a session id names one refit, its verdict is kept
    by id, and a pass under a reused id would replace the failure of the refit that used it first."""
    with _LOCK:
        if session in _CLAIMED or session in _PASSED or session in _FAILED:
            return False
        _CLAIMED[session] = None
        while len(_CLAIMED) > MAX_KEPT:
            _CLAIMED.pop(next(iter(_CLAIMED)))
        return True


def record(session: str | None, ok: bool, why: str = "its refit failed verification", *,
           bad: frozenset[str] | None = None) -> None:
    """Record the verdict on ``session``: a failure with ``why``, or a pass (either replaces an earlier one).
    ``bad``: for a failure, the parameters (worker labels) whose bytes it wrote are not the trainer's
    (empty: every write verified; it failed for something else); None: any of them."""
    if not isinstance(session, str):
        return
    with _LOCK:
        _FAILED.pop(session, None)
        _PASSED.pop(session, None)
        _BAD.pop(session, None)
        kept: dict = _PASSED if ok else _FAILED
        kept[session] = None if ok else why
        if not ok:
            _BAD[session] = None if bad is None else frozenset(bad)
        while len(kept) > MAX_KEPT:
            _BAD.pop(next(iter(kept)), None)
            kept.pop(next(iter(kept)))


def failed(session: str | None) -> str | None:
    """Why ``session`` failed in this process, or None (passed, or not seen here)."""
    with _LOCK:
        return _FAILED.get(session) if isinstance(session, str) else None


def writes(session: str) -> tuple[str, str | None, frozenset[str] | None]:
    """How far this process vouches for the bytes ``session`` wrote: ``("passed", None, None)``,
    ``("failed", why, bad)`` (``bad``: the parameters it wrote wrong, None: any) or ``("unknown",
    None, None)`` (not seen here, or forgotten). A session asked about is kept as the newest of its
    kind: the writer of parameters no later refit rewrites stays known."""
    with _LOCK:
        if session in _PASSED:
            _PASSED[session] = _PASSED.pop(session)
            return "passed", None, None
        if session in _FAILED:
            _FAILED[session] = why = _FAILED.pop(session)
            return "failed", why, _BAD.get(session)
        return "unknown", None, None


def passed(session: str | None) -> bool:
    """True iff ``session``'s last verdict in this process (among the :data:`MAX_KEPT` latest) was a pass."""
    with _LOCK:
        return isinstance(session, str) and session in _PASSED
