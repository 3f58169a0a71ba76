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
* ``LLM.update_weights`` / ``start_weight_update`` / ``finish_weight_update``, only to note which
  in-process engine an update went to (or is open on), for senders whose arguments name no
  client (``nccl``: a process group only).

:class:`NativeSendVerifier` is the same logic as an explicit helper, for trainers that run where
vLLM's plugins are never loaded (a Ray actor) or use a client refit-verify cannot reach the
workers through. ``enforce`` raises :class:`~refit_verify.errors.RefitVerificationError` naming the
parameters and the worker rank; ``log`` logs a warning. The mode is read from ``REFIT_VERIFY`` at
each send.

Source: vllm/distributed/weight_transfer/{base,factory,ipc_engine,nccl_engine}.py (0.26.0 and 0.32.0).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from refit_verify.config import RefitConfig, VerifyMode, act_on_all, mode_from_env
from refit_verify.errors import RefitConfigError, RefitTimeoutError
from refit_verify.check import compare_session
from refit_verify.manifest import from_wire
from refit_verify.report import VerificationReport, compare_manifests
from refit_verify.vllm_plugin import shims
from refit_verify.vllm_plugin.native_worker import MANIFEST_METHOD

logger = logging.getLogger("refit_verify")

__all__ = ["MANIFEST_METHOD", "NativeSendVerifier", "detect", "install", "last_reports", "status"]

UNSUPPORTED_BACKENDS = frozenset({"sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress"})
"""Trainer backends that ship deltas or partial shards, or load without ``model.load_weights``:
the worker's loaded tensors are not the exported ones, so their digests cannot be compared."""

FETCH_TIMEOUT_S = 300.0
"""Bound, in seconds, on fetching the workers' manifests after a send."""

_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"installed": False, "mode": None, "version": None, "sender_paths": ()}
_ACTIVE: list[NativeSendVerifier] = []  # sends in progress in this process (for engine tracking)
_LAST: dict[str, Any] = {"reports": [], "key": None, "sender": {}}
_OPEN: list[weakref.ref] = []  # in-process LLMs between start_weight_update and finish_weight_update
_PENDING: list[NativeSendVerifier] = []  # static sends checked by digests, whose whole session is checked at finish
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


def _uninstall() -> None:
    """Restore every patched attribute (tests only; engines already built keep their wrappers)."""
    with _LOCK:
        shims.restore_all()
        _STATE.update(installed=False, mode=None, version=None, sender_paths=())
        from refit_verify.vllm_plugin import patches

        patches.reset()


# --------------------------------------------------------------------------- sender


