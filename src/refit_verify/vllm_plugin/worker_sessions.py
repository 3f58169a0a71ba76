"""Worker side of the model boundary: one :class:`~refit_verify.boundary.worker.WorkerBoundary` per vLLM
worker, attached once its models are loaded, and the session methods reached through
``collective_rpc``.

* ``Worker.load_model`` is wrapped (:func:`wrap_load_model`): when it returns, the main model and the
  drafter (speculative decoding, MTP) get their boundary; works for multiprocess workers and for the
  in-process worker of ``distributed_executor_backend="external_launcher"`` (TRL colocate).
* ``Worker.reload_weights`` is wrapped so that loads from disk outside a session are reported as
  such (``Unsessioned.where == "reload_weights"``).
* Worker methods ``refit_verify_session_open`` / ``_close`` / ``_manifest``, ``refit_verify_engine_state``,
  ``refit_verify_audit`` and ``refit_verify_certificate`` (added to ``WorkerBase`` by ``register()``).

A worker whose ``REFIT_VERIFY`` is ``off`` gets no boundary: its methods answer ``verifying: False``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import weakref
from collections.abc import Mapping
from typing import Any

from refit_verify.boundary.worker import WorkerBoundary
from refit_verify.config import mode_from_env
from refit_verify.errors import RefitConfigError
from refit_verify.manifest import Producer, local_reply_token, to_text
from refit_verify.vllm_plugin import runner, shims, worker_warmup

logger = logging.getLogger("refit_verify")

METHODS = ("refit_verify_session_open", "refit_verify_session_close", "refit_verify_session_manifest",
           "refit_verify_engine_state", "refit_verify_audit", "refit_verify_certificate", "refit_verify_layout_map",
           "refit_verify_restart_versions")
_ATTR = "_refit_verify_boundary"
_BY_MODEL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> WorkerBoundary


def _new_boundary(identity) -> WorkerBoundary:
    from refit_verify.engine import state as engine_state

    wb = WorkerBoundary(identity, verifying=True)
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    return wb


def boundary_of(worker: Any) -> WorkerBoundary | None:
    """Return the worker's boundary (attaching its models if needed), or None when not verifying:
    ``REFIT_VERIFY=off``, or the plugin cannot find the worker's model (:func:`runner.unverifiable`,
    logged; the worker's methods then answer ``verifying: False`` with the reason)."""
    wb = getattr(worker, _ATTR, None)
    if wb is not None:
        return wb
    if not mode_from_env().verifies or runner.unverifiable(worker) is not None:
        return None
    wb = _new_boundary(runner.identity(worker))
    setattr(worker, _ATTR, wb)
    logger.info("refit-verify: verifying worker rank %s: %s", wb.identity.rank, runner.describe(worker))
    attach_models(worker, wb)
    return wb


def attach_models(worker: Any, wb: WorkerBoundary, refresh: bool = True) -> None:
    """Attach the main model and the drafter of ``worker`` to ``wb`` (idempotent; ``refresh``: see
    :meth:`WorkerBoundary.attach`)."""
    default = shims.default_weight_loader()
    found = runner.models(worker)  # (None, None) before the model is loaded
    for role, m in (("model", found.model), ("drafter", found.drafter)):
        if m is not None and wb.attach(role, m, default, shims.layerwise_restore_params, refresh=refresh) is not None:
            _BY_MODEL[m] = wb


def boundary_for_model(model: Any) -> WorkerBoundary | None:
    """The boundary a model belongs to; a bare one (rank 0) for a model no worker attached."""
    wb = _BY_MODEL.get(model)
    if wb is None and mode_from_env().verifies and callable(getattr(model, "load_weights", None)):
        from refit_verify.boundary.worker import identity_of

        wb = _new_boundary(identity_of(0))
        wb.attach("model", model, shims.default_weight_loader(), shims.layerwise_restore_params)
        _BY_MODEL[model] = wb
    return wb


