"""What a parameter the engine quantizes on load must satisfy, checked without vLLM.

vLLM's online quantization (``quantization="fp8"`` on vLLM 0.26, ``fp8_per_tensor`` /
``fp8_per_channel`` / ``fp8_per_block`` on 0.32) loads the delivered bf16 weight into a fresh
tensor, then the layer's quant method replaces it by an fp8 ``weight`` and a ``weight_scale`` (or
``weight_scale_inv``). The vLLM plugin re-runs that quant method on a copy of the layer
(:mod:`refit_verify.vllm_plugin.quantized`) and :mod:`refit_verify.engine.quantized` records the
result; the helpers here say whether two results are the same bytes and whether a scale can be
right at all. A zero, NaN, Inf or negative scale is never right: every weight it scales
dequantizes to 0 or NaN (verl #7224: every FP8 scale zero after a "successful" load).
"""

from __future__ import annotations

import torch

__all__ = ["differs", "is_scale", "scale_problem"]


def is_scale(name: str) -> bool:
    """True iff parameter ``name`` (dotted) is a quantization scale (its last part names a scale:
    ``weight_scale``, ``weight_scale_inv``, ``input_scale``)."""
    return "scale" in name.rsplit(".", 1)[-1]


def scale_problem(name: str, t: torch.Tensor) -> str | None:
    """Why scale parameter ``name`` cannot be right (zero, negative, NaN or Inf elements, or none at
    all), or None; None for a parameter that is not a scale (:func:`is_scale`). Reads every element
    (scales are small: one per tensor, channel or block)."""
    if not is_scale(name):
        return None
    if t.numel() == 0:
        return f"{name} is empty: a quantization scale with no element"
    v = t.detach().float()
    bad = ~torch.isfinite(v) | (v <= 0)
    n = int(bad.sum())
    if not n:
        return None
    flat = v.reshape(-1)
    i = int(bad.reshape(-1).nonzero()[0])
    kinds = [k for k, m in (("zero", flat == 0), ("negative", flat < 0), ("NaN", flat.isnan()), ("Inf", flat.isinf()))
             if bool(m.any())]
    return (f"{name} holds {n} of {t.numel()} scale elements that are {' / '.join(kinds)} (first at flat index {i}: "
            f"{float(flat[i])}): every weight it scales dequantizes to 0, a sign flip or NaN")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().reshape(-1).contiguous()
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def differs(name: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """Why ``got`` (what the layer holds) is not bytewise ``want`` (what the engine's quantization
    yields for the delivered tensor): dtype, shape or the elements that differ; None when equal
    (logical bytes in row-major order: two layouts of the same values are equal)."""
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return (f"{name} is {str(got.dtype).removeprefix('torch.')} {list(got.shape)}, the engine's quantization of the "
                f"delivered tensor gives {str(want.dtype).removeprefix('torch.')} {list(want.shape)}")
    a, b = _bytes(got), _bytes(want.to(got.device))
    if torch.equal(a, b):
        return None
    size = max(got.element_size(), 1)
    diff = (a != b).reshape(-1, size).any(dim=1) if a.numel() else a.bool()
    n = int(diff.sum())
    i = int(diff.nonzero()[0])
    return (f"{name} holds other bytes than the engine's quantization of the delivered tensor: {n} of {got.numel()} "
            f"elements differ (first at flat index {i})")
