"""Worker side of vLLM's native weight-transfer API: its updates are sessions of the model boundary.

``WeightTransferEngineFactory.create_engine`` is wrapped (patch ``native.create_engine``): each
engine it creates gets instance-level ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` wrappers. ``start`` opens an implicit boundary session on the engine's
model (``opened_by="native"``; it joins a session the trainer opened explicitly), ``finish`` closes
it (vLLM's layerwise reload finalises inside ``finish``, so deferred applies are seen). Whatever the
backend hands to ``model.load_weights`` is digested by the boundary, never by a parallel copy here.

The worker method ``refit_verify_native_manifest`` returns the digests of the current or last update
(reached through ``collective_rpc`` by :class:`~refit_verify.vllm_plugin.native_trainer.NativeSendVerifier`);
``refit_verify_native_version`` sets the weight version the next update's session opens with (the
trainer calls it through :func:`refit_verify.vllm_plugin.native_trainer.next_update_version`): the
session's order is checked where every session's is (:meth:`WorkerBoundary.open
<refit_verify.boundary.worker.WorkerBoundary.open>`).

Source: vllm/distributed/weight_transfer/{base,factory,ipc_engine,nccl_engine}.py (0.26.0, 0.32.0).
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from refit_verify.config import check_version, mode_from_env
from refit_verify.manifest import digest_map_text, to_text
from refit_verify.vllm_plugin import worker_sessions as sessions
from refit_verify.vllm_plugin.rpc_names import ABANDON_METHOD, FINISH_METHOD, MANIFEST_METHOD, VERSION_METHOD

logger = logging.getLogger("refit_verify")

METHODS = (MANIFEST_METHOD, FINISH_METHOD, VERSION_METHOD, ABANDON_METHOD)
_ENGINE_ATTR = "_refit_verify_native"


class _EngineState:
    """What one worker-side engine's updates were (for ``refit_verify_native_manifest``)."""

    def __init__(self, backend: str, model: Any) -> None:
        self.backend = backend
        self.token = uuid.uuid4().hex[:16]
        self.starts = 0
        self.active = False
        self.session: str | None = None
        self.last = None  # SessionManifest of the last finished update
        self.next_version: int | None = None  # the weight version the next update opens with (taken once)
        self.model = model

    def boundary(self):
        return sessions.boundary_for_model(self.model)


def _engine_state(worker: Any) -> tuple[Any, _EngineState | None]:
    """The worker's weight-transfer engine and what its updates were (None: no engine, or not instrumented)."""
    engine = getattr(worker, "weight_transfer_engine", None)
    return engine, getattr(engine, _ENGINE_ATTR, None) if engine is not None else None


def wrap_create_engine(raw: classmethod) -> classmethod:
    original = raw.__func__

    @functools.wraps(original)
    def create_engine(cls, config, *args, **kwargs):
        engine = original(cls, config, *args, **kwargs)
        if mode_from_env().verifies:
            instrument_engine(engine, str(getattr(config, "backend", "?")))
        return engine

    return classmethod(create_engine)


def instrument_engine(engine: Any, backend: str) -> None:
    """Give one worker-side engine instance-level start / update / finish wrappers (idempotent)."""
    if getattr(engine, _ENGINE_ATTR, None) is not None:
        return
    state = _EngineState(backend, getattr(engine, "model", None))
    start, update, finish = engine.start_weight_update, engine.update_weights, engine.finish_weight_update

    def _open() -> None:
        state.model = getattr(engine, "model", state.model)  # the update target (a drafter for a draft update)
        wb = state.boundary()
        if wb is None:
            return
        if state.active and state.session is not None:  # a start without finish: that update is abandoned
            wb.abandon(state.session, "a new start_weight_update came before finish_weight_update")
        version, state.next_version = state.next_version, None
        state.session = wb.open(version=version, opened_by="native", explicit=False)

    def _close(error: str | None = None) -> None:
        wb = state.boundary()
        if wb is None or state.session is None:
            return
        if error:
            wb.note_error(error)
        man = wb.close(state.session, explicit=False)
        state.last = man if man is not None else wb.manifests.get(state.session, state.last)

    @functools.wraps(start)
    def start_weight_update(*args, **kwargs):
        _open()
        state.starts += 1
        state.active = True
        try:
            return start(*args, **kwargs)
        except BaseException as e:
            state.active = False
            _close(f"start_weight_update raised {type(e).__name__}: {e}")
            raise

    @functools.wraps(update)
    def update_weights(*args, **kwargs):
        try:
            return update(*args, **kwargs)
        except BaseException as e:
            wb = state.boundary()
            if wb is not None:
                wb.note_error(f"update_weights raised {type(e).__name__}: {e}")
            raise

    @functools.wraps(finish)
    def finish_weight_update(*args, **kwargs):
        try:
            return finish(*args, **kwargs)  # layerwise reload finalises here: deferred applies happen now
        finally:
            state.active = False
            _close()

    engine.start_weight_update = start_weight_update
    engine.update_weights = update_weights
    engine.finish_weight_update = finish_weight_update
    setattr(engine, _ENGINE_ATTR, state)


