"""Worker side of adapter verification: where vLLM's LoRA manager holds each PEFT tensor.

Worker methods (added to ``WorkerBase`` by ``register()``, reached through ``collective_rpc``):

* ``refit_verify_lora_layout(config, names, shapes)``: the dtype vLLM casts adapters to (``lora_dtype``)
  and the scale it folds into each ``lora_B`` (vLLM's own ``PEFTHelper.get_rank_and_scaling``), so the
  trainer can build the bytes the engine must hold with the same ops (``lora.lora_model``:
  ``tensor.to(device="cpu", dtype=lora_dtype)``; ``lora.lora_weights.LoRALayerWeights.optimize``:
  ``lora_b *= scaling`` unless the scaling is 1); at TP > 1 the slice of each tensor this rank's
  slots hold.
* ``refit_verify_lora_verify(adapter_id, version, expected, slices)``: digest the regions of adapter
  ``adapter_id`` (its slot when active, else the copy its manager registered) and compare.
* ``refit_verify_lora_audit()``: the adapters active in slots now, against what was verified.

Layout (vLLM 0.32, ``lora/layers``, TP=1): slot ``i`` of a linear layer holds, per slice ``s`` (q, k,
v of ``qkv_proj``; gate, up of ``gate_up_proj``; one slice otherwise),
``lora_a_stacked[s][i, 0, :r, :in]`` = ``lora_A`` and ``lora_b_stacked[s][i, 0, :out, :r]`` =
``lora_B * scaling``; padding up to ``max_lora_rank`` is zero (``reset_lora`` before ``set_lora``).
The logits layer keeps one tensor instead of a tuple; the embedding keeps ``lora_A`` transposed
(``lora_a_stacked[i, :vocab, :r]``).

At TP > 1 vLLM's ``set_lora`` hands each linear layer's ``slice_lora_a`` / ``slice_lora_b`` the
tensors before copying them in: column-parallel layers keep their output rows of ``lora_B`` (per
slice of ``qkv_proj`` / ``gate_up_proj``; K / V rows of the KV heads this rank serves, whole when KV
heads are replicated), row-parallel layers their input columns of ``lora_A``. Which part a rank
holds is learned by handing those same functions an index map (``engine.adapters.index_map``), so the
slicing is vLLM's own; the slot then holds that slice at ``[:rows, :cols]``, padded as above. The
embedding and logits layers keep the whole tensors on every rank. Fully sharded LoRA
(``fully_sharded_loras=True``: ``lora_A`` split by ``max_lora_rank / tp`` too) and layer classes other
than these are named not provable.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from refit_verify.config import check_version, mode_from_env
from refit_verify.engine.adapters import AdapterLedger, check_regions, index_map, outside, selection, slot_fingerprint
from refit_verify.errors import RefitConfigError
from refit_verify.manifest import to_text
from refit_verify.trainer.adapters import (AUDIT_METHOD, LAYOUT_METHOD, VERIFY_METHOD, AdapterAudit, AdapterManifest, RankSlices,
                                           SliceSpec, describe_slice)
from refit_verify.vllm_plugin import runner

logger = logging.getLogger("refit_verify")

METHODS = (LAYOUT_METHOD, VERIFY_METHOD, AUDIT_METHOD)  # the functions below, by name
_LEDGER = "_refit_verify_lora_ledger"
_EXPECTED = msgspec.json.Decoder(dict[str, tuple[str, list[int]]])
_SLICES = msgspec.json.Decoder(RankSlices)


def _arg(v: Any) -> Any:
    """An argument as sent: a ``vllm serve``'s ``POST /collective_rpc`` hands every argument over as
    JSON text (refit-verify's HTTP channel encodes each non-str one)."""
    return json.loads(v) if isinstance(v, str) else v


def _not_verifying(worker) -> dict[str, Any]:
    from refit_verify.vllm_plugin.worker_sessions import not_verifying_reason

    return {"rank": getattr(worker, "rank", None), "verifying": False, "reason": not_verifying_reason(worker)}


def _manager(worker) -> Any:
    """The worker's ``LoRAModelManager`` (vLLM's adapter slots), or None when LoRA is off."""
    return runner.lora_manager(worker)


def _ledger(worker) -> AdapterLedger:
    led = getattr(worker, _LEDGER, None)
    if led is None:
        led = AdapterLedger()
        setattr(worker, _LEDGER, led)
    return led


def _mapper(am) -> Any:
    m = getattr(am.model, "hf_to_vllm_mapper", None)
    return m.get_rename_mapper() if m is not None else None


def _place(am, module_name: str) -> tuple[str, int] | None:
    """``(LoRA layer name, slice)`` that ``module_name`` (a PEFT module, after vLLM's mapping) lands in."""
    if module_name in am.packed_modules:  # a packed module named whole: not a PEFT layout vLLM splits per slice
        return None
    if module_name in am.modules:
        return module_name, 0
    for packed, subs in am.packed_modules.items():
        if module_name in subs:
            return packed, subs.index(module_name)
    return None


def _why_not_provable(am, layer: Any) -> str | None:
    from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

    if getattr(am.lora_config, "fully_sharded_loras", False):
        return ("fully sharded LoRA (fully_sharded_loras=True): each rank holds a shard of lora_a too (split by "
                "max_lora_rank / tp); not mapped")
    a = getattr(layer, "lora_a_stacked", None)
    if isinstance(layer, VocabParallelEmbeddingWithLoRA) or isinstance(a, tuple) or (isinstance(a, torch.Tensor) and a.dim() == 4):
        return None
    return f"layout of {type(layer).__name__} not mapped"


def _rank_slice(layer: Any, s: int, is_a: bool, shape: list[int]) -> SliceSpec | str | None:
    """The part of a PEFT tensor of ``shape`` (slice ``s`` of ``layer``, ``lora_A`` when ``is_a``) that
    this rank's slot holds: None when whole, a :data:`SliceSpec`, or why it cannot be said.

    Asked of vLLM's own ``slice_lora_a`` / ``slice_lora_b`` (``set_lora`` calls them when the layer's
    ``tp_size`` > 1) with an index map in place of the tensor.
    """
    from vllm.lora.layers import LogitsProcessorWithLoRA, VocabParallelEmbeddingWithLoRA

    tp = getattr(layer, "tp_size", 1) or 1
    if tp <= 1 or isinstance(layer, (VocabParallelEmbeddingWithLoRA, LogitsProcessorWithLoRA)):
        return None  # set_lora copies the whole tensors
    fn = getattr(layer, "slice_lora_a" if is_a else "slice_lora_b", None)
    if fn is None:
        return f"sharded across {tp} tensor-parallel ranks, and {type(layer).__name__} has no {'slice_lora_a' if is_a else 'slice_lora_b'}: not mapped"
    probe = index_map(shape)
    stacked = layer.lora_a_stacked
    many = isinstance(stacked, tuple) and len(stacked) > 1  # merged layers slice a list, one tensor per slice
    try:
        got = fn([probe if i == s else None for i in range(len(stacked))])[s] if many else fn(probe)
    except Exception as e:  # noqa: BLE001 - vLLM's own slicing refused this shape: say so, never guess
        return f"vLLM's {type(layer).__name__}.{fn.__name__} fails on a tensor of shape {shape} ({type(e).__name__}: {e})"
    return selection(got, shape)


def _slot_matrices(layer: Any, slot: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per slice, ``(A, B)`` of ``slot`` as 2-D views in PEFT's orientation: ``A`` is
    ``(max_rank, in)``, ``B`` is ``(out, max_rank)``."""
    from vllm.lora.layers import VocabParallelEmbeddingWithLoRA

    a, b = layer.lora_a_stacked, layer.lora_b_stacked
    if isinstance(layer, VocabParallelEmbeddingWithLoRA):
        return [(a[slot].t(), b[slot, 0])]
    if isinstance(a, tuple):
        return [(ai[slot, 0], bi[slot, 0]) for ai, bi in zip(a, b)]
    return [(a[slot, 0], b[slot, 0])]


def _slice_label(am, layer_name: str, s: int) -> str:
    subs = am.packed_modules.get(layer_name)
    return f"{layer_name}[{subs[s].rsplit('.', 1)[-1]}]" if subs else layer_name


def _registered_pair(lora_model, layer_name: str, s: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    lw = lora_model.loras.get(layer_name)
    if lw is None:
        return None, None
    if isinstance(lw.lora_a, list):
        return lw.lora_a[s], lw.lora_b[s]
    return lw.lora_a, lw.lora_b


def _skipped(am) -> Any:
    """``why(name)``: why vLLM's LoRA loader skips tensor ``name`` (``LoRAModel.from_lora_tensors``), or None."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.utils import is_base_embedding_weights

    prefixes = getattr(am.model, "lora_skip_prefixes", None)

    def why(name: str) -> str | None:
        if is_base_embedding_weights(name):
            return ("a base embedding weight saved with the adapter (PEFT's save_embedding_layers): vLLM's LoRA loader skips "
                    "it and serves the base model's own (checked by refit and audit, not here)")
        if prefixes and LoRAModel._should_skip_module(name, prefixes):
            return f"vLLM's LoRA loader skips it (the model's lora_skip_prefixes {list(prefixes)})"
        return None

    return why


def _parse(name: str, mapper) -> tuple[str, bool] | None:
    from vllm.lora.utils import parse_fine_tuned_lora_name

    try:
        return parse_fine_tuned_lora_name(name, mapper)
    except ValueError:
        return None


def refit_verify_lora_layout(self, config: Mapping[str, Any], names: list[str], shapes: list[list[int]] | None = None) -> dict[str, Any]:
    """The dtype vLLM gives adapters, the scale it folds into each ``lora_B`` of ``names``, and the
    slice of each this rank holds.

    Args:
        config: the adapter's PEFT config (``r``, ``lora_alpha``, ``target_modules``, and
            ``use_rslora`` / ``rank_pattern`` / ``alpha_pattern`` when set), as vLLM's
            ``PEFTHelper.from_dict`` reads it.
        names: the PEFT tensor names the trainer pushed.
        shapes: their shapes, in the same order (None: no slices asked for).

    Returns:
        dict: ``rank``, ``verifying``, ``enabled`` (LoRA on in this engine), ``lora_dtype`` (e.g.
        ``"bfloat16"``), ``scalings`` (``{name: float}``: 1.0 for ``lora_A`` and names vLLM does not
        parse), ``slices`` (``{name: [dim, [[start, stop], ...]]}`` of the 2-D tensors this rank's
        slots hold a slice of; empty at TP=1), or ``reason``.

    Raises:
        RefitConfigError: ``config`` is not a PEFT LoRA config vLLM reads.
    """
    if not mode_from_env().verifies:
        return _not_verifying(self)
    am = _manager(self)
    if am is None:
        return {"rank": self.rank, "verifying": True, "enabled": False, "reason": "LoRA is not enabled in this engine (enable_lora=False)"}
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import parse_fine_tuned_lora_name

    config, names = _arg(config), _arg(names)
    try:
        helper = PEFTHelper.from_dict(dict(config))
    except (TypeError, ValueError) as e:
        raise RefitConfigError(f"refit-verify: not a PEFT LoRA config vLLM reads ({e})") from e
    scalings: dict[str, float] = {}
    for n in names:
        try:
            module, is_a = parse_fine_tuned_lora_name(n)  # rank/alpha patterns match the names before mapping
        except ValueError:
            scalings[n] = 1.0
            continue
        scalings[n] = 1.0 if is_a else float(helper.get_rank_and_scaling(module)[1])
    dtype = str(am.lora_config.lora_dtype).removeprefix("torch.")
    slices = _layout_slices(am, names, _arg(shapes)) if shapes is not None else {}
    return {"rank": self.rank, "verifying": True, "enabled": True, "lora_dtype": dtype, "scalings": scalings, "slices": slices}


def _layout_slices(am, names: list[str], shapes: list[list[int]]) -> dict[str, list[Any]]:
    """``{name: [dim, [[start, stop], ...]]}`` of the names whose slot region on this rank is a slice."""
    if len(shapes) != len(names):
        raise RefitConfigError(f"refit_verify_lora_layout: {len(names)} names but {len(shapes)} shapes")
    mapper = _mapper(am)
    out: dict[str, list[Any]] = {}
    for n, shape in zip(names, shapes):
        parsed = _parse(n, mapper) if len(shape) == 2 else None
        placed = _place(am, parsed[0]) if parsed is not None else None
        if placed is None:
            continue
        layer = am.modules[placed[0]]
        if _why_not_provable(am, layer) is not None:
            continue
        spec = _rank_slice(layer, placed[1], parsed[1], list(shape))
        if isinstance(spec, tuple):
            out[n] = [spec[0], [list(r) for r in spec[1]]]
    return out


def refit_verify_lora_verify(self, adapter_id: int, version: int | None, expected: str, slices: str = "{}") -> dict[str, Any]:
    """Digest what this worker holds of adapter ``adapter_id`` and compare it with ``expected``.

    Args:
        adapter_id: vLLM's ``lora_int_id``.
        version: the trainer's version of the adapter (its step), or None.
        expected: JSON text ``{PEFT name: [32-hex, shape]}``: the digest and shape of the bytes the
            engine must hold for each name (cast and scaled as vLLM does).
        slices: JSON text ``{worker rank: {PEFT name: [32-hex, slice shape, [dim, [[start, stop], ...]]]}}``:
            the same for the slice each rank's slot holds at TP > 1 (:data:`~refit_verify.trainer.adapters.RankSlices`).

    Returns:
        dict: ``rank``, ``verifying``, ``adapter`` (an :class:`~refit_verify.trainer.adapters.AdapterManifest`
        as JSON text), or ``reason`` when not verifying.
    """
    if not mode_from_env().verifies:
        return _not_verifying(self)
    adapter_id, version = _arg(adapter_id), check_version(_arg(version))
    if isinstance(adapter_id, bool) or not isinstance(adapter_id, int):
        raise RefitConfigError(f"refit_verify_lora_verify: adapter_id must be an int, got {adapter_id!r}")
    want = _EXPECTED.decode(expected)
    ident = runner.identity(self)
    mine = _SLICES.decode(slices).get(ident.rank, {})
    man = _verify(self, adapter_id, version, want, mine)
    return {"rank": ident.rank, "verifying": True, "adapter": to_text(man)}


def _verify(self, adapter_id: int, version: int | None, want: dict, mine: dict) -> AdapterManifest:
    """The body of :func:`refit_verify_lora_verify` on decoded arguments (``want``: ``{PEFT name:
    (32-hex, shape)}``; ``mine``: this rank's slices); a pass is recorded in the worker's ledger."""
    ident = runner.identity(self)
    expect = {n: d for n, (d, _) in want.items()}
    am = _manager(self)
    base = dict(worker=ident, adapter_id=adapter_id, version=version)
    if am is None:
        return AdapterManifest(**base, loaded=False, problems=["LoRA is not enabled in this engine (enable_lora=False): no adapter is served"])
    registered = sorted(am.list_adapters())
    if adapter_id not in registered:
        before = _ledger(self).get(adapter_id)
        why = (f"adapter {adapter_id} was never loaded on this worker" if before is None else
               f"adapter {adapter_id} is not loaded on this worker now (verified at version {before[0]} before: evicted or removed since)")
        return AdapterManifest(**base, loaded=False, where={n: "adapter not loaded" for n in want},
                               problems=[f"{why}: not in its LoRA manager (loaded: {registered or 'none'})"])
    slot = am.lora_index_to_id.index(adapter_id) if adapter_id in am.lora_index_to_id else None
    mapper = _mapper(am)
    regions: dict[str, torch.Tensor] = {}
    pads: dict[str, list[torch.Tensor]] = {}
    where: dict[str, str] = {}
    not_proven: dict[str, str] = {}
    covered: set[tuple[str, int, str]] = set()
    problems: list[str] = []
    lora_model = am.get_adapter(adapter_id) if slot is None else None
    skipped = _skipped(am)
    for n, (_, shape) in want.items():
        why = skipped(n)
        if why is not None:
            not_proven[n] = why
            continue
        parsed = _parse(n, mapper)
        if parsed is None:
            where[n] = "not a LoRA tensor name vLLM parses: no region holds it"
            continue
        module, is_a = parsed
        ab = "lora_a" if is_a else "lora_b"
        if module.rsplit(".", 1)[-1] in ("score", "classifier"):
            not_proven[n] = "a full module (modules_to_save), not a LoRA pair: not mapped"
            continue
        placed = _place(am, module)
        if placed is None:
            where[n] = f"no LoRA layer of this engine takes module {module} (a target-module filter, or not supported)"
            continue
        layer_name, s = placed
        layer = am.modules[layer_name]
        why = _why_not_provable(am, layer)
        if why is not None:
            not_proven[n] = why
            continue
        label = f"{_slice_label(am, layer_name, s)}.{ab}"
        if len(shape) != 2:
            where[n] = f"{label}: a LoRA tensor is 2-D, the trainer's is {shape}"
            continue
        if slot is not None:
            mats = _slot_matrices(layer, slot)
            if s >= len(mats):
                not_proven[n] = f"{layer_name} has {len(mats)} slices, slice {s} not mapped"
                continue
            m = mats[s][0 if is_a else 1]
            rows, cols = shape
            spec = _rank_slice(layer, s, is_a, list(shape))
            if isinstance(spec, str):
                not_proven[n] = f"{label}: {spec}"
                continue
            held = ""
            if spec is not None:
                got = mine.get(n)
                if got is None or (got[2][0], [tuple(r) for r in got[2][1]]) != (spec[0], [tuple(r) for r in spec[1]]):
                    where[n] = (f"{label}, slot {slot}: worker rank {ident.rank} holds its slice {describe_slice(spec)}, "
                                "for which the trainer sent no digest (the layout changed between the calls?)")
                    continue
                expect[n], (rows, cols) = got[0], got[1]
                held = f", worker rank {ident.rank}'s slice {describe_slice(spec)}"
            if rows > m.shape[0] or cols > m.shape[1]:
                where[n] = f"{label}, slot {slot}{held}: the shape {[rows, cols]} does not fit the slot's {list(m.shape)}"
                continue
            regions[n] = m[:rows, :cols]
            pads[f"{label} (slot {slot}{held}, padding beyond {[rows, cols]})"] = outside(m, rows, cols)
            where[n] = f"{label}, slot {slot}{held}"
        else:
            a, b = _registered_pair(lora_model, layer_name, s)
            t = a if is_a else b
            if t is None:
                where[n] = f"{label}: the registered adapter has no tensor there"
                continue
            regions[n] = t
            where[n] = f"{label}, registered copy (in no slot)"
        covered.add((layer_name, s, ab))
    uncovered: dict[str, torch.Tensor] = {}
    unchecked: list[str] = []
    unmapped = sorted({type(lay).__name__ for lay in am.modules.values() if _why_not_provable(am, lay) is not None})
    if slot is not None:
        areas: dict[str, torch.Tensor] = {}
        for layer_name, layer in am.modules.items():
            if _why_not_provable(am, layer) is not None:
                continue
            for s, (a, b) in enumerate(_slot_matrices(layer, slot)):
                for ab, m in (("lora_a", a), ("lora_b", b)):
                    areas[f"{_slice_label(am, layer_name, s)}.{ab}"] = m
                    if (layer_name, s, ab) not in covered:
                        uncovered[f"{_slice_label(am, layer_name, s)}.{ab} (slot {slot})"] = m
        fingerprint = slot_fingerprint(areas)
    else:
        fingerprint = None
        unchecked.append(f"adapter {adapter_id} is registered but in no LoRA slot now: its registered copy (what vLLM "
                         "copies into a slot when a request activates it) was compared; padding and other layers not read")
        for layer_name, lw in lora_model.loras.items():
            for s in range(len(lw.lora_a) if isinstance(lw.lora_a, list) else 1):
                a, b = _registered_pair(lora_model, layer_name, s)
                for ab, t in (("lora_a", a), ("lora_b", b)):
                    if t is not None and (layer_name, s, ab) not in covered:
                        uncovered[f"{_slice_label(am, layer_name, s)}.{ab} (registered)"] = t
    if unmapped:
        unchecked.append("LoRA layers of types not mapped, not read: " + ", ".join(unmapped))
    chk = check_regions(regions, pads, uncovered)
    provable = {n: d for n, d in expect.items() if n not in not_proven}
    mismatched = [n for n, d in provable.items() if n in chk.digests and chk.digests[n] != d]
    missing = [n for n in provable if n not in chk.digests]
    ok = bool(chk.digests) and not (mismatched or missing or chk.padding or chk.unexpected)
    led = _ledger(self)
    problems.extend(led.judge(adapter_id, version, fingerprint, ok))
    ok = ok and not problems
    if ok:  # verified in no slot: what was expected is kept, to check the slot it is copied into later
        led.record(adapter_id, version, fingerprint, expected=(want, mine) if fingerprint is None else None)
    else:
        led.fail(adapter_id, version)
    return AdapterManifest(**base, loaded=True, slot=slot, digests=chk.digests, where=where, not_proven=not_proven,
                           padding=chk.padding, unexpected=chk.unexpected, problems=problems, unchecked=unchecked,
                           proven_bytes=chk.proven_bytes, fingerprint=fingerprint, ok=ok)


def refit_verify_lora_audit(self) -> dict[str, Any]:
    """The adapters active in this worker's LoRA slots now, against what the trainer verified here.

    Returns:
        dict: ``rank``, ``verifying``, ``audit`` (an :class:`~refit_verify.trainer.adapters.AdapterAudit`
        as JSON text), or ``reason`` when not verifying.
    """
    if not mode_from_env().verifies:
        return _not_verifying(self)
    ident = runner.identity(self)
    am = _manager(self)
    led = _ledger(self)
    if am is None:
        audit = AdapterAudit(worker=ident, verified=led.verified(), unchecked=["LoRA is not enabled in this engine"])
        return {"rank": ident.rank, "verifying": True, "audit": to_text(audit)}
    active: dict[int, str | None] = {}
    slots: dict[int, int] = {}
    for slot, aid in enumerate(am.lora_index_to_id):
        if aid is None:
            continue
        slots[slot] = aid
        active[aid] = slot_fingerprint({f"{_slice_label(am, name, s)}.{ab}": m
                                        for name, layer in am.modules.items() if _why_not_provable(am, layer) is None
                                        for s, pair in enumerate(_slot_matrices(layer, slot))
                                        for ab, m in zip(("lora_a", "lora_b"), pair)})
    # adapters verified in no slot (their registered copy) and active now: their slot is compared with what was
    # expected then; a pass records the slot's fingerprint, so later audits compare fingerprints
    copied: list[int] = []
    copy_problems: list[str] = []
    for aid in sorted(active):
        kept = led.expectation(aid)
        if kept is None:
            continue
        version, (want, mine) = kept
        man = _verify(self, aid, version, want, mine)
        if not man.ok:
            copied.append(aid)
            bad = [n for n, d in man.digests.items() if d != want.get(n, (None,))[0]] + [n for n in want if n not in man.digests]
            copy_problems.append(f"adapter {aid} was verified at version {version} in no LoRA slot (its registered copy); "
                                 f"slot {am.lora_index_to_id.index(aid)} holds other bytes now"
                                 + (f": {', '.join(sorted(bad)[:8])}" if bad else "") + "; ".join(["", *man.problems]))
    never, changed, problems = led.audit(active, skip=copied)
    changed, problems = [*copied, *changed], [*copy_problems, *problems]
    idle = sorted(set(am.list_adapters()) - set(active))
    unchecked = [f"adapters registered but in no slot (not served until activated, then copied from the registered "
                 f"copy): {idle}"] if idle else []
    audit = AdapterAudit(worker=ident, active=slots, verified=led.verified(), never_verified=never,
                         changed=[f"adapter {a}" for a in changed], problems=problems, unchecked=unchecked)
    return {"rank": ident.rank, "verifying": True, "audit": to_text(audit)}
