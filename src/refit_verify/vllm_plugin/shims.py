"""Version shims and patch machinery: everything that knows which vLLM is installed.

* :func:`vllm_version`, :func:`detect_native`: what the installed vLLM offers.
* :func:`patch`: replace a class attribute by a marked wrapper, remembered in :data:`APPLIED`
  (label -> original) so tests can restore it (:func:`restore_all`); idempotent.
* :func:`when_imported`: run a callback once a module is imported (post-import hook), for modules
  vLLM imports after the plugin ran.
* :func:`layerwise_reload`, :func:`default_weight_loader`, :func:`worker_identity`: small per-version
  accessors (a worker's models, config and device: :mod:`refit_verify.vllm_plugin.runner`).
* :func:`restore_unfinished_layers`: a layer of vLLM's layerwise reload that cannot land whole
  (a refused part, a failed refit) gets its previous kernel tensors back before finalize.

Sources: vllm/{v1/worker/gpu_worker.py, model_executor/model_loader/reload/, distributed/weight_transfer/}
of 0.24 - 0.33.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("refit_verify")

MARK = "__refit_verify_patch__"
LOCK = threading.RLock()
APPLIED: dict[str, tuple[object, str, object]] = {}
"""label -> (owner, attribute, original ``__dict__`` value) of every attribute patched in this process."""


# --------------------------------------------------------------------------- detection


def vllm_version() -> tuple[int, int] | None:
    """Return the installed vLLM's (major, minor), or None when it cannot be read."""
    try:
        import vllm
    except ImportError:
        return None
    m = re.match(r"(\d+)\.(\d+)", str(getattr(vllm, "__version__", "")))
    return (int(m.group(1)), int(m.group(2))) if m else None


def detect_native() -> dict[str, Any]:
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


# --------------------------------------------------------------------------- patching


def unwrap_descriptor(obj: Any) -> Any:
    return obj.__func__ if isinstance(obj, (classmethod, staticmethod)) else obj


def patch(owner: type, attr: str, make: Callable[[Any], Any]) -> bool:
    """Replace ``owner.__dict__[attr]`` by ``make(original)``, marked and remembered; idempotent.
    ``owner`` is a class, or a module (a module-level function).

    Returns False (and patches nothing) when ``owner`` does not define ``attr`` itself.
    """
    with LOCK:
        if attr not in owner.__dict__:
            return False
        label = (f"{owner.__module__}.{owner.__qualname__}.{attr}" if isinstance(owner, type)
                 else f"{owner.__name__}.{attr}")
        raw = owner.__dict__[attr]
        if getattr(unwrap_descriptor(raw), MARK, False):
            return True
        new = make(raw)
        setattr(unwrap_descriptor(new), MARK, True)
        setattr(owner, attr, new)
        APPLIED[label] = (owner, attr, raw)
        return True


def restore_all() -> None:
    """Restore every patched attribute (tests only; objects built meanwhile keep their wrappers)."""
    with LOCK:
        for owner, attr, raw in APPLIED.values():
            setattr(owner, attr, raw)
        APPLIED.clear()
        _FINDER.pending.clear()


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


def when_imported(name: str, fn: Callable[[Any], None]) -> None:
    """Run ``fn(module)`` now if ``name`` is imported, else right after its import."""
    mod = sys.modules.get(name)
    if mod is not None:
        fn(mod)
        return
    _FINDER.pending.setdefault(name, []).append(fn)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)


# --------------------------------------------------------------------------- accessors


def layerwise_reload():
    """Return vLLM's (initialize, finalize) layerwise-reload functions, or (None, None) without them."""
    try:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
    except ImportError:  # pragma: no cover - a vLLM without layerwise reload: load_weights writes in place
        return None, None
    return initialize_layerwise_reload, finalize_layerwise_reload


def layerwise_restore_params(model: Any) -> list[tuple[str, Any]]:
    """Return ``[(parameter name, meta tensor)]`` that vLLM's layerwise reload will restore into ``model``.

    ``record_metadata_for_reloading`` keeps meta copies of every layer's parameters (their
    ``weight_loader`` included) and ``initialize_layerwise_reload`` swaps them in: a wrapper of the
    live parameters' loaders would not be seen during a reload. Empty for a vLLM without it.
    """
    try:
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
    except ImportError:
        return []
    out = []
    for mname, module in model.named_modules():
        info = LAYERWISE_INFO.get(module)
        meta = getattr(info, "restore_metadata", None)
        if not meta:
            continue
        for pname, t in meta[0].items():
            out.append((f"{mname}.{pname}" if mname else pname, t))
    return out


