"""Verification of vLLM's native weight-transfer API (``init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``) with no user code change.

:func:`install` runs from the plugin's ``register()`` in every vLLM process when ``REFIT_VERIFY``
is ``log`` or ``enforce``; with ``off`` it patches nothing. What it wraps:

* **Receiver** (every worker): ``WeightTransferEngineFactory.create_engine``. Each engine it
  creates gets instance-level ``start_weight_update`` / ``finish_weight_update`` wrappers; between
  them the update target's ``model.load_weights`` is wrapped on the instance, so every
  ``(name, tensor)`` the engine hands to it (ipc packed: the staged slices; ipc unpacked: the
  per-tensor IPC views; any backend whose receive ends in ``load_weights``) is digested before it
  is loaded. The digests of one update accumulate on the engine; the worker method
  ``refit_verify_native_manifest`` returns them (reached through ``collective_rpc``).
* **Sender** (trainer process, where the plugin is loaded, e.g. beside an in-process ``LLM``):
  ``TrainerWeightTransferEngine.__init__`` (vLLM >= 0.27 trainer engines): each engine's
  ``send_weights`` iterates a digesting proxy of its ``WeightSource``, then fetches every worker's
  manifest and compares; and, where they exist (vLLM 0.26), the static
  ``IPCWeightTransferEngine.trainer_send_weights(iterator, trainer_args)`` and
  ``NCCLWeightTransferEngine.trainer_send_weights``, whose iterators are wrapped the same way.
  ``LLM.update_weights`` / ``start_weight_update`` / ``finish_weight_update`` are wrapped only to
  note which in-process engine an update went to (or is open on), for senders whose arguments
  name no client (``nccl``: a process group only).
* :class:`NativeSendVerifier` is the same sender logic as an explicit helper, for trainers that
  run where vLLM's plugins are never loaded (a Ray actor) or use a client refit-verify cannot
  reach the workers through.

``enforce`` raises :class:`~refit_verify.errors.RefitVerificationError` naming the parameters and
the worker rank; ``log`` logs a warning. The mode is read from ``REFIT_VERIFY`` at each send.

Source: vllm/distributed/weight_transfer/{base,factory,ipc_engine,nccl_engine}.py (0.26.0 and 0.32.0).
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import re
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from refit_verify.config import RefitConfig, VerifyMode, mode_from_env
from refit_verify.errors import RefitConfigError, RefitTimeoutError
from refit_verify.report import VerificationReport, act_on, compare_manifests

logger = logging.getLogger("refit_verify")

__all__ = ["METHODS", "NativeSendVerifier", "install", "last_reports", "refit_verify_native_manifest", "status"]

MANIFEST_METHOD = "refit_verify_native_manifest"
METHODS = (MANIFEST_METHOD,)
from refit_verify.vllm_plugin import SUPPORTED as TESTED  # noqa: E402  [low, high) vLLM releases
UNSUPPORTED_BACKENDS = frozenset({"sparse_nccl", "sharded_rdt", "nccl_m2n", "modelexpress"})
"""Trainer backends that ship deltas or partial shards, or load without ``model.load_weights``:
the worker's loaded tensors are not the exported ones, so their digests cannot be compared."""

_MARK = "__refit_verify_native__"  # set on every wrapper this module installs
_LOCK = threading.RLock()
_STATE: dict[str, Any] = {"installed": False, "mode": None, "patched": [], "version": None, "sender_paths": ()}
_ORIGINALS: dict[str, tuple[object, str, object]] = {}  # label -> (owner, attribute, original __dict__ value)
_ACTIVE: list[NativeSendVerifier] = []  # sends in progress in this process (for engine tracking)
_LAST: dict[str, Any] = {"reports": [], "key": None, "sender": {}}
_OPEN: list[weakref.ref] = []  # in-process LLMs between start_weight_update and finish_weight_update
STATIC_SENDERS = {"vllm.distributed.weight_transfer.ipc_engine": "IPCWeightTransferEngine",
                  "vllm.distributed.weight_transfer.nccl_engine": "NCCLWeightTransferEngine"}
"""vLLM 0.26's static ``trainer_send_weights`` entries (module -> engine class) that get wrapped."""


# --------------------------------------------------------------------------- detection


def vllm_version() -> tuple[int, int] | None:
    """Return the installed vLLM's (major, minor), or None when it cannot be read."""
    try:
        import vllm
    except ImportError:
        return None
    m = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return (int(m.group(1)), int(m.group(2))) if m else None


