"""Trainer side of vLLM's native weight-transfer API: digest what is exported, then compare with
every worker's manifest, with no user code change.

:func:`install` runs from the plugin's ``register()`` in the trainer's process (vLLM loads plugins in
every process that builds an engine; elsewhere call ``refit_verify.vllm_plugin.register()``) when
``REFIT_VERIFY`` is ``log`` or ``enforce``; with ``off`` it patches nothing. What it wraps:

* ``TrainerWeightTransferEngine.__init__`` (vLLM >= 0.27 trainer engines): each engine's
  ``send_weights`` iterates a digesting proxy of its ``WeightSource``, then fetches every worker's
  manifest (``refit_verify_native_manifest``, the worker side is
  :mod:`refit_verify.vllm_plugin.native_worker`) and compares;
* where they exist (vLLM 0.26), the static ``IPCWeightTransferEngine.trainer_send_weights`` and
  ``NCCLWeightTransferEngine.trainer_send_weights``, whose iterators are wrapped the same way;
* ``LLM.update_weights`` / ``start_weight_update`` / ``finish_weight_update`` / ``collective_rpc``,
  to note which in-process engine an update went to (or is open on), for senders whose arguments
  name no client (``nccl``: a process group only), and to check the sends made into an update when
  it closes (``finish_weight_update``, or ``collective_rpc("finish_weight_update")``).

When a static send (0.26) goes into an in-process ``LLM``'s open update (that ``LLM`` and no other),
its check is left to that update's close: one fetch of the workers' manifests checks the whole
session (coverage, apply-time digests, read-back) after the layerwise reload finalised; from the
``LLM``'s second update on, 0.26's one-line finish and that fetch are one RPC. A new
``start_weight_update`` before that finish checks the pending sends first (by their delivered
digests: the update never closed), and sends still pending when the process exits are named in a
warning. A send with no such update in this process (a Ray or HTTP client, an engine elsewhere)
is checked right after the send.

:class:`NativeSendVerifier` (:mod:`refit_verify.vllm_plugin.native_sender`) is the same logic as an explicit helper, for trainers that run where
vLLM's plugins are never loaded (a Ray actor) or use a client refit-verify cannot reach the
workers through. :func:`next_update_version` names the weight version of the next update (before
``start_weight_update``); each worker checks its order. ``enforce`` raises :class:`~refit_verify.errors.RefitVerificationError` naming the
parameters and the worker rank; ``log`` logs a warning. The mode is read from ``REFIT_VERIFY`` at
each send.

The module stays whole past 500 lines: its wrappers (trainer engines, static senders, the in-process
``LLM``) share one table of pending sends and one lock, and are installed and undone together.

Source: vllm/distributed/weight_transfer/{base,factory,ipc_engine,nccl_engine}.py (0.26.0 and 0.32.0).
"""

from __future__ import annotations

import atexit
import functools
import logging
import math
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

from refit_verify.config import RefitConfig, VerifyMode, check_version, mode_from_env
from refit_verify.errors import RefitConfigError, RefitTimeoutError
from refit_verify.report import VerificationReport
from refit_verify.trainer.overlap import run_in_shadow
from refit_verify.vllm_plugin import shims
from refit_verify.vllm_plugin.native_sender import (  # noqa: F401  (FETCH_TIMEOUT_S: re-exported)
    _ACTIVE,
    _LAST,
    _LOCK,
    _OPEN,
    _PENDING,
    FETCH_TIMEOUT_S,
    NativeSendVerifier,
    _Wrapped,
)
from refit_verify.vllm_plugin.rpc_names import FINISH_METHOD, MANIFEST_METHOD, VERSION_METHOD

logger = logging.getLogger("refit_verify")

__all__ = ["MANIFEST_METHOD", "NativeSendVerifier", "detect", "install", "last_reports", "next_update_version", "status"]

UNSUPPORTED_BACKENDS = frozenset({"sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress"})
"""Trainer backends that ship deltas or partial shards, or load without ``model.load_weights``:
the worker's loaded tensors are not the exported ones, so their digests cannot be compared."""