def layerwise_stand_in(meta: Any, layer: Any, device: Any) -> Any:
    """A parameter on ``device`` (fresh, uninitialised memory) as vLLM's layerwise reload makes it from
    the meta copy ``meta`` of a parameter of ``layer`` (:func:`layerwise_restore_params`): its class and
    a copy of its attributes, loader methods bound to ``layer`` (vLLM's ``materialize_meta_tensor`` and
    ``restore_layer_refs``); ``meta`` is left as it is. None for a vLLM without layerwise reload."""
    try:
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs
    except ImportError:
        return None
    import torch

    with torch.device(device):
        return restore_layer_refs(materialize_meta_tensor(meta), layer)


def _layers_for(name: str, modules: dict[str, Any], packed: dict[str, list[str]]) -> list[str]:
    """Module paths of the layers a delivered (checkpoint) name is meant for.

    The module owning the parameter (``…o_proj.weight`` → ``…o_proj``); else the fused module of
    a part (``…k_proj.weight`` → ``…qkv_proj``, from the model's ``packed_modules_mapping``); else
    every module under the deepest one that contains the name (a loader that renames: MoE
    experts, prefixes); else all of them.
    """
    parts = name.split(".")
    owner = ".".join(parts[:-1])
    if owner in modules:
        return [owner]
    for i in range(len(parts) - 2, -1, -1):
        for fused, subs in packed.items():
            if parts[i] in subs:
                cand = ".".join([*parts[:i], fused])
                if cand in modules:
                    return [cand]
    for k in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in modules:
            return [p for p in modules if p == prefix or p.startswith(prefix + ".")]
    return list(modules)


def restore_unfinished_layers(model: Any, refused: list[str], failed: bool,
                              name_of: Callable[[Any], str | None]) -> tuple[dict[str, str], dict[str, str], set[str]]:
    """Before ``finalize_layerwise_reload``: put back every layer that cannot land whole.

    vLLM's layerwise reload buffers each layer's weights and processes the layer once all of it
    arrived; at finalize a layer that got only part of its weights is processed anyway ("Delayed
    processing") on freshly materialised storage, so the parts that never came are garbage rows of
    a fused ``qkv_proj`` / ``gate_up_proj``. A layer that a ``refused`` name was meant for, and
    after a failed refit (``failed``) every partly loaded layer, gets its previous kernel tensors
    back instead (``_place_kernel_tensors``, what vLLM itself does for a layer that got nothing):
    its parts land together or not at all. A partly loaded layer no refused name points to is left
    to vLLM (a weight with padding elements no checkpoint tensor covers).

    Args:
        model: the model under layerwise reload.
        refused: delivered names refused before loading (never handed to the model).
        failed: the refit failed (aborted, timed out, disconnected) before its end.
        name_of: maps a buffered tensor to its delivered name (the model boundary), or None.

    Returns:
        ``(kept, withheld, attributed)``: ``{parameter: why}`` of parameters that keep the
        previous version (layers put back here, and layers that got nothing, which vLLM puts back),
        ``{delivered name: why}`` of tensors buffered for a put-back layer (never landed), and the
        refused names whose layers were found. Empty where vLLM has no layerwise reload.
    """
    try:
        from vllm.model_executor.model_loader.reload import layerwise as lw
    except ImportError:  # pragma: no cover - a vLLM without layerwise reload
        return {}, {}, set()
    info_of = getattr(lw, "LAYERWISE_INFO", None)
    place = getattr(lw, "_place_kernel_tensors", None)
    if info_of is None or place is None:  # pragma: no cover - another layout of the reload module
        logger.warning("refit-verify: this vLLM's layerwise reload has no _place_kernel_tensors; a layer with a refused part "
                       "is finalized by vLLM")
        return {}, {}, set()
    modules = dict(model.named_modules())
    packed = getattr(model, "packed_modules_mapping", None) or {}
    hits: dict[str, list[str]] = {}
    for n in refused:
        for path in _layers_for(n, modules, packed):
            hits.setdefault(path, []).append(n)
    kept: dict[str, str] = {}
    withheld: dict[str, str] = {}
    attributed: set[str] = set()
    for path, layer in modules.items():
        info = info_of.get(layer)
        if info is None or not info.can_load() or info.kernel_tensors is None:
            continue
        total = info.load_numel_total or 0
        if total <= 0 or info.load_numel >= total:
            continue
        parts = hits.get(path, [])
        if not parts and not failed:
            continue
        if parts:
            attributed.update(parts)
            why = f"its part {parts[0]} was refused before loading" + (f" (and {len(parts) - 1} more)" if len(parts) > 1 else "")
        else:
            why = "the refit failed before all of its parts arrived"
        def label(pn: str, p: str = path) -> str:
            return f"{p}.{pn}" if p else pn

        params = list(info.kernel_tensors[0])
        if info.load_numel > 0:
            for pname, args in info.loaded_weights:
                dn = name_of(args.arguments.get("loaded_weight"))
                if dn is not None:
                    withheld[dn] = (f"not applied: {label(pname)} keeps the previous version ({why}; a layer's parts land "
                                    "together or not at all)")
            place(layer, info)  # the previous kernel tensors, untouched since the reload began
            info.reset()  # finalize skips it now
        # (a layer that got nothing is put back by finalize itself)
        for pname in params:
            kept[label(pname)] = why
    return kept, withheld, attributed


