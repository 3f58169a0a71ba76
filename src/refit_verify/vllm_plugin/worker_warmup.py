"""Worker side of the digest warm-up: the digest kernels of a worker's device are compiled and run
once in a background thread from the moment the device is set, so the first refit compiles nothing.

* ``Worker.init_device`` / ``CPUWorker.init_device`` are wrapped (:func:`wrap_init_device`): when
  they return, :func:`refit_verify.digest.backends.start_warmup` starts on ``worker.device``, and
  imports, in the same thread, the modules a refit imports in the worker (:data:`REFIT_MODULES`).
  A digest that comes while it runs waits for it (bounded, ``backends.WARMUP_WAIT_S``).
* ``Worker.compile_or_warm_up_model`` is wrapped (:func:`wrap_compile_or_warm_up_model`): vLLM
  captures its CUDA graphs there, and a launch or allocation of the warm-up thread during a capture
  would break it, so it first waits for the warm-up (same bound).
* Once the model is loaded and its boundary attached (:func:`after_load`, from the plugin's
  ``load_model`` hook), what the first session's close would build and keep is built before any
  refit (:meth:`WorkerBoundary.prepare <refit_verify.boundary.worker.WorkerBoundary.prepare>`: the
  model index, the engine-state kept set read once) and the refit modules imported: in a
  background thread on the CPU; on CUDA in ``compile_or_warm_up_model`` before vLLM's capture (after
  its memory profiling, which a background allocation would disturb). Where each loader puts the
  checkpoint's tensors (:func:`checkpoint_specs`: the config's HF tensors in the engine's dtype) is
  learned there too, dry (no write reaches the model); tensors pushed with other names, shapes or
  dtypes, the refit plan and the layout map are learned at the first verified refit, or dry on
  request (``refit_verify_layout_map``).
* ``CPUWorker.compile_or_warm_up_model`` is wrapped (:func:`wrap_cpu_compile_or_warm_up_model`):
  vLLM's GPU ``Worker`` freezes its startup heap there (``vllm.utils.gc_utils.freeze_gc_heap``) so
  the garbage collector stops scanning static objects; ``CPUWorker`` overrides the method without
  it. Once vLLM's own method returned and the first session's prepare ended (bounded), the same
  freeze runs in a CPU worker (:func:`freeze_heap`).

Nothing starts with ``REFIT_VERIFY=off`` or ``REFIT_VERIFY_WARMUP=0``.
"""

from __future__ import annotations

import functools
import gc
import importlib
import logging
import threading
import time
from typing import Any

from refit_verify.config import mode_from_env, warmup_enabled
from refit_verify.digest import backends
from refit_verify.vllm_plugin import runner

logger = logging.getLogger("refit_verify")

REFIT_MODULES = ("refit_verify.transport.receiver", "refit_verify.collective.broadcast", "refit_verify.engine.forward")
"""What the worker's refit methods import on their first call (our transport's receiver, our broadcast
path, the proof of weights a CPU kernel repacked): tens of milliseconds on a CPU host, imported by the
warm-up instead."""


def _import_refit_modules() -> None:
    for name in REFIT_MODULES:
        importlib.import_module(name)


_PENDING = "_refit_verify_prepare"  # a CUDA worker's attribute: its boundary, prepared in compile_or_warm_up_model
_THREAD = "_refit_verify_prepare_thread"  # a CPU worker's attribute: the thread preparing its first session


def after_load(worker: Any, wb: Any) -> threading.Thread | None:
    """Prepare ``wb`` (the worker's :class:`~refit_verify.boundary.worker.WorkerBoundary`, its models
    attached) before the first refit: :data:`LOAD_HOOKS` on its models now, in this thread; then
    :func:`prepare` in a daemon thread, or, on a CUDA worker, in
    ``compile_or_warm_up_model`` (:func:`wrap_compile_or_warm_up_model`). Nothing with the warm-up off
    (``REFIT_VERIFY_WARMUP=0``); never raises.

    Returns:
        the thread started, or None (deferred to ``compile_or_warm_up_model``, or nothing to do).
    """
    try:
        if not warmup_enabled() or wb is None:
            return None
        built: dict[str, Any] = {}

        def specs() -> dict[str, tuple[tuple[int, ...], str]]:
            if "specs" not in built:
                built["specs"] = checkpoint_specs(worker)
            return built["specs"]

        _load_hooks(wb, specs)
        device = runner.device(worker)
        if device is not None and getattr(device, "type", None) == "cuda":
            setattr(worker, _PENDING, wb)
            return None
        th = threading.Thread(target=prepare, args=(wb, getattr(device, "type", "cpu"), worker, built.get("specs")),
                              name="refit-verify-prepare", daemon=True)
        th.start()
        setattr(worker, _THREAD, th)
        return th
    except Exception:  # noqa: BLE001 - the worker starts regardless; the first close builds them
        logger.warning("refit-verify: preparing the first session could not start", exc_info=True)
        return None


