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
earlier one.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_KEPT", "failed", "passed", "record"]

MAX_KEPT = 1024
"""Failed sessions remembered, and passed ones (the oldest of each are forgotten first)."""

_FAILED: dict[str, str] = {}
_PASSED: dict[str, None] = {}
_LOCK = threading.Lock()


def record(session: str | None, ok: bool, why: str = "its refit failed verification") -> None:
    """Record the verdict on ``session``: a failure with ``why``, or a pass (either replaces an earlier one)."""
    if not isinstance(session, str):
        return
    with _LOCK:
        _FAILED.pop(session, None)
        _PASSED.pop(session, None)
        kept: dict = _PASSED if ok else _FAILED
        kept[session] = None if ok else why
        while len(kept) > MAX_KEPT:
            kept.pop(next(iter(kept)))


def failed(session: str | None) -> str | None:
    """Why ``session`` failed in this process, or None (passed, or not seen here)."""
    with _LOCK:
        return _FAILED.get(session) if isinstance(session, str) else None


def passed(session: str | None) -> bool:
    """True iff ``session``'s last verdict in this process (among the :data:`MAX_KEPT` latest) was a pass."""
    with _LOCK:
        return isinstance(session, str) and session in _PASSED