def default_weight_loader() -> Callable | None:
    """Return vLLM's ``default_weight_loader`` (the loader of parameters without one)."""
    try:
        from vllm.model_executor.model_loader.weight_utils import default_weight_loader as f
    except ImportError:  # pragma: no cover
        return None
    return f


def _group_rank(getter: str) -> int:
    try:
        from vllm.distributed import parallel_state as ps

        return int(getattr(ps, getter)().rank_in_group)
    except Exception:  # noqa: BLE001 - not initialised (a bare test worker): rank 0
        return 0


def worker_identity(worker: Any, device: Any = None):
    """Return the :class:`~refit_verify.manifest.WorkerIdentity` of a vLLM worker object on ``device``
    (:func:`refit_verify.vllm_plugin.runner.identity` finds it; None: ``"cpu"``)."""
    from refit_verify.manifest import WorkerIdentity

    pc = getattr(worker, "parallel_config", None)
    dp = getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0)) or 0
    return WorkerIdentity(rank=int(getattr(worker, "rank", 0) or 0), dp=int(dp), tp=_group_rank("get_tp_group"),
                          pp=_group_rank("get_pp_group"), device=str(device) if device is not None else "cpu", pid=os.getpid())


def hide_llvmlite_ffi(raw: Any) -> Any:
    """Wrap a classmethod so ``llvmlite.binding.ffi`` is out of ``sys.modules`` while it runs (patch ``cpu-kernel-scan``)."""
    if not isinstance(raw, classmethod):
        return raw
    func = raw.__func__

    def register_triton_kernel_overrides(klass, *args, **kwargs):
        ffi = sys.modules.pop("llvmlite.binding.ffi", None)
        try:
            return func(klass, *args, **kwargs)
        finally:
            if ffi is not None:
                sys.modules["llvmlite.binding.ffi"] = ffi

    return classmethod(register_triton_kernel_overrides)


def record_into(ms: Any, what: str, mname: str, record: Callable[[], None]) -> None:
    """Run ``record`` (what a wrapped ``process_weights_after_loading`` did to layer ``mname``, into
    module session ``ms``) with plain tensor ops. It never raises into vLLM's load: an error is logged
    and kept in ``ms.errors`` ("could not record the <what> of <mname>"), which fails the session.

    Its wall seconds are refit-verify's own work, though they run inside vLLM's load or finalize:
    they are added to the module boundary's ``record_s`` (``ms.module``, counted by
    :meth:`ModelBoundary.own_seconds <refit_verify.boundary.model.ModelBoundary.own_seconds>`)."""
    t0 = time.perf_counter()
    try:
        from refit_verify.digest.tensors import PLAIN

        with PLAIN():
            record()
    except Exception as e:  # noqa: BLE001 - the session reports it
        logger.exception("refit-verify: recording the %s of %s failed", what, mname)
        ms.errors.append(f"refit-verify could not record the {what} of {mname}: {type(e).__name__}: {e}"[:500])
    finally:
        module = getattr(ms, "module", None)
        if isinstance(getattr(module, "record_s", None), float):
            module.record_s += time.perf_counter() - t0


def in_session(raw: Callable, session_of: Callable[[Any], Any], body: Callable) -> Callable:
    """Wrap ``raw`` (a quant method's ``process_weights_after_loading(self, layer, ...)``): outside a
    verifying session (``session_of(layer)`` is None) it runs as it is; inside one,
    ``body(raw, self, layer, (module session, label prefix, layer name), args, kwargs)`` runs instead
    and returns what the call returns."""

    @functools.wraps(raw)
    def process_weights_after_loading(self, layer, *args, **kwargs):
        ctx = session_of(layer) if hasattr(layer, "_parameters") else None
        if ctx is None:
            return raw(self, layer, *args, **kwargs)
        return body(raw, self, layer, ctx, args, kwargs)

    return process_weights_after_loading