# --------------------------------------------------------------------------- patches


def wrap_load_model(raw):
    @functools.wraps(raw)
    def load_model(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        if mode_from_env().verifies:
            wb = boundary_of(self)
            if wb is not None:
                attach_models(self, wb)
                worker_warmup.after_load(self, wb)  # the first session's index and kept set, before any refit
        return out

    return load_model


def wrap_reload_weights(raw):
    @functools.wraps(raw)
    def reload_weights(self, *args, **kwargs):
        wb = getattr(self, _ATTR, None)
        if wb is None:
            return raw(self, *args, **kwargs)
        prev, wb.loading_context = wb.loading_context, "reload_weights"
        try:
            out = raw(self, *args, **kwargs)
        finally:
            wb.loading_context = prev
        attach_models(self, wb)
        wb.audit("reload_weights")
        return out

    return reload_weights


_SLEPT = "_refit_verify_sleep_level"  # a worker's attribute: the level of its last sleep, until its weights wake


def wrap_wake_up(raw):
    """After ``wake_up`` outside a session, audit: weights lost or moved by sleep are named. After a
    sleep at level 2, which discards the weights by design, a wake that gives their memory back
    (``tags`` None or naming ``"weights"``) keeps what changed as changed outside any refit
    (:meth:`WorkerBoundary.discarded <refit_verify.boundary.worker.WorkerBoundary.discarded>`): a
    refit that writes it whole verifies, anything else fails until one does."""

    @functools.wraps(raw)
    def wake_up(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        tags = args[0] if args else kwargs.get("tags")
        weights = tags is None or "weights" in tags
        discarded = weights and getattr(self, _SLEPT, None) == 2
        if weights and hasattr(self, _SLEPT):
            delattr(self, _SLEPT)
        wb = getattr(self, _ATTR, None)
        if wb is not None and wb.open_session is None:
            if discarded:
                wb.discarded("sleep(level=2)")
            else:
                wb.audit("wake_up")
        return out

    return wake_up


def wrap_sleep(raw):
    """Before ``sleep``, give back what refit-verify holds on the GPU outside vLLM's allocator: the
    captured graphs of kept digest plans with their work areas (:func:`refit_verify.digest.kernels.replay.release_all`)
    and the reload copies' pools (:func:`refit_verify.vllm_plugin.worker_copies.release_pools`); vLLM's sleep
    then empties the cache. After the wake, kept plans capture again and a new pool is made. The
    sleep's level is kept for the wake (:func:`wrap_wake_up`)."""

    @functools.wraps(raw)
    def sleep(self, *args, **kwargs):
        release_gpu_holdings()
        out = raw(self, *args, **kwargs)
        try:  # read by the wake (wrap_wake_up)
            setattr(self, _SLEPT, args[0] if args else kwargs.get("level", 1))
        except (AttributeError, TypeError):  # a worker that takes no attribute: its wake audits as after any sleep
            pass
        return out

    return sleep


def release_gpu_holdings() -> tuple[int, int]:
    """Drop the graphs of kept plans and the copies' pools of this process (never raises: logged).

    Returns:
        tuple[int, int]: graphs dropped, pools dropped (``(0, 0)`` when nothing was held or on failure).
    """
    try:
        from refit_verify.digest.kernels import replay
        from refit_verify.vllm_plugin import worker_copies

        return replay.release_all(), worker_copies.release_pools()
    except Exception:  # noqa: BLE001 - sleep goes on; the memory just stays held
        logging.getLogger("refit_verify").exception("refit-verify: releasing graphs and pools before sleep failed")
        return 0, 0


# --------------------------------------------------------------------------- worker methods

_OPEN_KEYS = {"version": "an int >= 0 or None (the trainer's step)", "partial": "True or False",
              "allow": "a list of fnmatch patterns (str)", "readback": "True or False",
              "producer": "None or {'rank': int, 'device': str}",
              "deadline": "a finite time.time() in seconds (the trainer's wait ends then)",
              "replay": "True or False (False: watch every load and learn the refit plan again)",
              "base": "an int >= 0 (a delta refit: the weight version it applies to)",
              "state": "True or False (True: a check of the state, nothing is pushed)"}
DEADLINE_SKEW_S = 1.0
"""Seconds past its deadline an open is still taken (clock differences between hosts). Below the
trainer's own grace (``engines.GRACE_S``), so on one host an open the trainer stopped waiting for is
always refused; across hosts whose clocks differ by more, the trainer's close after its timeout
(queued behind the open) ends the session."""


def _open_options(options: Mapping[str, Any] | None) -> dict[str, Any]:
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise RefitConfigError(f"refit_verify_session_open options must be a mapping, got {type(options).__name__}")
    out: dict[str, Any] = {}
    for k, v in options.items():
        if k not in _OPEN_KEYS:
            raise RefitConfigError(f"unknown session option {k!r}; accepted: {', '.join(_OPEN_KEYS)}")
        ok = {"version": v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
              "base": v is None or (isinstance(v, int) and not isinstance(v, bool) and v >= 0),
              "partial": isinstance(v, bool), "readback": isinstance(v, bool), "replay": isinstance(v, bool),
              "state": isinstance(v, bool),
              "allow": isinstance(v, (list, tuple)) and all(isinstance(p, str) for p in v),
              "producer": v is None or (isinstance(v, Mapping) and isinstance(v.get("rank"), int) and isinstance(v.get("device", "cpu"), str)),
              "deadline": isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}[k]
        if not ok:
            raise RefitConfigError(f"session option {k}={v!r} is not accepted; accepted: {_OPEN_KEYS[k]}")
        out[k] = Producer(rank=v["rank"], device=v.get("device", "cpu")) if k == "producer" and v is not None else v
    if "allow" in out:
        out["allow"] = tuple(out["allow"])
    return out


def _not_verifying(self) -> dict[str, Any]:
    return {"rank": getattr(self, "rank", None), "verifying": False, "reason": not_verifying_reason(self)}


def not_verifying_reason(worker: Any) -> str:
    """Why ``worker`` answers ``verifying: False``: its ``REFIT_VERIFY``, or ``"not verifying: <why>"``
    where the plugin cannot find its model (:func:`runner.unverifiable`)."""
    mode = mode_from_env()
    why = runner.unverifiable(worker) if mode.verifies else None
    return f"not verifying: {why}" if why else f"REFIT_VERIFY={mode.value} in this vLLM worker"


def refit_verify_session_open(self, session_id: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Open refit session ``session_id`` on this worker (every later ``load_weights`` belongs to it).

    Args:
        session_id: the id the trainer chose (a non-empty str of at most 128 characters).
        options: ``version`` (the trainer's step), ``partial`` (not every parameter will be written),
            ``allow`` (fnmatch patterns of names exempt from the coverage checks), ``readback``
            (read the engine's parameters back at close; default True), ``replay`` (a module may replay
            the refit plan its last session left, :mod:`refit_verify.boundary.plan`; default True), ``producer``, ``deadline``
            (``time.time()`` after which the trainer no longer waits: a later open is refused, so a
            call that was queued behind another one never opens a session nobody will close).

    Returns:
        dict: ``rank``, ``verifying``, ``session`` (the id), or ``reason`` when not verifying;
        ``expired`` (True, ``session`` None) when it arrived after its deadline.

    Raises:
        RefitConfigError: a bad id or option.
        RefitProtocolError: another explicit session is still open on this worker.
    """
    if not isinstance(session_id, str) or not 0 < len(session_id) <= 128:
        raise RefitConfigError(f"session_id must be a non-empty str of at most 128 characters, got {session_id!r:.80}")
    opts = _open_options(options)
    deadline = opts.pop("deadline", None)
    wb = boundary_of(self)
    if wb is None:
        return _not_verifying(self)
    if deadline is not None and time.time() > deadline + DEADLINE_SKEW_S:
        logger.warning("refit-verify: session %s arrived %.1f s after the trainer stopped waiting; not opened",
                       session_id, time.time() - deadline)
        return {"rank": wb.identity.rank, "verifying": True, "session": None, "expired": True}
    attach_models(self, wb, refresh=False)  # the open wraps every module's parameters itself
    sid = wb.open(session_id, opened_by="rpc", explicit=True, **opts)
    return {"rank": wb.identity.rank, "verifying": True, "session": sid}


def refit_verify_session_close(self, session_id: str, reply_to: str | None = None,
                               announced: dict[str, Any] | None = None) -> dict[str, Any]:
    """Close session ``session_id`` and return this worker's manifest.

    Args:
        session_id: the session to close.
        reply_to: the caller's :func:`~refit_verify.manifest.local_reply_token` (a trainer that calls
            an in-process engine): when it is this process's own, the manifest is returned as the
            record itself, not encoded.
        announced: ``{module: {name: [32-hex, shape, dtype name]}}`` of every tensor the trainer
            announced: those no ``load_weights`` of the session delivered are judged by the engine
            state through the layout map (:meth:`WorkerBoundary.close`).

    Returns:
        dict: ``rank``, ``verifying`` and, when verifying, ``manifest``: a
        :class:`~refit_verify.manifest.SessionManifest` as JSON text (``manifest.to_text``; ``from_wire`` rebuilds it),
        or the record itself for a caller in this process (``reply_to``).

    Raises:
        RefitProtocolError: another session is open on this worker, or none was (``manifest`` None
            then only when ``session_id`` was never opened here).
        RefitConfigError: ``announced`` is not of that form.
    """
    wb = getattr(self, _ATTR, None)
    if wb is None:
        return _not_verifying(self)
    man = wb.close(session_id, explicit=True, expected=_announced(announced))
    if man is None:
        man = wb.manifests.get(session_id)
    if man is not None and not (reply_to is not None and reply_to == local_reply_token()):
        man = to_text(man)
    return {"rank": wb.identity.rank, "verifying": True, "manifest": man}


_ANNOUNCED = dict[str, dict[str, tuple[str, list[int], str]]]


def _announced(data: Any) -> dict[str, dict[str, tuple[str, tuple[int, ...], str]]] | None:
    """``announced`` of :func:`refit_verify_session_close`, validated (msgspec), shapes as tuples."""
    if data is None:
        return None
    import msgspec

    try:
        got = msgspec.convert(data, _ANNOUNCED, strict=True)
    except msgspec.ValidationError as e:
        raise RefitConfigError(f"refit_verify_session_close: announced must be {{module: {{name: [32-hex, shape, dtype]}}}}: {e}") from None
    return {m: {n: (h, tuple(sh), dt) for n, (h, sh, dt) in names.items()} for m, names in got.items()}


def refit_verify_layout_map(self, specs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return this worker's layout maps (which trainer tensor each parameter region holds), learning
    ``specs`` first where a map lacks them (a dry learn: the model's ``load_weights`` on placeholders,
    no write reaching the engine; :mod:`refit_verify.boundary.layout`).

    Args:
        specs: ``{module: {name: [shape, dtype name]}}``, or None (return the maps as they are).

    Returns:
        dict: ``rank``, ``verifying``, ``maps`` (``{module: LayoutMap.summary()}``; a module with no
        map: None) and ``notes`` (``{module: [what was learned]}``).

    Raises:
        RefitConfigError: ``specs`` is not of that form.
        RefitProtocolError: a session is open on this worker, or it has no such module.
    """
    import msgspec

    wb = boundary_of(self)
    if wb is None:
        return _not_verifying(self)
    try:
        want = msgspec.convert(specs or {}, dict[str, dict[str, tuple[list[int], str]]], strict=True)
    except msgspec.ValidationError as e:
        raise RefitConfigError(f"refit_verify_layout_map: specs must be {{module: {{name: [shape, dtype]}}}}: {e}") from None
    attach_models(self, wb, refresh=False)
    notes = {role: wb.layout_for(role, {n: (tuple(sh), dt) for n, (sh, dt) in names.items()}) for role, names in want.items()}
    maps = {role: (b.layout.summary() if b.layout is not None else None) for role, b in wb.modules.items()}
    return {"rank": wb.identity.rank, "verifying": True, "maps": maps, "notes": notes}


def refit_verify_session_manifest(self, session_id: str | None = None) -> dict[str, Any]:
    """Return the manifest of a closed session (the last one when ``session_id`` is None)."""
    wb = getattr(self, _ATTR, None)
    if wb is None:
        return _not_verifying(self)
    man = wb.last if session_id is None else wb.manifests.get(session_id)
    return {"rank": wb.identity.rank, "verifying": True, "manifest": to_text(man) if man is not None else None,
            "open": wb.current_id()}


def refit_verify_engine_state(self) -> dict[str, Any]:
    """Return this worker's engine state now: an :class:`~refit_verify.manifest.EngineSnapshot` as JSON text
    (every parameter and persistent buffer digested, with storage pointers), under ``state``."""
    wb = getattr(self, _ATTR, None) or boundary_of(self)
    if wb is None:  # an explicit request: digest the state even where REFIT_VERIFY is off (the canary's fresh engine)
        from refit_verify.engine import state as engine_state

        found = runner.models(self)
        modules = {"model": runner.main_model(self)}
        if found.drafter is not None:
            modules["drafter"] = found.drafter
        state = engine_state.snapshot(modules, runner.identity(self))
        return {"rank": getattr(self, "rank", 0), "verifying": False, "state": to_text(state)}
    attach_models(self, wb)
    return {"rank": wb.identity.rank, "verifying": True, "state": to_text(wb.state())}


def refit_verify_audit(self) -> dict[str, Any]:
    """Audit this worker now: re-digest its engine state and compare with what the last session left.

    Returns:
        dict: ``rank``, ``verifying``, ``audit`` (an :class:`~refit_verify.manifest.AuditResult` as
        JSON text, or None when no session has closed here yet).
    """
    wb = getattr(self, _ATTR, None)
    if wb is None:
        return _not_verifying(self)
    res = wb.audit("rpc")
    return {"rank": wb.identity.rank, "verifying": True, "audit": to_text(res) if res is not None else None}


def refit_verify_certificate(self) -> dict[str, Any]:
    """Say which weight version this worker holds and whether its engine still holds what the last
    session's close left (the engine state is digested again now).

    Returns:
        dict: ``rank``, ``verifying``, ``certificate`` (a :class:`~refit_verify.manifest.Certificate`
        as JSON text; its ``verified`` is None: the trainer knows the verdict), or ``reason`` when
        not verifying.
    """
    wb = getattr(self, _ATTR, None)
    if wb is None:
        return _not_verifying(self)
    return {"rank": wb.identity.rank, "verifying": True, "certificate": to_text(wb.certificate())}


def refit_verify_restart_versions(self, reason: str) -> dict[str, Any]:
    """Restart this worker's version order (:meth:`WorkerBoundary.restart_versions`).

    Returns:
        dict: ``rank``, ``verifying``, ``forgotten`` (the newest closed version, or None), or
        ``reason`` when not verifying.

    Raises:
        RefitConfigError: an empty ``reason``. RefitProtocolError: a session is open here.
    """
    wb = getattr(self, _ATTR, None)
    if wb is None:
        return _not_verifying(self)
    return {"rank": wb.identity.rank, "verifying": True, "forgotten": wb.restart_versions(reason)}
