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
earlier one. A refit that writes only some parameters vouches for the others only as far as the
sessions that wrote them last: :func:`failed_writes` says which of those failed in their own writes.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_KEPT", "failed", "failed_writes", "passed", "record"]

MAX_KEPT = 1024
"""Failed sessions remembered, and passed ones (the oldest of each are forgotten first)."""

_FAILED: dict[str, str] = {}
_PASSED: dict[str, None] = {}
_WRITES_OK: set[str] = set()  # failed sessions whose own writes verified (they failed for what they left)
_LOCK = threading.Lock()


def record(session: str | None, ok: bool, why: str = "its refit failed verification", *, writes_ok: bool = False) -> None:
    """Record the verdict on ``session``: a failure with ``why``, or a pass (either replaces an earlier one).
    ``writes_ok``: a failure only for what the session left unwritten; what it wrote verified."""
    if not isinstance(session, str):
        return
    with _LOCK:
        _FAILED.pop(session, None)
        _PASSED.pop(session, None)
        _WRITES_OK.discard(session)
        kept: dict = _PASSED if ok else _FAILED
        kept[session] = None if ok else why
        if not ok and writes_ok:
            _WRITES_OK.add(session)
        while len(kept) > MAX_KEPT:
            _WRITES_OK.discard(next(iter(kept)))
            kept.pop(next(iter(kept)))


def failed(session: str | None) -> str | None:
    """Why ``session`` failed in this process, or None (passed, or not seen here)."""
    with _LOCK:
        return _FAILED.get(session) if isinstance(session, str) else None


def failed_writes(session: str | None) -> str | None:
    """Why what ``session`` wrote is not the trainer's, or None (it passed, its writes verified, or it
    was not seen here)."""
    with _LOCK:
        if not isinstance(session, str) or session in _WRITES_OK:
            return None
        return _FAILED.get(session)


def passed(session: str | None) -> bool:
    """True iff ``session``'s last verdict in this process (among the :data:`MAX_KEPT` latest) was a pass."""
    with _LOCK:
        return isinstance(session, str) and session in _PASSED