_STATE: dict[str, Any] = {"installed": False, "mode": None, "version": None, "sender_paths": ()}
STATIC_SENDERS = {"vllm.distributed.weight_transfer.ipc_engine": "IPCWeightTransferEngine",
                  "vllm.distributed.weight_transfer.nccl_engine": "NCCLWeightTransferEngine"}
"""vLLM 0.26's static ``trainer_send_weights`` entries (module -> engine class) that get wrapped."""

detect = shims.detect_native


def status() -> dict[str, Any]:
    """Return what :func:`install` did in this process: ``installed``, ``mode``, ``version``,
    ``sender_paths`` and ``patched`` (labels of every attribute the plugin wrapped)."""
    with _LOCK:
        out = dict(_STATE)
    out["patched"] = list(shims.APPLIED)
    return out


def next_update_version(engine: Any, version: int | None, *, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Name the weight version of ``engine``'s next native weight update (call it before
    ``start_weight_update``): every worker opens that update's session with it.

    A worker that already closed this version or a newer one reports the update as stale (a
    ``problems`` entry of its report: ``enforce`` raises when the update is checked). Each worker
    takes the version once, with its next ``start_weight_update``; an update with no version named
    before it is unversioned (never out of order).

    Args:
        engine: what :func:`refit_verify.refit` takes: a ``vllm.LLM``, an object with
            ``collective_rpc``, a Ray actor handle, a ``vllm serve`` base URL.
        version: the trainer's step, an int >= 0, or None (the next update is unversioned).
        timeout_s: bound, in seconds, on the call to the workers.

    Returns:
        list[dict]: every worker's answer (``rank``, ``verifying``, ``version``); empty when
        ``REFIT_VERIFY`` is ``off`` in this process (nothing is called).

    Raises:
        RefitConfigError: ``version`` is neither None nor an int >= 0; in ``enforce``, a worker that
            does not verify or has no weight-transfer engine (``log`` warns).
        RefitTimeoutError: the workers did not answer within ``timeout_s``.
    """
    from refit_verify.trainer.channel import require_channel

    version = check_version(version)
    mode = mode_from_env()
    if not mode.verifies:
        return []
    answers = list(require_channel(engine).call(VERSION_METHOD, version, timeout_s=timeout_s))
    idle = [a for a in answers if not (isinstance(a, dict) and a.get("verifying"))]
    if idle:
        a = idle[0]
        msg = (f"refit-verify: the next native update's version {version} does not reach vLLM worker rank "
               f"{a.get('rank') if isinstance(a, dict) else '?'} "
               f"({a.get('reason', 'no reason given') if isinstance(a, dict) else repr(a)})")
        if mode is VerifyMode.ENFORCE:
            raise RefitConfigError(msg)
        logger.warning("%s", msg)
    return answers


def last_reports() -> list[VerificationReport]:
    """Return the per-worker reports of the last verified native send in this process."""
    return list(_LAST["reports"])


def install(mode: VerifyMode) -> None:
    """Wrap the trainer side of this process's native weight-transfer API for ``mode``; idempotent.

    With ``off`` nothing is patched. A vLLM without the native API (before 0.26) gets nothing here:
    its refits are verified at the model boundary.
    """
    if not mode.verifies:
        return
    with _LOCK:
        if _STATE["installed"]:
            return
        info = detect()
        if info["problem"] is None:
            from vllm.distributed.weight_transfer import base

            if "trainer_engine" in info["sender"]:
                shims.patch(base.TrainerWeightTransferEngine, "__init__", _wrap_trainer_init)
            if "static" in info["sender"]:
                for module_name, cls_name in STATIC_SENDERS.items():
                    shims.when_imported(module_name, functools.partial(_patch_static_sender, cls_name))
            shims.when_imported("vllm.entrypoints.llm", _patch_llm_tracking)
        _STATE.update(installed=True, mode=mode.value, version=info["version"], sender_paths=info["sender"])


def forget() -> None:
    """Forget that :func:`install` ran (:func:`refit_verify.vllm_plugin.patches.undo` calls it)."""
    with _LOCK:
        _STATE.update(installed=False, mode=None, version=None, sender_paths=())


# -- vLLM >= 0.27 trainer engines


def _wrap_trainer_init(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def __init__(self, *args, **kwargs):
        raw(self, *args, **kwargs)
        _instrument_trainer_engine(self)

    return __init__


def _backend_of(engine: Any) -> str:
    info_cls = getattr(type(engine), "init_info_cls", None)
    return str(getattr(info_cls, "backend", None) or type(engine).__name__)


def _instrument_trainer_engine(engine: Any) -> None:
    """Wrap one trainer engine's ``send_weights`` (instance level) to digest and verify."""
    if getattr(vars(engine).get("send_weights"), shims.MARK, False):
        return
    mode = mode_from_env()
    backend = _backend_of(engine)
    why = _unverifiable(engine, backend)
    if why and mode.verifies and getattr(engine, "is_sender", True):
        msg = f"refit-verify cannot verify weight-transfer backend {backend!r}: {why}"
        if mode is VerifyMode.ENFORCE:
            raise RefitConfigError(msg + "; set REFIT_VERIFY=off for this trainer or use a full-tensor backend (ipc, nccl)")
        logger.warning("%s; its updates are not verified", msg)
    original = engine.send_weights

    @functools.wraps(original)
    def send_weights(*args, **kwargs):
        mode = mode_from_env()
        if not mode.verifies or not getattr(engine, "is_sender", True) or _unverifiable(engine, backend):
            return original(*args, **kwargs)
        verifier = NativeSendVerifier(getattr(engine, "client", None), mode=mode)
        llm = _llm_behind(verifier.target)
        if llm is not None and _engine_elsewhere(llm):  # its client's update_weights waits on that LLM: digest meanwhile
            verifier.defer(_defer_budget(engine if hasattr(engine, "packed") else getattr(engine, "info", engine)), llm)
        source = engine.source
        engine.source = _digesting_source(source, verifier)
        try:
            with verifier:
                out = original(*args, **kwargs)
        except BaseException as e:
            _failed_send(verifier, e, llm)
            raise
        finally:
            engine.source = source
        engine.refit_verify_reports = verifier.verify()
        return out

    setattr(send_weights, shims.MARK, True)
    engine.send_weights = send_weights


