"""What the engine holds, checked from the trainer: audits, replica agreement.

* :func:`audit` — re-digest every worker's engine state and name every tensor that changed or
  whose storage moved since the last refit session closed on it (run it before a generation
  batch; the plugin also audits by itself after ``wake_up`` and ``reload_weights``). A baseline left
  by a refit that failed or aborted in this trainer process fails the audit.
* :func:`compare_replicas` — data-parallel replicas (and tensor-parallel ranks, for replicated
  tensors) must hold identical bytes; the rank that differs is named.
* :func:`certificate` — which weight version every worker holds, the digest of its engine state, the
  session that wrote it and when, this trainer's verdict on that session, and whether the engine
  still holds exactly what that session left.
* :func:`restart_versions` — let versions start again (a trainer resumed from an earlier checkpoint
  into an engine that stayed up).
* The cold-load canary is :func:`refit_verify.canary` (it starts an engine, so it lives in the plugin).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec

from refit_verify import verdicts
from refit_verify.compare import StateComparison
from refit_verify.compare import compare_replicas as _compare
from refit_verify.config import VerifyMode, mode_from_env
from refit_verify.errors import AuditError, RefitConfigError, ReplicaDisagreement
from refit_verify.manifest import AuditResult, Certificate, EngineSnapshot, WorkerIdentity, from_wire
from refit_verify.trainer.channel import require_channel

logger = logging.getLogger("refit_verify")

__all__ = ["audit", "certificate", "compare_replicas", "engine_states", "restart_versions"]


def _mode(mode: VerifyMode | str | None) -> VerifyMode:
    return mode_from_env() if mode is None else VerifyMode.parse(mode)


def audit(engine: Any, *, mode: VerifyMode | str | None = None, timeout_s: float = 120.0) -> list[AuditResult]:
    """Audit every worker of ``engine`` now (``refit_verify_audit``).

    Args:
        engine: what :func:`refit_verify.refit` accepts (LLM, Ray handle, HTTP URL, ...).
        mode: ``enforce`` raises on a failing audit, ``log`` warns; default ``REFIT_VERIFY``.
        timeout_s: bound on the call to the workers, seconds.

    Returns:
        list[AuditResult]: one per worker that has a baseline (a worker with no closed session yet
        has nothing to audit against and is skipped with a warning).

    Raises:
        AuditError: ``enforce`` and a worker's tensors changed or moved.
        RefitConfigError: ``enforce`` and a worker does not verify.
    """
    m = _mode(mode)
    if not m.verifies:
        return []
    out: list[AuditResult] = []
    for r in verifying_answers(engine, "refit_verify_audit", "cannot audit", m, timeout_s):
        if r.get("audit") is None:
            logger.warning("refit-verify: worker rank %s has no verified refit yet; nothing to audit against", r.get("rank"))
            continue
        a = from_wire(r["audit"], AuditResult)
        why = verdicts.failed(a.since_session)
        if why is not None:  # the baseline is the state a failed refit left: unchanged is not verified
            a = msgspec.structs.replace(a, problems=[*a.problems, f"its baseline is the state left by session {a.since_session}, "
                                                   f"and {why} in this trainer: the engine does not hold verified weights"])
        out.append(a)
    return settle(out, m)


def verifying_answers(engine: Any, method: str, what: str, mode: VerifyMode, timeout_s: float) -> Iterator[Mapping]:
    """The answers of the workers that verify to ``method``; a worker that does not verify raises
    :class:`RefitConfigError` in ``enforce`` ("... does not verify; ``what``"), else is logged and left out."""
    for r in require_channel(engine).call(method, timeout_s=timeout_s):
        if isinstance(r, Mapping) and r.get("verifying"):
            yield r
            continue
        msg = f"refit-verify: vLLM worker rank {r.get('rank') if isinstance(r, Mapping) else '?'} does not verify; {what}"
        if mode is VerifyMode.ENFORCE:
            raise RefitConfigError(msg)
        logger.warning("%s", msg)


def settle(results: list, mode: VerifyMode) -> list:
    """Act on audit ``results`` (each with ``ok`` and ``describe()``): in ``enforce`` any that failed raise
    :class:`AuditError` holding all of them; else each failed one is logged. Returns ``results``."""
    failed = [a for a in results if not a.ok]
    if failed:
        if mode is VerifyMode.ENFORCE:
            raise AuditError(results)
        for a in failed:
            logger.warning("refit-verify: %s", a.describe())
    return results


def certificate(engine: Any, *, timeout_s: float = 120.0) -> list[Certificate]:
    """Ask every worker of ``engine`` which weight version it holds (``refit_verify_certificate``).

    Each worker digests its engine state again and compares it with what its last session's close
    left; this trainer adds its verdict on that session (:mod:`refit_verify.verdicts`). A
    certificate is good (``cert.ok``) only when the session verified in this trainer process and
    the engine still holds exactly its state; ``cert.describe()`` says what it holds, or why not.

    Args:
        engine: what :func:`refit_verify.refit` accepts (LLM, Ray handle, HTTP URL, ...).
        timeout_s: bound on the call to the workers, seconds.

    Returns:
        list[Certificate]: one per worker, in worker order; a worker that does not verify answers
        one with no session and the reason in ``problems``.

    Raises:
        RefitConfigError: the engine lacks refit-verify's plugin, or answered for no worker.
        RefitProtocolError: a malformed answer. RefitTimeoutError: no answer within ``timeout_s``.
    """
    out: list[Certificate] = []
    for r in require_channel(engine).call("refit_verify_certificate", timeout_s=timeout_s):
        if not (isinstance(r, Mapping) and r.get("verifying")):
            rank = r.get("rank") if isinstance(r, Mapping) else None
            why = r.get("reason", "no reason given") if isinstance(r, Mapping) else repr(r)
            out.append(Certificate(worker=WorkerIdentity(rank=rank if type(rank) is int else -1), session=None, version=None,
                                   closed_at=None, state_digest=None, current_digest=None, current=False,
                                   problems=[f"this worker does not verify ({why}): it cannot say what it holds"]))
            continue
        c = from_wire(r["certificate"], Certificate)
        why = verdicts.failed(c.session)
        if why is not None:
            c = msgspec.structs.replace(c, verified=False, problems=[*c.problems, f"session {c.session} {why} in this trainer"])
        elif verdicts.passed(c.session):
            c = msgspec.structs.replace(c, verified=True)
        out.append(c)
    return out


def restart_versions(engine: Any, reason: str, *, timeout_s: float = 120.0) -> list[int | None]:
    """Restart every worker's version order: after it, a session of any version is in order again.

    Each worker rejects a session older than the newest it closed (a stale sync winning a race).
    A trainer that resumes from an earlier checkpoint into an engine that stayed up says so here,
    between refits; each worker logs ``reason`` with the version it forgot.

    Args:
        engine: what :func:`refit_verify.refit` accepts (LLM, Ray handle, HTTP URL, ...).
        reason: why (logged by every worker), a non-empty string.
        timeout_s: bound on the call to the workers, seconds.

    Returns:
        list[int | None]: per worker, in worker order, the newest closed version it forgot (None:
        none had closed, or the worker does not verify).

    Raises:
        RefitConfigError: an empty ``reason``; the engine lacks refit-verify's plugin.
        RefitProtocolError: a refit session is open on a worker. RefitTimeoutError: no answer within ``timeout_s``.
    """
    if not isinstance(reason, str) or not reason.strip():
        raise RefitConfigError(f"restart_versions needs a reason (a non-empty string), got {reason!r}")
    out: list[int | None] = []
    for r in require_channel(engine).call("refit_verify_restart_versions", reason, timeout_s=timeout_s):
        out.append(r.get("forgotten") if isinstance(r, Mapping) else None)
    return out


def engine_states(engines: Iterable[Any], timeout_s: float = 120.0) -> list[EngineSnapshot]:
    """Every worker's engine state (``refit_verify_engine_state``) of every engine, in order."""
    states = []
    for e in engines:
        for r in require_channel(e).call("refit_verify_engine_state", timeout_s=timeout_s):
            states.append(from_wire(r["state"], EngineSnapshot))
    return states