class NativeSendVerifier:
    """Sender half of a verified native weight update: digest what is exported, then compare.

    The automatic wrappers use it; call it yourself where they cannot run (a trainer process in
    which vLLM's plugins are never loaded, e.g. a Ray actor):

    .. code-block:: python

        v = NativeSendVerifier(llm)                  # or a Ray handle, an HTTP base URL, a client
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(v.wrap(model.named_parameters()), args)  # 0.26
        llm.finish_weight_update()
        v.verify()                                   # raises in enforce, warns in log

    Args:
        target: where the workers are: an object with ``collective_rpc`` (``LLM``), a Ray actor
            handle or a list of them, an HTTP base URL (``VLLM_SERVER_DEV_MODE=1`` server), a
            ``VLLMWeightSyncClient`` (Ray, HTTP, or one holding such an object as an attribute),
            or None: then the in-process ``LLM`` engines that received ``update_weights`` while
            the verifier was entered (``with v:``) are asked.
        mode: verification mode; default ``REFIT_VERIFY``.
    """

    def __init__(self, target: Any = None, *, mode: VerifyMode | str | None = None) -> None:
        from refit_verify.digest import StreamDigests

        self.mode = mode_from_env() if mode is None else VerifyMode.parse(mode)
        self.target = target
        self._stream = StreamDigests(hold_parameters=True)  # the model's parameters held, temporaries copied
        self.engines: list[weakref.ref] = []
        self.open_updates = False

    @property
    def digests(self) -> dict[str, str]:
        """``{name: 32-hex}`` of every tensor added so far (collects launched CUDA digests first)."""
        return self._stream.digests()

    @property
    def digest_s(self) -> float:
        """Host seconds spent digesting."""
        return self._stream.digest_s

    def add(self, name: str, tensor: Any) -> None:
        """Digest one exported tensor (:class:`refit_verify.digest.StreamDigests`: launched now, no per-tensor sync)."""
        self._stream.add(name, tensor)

    def wrap(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Yield ``pairs`` unchanged, digesting each tensor before it is handed on.

        A vLLM 0.26 static ``trainer_send_weights`` that is handed this iterator leaves the
        verification to this verifier (no second digest, no automatic ``verify``)."""
        return _Wrapped(self, pairs)

    # -- engine tracking
    def __enter__(self) -> NativeSendVerifier:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def _saw_engine(self, llm: Any) -> None:
        if not any(r() is llm for r in self.engines):
            self.engines.append(weakref.ref(llm))

    # -- comparing
    def fetch(self) -> list[dict[str, Any]]:
        """Return every worker's ``refit_verify_native_manifest`` result.

        Raises:
            RefitConfigError: no way to reach the workers; no target and more than one in-process
                engine could have received this send; or a worker lacks the method.
        """
        from refit_verify.engines import channel

        chans = [c for c in (channel(self.target),) if c is not None]
        if not chans:
            seen = [llm for llm in (r() for r in self.engines) if llm is not None]
            how = "received update_weights during this send"
            if not seen:  # e.g. nccl: the update went out before this send began; use the open updates
                with _LOCK:
                    seen = [llm for llm in (r() for r in _OPEN) if llm is not None]
                how = "have an open weight update (start_weight_update without finish_weight_update)"
            if len(seen) > 1:  # which one this send fed is unknown: comparing with all would blame the others
                raise RefitConfigError(
                    f"refit-verify cannot tell which of {len(seen)} in-process vLLM engines this send updated (all {how}); "
                    "pass the engine explicitly: NativeSendVerifier(target=llm) with trainer_send_weights(v.wrap(params), args)")
            for llm in seen:
                self._saw_engine(llm)
            chans = [c for c in (channel(llm) for llm in seen) if c is not None]
        if not chans:
            raise RefitConfigError(
                f"refit-verify cannot reach the vLLM workers to fetch their manifests (client: {type(self.target).__name__}). "
                "Use a client with collective_rpc, a Ray or HTTP client, an in-process LLM, or "
                "refit_verify.vllm_plugin.native.NativeSendVerifier(target=...)."
            )
        results: list[dict[str, Any]] = []
        for ch in chans:
            results.extend(ch.call(MANIFEST_METHOD, timeout_s=FETCH_TIMEOUT_S))
        return results

    def verify(self) -> list[VerificationReport]:
        """Fetch the worker manifests, compare each with the sender's, act on the mode.

        Every worker receives full tensors, so each manifest is compared with the whole sender
        manifest. Digests of several sends into one worker update (0.26: more than one
        ``trainer_send_weights`` between start and finish) are merged.

        Returns:
            list[VerificationReport]: one per worker, in worker order.

        Raises:
            RefitVerificationError: ``enforce`` and a worker's manifest differs; names the
                parameters and the worker rank (other failing workers are logged first).
            RefitConfigError: a worker does not verify (``REFIT_VERIFY`` off in the server), or
                the workers cannot be reached (``enforce``; ``log`` logs it).
        """
        if not self.mode.verifies:
            return []
        try:
            workers = self.fetch()
            idle = [w for w in workers if not w.get("verifying")]
            if idle or not workers:
                w = idle[0] if idle else {}
                raise RefitConfigError(
                    f"refit-verify: REFIT_VERIFY={self.mode.value} in the trainer but vLLM worker rank {w.get('rank')} does not "
                    f"verify ({w.get('reason', 'no workers answered')}); set REFIT_VERIFY in the vLLM server's environment too"
                )
        except RefitConfigError as e:
            if self.mode is VerifyMode.ENFORCE:
                raise
            logger.warning("%s", e)
            return []
        key = tuple(sorted((str(w.get("token")), int(w.get("session", 0))) for w in workers))
        sender = dict(self.digests)
        with _LOCK:
            if _LAST["key"] == key:  # a further send into the same worker update
                sender = {**_LAST["sender"], **sender}
                for name in self._stream.changed:  # what this send exported under it is unknown
                    sender.pop(name, None)
            _LAST.update(key=key, sender=sender)
        problems = self._sender_problems()
        reports = [self._compare(sender, w, problems) for w in workers]
        self.open_updates = any(w.get("active") for w in workers)
        with _LOCK:
            _LAST["reports"] = reports
        if all(r.ok for r in reports):
            logger.info("refit verified (native weight transfer): %d tensors on %d worker(s)", len(sender), len(reports))
        return act_on_all(reports, self.mode)


    def _sender_problems(self) -> list[str]:
        """The exported parameters (held, not copied) that changed before their digests were taken."""
        changed = self._stream.changed
        out = [f"the trainer's {name} could not be digested as exported: {why} (a parameter handed to the send is "
               "held until verify(); leave it untouched until then)" for name, why in list(changed.items())[:20]]
        if len(changed) > 20:
            out.append(f"… and {len(changed) - 20} more exported parameters changed before verify()")
        return out

    def _compare(self, sender: dict[str, str], w: dict[str, Any], problems: list[str]) -> VerificationReport:
        """A finished update is compared as a whole session (coverage, apply-time digests, read-back);
        one still open (0.26: the send runs between start and finish) by its delivered digests, and
        the report says what it could not check yet. ``problems``: the sender's own (each a failure)."""
        changed = tuple(self._stream.changed)
        data = w.get("session_manifest")
        if data is not None and not w.get("active"):
            return compare_session({"model": sender}, from_wire(data), sender_problems=problems, undigested=changed)
        r = compare_manifests(sender, w.get("manifest") or {}, rank=w.get("rank"))
        r = dataclasses.replace(r, unexpected=tuple(n for n in r.unexpected if n not in changed),
                                problems=(*r.problems, *problems))
        return dataclasses.replace(r, unchecked=(
            "coverage, apply-time digests and read-back: the worker's update was still open (checked again when "
            "LLM.finish_weight_update closes it in this process; call NativeSendVerifier.verify() after finish otherwise)",))


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
        source = engine.source
        engine.source = _digesting_source(source, verifier)
        try:
            with verifier:
                out = original(*args, **kwargs)
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


class _Wrapped:
    """Iterator returned by :meth:`NativeSendVerifier.wrap` (marks iterators already verified)."""

    def __init__(self, verifier: NativeSendVerifier, pairs: Iterable[tuple[str, Any]]) -> None:
        self.verifier, self._it = verifier, iter(pairs)

    def __iter__(self) -> _Wrapped:
        return self

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._it)
        if tensor is not None:
            self.verifier.add(name, tensor)
        return name, tensor


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
        with verifier:
            out = original(verifier.wrap(iterator), trainer_args)
        _wait_for_device()
        verifier.verify()  # delivered digests now (fails fast); the whole session at finish_weight_update
        if verifier.open_updates:
            with _LOCK:
                _PENDING.append(verifier)
        return out

    return staticmethod(trainer_send_weights)


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
    get = args.get if isinstance(args, dict) else lambda k, d=None: getattr(args, k, d)
    mode = get("send_mode") or get("mode")  # `mode` in early 0.2x releases
    if mode == "ray":
        return get("llm_handle")
    if mode == "http":
        return get("url")
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
                       ("finish_weight_update", _wrap_llm_finish)):
        owner = next((k for k in getattr(llm_cls, "__mro__", ()) if attr in k.__dict__), None)
        if owner is not None:
            with _LOCK:
                shims.patch(owner, attr, make)


def _wrap_llm_start(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def start_weight_update(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        with _LOCK:
            _OPEN[:] = [r for r in _OPEN if r() is not None and r() is not self] + [weakref.ref(self)]
        return out

    return start_weight_update


def _wrap_llm_finish(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def finish_weight_update(self, *args, **kwargs):
        with _LOCK:
            _OPEN[:] = [r for r in _OPEN if r() is not None and r() is not self]
            mine = [v for v in _PENDING if v.target is self or getattr(v.target, "__self__", None) is self
                    or any(r() is self for r in v.engines)]
            _PENDING[:] = [v for v in _PENDING if v not in mine]
        out = raw(self, *args, **kwargs)
        if mine:  # the update is closed now: coverage, apply-time digests and read-back of the session
            mine[-1].verify()
        return out

    return finish_weight_update


def _wrap_llm_update(raw: Callable) -> Callable:
    @functools.wraps(raw)
    def update_weights(self, *args, **kwargs):
        if _ACTIVE:
            with _LOCK:
                for v in _ACTIVE:
                    v._saw_engine(self)
        return raw(self, *args, **kwargs)

    return update_weights
