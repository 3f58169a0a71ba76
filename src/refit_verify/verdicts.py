"""The verdicts this trainer process reached, by worker session id (read by :func:`refit_verify.audit`).

An audit compares a worker's engine state with the state its last refit session left. That state is
the trainer's weights only if that refit verified. Workers do not learn the trainer's verdict (it
would cost a round trip per refit), so every path that reaches one records it here:
:func:`refit_verify.refit`, :func:`refit_verify.push` and :class:`~refit_verify.transport.RefitSender`.
An audit whose baseline is a session recorded as failed fails, with the reason. A later verified
refit under the same session id clears the record.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_KEPT", "failed", "record"]

MAX_KEPT = 1024
"""Failed sessions remembered (the oldest are forgotten first)."""

_FAILED: dict[str, str] = {}
_LOCK = threading.Lock()


def record(session: str | None, ok: bool, why: str = "its refit failed verification") -> None:
    """Record the verdict on ``session``: a failure with ``why``, or a pass, which clears an earlier failure."""
    if not isinstance(session, str):
        return
    with _LOCK:
        _FAILED.pop(session, None)
        if not ok:
            _FAILED[session] = why
            while len(_FAILED) > MAX_KEPT:
                _FAILED.pop(next(iter(_FAILED)))


def failed(session: str | None) -> str | None:
    """Why ``session`` failed in this process, or None (passed, or not seen here)."""
    with _LOCK:
        return _FAILED.get(session) if isinstance(session, str) else None