def compare_replicas(engines: Any, *, mode: VerifyMode | str | None = None, timeout_s: float = 120.0) -> StateComparison:
    """Check that replicas hold identical bytes, naming the rank that differs.

    Args:
        engines: one engine with several workers (TP ranks), or a list of engines (data-parallel
            replicas, each anything :func:`refit_verify.refit` accepts). Workers are grouped by
            (tp, pp) rank: replicas of the same rank must agree on every tensor; ranks of one
            replica must agree on tensors written whole from one delivered tensor (norms).
        mode: ``enforce`` raises on disagreement, ``log`` warns; default ``REFIT_VERIFY``
            (``off`` still compares and returns the result).

    Raises:
        ReplicaDisagreement: ``enforce`` and some tensor differs.
    """
    engs = engines if isinstance(engines, (list, tuple)) else [engines]
    states: list[EngineSnapshot] = []
    for i, e in enumerate(engs):
        for st in engine_states([e], timeout_s):
            if len(engs) > 1:  # separate engines each number their replica 0: tell them apart by position
                st = msgspec.structs.replace(st, worker=msgspec.structs.replace(st.worker, dp=i))
            states.append(st)
    res = _compare(states)
    m = _mode(mode)
    if not res.ok:
        if m is VerifyMode.ENFORCE:
            raise ReplicaDisagreement(res)
        logger.warning("refit-verify: %s", res.describe("replicas"))
    return res