def detect() -> dict[str, Any]:
    """Return which hookable paths of the native weight-transfer API this vLLM has.

    Returns:
        dict: ``version`` ((major, minor) or None), ``receiver`` (``create_engine`` present),
        ``sender`` (tuple of ``"trainer_engine"`` for vLLM >= 0.27 trainer engines and/or
        ``"static"`` for 0.26's ``WeightTransferEngine.trainer_send_weights``), ``problem`` (why
        not hookable, or None).
    """
    out: dict[str, Any] = {"version": vllm_version(), "receiver": False, "sender": (), "problem": None}
    try:
        from vllm.distributed.weight_transfer import base
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError as e:
        out["problem"] = f"vllm.distributed.weight_transfer is missing ({e})"
        return out
    out["receiver"] = isinstance(WeightTransferEngineFactory.__dict__.get("create_engine"), classmethod) and hasattr(base, "WeightTransferEngine")
    sender = []
    trainer = getattr(base, "TrainerWeightTransferEngine", None)
    if trainer is not None and "__init__" in trainer.__dict__:
        sender.append("trainer_engine")
    if "trainer_send_weights" in getattr(base, "WeightTransferEngine", object).__dict__:
        sender.append("static")
    out["sender"] = tuple(sender)
    if not out["receiver"]:
        out["problem"] = "WeightTransferEngineFactory.create_engine is missing or not a classmethod"
    elif not sender:
        out["problem"] = "neither TrainerWeightTransferEngine nor WeightTransferEngine.trainer_send_weights exists"
    return out


def status() -> dict[str, Any]:
    """Return what :func:`install` did in this process: ``installed``, ``mode``, ``version``,
    ``sender_paths`` and ``patched`` (labels of the wrapped attributes)."""
    with _LOCK:
        return {k: (list(v) if isinstance(v, list) else v) for k, v in _STATE.items()}


def last_reports() -> list[VerificationReport]:
    """Return the per-worker reports of the last verified native send in this process."""
    return list(_LAST["reports"])


# --------------------------------------------------------------------------- install


def install(mode: VerifyMode) -> None:
    """Wrap the native weight-transfer path of this process's vLLM for ``mode``; idempotent.

    With ``off`` nothing is imported or patched. Otherwise the version and the API are detected
    and the receiver and sender wrappers described in the module docstring are installed.

    Raises:
        RuntimeError: verification is requested but this vLLM has no hookable weight-transfer
            path (vLLM older than 0.26, or an API refit-verify does not know); the message names
            the installed version and the supported range.
    """
    if not mode.verifies:
        return
    with _LOCK:
        if _STATE["installed"]:
            return
        info = detect()
        ver = info["version"]
        shown = "unknown" if ver is None else f"{ver[0]}.{ver[1]}"
        if info["problem"]:
            raise RuntimeError(
                f"refit-verify: REFIT_VERIFY={mode.value} but vLLM {shown} has no hookable native weight-transfer path "
                f"({info['problem']}); supported: vLLM {TESTED[0][0]}.{TESTED[0][1]} to {TESTED[1][0]}.{TESTED[1][1] - 1}. "
                "Install a supported vLLM or set REFIT_VERIFY=off."
            )
        if ver is not None and not (TESTED[0] <= ver < TESTED[1]):
            logger.warning("refit-verify: vLLM %s is outside the tested range %s.%s-%s.%s; the weight-transfer hooks were found and are installed",
                           shown, TESTED[0][0], TESTED[0][1], TESTED[1][0], TESTED[1][1] - 1)
        from vllm.distributed.weight_transfer import base
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

        _patch(WeightTransferEngineFactory, "create_engine", _wrap_create_engine)
        if "trainer_engine" in info["sender"]:
            _patch(base.TrainerWeightTransferEngine, "__init__", _wrap_trainer_init)
        if "static" in info["sender"]:
            for module_name, cls_name in STATIC_SENDERS.items():
                _when_imported(module_name, functools.partial(_patch_static_sender, cls_name))
        _when_imported("vllm.entrypoints.llm", _patch_llm_tracking)
        _STATE.update(installed=True, mode=mode.value, version=ver, sender_paths=info["sender"])


def _patch(owner: type, attr: str, make: Callable[[Any], Any]) -> None:
    """Replace ``owner.__dict__[attr]`` with ``make(original)``, marked and remembered."""
    label = f"{owner.__module__}.{owner.__qualname__}.{attr}"
    raw = owner.__dict__[attr]
    if getattr(_unwrap_descriptor(raw), _MARK, False):
        return
    new = make(raw)
    setattr(_unwrap_descriptor(new), _MARK, True)
    setattr(owner, attr, new)
    _ORIGINALS[label] = (owner, attr, raw)
    _STATE["patched"].append(label)