def refit_verify_native_manifest(self) -> dict[str, Any]:
    """Worker method: the digests of this worker's current or last native weight update.

    Reached through ``collective_rpc("refit_verify_native_manifest")``; plain msgpack-safe types.

    Returns:
        dict: ``rank``; ``finish_rpc`` (True: this worker also answers ``refit_verify_native_finish``);
        ``verifying`` (False when ``REFIT_VERIFY`` is off here or the worker has no
        weight-transfer engine, with ``reason``); when verifying: ``backend``, ``token`` (per
        engine), ``session`` (count of ``start_weight_update`` calls), ``active``, ``manifest``
        (``{name: 32-hex}`` of every tensor handed to ``load_weights`` in the update), ``tensors``,
        ``calls`` (``load_weights`` calls), ``digest_s`` (seconds) and ``session_manifest`` (the
        full :class:`~refit_verify.manifest.SessionManifest` of a finished update, as JSON text, ``manifest.to_text``).
        ``manifest`` is JSON text too (:func:`~refit_verify.manifest.digest_map_text`; read it with
        :func:`~refit_verify.manifest.digest_map`): vLLM's multiprocess ``collective_rpc`` decodes a
        dictionary object by object, a string in one step.
    """
    engine, state = _engine_state(self)
    out: dict[str, Any] = {"rank": getattr(self, "rank", None), "verifying": state is not None, "finish_rpc": True}
    if state is None:
        out["reason"] = ("no weight-transfer engine (LLM(..., weight_transfer_config=...) not set)" if engine is None
                         else f"REFIT_VERIFY={mode_from_env().value} in this vLLM worker")
        return out
    wb = state.boundary()
    if state.active and wb is not None and wb.current_id() == state.session:
        digests, calls, tensors, digest_s = wb.snapshot()
        full = None
    elif state.last is not None:
        digests = state.last.digests()
        calls = sum(m.calls for m in state.last.modules.values())
        tensors = len(digests)
        digest_s = sum(m.digest_s for m in state.last.modules.values())
        full = to_text(state.last)
    else:
        digests, calls, tensors, digest_s, full = {}, 0, 0, 0.0, None
    out.update(backend=state.backend, token=state.token, session=state.starts, active=state.active, manifest=digest_map_text(digests),
               tensors=tensors, calls=calls, digest_s=digest_s, session_manifest=full)
    if wb is not None:
        out["rank"] = wb.identity.rank if out["rank"] is None else out["rank"]
    return out


def refit_verify_native_version(self, version: int | None) -> dict[str, Any]:
    """Worker method: the weight version this worker's next native update (``start_weight_update``)
    opens its session with; taken by that update, then None again (unversioned).

    Args:
        version: the trainer's step, an int >= 0, or None (the next update is unversioned).

    Returns:
        dict: ``rank``, ``verifying`` (False when ``REFIT_VERIFY`` is off here or the worker has no
        weight-transfer engine, with ``reason``), ``version`` (the version set, when verifying).

    Raises:
        RefitConfigError: ``version`` is neither None nor an int >= 0.
    """
    version = check_version(version)
    engine, state = _engine_state(self)
    if state is None:
        return {"rank": getattr(self, "rank", None), "verifying": False,
                "reason": ("no weight-transfer engine (LLM(..., weight_transfer_config=...) not set)" if engine is None
                           else f"REFIT_VERIFY={mode_from_env().value} in this vLLM worker")}
    state.next_version = version
    return {"rank": getattr(self, "rank", None), "verifying": True, "version": version}


def refit_verify_native_abandon(self, why: str) -> dict[str, Any]:
    """Worker method: the trainer's send into this worker's open native update raised (``why``); the
    update's session records it as an error, so the state it leaves is failed whoever compares it,
    and an audit of that state fails (:meth:`WorkerBoundary.audit <refit_verify.boundary.worker.WorkerBoundary.audit>`).

    Returns:
        dict: ``rank``, ``verifying``, ``marked`` (False: no native update was open here).
    """
    engine, state = _engine_state(self)
    wb = state.boundary() if state is not None else None
    marked = bool(state is not None and state.active and wb is not None and state.session is not None
                  and wb.fail_open(state.session, f"the trainer's send into this update raised before it finished ({why})"[:500]))
    return {"rank": getattr(self, "rank", None), "verifying": state is not None, "marked": marked}


def refit_verify_native_finish(self) -> dict[str, Any]:
    """Worker method: vLLM's ``finish_weight_update``, then :func:`refit_verify_native_manifest`.

    One ``collective_rpc`` closes the update and returns the manifest of the session it closed
    (vLLM 0.26's ``LLM.finish_weight_update`` is that RPC with the result dropped; the trainer's
    wrapper calls this instead, :func:`refit_verify.vllm_plugin.native_trainer._wrap_llm_finish`). An error
    of ``finish_weight_update`` propagates as it would through vLLM's own RPC.

    Returns:
        dict: as :func:`refit_verify_native_manifest`; if building it fails (the finish happened),
        ``rank``, ``verifying`` and ``error`` (the exception, as text): never an exception of ours.
    """
    self.finish_weight_update()
    try:
        return refit_verify_native_manifest(self)
    except Exception as e:  # noqa: BLE001 - the finish happened: the trainer reports this as the check's failure
        return {"rank": getattr(self, "rank", None), "verifying": True, "finish_rpc": True, "error": f"{type(e).__name__}: {e}"[:2000]}
