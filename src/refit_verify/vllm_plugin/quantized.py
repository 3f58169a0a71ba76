"""vLLM's quantization on load, watched in a refit session (patch ``quant-process``).

vLLM's online quantization (vLLM 0.26 ``quantization="fp8"``: ``Fp8OnlineLinearMethod``; 0.32
``fp8_per_tensor`` / ``fp8_per_channel`` / ``fp8_per_block``: the ``OnlineLinearBase`` methods)
creates each linear layer's bf16 ``weight`` on the meta device and wraps its loader
(``initialize_online_processing``). A refit's loads are buffered per layer; once a layer has all
its weights, vLLM materialises a fresh bf16 ``weight``, loads into it, calls the quant method's
``process_weights_after_loading`` (an fp8 ``weight`` and ``weight_scale`` replace it) and copies the
result into the engine's tensors (``_copy_and_restore_kernel_tensors``).

Each online linear method's ``process_weights_after_loading`` is wrapped here. Inside a verifying
session, on a layer of a model the worker's boundary watches, the wrapper

1. runs the same method on a copy of the layer first (its parameters cloned, the layer's other
   attributes shared; the method's own state is set again by the real run that follows), on the
   same device: what the engine's quantization yields for the bf16 tensors the loaders wrote;
2. runs the real one;
3. hands both to :func:`refit_verify.engine.quantized.settle`, which reads back the bf16 tensors
   against the delivered bytes, compares the layer's fp8 tensors and scales with the copy's
   (bit-equal, or named), checks the scales, and records them for the close's read-back of the
   engine's own copies.

Outside a session, on a layer no boundary watches, or for a quant method that is not an online
linear one (fused-MoE methods keep kernel state on the method: a copy's run would change it), the
call passes through; such parameters stay ``not_proven`` with the reason.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from refit_verify.vllm_plugin import worker_warmup
from refit_verify.vllm_plugin.shims import in_session, record_into

__all__ = ["ONLINE_MODULES", "online_linear_methods", "patch_module", "wrap_process"]

ONLINE_MODULES = ("vllm.model_executor.layers.quantization.online.fp8",   # 0.32: Fp8PerTensor/PerBlock/Ptpc
                  "vllm.model_executor.layers.quantization.online.mxfp8",
                  "vllm.model_executor.layers.quantization.online.mxfp4",
                  "vllm.model_executor.layers.quantization.fp8")          # 0.26: Fp8OnlineLinearMethod
"""Modules whose online linear quant methods are wrapped (each when imported, if it exists)."""

_NAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {id(module): qualified name}


def online_linear_methods(module: Any) -> list[type]:
    """The classes of ``module`` that quantize a linear layer online: subclasses of vLLM's
    ``LinearMethodBase`` defined there that define ``process_weights_after_loading`` themselves and
    either create the bf16 weight on the meta device (``uses_meta_device``) or are named online
    (``Fp8OnlineLinearMethod``)."""
    try:
        from vllm.model_executor.layers.linear import LinearMethodBase
    except ImportError:  # pragma: no cover - a vLLM without it
        return []
    out = []
    for v in vars(module).values():
        if (isinstance(v, type) and issubclass(v, LinearMethodBase) and v.__module__ == module.__name__
                and "process_weights_after_loading" in v.__dict__
                and (getattr(v, "uses_meta_device", False) is True or "Online" in v.__name__)):
            out.append(v)
    return out


def patch_module(module: Any) -> None:
    """Wrap ``process_weights_after_loading`` of every online linear method of ``module`` (idempotent)."""
    from refit_verify.vllm_plugin import shims

    for cls in online_linear_methods(module):
        shims.patch(cls, "process_weights_after_loading", wrap_process)


def remember_names(model: torch.nn.Module) -> None:
    """Map ``model``'s modules to their qualified names now (a worker's prepare at engine start), so
    the first refit's :func:`session_of` does not walk the model: each name it takes from the map is
    checked against the model at its use, and the map is made again when one no longer holds."""
    _NAMES[model] = {id(m): n for n, m in model.named_modules()}


worker_warmup.MODEL_HOOKS.append(remember_names)


def _module_name(model: torch.nn.Module, layer: torch.nn.Module) -> str | None:
    names = _NAMES.get(model)
    name = names.get(id(layer)) if names is not None else None
    if name is not None:
        try:
            if model.get_submodule(name) is layer:
                return name
        except AttributeError:
            pass
    names = _NAMES[model] = {id(m): n for n, m in model.named_modules()}
    return names.get(id(layer))


def session_of(layer: torch.nn.Module) -> tuple[Any, str, str] | None:
    """``(module session, label prefix, the layer's qualified name)`` of the open verifying session
    whose watched model holds ``layer``, or None."""
    from refit_verify.vllm_plugin import worker_sessions

    for model, wb in list(getattr(worker_sessions, "_BY_MODEL", {}).items()):
        if not wb.verifying or wb.open_session is None:
            continue
        for role, b in list(wb.modules.items()):
            if b.session is None or b.model is not model:
                continue
            name = _module_name(model, layer)
            if name is not None:
                return b.session, "" if role == "model" else f"{role}:", name
    return None


def _clone(p: torch.Tensor) -> torch.Tensor:
    """A copy of parameter ``p`` of its own memory, class and attributes (as vLLM materialises one)."""
    t = torch.empty_strided(tuple(p.size()), tuple(p.stride()), dtype=p.dtype, device=p.device)
    t.copy_(p.detach())
    t.__class__ = p.__class__
    t.__dict__ = p.__dict__.copy()
    return t


def rerun(raw, method: Any, layer: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """Run quant method ``method``'s ``process_weights_after_loading`` (``raw``) on a copy of ``layer``
    whose parameters and buffers are clones (the layer itself is untouched); return the copy's
    parameters after it, ``{name: tensor}``."""
    scratch = copy.copy(layer)
    scratch._parameters = {n: (_clone(p) if p is not None else None) for n, p in layer._parameters.items()}
    scratch._buffers = {n: (b.detach().clone() if b is not None else None) for n, b in layer._buffers.items()}
    scratch._non_persistent_buffers_set = set(layer._non_persistent_buffers_set)
    scratch._modules = dict(layer._modules)
    with torch.no_grad():
        raw(method, scratch, *args, **kwargs)
    return {n: p for n, p in scratch._parameters.items() if p is not None}


def wrap_process(raw):
    """The wrapper of an online linear method's ``process_weights_after_loading`` (see the module docstring)."""

    def body(raw, self, layer, ctx, args, kwargs):
        ms, prefix, mname = ctx
        before = {f"{mname}.{n}": p for n, p in layer._parameters.items() if p is not None}
        if not any(k in ms.written or k in ms.inexact for k in before):
            return raw(self, layer, *args, **kwargs)
        what = f"quantized on load by {type(self).__name__}.process_weights_after_loading"
        reference, why_not = None, None
        try:
            got = rerun(raw, self, layer, args, kwargs)
            reference = {f"{mname}.{n}": t for n, t in got.items()}
        except Exception as e:  # noqa: BLE001 - the engine's own run decides; its parameters are then not proven
            why_not = f"running it again on a copy of the layer raised {type(e).__name__}: {e}"[:300]
        out = raw(self, layer, *args, **kwargs)
        after = {f"{mname}.{n}": p for n, p in layer._parameters.items() if p is not None}

        def record() -> None:
            from refit_verify.engine.quantized import settle

            settle(ms, prefix, before, after, reference, what, why_not)

        record_into(ms, "quantization", mname, record)
        return out

    return in_session(raw, session_of, body)