def _unverifiable(engine: Any, backend: str) -> str | None:
    if backend in UNSUPPORTED_BACKENDS:
        return "it ships deltas or partial shards, or loads without model.load_weights"
    source = getattr(engine, "source", None)
    if source is None:
        return "it has no WeightSource (per-round payloads)"
    held = getattr(source, "held_names", None)
    if callable(held) and held() is not None:
        return "its WeightSource holds only part of the model on this rank"
    return None


_SOURCE_CLS: dict[type, type] = {}


def _digesting_source(inner: Any, verifier: NativeSendVerifier) -> Any:
    """Return a ``WeightSource`` that yields ``inner``'s pairs, digesting each as it is exported."""
    from vllm.distributed.weight_transfer.base import WeightSource

    cls = _SOURCE_CLS.get(WeightSource)
    if cls is None:

        class DigestingSource(WeightSource):
            def __init__(self, inner, verifier):
                self._inner, self._verifier = inner, verifier

            def metadata(self):
                return self._inner.metadata()

            def __iter__(self):
                return self._verifier.wrap(iter(self._inner))

            def held_names(self):
                return self._inner.held_names()

            def groups(self):
                return self._inner.groups()

            def iter_groups(self):
                for names, tensors in self._inner.iter_groups():
                    for n, t in zip(names, tensors):
                        if t is not None:
                            self._verifier.add(n, t)
                    yield names, tensors

            def __getattr__(self, name):
                if name.startswith("_"):
                    raise AttributeError(name)
                return getattr(self._inner, name)

        cls = _SOURCE_CLS[WeightSource] = DigestingSource
    return cls(inner, verifier)


# -- vLLM 0.26 static senders (ipc, nccl)