def checkpoint_specs(worker: Any) -> dict[str, tuple[tuple[int, ...], str]]:
    """``{HF name: (shape, dtype name)}`` of the checkpoint the worker's model config describes, as a
    trainer of that architecture pushes it: the floating-point tensors of the ``transformers`` model
    built from the config on the meta device (no memory), in the engine's dtype. Empty when none can
    be built (an architecture ``transformers`` does not know, a config it refuses); never raises."""
    try:
        import torch
        from transformers import AutoModelForCausalLM

        mc = runner.model_config(worker)
        cfg, dtype = getattr(mc, "hf_config", None), getattr(mc, "dtype", None)
        if cfg is None or not isinstance(dtype, torch.dtype):
            return {}
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(cfg, torch_dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        return {n: (tuple(t.shape), name) for n, t in hf.state_dict().items() if t.is_floating_point()}
    except Exception:  # noqa: BLE001 - nothing learned ahead: the first refit learns its placements
        logger.info("refit-verify: no checkpoint layout for learning placements ahead", exc_info=True)
        return {}


def _fill_digests(wb: Any) -> None:
    """The digests of the fills the checkpoint's loaders write (learned ahead: ``ModelBoundary.fills_ahead``),
    computed into the close's cache (:func:`refit_verify.engine.fills.fill_hex`)."""
    from refit_verify.engine import fills

    for b in list(getattr(wb, "modules", {}).values()):
        for dtype, shape, value in getattr(b, "fills_ahead", ()):
            try:
                fills.fill_hex(dtype, shape, value)
            except (RuntimeError, TypeError, ValueError):  # the close says why it cannot rebuild it
                pass


LOAD_HOOKS: list = []
"""Callables ``hook(boundary, specs)`` run on each watched model's
:class:`~refit_verify.boundary.model.ModelBoundary` in the worker's own thread right after the model
is loaded (:func:`after_load`), before vLLM runs any forward: work that must not run beside vLLM's (a
forward of one of its layers, a parameter swapped for a moment). ``specs()`` gives the checkpoint's
``{name: (shape, dtype name)}`` (:func:`checkpoint_specs`, built at the first call and handed on to
:func:`prepare`). A module registers its own at import."""


def _load_hooks(wb: Any, specs: Any) -> None:
    for b in list(getattr(wb, "modules", {}).values()):
        if callable(getattr(getattr(b, "model", None), "modules", None)):
            for hook in list(LOAD_HOOKS):
                try:
                    hook(b, specs)
                except Exception:  # noqa: BLE001 - the first refit does that work instead
                    logger.warning("refit-verify: a warm-up hook failed after load", exc_info=True)


MODEL_HOOKS: list = []
"""Callables ``hook(model)`` a worker's prepare runs on each watched model, after the rest (work of
other plugin modules that the first refit would do otherwise; a module registers its own at import)."""


def prepare(wb: Any, device_type: str = "cpu", worker: Any = None,
            specs: dict[str, tuple[tuple[int, ...], str]] | None = None) -> bool:
    """Wait for the digest warm-up of ``device_type`` (bounded: ``backends.WARMUP_WAIT_S``), then
    :meth:`WorkerBoundary.prepare <refit_verify.boundary.worker.WorkerBoundary.prepare>` (with
    ``worker``: the loaders' placements of its checkpoint's tensors learned ahead, :func:`checkpoint_specs`)
    and import the refit modules (a process whose device warm-up another caller started, a colocated
    trainer, did not import them in it); then the first use of the refit's digest paths on the device
    (:func:`~refit_verify.digest.backends.warm_paths`: the CPU's and a kernel device's); the digests of the fills learned ahead; and
    each model handed to :data:`MODEL_HOOKS` (its modules' names: :func:`~refit_verify.vllm_plugin.quantized.remember_names`).
    ``specs``: the checkpoint's tensors when the caller built them already. Logs what it did; never
    raises. Returns whether ``wb`` was prepared."""
    t0 = time.perf_counter()
    try:
        backends.wait_for_warmup(device_type)
        if specs is None:
            specs = checkpoint_specs(worker) if worker is not None else {}
        done = wb.prepare(specs={"model": specs} if specs else None)
        _import_refit_modules()
        backends.warm_paths(device_type)  # the first use of the refit's digest paths (their modules are imported now)
        _fill_digests(wb)
        for b in list(getattr(wb, "modules", {}).values()):  # e.g. the layers' names the first refit's session_of looks up
            if callable(getattr(getattr(b, "model", None), "named_modules", None)):
                for hook in list(MODEL_HOOKS):
                    hook(b.model)
    except Exception:  # noqa: BLE001 - the first close builds them instead
        logger.warning("refit-verify: preparing the first session failed; its close builds what it needs", exc_info=True)
        return False
    if done:
        logger.info("refit-verify: first session prepared in %.3f s (model index, engine-state kept set, %d placements learned "
                    "ahead)", time.perf_counter() - t0, sum(len(b.tap.ahead) for b in list(getattr(wb, "modules", {}).values())))
    return done


def start(worker: Any) -> backends.Warmup | None:
    """Start the digest warm-up on ``worker.device`` when this process verifies; never raises.

    Returns:
        the device's :class:`~refit_verify.digest.backends.Warmup`, or None (not verifying, warm-up
        off, or the worker has no device yet).
    """
    try:
        device = runner.device(worker)
        if device is None or not mode_from_env().verifies:
            return None
        return backends.start_warmup(device, then=_import_refit_modules)
    except Exception:  # noqa: BLE001 - the worker starts regardless; its first refit compiles the digests
        logger.warning("refit-verify: the digest warm-up could not start", exc_info=True)
        return None


def wrap_init_device(raw):
    @functools.wraps(raw)
    def init_device(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        start(self)
        return out

    return init_device


def wrap_compile_or_warm_up_model(raw):
    @functools.wraps(raw)
    def compile_or_warm_up_model(self, *args, **kwargs):
        device = runner.device(self)
        if device is not None:
            backends.wait_for_warmup(getattr(device, "type", str(device)))
        wb = getattr(self, _PENDING, None)
        if wb is not None:
            delattr(self, _PENDING)  # before the capture: none of its launches or allocations lands inside one
            prepare(wb, getattr(device, "type", "cuda"), self)
        return raw(self, *args, **kwargs)

    return compile_or_warm_up_model


def freeze_heap(worker: Any, timeout_s: float | None = None) -> int | None:
    """Freeze the process's heap as vLLM's GPU ``Worker`` does after its warm-up
    (``vllm.utils.gc_utils.freeze_gc_heap``: collect every generation, then ``gc.freeze()``), once the
    thread preparing ``worker``'s first session (:func:`after_load`) ended, waited for at most
    ``timeout_s`` (default ``backends.WARMUP_WAIT_S``); its objects are startup objects too. Nothing
    with the warm-up off or where vLLM has no ``freeze_gc_heap``; never raises.

    Returns:
        the number of objects frozen (``gc.get_freeze_count()``), or None when nothing was done.
    """
    try:
        if not warmup_enabled():
            return None
        try:
            from vllm.utils.gc_utils import freeze_gc_heap
        except ImportError:  # a vLLM without the policy: its heap is left as it is
            return None
        th = getattr(worker, _THREAD, None)
        t0 = time.perf_counter()
        if th is not None:
            th.join(backends.WARMUP_WAIT_S if timeout_s is None else timeout_s)
        t1 = time.perf_counter()
        freeze_gc_heap()
        n = gc.get_freeze_count()
        logger.info("refit-verify: worker heap frozen after the warm-up, as vLLM's GPU worker does: %d objects "
                    "(waited %.3f s for the first session's prepare%s, froze in %.3f s)", n, t1 - t0,
                    ", still running" if th is not None and th.is_alive() else "", time.perf_counter() - t1)
        return n
    except Exception:  # noqa: BLE001 - the worker starts regardless; its collections scan the whole startup heap
        logger.warning("refit-verify: freezing the worker heap failed", exc_info=True)
        return None


def wrap_cpu_compile_or_warm_up_model(raw):
    @functools.wraps(raw)
    def compile_or_warm_up_model(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        freeze_heap(self)
        return out

    return compile_or_warm_up_model
