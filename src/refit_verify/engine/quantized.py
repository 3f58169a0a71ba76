"""Parameters the engine quantizes on load, proven against the engine's own quantization.

vLLM's online quantization loads the delivered bf16 tensors into fresh parameters of a layer, then
the layer's quant method replaces them (``process_weights_after_loading``: an fp8 ``weight`` and a
``weight_scale``), and its layerwise reload copies those into the engine's tensors. At that moment
the vLLM plugin (:mod:`refit_verify.vllm_plugin.quantized`) calls :func:`settle` with the layer's
tensors before and after, and what the same quant method gives when run again on a copy of the
bf16 tensors (the same function on the same device: bit-equal, or it is named). :func:`settle`

* reads back the bf16 tensors now, as the close would (:func:`~refit_verify.engine.readback.read_now`):
  they must hold the delivered bytes where the loaders put them;
* compares every tensor the quantization produced with the re-run's, and checks each scale
  (:func:`~refit_verify.boundary.quantized.scale_problem`: never zero, negative, NaN or Inf);
* records them on the module session: the close then reads the engine's copy of each whole
  (:func:`~refit_verify.engine.readback.read_back`), which must hold those bytes (a stale, overwritten
  or uncopied fp8 weight or scale is a ``mismatch``), and they count in ``proven_bytes``.

Whatever cannot be shown is said: the parameter is ``mismatch`` (delivered bytes or quantization
differ, a bad scale) or ``not_coverable`` with the reason (no re-run for this quant method).
"""

from __future__ import annotations

import torch

from refit_verify.boundary.quantized import differs, is_scale, scale_problem
from refit_verify.boundary.regions import covered
from refit_verify.engine.readback import read_now

__all__ = ["settle"]

_UNQUANTIZED = (torch.bfloat16, torch.float16, torch.float32)

_RECORDS = ("written", "placed", "inexact", "unexplained", "assumed", "opaque", "param_numel", "param_dtype",
            "param_geometry", "replicated")


def settle(ms, prefix: str, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
           reference: dict[str, torch.Tensor] | None, what: str, why_not: str | None = None) -> list[str]:
    """Record one layer's quantization on load in module session ``ms`` (see the module docstring).

    Args:
        ms: the module session (:class:`refit_verify.boundary.record.ModuleSession`) of the open session.
        prefix: label prefix of the module (``""`` for the main model, ``"drafter:"``).
        before: ``{parameter name: tensor}`` of the layer right before its quant method ran.
        after: the same right after (the tensors its layerwise reload copies into the engine's).
        reference: what the quant method gave run again on a copy of ``before``'s tensors, or None
            (``why_not`` says why: such parameters are not proven).
        what: what quantized them, for the report (``"quantized on load by Fp8...Method"``).

    Returns:
        The parameters produced by the quantization whose bf16 input this session wrote (empty when
        it wrote none of the layer's quantized inputs: nothing is recorded).
    """
    loaded = [p for p in before if p in ms.written or p in ms.inexact]
    inputs = [p for p in loaded if after.get(p) is not before[p]]
    if not inputs:
        for p in loaded:  # the layer counted as processed already: its engine tensors get a cast of the loaded bytes
            if p.rsplit(".", 1)[-1] == "weight" and before[p].dtype in _UNQUANTIZED:
                ms.unexplained[p] = (f"{what} left it as loaded ({str(before[p].dtype).removeprefix('torch.')}): nothing was "
                                     "quantized (the layer counted as processed already), so the engine's quantized copy is "
                                     "not made from the delivered bytes")
        return []
    # what the quantization produced: tensors it replaced or added, and scales no loader wrote (a vLLM that
    # creates the scale with the layer and fills it in place)
    outputs = [p for p, t in after.items()
               if before.get(p) is not t or (is_scale(p) and p not in ms.written and p not in ms.inexact)]
    ms.land_pending(set(inputs))
    states, early = read_now(ms, {p: before[p] for p in inputs}, prefix)
    ms.read_early.update(early)
    got = {p: min(covered(ms.written[p]), before[p].numel()) if p in ms.written else 0 for p in inputs}
    part = [p for p in inputs if got[p] < before[p].numel()]
    sources = sorted({src for p in inputs for c, _key, src in ms.placed.get(p, ()) if not c.fill})
    for p in inputs:
        for rec in _RECORDS:
            getattr(ms, rec).pop(p, None)
    wrong = [(p, st.why) for p in inputs if (st := states.get(prefix + p)) is not None and st.status == "mismatch"]
    unsure = [(p, st.why) for p in inputs if (st := states.get(prefix + p)) is not None and st.status != "verified"]
    for o in outputs:
        t = after[o]
        ms.param_numel[o], ms.param_dtype[o] = t.numel(), t.dtype
        ms.written[o] = {} if part else {(0, tuple(t.shape), tuple(t.stride())): t.numel()}
        if wrong:
            p, why = wrong[0]
            ms.unexplained[o] = f"{what} from {p}, which held other bytes than were delivered: {why}"
            continue
        if part:  # vLLM's reload quantizes the layer anyway, from a freshly made (uninitialised) bf16 tensor
            p = part[0]
            ms.unexplained[o] = (f"{what} from {p}, which this refit wrote only in part ({got[p]} of {before[p].numel()} "
                                 "elements): the rest of what was quantized is not the engine's previous weights but "
                                 "memory the reload made for it")
            continue
        if unsure:
            p, why = unsure[0]
            ms.inexact[o] = f"{what} from {p}, whose delivered bytes are not proven there: {why}"
            continue
        if reference is None:
            ms.inexact[o] = f"{what}: {why_not or 'its quantization could not be run again'}"
            continue
        ref = reference.get(o)
        bad = (differs(o, t, ref) if ref is not None else f"running the quantization again gave no {o}") or scale_problem(o, t)
        if bad is not None:
            ms.unexplained[o] = f"{what}: {bad}"
            continue
        key = f"{o}#quantized"
        ms.blocks.add(key, t)
        ms.quantized[o] = (key, sources, f"{what} from the delivered {', '.join(sources) or 'tensors'}")
    return outputs