def _patch_static_sender(cls_name: str, module: Any) -> None:
    cls = getattr(module, cls_name, None)
    if cls is None or not isinstance(cls.__dict__.get("trainer_send_weights"), staticmethod):
        return
    with _LOCK:
        shims.patch(cls, "trainer_send_weights", _wrap_static_sender)


def _wrap_static_sender(raw: staticmethod) -> staticmethod:
    original = raw.__func__

    @functools.wraps(original)
    def trainer_send_weights(iterator, trainer_args):
        mode = mode_from_env()
        if mode.verifies and not _is_rank_zero() and not isinstance(iterator, _Wrapped):
            _warn_once("refit-verify: trainer_send_weights on global rank %d is not verified (only global rank 0's sends "
                       "are; use NativeSendVerifier(target).wrap(...) to verify this one)", _global_rank())
        if not mode.verifies or not _is_rank_zero() or isinstance(iterator, _Wrapped):
            return original(iterator, trainer_args)
        verifier = NativeSendVerifier(_target_of_trainer_args(trainer_args), mode=mode)
        _LAST["reports"] = []  # a send that fails before its check leaves no earlier pass in view
        llm = _shadow_target(verifier, trainer_args)
        if llm is not None:
            verifier.defer(_defer_budget(trainer_args), llm)
        try:
            with verifier:
                out = original(verifier.wrap(iterator), trainer_args)
        except BaseException as e:
            _failed_send(verifier, e)
            raise
        if _deferred(verifier):  # its update's finish (or the next start) in this process checks the whole session
            verifier._stream.launch()  # the last digests read the exported tensors now, in stream order
            return out
        _wait_for_device()
        verifier.verify()  # delivered digests now: nothing in this process will check this update's close
        if verifier.open_updates:
            _pend(verifier)
        return out

    return staticmethod(trainer_send_weights)


def _failed_send(verifier: NativeSendVerifier, error: BaseException, llm: Any = None) -> None:
    """A send that raised may have fed part of an update: when that update is an in-process ``LLM``'s
    open one (``llm``: the one behind the trainer engine's client, when known), its finish checks the
    session with the send's failure among the problems, so the verdict on it is a failure (audits of
    the state it leaves fail). Elsewhere (a remote engine) the workers are told
    (:meth:`NativeSendVerifier.abandon`): the session records it as an error when it closes. Never raises."""
    try:
        verifier.send_error = f"{type(error).__name__}: {error}"[:300]
        if llm is not None:
            verifier.target = llm
        if not _deferred(verifier) and verifier.mode.verifies:
            verifier.abandon()
    except Exception:  # noqa: BLE001 - the send's own error is what the caller gets
        logger.exception("refit-verify: keeping a failed send for its update's finish failed")


def _deferred(verifier: NativeSendVerifier) -> bool:
    """Leave ``verifier``'s check to the close of the update it fed, when that update is an in-process
    ``LLM``'s open one (``start_weight_update`` went through the tracking wrapper); True iff it was
    left there. A check at the send would cost a second fetch of the manifests and a read of the open
    update's landed tensors. The module docstring says what happens to a send left pending
    (:func:`_wrap_llm_start`, :func:`_unchecked_at_exit`)."""
    with _LOCK:
        live = [llm for llm in (r() for r in _OPEN) if llm is not None]
        fed = [llm for llm in live if verifier._feeds(llm)]
        if not fed and verifier.target is None and not verifier.engines and len(live) == 1:
            fed = live  # nccl: the update went out before the send began; the one open update is the one fed
            verifier._saw_engine(live[0])
        if len(fed) != 1:  # none, or not one engine for sure: checked right after the send (which says why)
            return False
        verifier.open_updates = True
        _pend(verifier)
    return True


def _pend(verifier: NativeSendVerifier) -> None:
    """Leave ``verifier`` to its update's finish (:data:`_PENDING`), holding its engine weakly: an
    engine the user drops before that finish (a failed update never finished, the engine rebuilt)
    is freed with its workers, and the sends into it leave the list, named in a warning
    (:func:`_prune_gone`)."""
    verifier._hold_target_weakly()
    with _LOCK:
        _prune_gone()
        _PENDING.append(verifier)