def _unwrap_descriptor(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def _uninstall() -> None:
    """Restore every patched attribute (tests only; engines already built keep their wrappers)."""
    with _LOCK:
        for owner, attr, raw in _ORIGINALS.values():
            setattr(owner, attr, raw)
        _ORIGINALS.clear()
        _FINDER.pending.clear()
        _STATE.update(installed=False, mode=None, patched=[], version=None, sender_paths=())


# --------------------------------------------------------------------------- post-import hooks


class _CallbackLoader(importlib.abc.Loader):
    """Delegates to the real loader and runs callbacks on the module right after it executed."""

    def __init__(self, inner: Any, fire: Callable[[Any], None]) -> None:
        self._inner, self._fire = inner, fire

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._fire(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._inner, name)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Runs callbacks once a named module is imported (for modules not imported yet at install)."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[Any], None]]] = {}
        self._busy = threading.local()

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.pending or getattr(self._busy, "on", False):
            return None
        self._busy.on = True
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._busy.on = False
        if spec.loader is None:
            return spec
        spec.loader = _CallbackLoader(spec.loader, self._fire)
        return spec

    def _fire(self, module) -> None:
        for fn in self.pending.pop(module.__name__, []):
            fn(module)


_FINDER = _PostImportFinder()


def _when_imported(name: str, fn: Callable[[Any], None]) -> None:
    """Run ``fn(module)`` now if ``name`` is imported, else right after its import."""
    mod = sys.modules.get(name)
    if mod is not None:
        fn(mod)
        return
    _FINDER.pending.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


# --------------------------------------------------------------------------- receiver


class _Receiver:
    """Digests of the current (or last) weight update of one worker-side engine."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.token = uuid.uuid4().hex[:16]
        self.lock = threading.Lock()
        self.session = 0
        self.active = False
        self.manifest: dict[str, str] = {}
        self.calls = 0
        self.digest_s = 0.0
        self._hooked: weakref.ref | None = None
        self._prev: tuple[bool, Any] = (False, None)

    def begin(self) -> None:
        self.unhook()
        with self.lock:
            self.session += 1
            self.active = True
            self.manifest = {}
            self.calls = 0
            self.digest_s = 0.0

    def end(self) -> None:
        self.unhook()
        self.active = False

    def hook(self, model: Any) -> None:
        """Wrap ``model.load_weights`` on the instance for the rest of the update."""
        self.unhook()
        if model is None or not callable(getattr(model, "load_weights", None)):
            return
        original = model.load_weights
        receiver = self

        @functools.wraps(original)
        def load_weights(weights, *args, **kwargs):
            if not receiver.active:
                return original(weights, *args, **kwargs)
            return original(receiver.digest(weights), *args, **kwargs)

        setattr(load_weights, _MARK, True)
        self._prev = ("load_weights" in vars(model), vars(model).get("load_weights"))
        object.__setattr__(model, "load_weights", load_weights)
        self._hooked = weakref.ref(model)

    def unhook(self) -> None:
        model = self._hooked() if self._hooked is not None else None
        self._hooked = None
        if model is None or not getattr(vars(model).get("load_weights"), _MARK, False):
            return
        had, prev = self._prev
        if had:
            object.__setattr__(model, "load_weights", prev)
        else:
            object.__delattr__(model, "load_weights")

    def digest(self, weights: Iterable) -> Iterable:
        """Digest every (name, tensor) before it reaches ``load_weights``; return what to load."""
        from refit_verify.digest import DigestBatch

        if isinstance(weights, (list, tuple)):
            t0 = time.perf_counter()
            batch = DigestBatch()
            for name, tensor in weights:
                batch.add(name, tensor)
            self._record(batch.hexdigests(), time.perf_counter() - t0)
            return weights
        return self._digest_lazily(weights)

    def _digest_lazily(self, weights: Iterable) -> Iterator:
        from refit_verify.digest import DigestBatch

        for name, tensor in weights:
            t0 = time.perf_counter()
            batch = DigestBatch()
            batch.add(name, tensor)
            self._record(batch.hexdigests(), time.perf_counter() - t0)
            yield name, tensor

    def _record(self, digests: dict[str, str], seconds: float) -> None:
        with self.lock:
            self.manifest.update(digests)
            self.calls += 1
            self.digest_s += seconds

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return {"backend": self.backend, "token": self.token, "session": self.session, "active": self.active,
                    "manifest": dict(self.manifest), "tensors": len(self.manifest), "calls": self.calls, "digest_s": self.digest_s}


def _wrap_create_engine(raw: classmethod) -> classmethod:
    original = raw.__func__

    @functools.wraps(original)
    def create_engine(cls, config, *args, **kwargs):
        engine = original(cls, config, *args, **kwargs)
        _instrument_engine(engine, str(getattr(config, "backend", "?")))
        return engine

    return classmethod(create_engine)


def _instrument_engine(engine: Any, backend: str) -> None:
    """Give one worker-side engine a :class:`_Receiver` and instance-level start/finish wrappers."""
    if getattr(engine, "_refit_verify_native", None) is not None:
        return
    receiver = _Receiver(backend)
    start, update, finish = engine.start_weight_update, engine.update_weights, engine.finish_weight_update

    @functools.wraps(start)
    def start_weight_update(*args, **kwargs):
        receiver.begin()
        try:
            out = start(*args, **kwargs)
        except BaseException:
            receiver.end()
            raise
        receiver.hook(engine.model)  # the update target (the draft model for a draft update)
        return out

    @functools.wraps(update)
    def update_weights(*args, **kwargs):
        try:
            return update(*args, **kwargs)
        except BaseException:
            receiver.end()  # the worker ends the session on a failed chunk
            raise

    @functools.wraps(finish)
    def finish_weight_update(*args, **kwargs):
        try:
            return finish(*args, **kwargs)  # deferring engines may still load here
        finally:
            receiver.end()

    for fn in (start_weight_update, update_weights, finish_weight_update):
        setattr(fn, _MARK, True)
    engine.start_weight_update = start_weight_update
    engine.update_weights = update_weights
    engine.finish_weight_update = finish_weight_update
    engine._refit_verify_native = receiver


def refit_verify_native_manifest(self) -> dict[str, Any]:
    """Worker method: return the digests of this worker's current or last native weight update.

    Reached through ``collective_rpc("refit_verify_native_manifest")``; plain msgpack-safe types.

    Returns:
        dict: ``rank``; ``verifying`` (False when the plugin runs with ``REFIT_VERIFY=off`` here
        or the worker has no weight-transfer engine); and, when verifying, ``backend``, ``token``
        (per engine), ``session`` (count of ``start_weight_update`` calls), ``active``,
        ``manifest`` ({name: 32-hex} of every tensor handed to ``load_weights`` in the session),
        ``tensors``, ``calls`` (``load_weights`` calls) and ``digest_s`` (seconds).
    """
    engine = getattr(self, "weight_transfer_engine", None)
    receiver = getattr(engine, "_refit_verify_native", None) if engine is not None else None
    out: dict[str, Any] = {"rank": getattr(self, "rank", None), "verifying": receiver is not None}
    if receiver is not None:
        out.update(receiver.snapshot())
    elif engine is None:
        out["reason"] = "no weight-transfer engine (LLM(..., weight_transfer_config=...) not set)"
    else:
        out["reason"] = f"REFIT_VERIFY={mode_from_env().value} in this vLLM worker"
    return out


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

    FLUSH_TENSORS = 64
    FLUSH_BYTES = 512 << 20
    """CUDA digests are launched per tensor and collected (one synchronisation) per this many
    tensors or bytes; the verifier holds references to the tensors of the open group until then."""

    def __init__(self, target: Any = None, *, mode: VerifyMode | str | None = None) -> None:
        self.mode = mode_from_env() if mode is None else VerifyMode.parse(mode)
        self.target = target
        self._digests: dict[str, str] = {}
        self.digest_s = 0.0
        self.engines: list[weakref.ref] = []
        self._batch: Any = None
        self._held: list[Any] = []
        self._held_bytes = 0

    # -- digesting
    @property
    def digests(self) -> dict[str, str]:
        """``{name: 32-hex}`` of every tensor added so far (collects launched CUDA digests first)."""
        self._flush()
        return self._digests

    def add(self, name: str, tensor: Any) -> None:
        """Digest one exported tensor: computed now on CPU; on CUDA its kernel is launched now on the
        current stream (so it reads the bytes as they are at this point of the stream, before any
        later in-place change) and collected without a per-tensor synchronisation."""
        from refit_verify.digest import DigestBatch

        t0 = time.perf_counter()
        if self._batch is None:
            self._batch = DigestBatch()
        self._batch.add(name, tensor)
        self._batch.launch()
        if getattr(tensor, "is_cuda", False):
            self._held.append(tensor)  # keep the memory alive (and unreused) until the kernel is collected
            self._held_bytes += tensor.numel() * tensor.element_size()
        if len(self._held) >= self.FLUSH_TENSORS or self._held_bytes >= self.FLUSH_BYTES:
            self._flush()
        self.digest_s += time.perf_counter() - t0

    def _flush(self) -> None:
        if self._batch is None:
            return
        t0 = time.perf_counter()
        self._digests.update(self._batch.hexdigests())
        self._batch, self._held, self._held_bytes = None, [], 0
        self.digest_s += time.perf_counter() - t0

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
        fetchers = [f for f in (_fetcher(self.target),) if f is not None]
        if not fetchers:
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
            fetchers = [_fetcher(llm) for llm in seen]
        if not fetchers:
            raise RefitConfigError(
                f"refit-verify cannot reach the vLLM workers to fetch their manifests (client: {type(self.target).__name__}). "
                "Use a client with collective_rpc, a Ray or HTTP client, an in-process LLM, or "
                "refit_verify.vllm_plugin.native.NativeSendVerifier(target=...)."
            )
        results: list[dict[str, Any]] = []
        for f in fetchers:
            try:
                out = f()
            except Exception as e:
                raise RefitConfigError(
                    f"refit-verify could not fetch worker manifests through {MANIFEST_METHOD!r} ({type(e).__name__}: {e}); "
                    "is refit-verify installed in the vLLM server's environment?"
                ) from e
            results.extend(out or [])
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
            _LAST.update(key=key, sender=sender)
        reports = [compare_manifests(sender, w.get("manifest") or {}, rank=w.get("rank")) for w in workers]
        with _LOCK:
            _LAST["reports"] = reports
        failing = [r for r in reports if not r.ok]
        if not failing:
            logger.info("refit verified (native weight transfer): %d tensors on %d worker(s)", len(sender), len(reports))
        if failing and self.mode is VerifyMode.ENFORCE:
            for r in failing[1:]:
                logger.warning("%s", r.describe())
            act_on(failing[0], self.mode)
        for r in reports:
            act_on(r, self.mode)
        return reports


def _fetcher(target: Any) -> Callable[[], list[dict[str, Any]]] | None:
    """Return a function fetching every worker's manifest through ``target``, or None."""
    if target is None:
        return None
    if isinstance(target, str):
        return functools.partial(_fetch_http, target)
    handles = target if isinstance(target, list) else getattr(target, "handles", None)
    if isinstance(handles, list) and handles and all(_is_ray_handle(h) for h in handles):
        return functools.partial(_fetch_ray, handles)
    if _is_ray_handle(target):
        return functools.partial(_fetch_ray, [target])
    rpc = getattr(target, "collective_rpc", None)
    if callable(rpc) and not _is_async(rpc):
        return lambda: list(rpc(MANIFEST_METHOD))
    base_url = getattr(target, "base_url", None)
    if isinstance(base_url, str):
        return functools.partial(_fetch_http, base_url)
    owner = getattr(target, "__self__", None)  # a bound method (0.26 send_mode callable)
    if owner is not None and owner is not target:
        found = _fetcher(owner)
        if found is not None:
            return found
    for value in list(getattr(target, "__dict__", {}).values()):  # a client holding an LLM / handle
        if value is target or isinstance(value, (str, int, float, bool, type(None))):
            continue
        rpc = getattr(value, "collective_rpc", None)
        if _is_ray_handle(value) or (callable(rpc) and not _is_async(rpc)):
            return _fetcher(value)
    return None


def _is_ray_handle(obj: Any) -> bool:
    return callable(getattr(getattr(obj, "collective_rpc", None), "remote", None))


def _is_async(fn: Any) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


def _fetch_ray(handles: list) -> list[dict[str, Any]]:
    import ray

    out: list[dict[str, Any]] = []
    for res in ray.get([h.collective_rpc.remote(MANIFEST_METHOD) for h in handles]):
        out.extend(res)
    return out


def _fetch_http(base_url: str) -> list[dict[str, Any]]:
    import requests

    r = requests.post(f"{base_url.rstrip('/')}/collective_rpc", json={"method": MANIFEST_METHOD}, timeout=300)
    r.raise_for_status()
    return list(r.json().get("results", []))


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
    if getattr(vars(engine).get("send_weights"), _MARK, False):
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

    setattr(send_weights, _MARK, True)
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
        _patch(cls, "trainer_send_weights", _wrap_static_sender)


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
        verifier.verify()
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
                _patch(owner, attr, make)


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
        return raw(self, *args, **kwargs)

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