def _prune_gone() -> None:
    """Drop the pending sends whose engine was garbage-collected before its update finished (they
    can never be checked now) and warn that they were not verified. The caller holds ``_LOCK``."""
    gone = [v for v in _PENDING if v._target_gone()]
    if not gone:
        return
    _PENDING[:] = [v for v in _PENDING if v not in gone]
    unchecked = sum(1 for v in gone if v.mode.verifies and not v.checked)
    if unchecked:
        logger.warning("refit-verify: %d weight send(s) into an in-process vLLM engine that was garbage-collected before its "
                       "update finished were never verified", unchecked)


@atexit.register
def _unchecked_at_exit() -> None:
    """Warn about sends whose update never closed through ``finish_weight_update`` in this process."""
    with _LOCK:
        _prune_gone()
        left = [v for v in _PENDING if v.mode.verifies and not v.checked]
    if left:
        logger.warning("refit-verify: %d weight send(s) into an update that never finished (no finish_weight_update or "
                       "start_weight_update after them in this process) were never verified", len(left))


DRAIN_TIMEOUT_S = RefitConfig.model_fields["timeout_s"].default
"""Seconds the static sender wrapper waits for the trainer's queued sends to complete (120)."""


def _wait_for_device() -> None:
    """Let the sends finish before the manifests are asked for: a NCCL broadcast returns once it
    is queued, and completes only when every worker took part, i.e. is inside its update.

    Raises:
        RefitTimeoutError: the device did not drain within ``DRAIN_TIMEOUT_S`` (a worker never joined
            the broadcast); the synchronising thread is left behind (daemon).
    """
    import torch

    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    out: dict[str, BaseException | None] = {}

    def drain() -> None:
        try:
            torch.cuda.synchronize()
            out["error"] = None
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            out["error"] = e

    th = threading.Thread(target=drain, name="refit-verify-drain", daemon=True)
    th.start()
    th.join(DRAIN_TIMEOUT_S)
    if "error" not in out:
        raise RefitTimeoutError(f"refit-verify: the trainer's weight sends did not complete within {DRAIN_TIMEOUT_S} s "
                                "(a vLLM worker never took part in the broadcast?); the update was not verified",
                                {"waiting_for": "trainer sends to complete"})
    if out["error"] is not None:
        raise out["error"]


def _target_of_trainer_args(args: Any) -> Any:
    mode = _arg(args, "send_mode") or _arg(args, "mode")  # `mode` in early 0.2x releases
    if mode == "ray":
        return _arg(args, "llm_handle")
    if mode == "http":
        return _arg(args, "url")
    return getattr(mode, "__self__", None) if callable(mode) else None  # a bound method's engine; else tracking (nccl)


def _global_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _is_rank_zero() -> bool:
    return _global_rank() == 0


_WARNED: set[str] = set()


def _warn_once(msg: str, *args: Any) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg, *args)


# -- in-process engine tracking (LLM.update_weights)


def _patch_llm_tracking(module: Any) -> None:
    llm_cls = getattr(module, "LLM", None)
    for attr, make in (("update_weights", _wrap_llm_update), ("start_weight_update", _wrap_llm_start),
                       ("finish_weight_update", _wrap_llm_finish), ("collective_rpc", _wrap_llm_rpc)):
        owner = next((k for k in getattr(llm_cls, "__mro__", ()) if attr in k.__dict__), None)
        if owner is not None:
            with _LOCK:
                shims.patch(owner, attr, make)


def _wrap_llm_start(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def start_weight_update(self, *args, **kwargs):
        with _LOCK:
            _prune_gone()
            stale = [v for v in _PENDING if v._feeds(self)]
            _PENDING[:] = [v for v in _PENDING if v not in stale]
        if stale:  # their session never closed through finish_weight_update
            logger.warning("refit-verify: a weight update of this LLM was started again before finish_weight_update closed "
                           "the previous one: %d send(s) into it are checked by their delivered digests only", len(stale))
            unchecked = [v for v in stale if not v.checked]
            if unchecked:  # left to that finish: checked now, while the workers still hold the open update
                unchecked[-1]._earlier = unchecked[:-1]
                unchecked[-1].verify()
        try:
            out = raw(self, *args, **kwargs)
        except BaseException:  # vLLM refused the start (0.26: an update is still open): its finish checks the whole session
            with _LOCK:
                _PENDING[:] = stale + [v for v in _PENDING if v not in stale]
            raise
        with _LOCK:
            _OPEN[:] = [r for r in _OPEN if r() is not None and r() is not self] + [weakref.ref(self)]
        return out

    return start_weight_update


def _wrap_llm_finish(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def finish_weight_update(self, *args, **kwargs):
        combined = not args and not kwargs and _is_026_finish(raw)
        return _finishing(self, lambda: raw(self, *args, **kwargs), combined)

    return finish_weight_update


def _wrap_llm_rpc(raw: Callable) -> Callable:
    """``LLM.collective_rpc``: a finish sent through it (``llm.collective_rpc("finish_weight_update")``)
    checks the sends pending on that update as ``LLM.finish_weight_update`` does."""

    @functools.wraps(raw)
    def collective_rpc(self, method, *args, **kwargs):
        if method != "finish_weight_update" or not _PENDING:
            return raw(self, method, *args, **kwargs)
        return _finishing(self, lambda: raw(self, method, *args, **kwargs), False)

    return collective_rpc


_FINISH_RPC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # LLM -> its workers answer FINISH_METHOD


def _finishing(llm: Any, run: Callable[[], Any], combined: bool) -> Any:
    """Close ``llm``'s open update with ``run()`` and check every send pending on it as one session.

    ``combined``: ``run`` is vLLM 0.26's one-line finish; once ``llm``'s workers have said they
    carry :data:`~refit_verify.vllm_plugin.rpc_names.FINISH_METHOD` (in an earlier manifest), one
    RPC finishes and returns the manifests instead of a finish and a fetch. An exception from the
    finish leaves the sends pending (a retried finish checks them) and propagates unchanged."""
    with _LOCK:
        was_open = any(r() is llm for r in _OPEN)
        _OPEN[:] = [r for r in _OPEN if r() is not None and r() is not llm]
        mine = [v for v in _PENDING if v._feeds(llm)]
        _PENDING[:] = [v for v in _PENDING if v not in mine]
    workers = None
    try:
        if mine and combined and _FINISH_RPC.get(llm, False):
            out, workers = None, list(llm.llm_engine.collective_rpc(FINISH_METHOD))  # no bound: vLLM's own finish has none
        else:
            out = run()
    except BaseException:
        with _LOCK:  # the update did not close: it stays open, and a retried finish checks its sends
            _PENDING[:] = mine + [v for v in _PENDING if v not in mine]
            if was_open and not any(r() is llm for r in _OPEN):
                _OPEN.append(weakref.ref(llm))
        raise
    if mine:  # the update is closed now: coverage, apply-time digests and read-back of the session
        mine[-1]._earlier = mine[:-1]  # every send into it
        try:
            mine[-1].verify(workers)
        finally:
            got = mine[-1].workers
            if combined and got:
                _FINISH_RPC[llm] = all(w.get("finish_rpc") is True for w in got)
    return out


_CO_NESTED = 0x10  # inspect.CO_NESTED: a method defined inside a function (a test's) compiles the same otherwise
_CO_FUTURE_ANNOTATIONS = 0x1000000  # `from __future__ import annotations` in this module, not in vLLM 0.26's llm.py
_FLAGS_IGNORED = _CO_NESTED | _CO_FUTURE_ANNOTATIONS  # neither changes what the function does


def _finish_026(self) -> None:
    """Finish the current weight update."""
    self.llm_engine.collective_rpc("finish_weight_update")


def _is_026_finish(raw: Callable) -> bool:
    """True iff ``raw`` is vLLM 0.26's ``LLM.finish_weight_update``, instruction for instruction
    (:func:`_finish_026`: one ``collective_rpc``, nothing returned), under vLLM 0.26."""
    code, ref = getattr(raw, "__code__", None), _finish_026.__code__
    if code is None or shims.vllm_version() != (0, 26):
        return False
    return (code.co_code == ref.co_code and code.co_names == ref.co_names and code.co_argcount == 1
            and code.co_kwonlyargcount == 0 and code.co_flags & ~_FLAGS_IGNORED == ref.co_flags & ~_FLAGS_IGNORED
            and _consts(code, raw.__doc__) == _consts(ref, _finish_026.__doc__))


def _consts(code: Any, doc: str | None) -> tuple:
    """``code``'s constants in order (the instructions index them), without its docstring (the first one)."""
    consts = code.co_consts
    return consts[1:] if doc is not None and consts and consts[0] == doc else consts


def _wrap_llm_update(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def update_weights(self, *args, **kwargs):
        shadowed: list[NativeSendVerifier] = []
        if _ACTIVE:
            with _LOCK:
                for v in _ACTIVE:
                    target = getattr(v.target, "__self__", v.target)
                    if target is self or not hasattr(target, "collective_rpc"):  # not a send that names another engine
                        v._saw_engine(self)
                shadowed = [v for v in _ACTIVE if v.shadow_ready(self)]
        if shadowed and _engine_elsewhere(self):  # the sender's digest work runs while this thread waits for the reply
            return run_in_shadow(lambda: raw(self, *args, **kwargs), lambda: [v.shadow_work() for v in shadowed],
                                 on_wait=shadowed[0]._waited)
        return raw(self, *args, **kwargs)

    return update_weights


def _engine_elsewhere(llm: Any) -> bool:
    """True iff ``llm`` is an ``LLM`` whose engine core runs in another process (vLLM's ``SyncMPClient``):
    its ``update_weights`` then blocks this thread on a reply without running vLLM's Python here."""
    mod = sys.modules.get("vllm.v1.engine.core_client")
    client = getattr(mod, "SyncMPClient", None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    return client is not None and isinstance(core, client)


def _arg(trainer_args: Any, key: str) -> Any:
    return trainer_args.get(key) if isinstance(trainer_args, dict) else getattr(trainer_args, key, None)


def _defer_budget(trainer_args: Any) -> float:
    """Deferred bytes past which a send's digest work is done at once: none for an unpacked send (its
    one ``update_weights`` comes after every tensor was exported, and vLLM holds them all until then),
    two packed buffers for a packed one (an ``update_weights`` comes at least once per buffer)."""
    if not _arg(trainer_args, "packed"):
        return math.inf
    return 2 * int(_arg(trainer_args, "packed_buffer_size_bytes") or 1 << 30)


def _llm_behind(target: Any) -> Any:
    """The in-process ``LLM`` a send's target is or holds (itself, a bound method's owner, or an
    attribute of a client such as ``VLLMWeightSyncClient``), or None."""
    target = getattr(target, "__self__", target)
    if target is None or hasattr(target, "llm_engine"):
        return target
    return next((v for v in getattr(target, "__dict__", {}).values() if hasattr(v, "llm_engine")), None)


def _shadow_target(verifier: NativeSendVerifier, trainer_args: Any) -> Any:
    """The ``LLM`` whose ``update_weights`` a 0.26 static send will wait on in this thread, or None:
    the send hands its updates to a callable ``send_mode`` (``ipc``) and goes to an in-process
    ``LLM`` with its engine in another process (the callable's own, or, naming none, the one such
    ``LLM`` with an open update). Its digest work is then done while the sending thread waits for
    that engine's ``update_weights`` (:func:`~refit_verify.trainer.overlap.run_in_shadow`); where no such wait
    comes (the callable calls it from another thread), past :func:`_defer_budget` and when the send
    ends. None for ``nccl`` (no ``send_mode``: the update runs in another thread)."""
    if not callable(_arg(trainer_args, "send_mode")):
        return None
    target = _llm_behind(verifier.target)
    if target is None:
        with _LOCK:
            live = [llm for llm in (r() for r in _OPEN) if llm is not None]
        target = live[0] if len(live) == 1 else None
    return target if target is not None and _engine_elsewhere(target) else None
