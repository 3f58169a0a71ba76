"""LoRA adapters, verified like weights: the trainer says which adapter it pushed and its tensors;
every vLLM worker digests what its LoRA slots hold for that adapter, in the engine's own layout.

Adapters reach vLLM through its LoRA manager (``add_lora`` / ``LoRARequest``: a PEFT directory, or
in-memory tensors as verl's ``TensorLoRARequest``), not through ``load_weights``, so the model
boundary never sees them. :func:`verify_adapter` checks them after the push:

1. it asks each worker for vLLM's ``lora_dtype`` and the scale vLLM folds into each ``lora_B``
   (computed there by vLLM's own ``PEFTHelper`` from the adapter's PEFT config);
2. it builds the bytes the engine must hold with vLLM's ops (``t.to("cpu", lora_dtype)``, then
   ``*= scaling`` unless it is 1) and digests them;
3. each worker digests the region each PEFT tensor landed in (its slot, without the padding up to
   ``max_lora_rank``), checks that the padding and every slot area the trainer sent nothing for
   hold zeros, and compares; it remembers the version and slot fingerprint it verified per id.

At tensor parallelism a rank's slot holds a slice of a tensor (its rows of a column-parallel
``lora_B``, its columns of a row-parallel ``lora_A``). Step 1's answer then names, per rank, the
slice vLLM's own ``slice_lora_a`` / ``slice_lora_b`` take (:data:`SliceSpec`); the trainer digests
every rank's slices of its built tensors in the same batch as the whole ones, checks that the ranks'
slices together hold every element, and each worker compares its own.

:func:`audit_adapters` lists adapters active in slots that the trainer never verified, and adapters
whose bytes changed since they verified (replaced under the same id).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from refit_verify.compare import compare_manifests
from refit_verify.config import VerifyMode, check_version, mode_from_env
from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitConfigError, RefitInputError, RefitProtocolError, RefitVerificationError
from refit_verify.manifest import WorkerIdentity, from_wire
from refit_verify.report import VerificationReport
from refit_verify.trainer.audits import settle, verifying_answers
from refit_verify.trainer.channel import DEFAULT_TIMEOUT_S, require_channel

logger = logging.getLogger("refit_verify")

__all__ = ["AdapterAudit", "AdapterManifest", "AdapterReport", "SliceSpec", "audit_adapters", "describe_slice", "expected_digests",
           "expected_slices", "peft_config", "take_slice", "unheld", "verify_adapter"]

LAYOUT_METHOD = "refit_verify_lora_layout"
VERIFY_METHOD = "refit_verify_lora_verify"
AUDIT_METHOD = "refit_verify_lora_audit"
_CONFIG_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "rank_pattern", "alpha_pattern")
_OPTS = dict(forbid_unknown_fields=True, omit_defaults=False)

SliceSpec = tuple[int, list[tuple[int, int]]]
"""``(dim, [(start, stop), ...])``: a 2-D tensor's ranges along ``dim`` (0: rows, 1: columns),
concatenated in that order, the other dim whole: what one tensor-parallel rank holds of a PEFT tensor."""
RankSlices = dict[int, dict[str, tuple[str, list[int], SliceSpec]]]
"""``{worker rank: {PEFT name: (32-hex, slice shape, spec)}}``: the trainer's digest of each rank's slice."""


def describe_slice(spec: SliceSpec) -> str:
    """``"dim 0 [64:128]"`` (ranges joined by ``+``)."""
    dim, ranges = spec
    return f"dim {dim} " + "+".join(f"[{a}:{b}]" for a, b in ranges)


def take_slice(t: torch.Tensor, spec: SliceSpec) -> torch.Tensor:
    """The part of 2-D ``t`` that ``spec`` names: a view for one range, a concatenation (a copy) for several.

    Raises:
        RefitInputError: ``t`` is not 2-D, or a range lies outside it.
    """
    dim, ranges = spec
    if t.dim() != 2 or dim not in (0, 1) or not ranges or any(not 0 <= a < b <= t.shape[dim] for a, b in ranges):
        raise RefitInputError(f"refit-verify: slice {describe_slice(spec)} does not fit a tensor of shape {list(t.shape)}")
    parts = [t.narrow(dim, a, b - a) for a, b in ranges]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def unheld(specs: Mapping[int, Mapping[str, SliceSpec]], shapes: Mapping[str, list[int]]) -> dict[str, str]:
    """``{PEFT name: which part}`` of each sliced tensor that no rank's slice holds.

    Args:
        specs: ``{worker rank: {PEFT name: spec}}`` of the ranks that hold the name sliced.
        shapes: ``{PEFT name: [rows, cols]}`` of the trainer's tensors.
    """
    held: dict[str, tuple[int, set[int]]] = {}
    for per_rank in specs.values():
        for n, (dim, ranges) in per_rank.items():
            d, ids = held.setdefault(n, (dim, set()))
            if d != dim:  # ranks slicing along different dims: say what the first dim leaves out
                continue
            for a, b in ranges:
                ids.update(range(a, b))
    out = {}
    for n, (dim, ids) in held.items():
        if n not in shapes:
            continue
        gaps = [i for i in range(shapes[n][dim]) if i not in ids]
        if gaps:
            runs: list[list[int]] = []
            for i in gaps:
                if runs and runs[-1][1] == i:
                    runs[-1][1] = i + 1
                else:
                    runs.append([i, i + 1])
            out[n] = describe_slice((dim, [(a, b) for a, b in runs]))
    return out


class AdapterManifest(msgspec.Struct, tag="adapter_manifest", **_OPTS):
    """What one worker holds of one adapter (``refit_verify_lora_verify``'s answer).

    Attributes:
        worker: whose. adapter_id: vLLM's ``lora_int_id``. version: the trainer's version.
        loaded: the id is in the worker's LoRA manager. slot: its slot index, None when in none.
        digests: ``{PEFT name: 32-hex}`` of the region each tensor landed in (PEFT's shape, ``lora_dtype``).
        where: ``{PEFT name: region}`` (layer, slice, A or B, slot), or why the name has none.
        not_proven: ``{PEFT name: why}`` of regions not comparable bytewise.
        padding: regions whose padding beyond the adapter's rank is not zero.
        unexpected: ``{slot area: why}`` of areas the trainer sent nothing for that are not zero.
        problems: one sentence each (never loaded, stale version, old version still served).
        unchecked: what was not read, and why. proven_bytes: bytes of the regions digested.
        fingerprint: 32-hex digest of the whole slot (None when in no slot). ok: the worker's verdict.
    """

    worker: WorkerIdentity
    adapter_id: int
    version: int | None
    loaded: bool
    slot: int | None = None
    digests: dict[str, str] = {}
    where: dict[str, str] = {}
    not_proven: dict[str, str] = {}
    padding: list[str] = []
    unexpected: dict[str, str] = {}
    problems: list[str] = []
    unchecked: list[str] = []
    proven_bytes: int = 0
    fingerprint: str | None = None
    ok: bool = False


class AdapterAudit(msgspec.Struct, tag="adapter_audit", **_OPTS):
    """One worker's adapters now (``refit_verify_lora_audit``'s answer).

    Attributes:
        worker: whose. active: ``{slot: adapter id}``. verified: ``{adapter id: version}`` this worker
        verified. never_verified: active ids never verified. changed: ``"adapter N"`` of active adapters
        whose slot holds other bytes than verified. problems: one sentence each. unchecked: not read.
    """

    worker: WorkerIdentity
    active: dict[int, int] = {}
    verified: dict[int, int | None] = {}
    never_verified: list[int] = []
    changed: list[str] = []
    problems: list[str] = []
    unchecked: list[str] = []

    @property
    def ok(self) -> bool:
        return not self.problems

    def describe(self) -> str:
        """One sentence: the adapters served and whether each was verified."""
        if self.ok:
            text = f"adapter audit of {self.worker.label()}: {len(self.active)} active adapters, all verified"
        else:
            text = f"adapter audit of {self.worker.label()} failed: " + "; ".join(self.problems)
        return text + ("; not checked: " + "; ".join(self.unchecked) if self.unchecked else "")


_SAID = (("the worker loaded no tensor in this session (pushed outside the refit, or into another engine?)",
          "the worker holds none of the adapter's tensors"),
         ("nothing was checked: the trainer stated no tensor and the worker loaded none (a refit that compares nothing "
          "verifies nothing)", "nothing was checked"),
         ("engine read-back: ", "in the LoRA slots: "), (" parameters not coverable: ", " tensors not provable: "))


@dataclasses.dataclass(frozen=True)
class AdapterReport(VerificationReport):
    """A :class:`~refit_verify.report.VerificationReport` of one adapter on one worker: names are PEFT
    names, ``session`` is ``"adapter N"``; :meth:`describe` speaks of the adapter, not of a refit."""

    def describe(self, limit: int = 20) -> str:
        text = super().describe(limit)
        if text.startswith("refit session adapter "):
            text = text[len("refit session "):]
        for said, meant in _SAID:
            text = text.replace(said, meant)
        return text


def _mode(mode: VerifyMode | str | None) -> VerifyMode:
    return mode_from_env() if mode is None else VerifyMode.parse(mode)


def _adapter_id(lora: Any) -> int:
    aid = lora if isinstance(lora, int) else getattr(lora, "lora_int_id", None)
    if isinstance(aid, bool) or not isinstance(aid, int) or aid < 1:
        raise RefitConfigError(f"refit-verify: an adapter is a LoRARequest or its lora_int_id (an int >= 1), got {lora!r}")
    return aid


def peft_config(lora: Any, config: Any = None) -> dict[str, Any]:
    """The PEFT config fields vLLM's ``PEFTHelper`` reads for scaling, as plain builtins.

    Taken from ``config`` (a ``peft.LoraConfig``, or a dict), else ``lora.peft_config`` (verl's
    ``TensorLoRARequest``), else ``adapter_config.json`` in ``lora.lora_path``.

    Raises:
        RefitConfigError: none of these gives ``r`` and ``lora_alpha``.
    """
    src = config
    if src is None:
        src = getattr(lora, "peft_config", None)
    if src is None:
        path = getattr(lora, "lora_path", None)
        cfg_file = os.path.join(path, "adapter_config.json") if isinstance(path, str) else None
        if cfg_file is not None and os.path.isfile(cfg_file):
            with open(cfg_file) as f:
                src = json.load(f)
    if src is None:
        raise RefitConfigError("refit-verify: the adapter's PEFT config is needed for the scale vLLM folds into lora_B: "
                               "pass config= (a peft.LoraConfig or dict), or a LoRARequest whose lora_path holds adapter_config.json")
    get = src.get if isinstance(src, Mapping) else (lambda k, d=None: getattr(src, k, d))
    out: dict[str, Any] = {}
    for k in _CONFIG_KEYS:
        v = get(k, None)
        if v is None:
            continue
        out[k] = sorted(v) if isinstance(v, (set, frozenset)) else dict(v) if isinstance(v, Mapping) else v
    if not isinstance(out.get("r"), int) or not isinstance(out.get("lora_alpha"), (int, float)):
        raise RefitConfigError(f"refit-verify: the adapter's PEFT config has no int r and numeric lora_alpha: {out}")
    out.setdefault("target_modules", [])
    return out


def _built(tensors: Mapping[str, torch.Tensor], lora_dtype: torch.dtype, scalings: Mapping[str, float]) -> dict[str, torch.Tensor]:
    built = {}
    for n, t in tensors.items():
        e = t.detach().to(device="cpu", dtype=lora_dtype, copy=True)
        s = scalings.get(n, 1.0)
        if s != 1:
            e *= s
        built[n] = e
    return built


def expected_digests(tensors: Mapping[str, torch.Tensor], lora_dtype: torch.dtype,
                     scalings: Mapping[str, float]) -> dict[str, tuple[str, list[int]]]:
    """``{PEFT name: (32-hex, shape)}`` of the bytes vLLM holds for each tensor.

    The same ops as vLLM 0.32, on the CPU as there: ``t.to(device="cpu", dtype=lora_dtype)``
    (``LoRAModel.from_lora_tensors``), then ``*= scaling`` when the scaling is not 1
    (``LoRALayerWeights.optimize``). The trainer's tensors are never changed (a copy is scaled).
    """
    return expected_slices(tensors, lora_dtype, scalings, {})[0]


def expected_slices(tensors: Mapping[str, torch.Tensor], lora_dtype: torch.dtype, scalings: Mapping[str, float],
                    specs: Mapping[int, Mapping[str, SliceSpec]]) -> tuple[dict[str, tuple[str, list[int]]], RankSlices]:
    """:func:`expected_digests`, and the digest of each rank's slice of the same bytes, in one batch.

    Args:
        specs: ``{worker rank: {PEFT name: spec}}`` of the tensors each rank holds sliced (names the
            trainer has no tensor for are left out).

    Returns:
        ``(whole, by_rank)``: ``{PEFT name: (32-hex, shape)}`` and ``{rank: {PEFT name: (32-hex, slice
        shape, spec)}}``.

    Raises:
        RefitInputError: a spec that does not fit its tensor.
    """
    built = _built(tensors, lora_dtype, scalings)
    parts = {f"{n}\x00rank {r}": (r, n, spec, take_slice(built[n], spec))
             for r, per_rank in specs.items() for n, spec in per_rank.items() if n in built}
    digests = digest_tensors([*built.items(), *((k, p[3]) for k, p in parts.items())])
    by_rank: RankSlices = {}
    for k, (r, n, spec, t) in parts.items():
        by_rank.setdefault(r, {})[n] = (digests[k], list(t.shape), (spec[0], [tuple(x) for x in spec[1]]))
    return {n: (digests[n], list(built[n].shape)) for n in built}, by_rank


def _check_tensors(tensors: Any) -> dict[str, torch.Tensor]:
    if not isinstance(tensors, Mapping):
        raise RefitInputError(f"refit-verify: the adapter's tensors are a mapping {{PEFT name: tensor}}, got {type(tensors).__name__}")
    for n, t in tensors.items():
        if not isinstance(n, str) or not isinstance(t, torch.Tensor):
            raise RefitInputError(f"refit-verify: adapter tensors map str names to tensors, got {n!r}: {type(t).__name__}")
    return dict(tensors)


def _report(man: AdapterManifest, sender: Mapping[str, str], extra: list[str] | None = None) -> AdapterReport:
    provable = {n: d for n, d in sender.items() if n not in man.not_proven}
    rep = compare_manifests(provable, man.digests, rank=man.worker.rank)
    problems = [*man.problems, *(extra or ())]
    for n in (*rep.mismatched, *rep.missing):
        if n in man.where:
            problems.append(f"{n}: {man.where[n]}")
    fields = {f.name: getattr(rep, f.name) for f in dataclasses.fields(rep)}
    return AdapterReport(**{
        **fields, "session":f"adapter {man.adapter_id}", "version": man.version, "worker": man.worker.label(),
        "unexpected": (*rep.unexpected, *man.unexpected), "engine_mismatched": tuple(f"{r} not zero" for r in man.padding),
        "problems": tuple(problems), "not_proven": dict(man.not_proven), "proven_bytes": man.proven_bytes,
        "unproven_bytes": 0 if not man.not_proven else None, "unchecked": tuple(man.unchecked)})


def verify_adapter(engine: Any, lora: Any, tensors: Mapping[str, torch.Tensor], *, version: int | None = None,
                   config: Any = None, mode: VerifyMode | str | None = None,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> list[AdapterReport]:
    """Check that every worker of ``engine`` serves exactly ``tensors`` as adapter ``lora``.

    Args:
        engine: what :func:`refit_verify.refit` accepts (``vllm.LLM``, Ray handle, HTTP URL, ...).
        lora: the ``LoRARequest`` pushed (or verl's ``TensorLoRARequest``), or its ``lora_int_id``.
        tensors: ``{PEFT name: tensor}`` as pushed (``get_peft_model_state_dict``), e.g.
            ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``; any dtype and device.
        version: the adapter's version (the trainer's step), an int >= 0, or None. Each worker
            remembers the last version it verified per id: an older one, or a newer one whose bytes
            are still the old ones, fails.
        config: the adapter's PEFT config (see :func:`peft_config`), when ``lora`` does not carry it.
        mode: ``enforce`` raises, ``log`` warns, ``off`` does nothing; default ``REFIT_VERIFY``.
        timeout_s: bound on each call into the workers, seconds.

    Returns:
        list[AdapterReport]: one per worker (a :class:`~refit_verify.report.VerificationReport`; ``session``
        is ``"adapter N"``); empty with ``off``.

    Raises:
        RefitVerificationError: ``enforce`` and a worker's report is not ok (the others are logged).
        RefitConfigError / RefitInputError: bad arguments, no PEFT config, no plugin in the engine.
        RefitProtocolError: a malformed answer, or workers that disagree on vLLM's LoRA dtype.
    """
    m = _mode(mode)
    if not m.verifies:
        return []
    aid = _adapter_id(lora)
    version = check_version(version)
    tensors = _check_tensors(tensors)
    cfg = peft_config(lora, config)
    ch = require_channel(engine)
    layouts = ch.call(LAYOUT_METHOD, cfg, list(tensors), [list(t.shape) for t in tensors.values()], timeout_s=timeout_s)
    seen = {(r.get("lora_dtype"), json.dumps(r.get("scalings"), sort_keys=True)) for r in layouts
            if isinstance(r, Mapping) and r.get("verifying") and r.get("enabled")}
    if len(seen) > 1:
        raise RefitProtocolError(f"refit-verify: the workers disagree on vLLM's LoRA dtype or scalings: {sorted(seen)}")
    reports: list[AdapterReport] = []
    if seen:
        (dtype_name, scalings_text), = seen
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise RefitProtocolError(f"refit-verify: a worker named no torch dtype for LoRA: {dtype_name!r}")
        specs = _specs(layouts)
        expected, by_rank = expected_slices(tensors, dtype, json.loads(scalings_text), specs)
        sender = {n: d for n, (d, _) in expected.items()}
        gaps = unheld(specs, {n: s for n, (_, s) in expected.items()})
        text = msgspec.json.encode({n: [d, s] for n, (d, s) in expected.items()}).decode()
        args = (aid, version, text) + ((msgspec.json.encode(by_rank).decode(),) if by_rank else ())
        for r in ch.call(VERIFY_METHOD, *args, timeout_s=timeout_s):
            if not (isinstance(r, Mapping) and r.get("verifying")):
                reports.append(_not_verifying(r, aid, version))
                continue
            man = from_wire(r["adapter"], AdapterManifest)
            mine = by_rank.get(man.worker.rank, {})
            extra = [f"{n}: {part} is held by no worker's LoRA slot (the ranks' slices leave it out)"
                     for n, part in sorted(gaps.items()) if n in mine]
            reports.append(_report(man, {**sender, **{n: d for n, (d, _, _) in mine.items()}}, extra))
    else:  # no worker has LoRA on (or none verifies): say why, once per worker
        for r in layouts:
            if isinstance(r, Mapping) and r.get("verifying"):
                reports.append(AdapterReport.unchecked_because(
                    f"worker rank {r.get('rank')}: {r.get('reason', 'LoRA is not enabled')}: adapter {aid} is not served",
                    session=f"adapter {aid}", version=version))
            else:
                reports.append(_not_verifying(r, aid, version))
    failed = [rep for rep in reports if not rep.ok]
    if failed:
        for rep in failed[1:] if m is VerifyMode.ENFORCE else failed:
            logger.warning("refit-verify: %s", rep.describe())
        if m is VerifyMode.ENFORCE:
            raise RefitVerificationError(failed[0])
    return reports


def _specs(layouts: Any) -> dict[int, dict[str, SliceSpec]]:
    """``{worker rank: {PEFT name: spec}}`` from the layout answers (``slices``: JSON lists)."""
    out: dict[int, dict[str, SliceSpec]] = {}
    for r in layouts:
        if not (isinstance(r, Mapping) and r.get("verifying") and r.get("enabled") and r.get("slices")):
            continue
        try:
            out[int(r["rank"])] = {str(n): (int(d), [(int(a), int(b)) for a, b in rs]) for n, (d, rs) in r["slices"].items()}
        except (TypeError, ValueError, KeyError) as e:
            raise RefitProtocolError(f"refit-verify: a worker's LoRA slices are malformed: {r.get('slices')!r:.200}") from e
    return out


def _not_verifying(r: Any, aid: int, version: int | None) -> AdapterReport:
    rank = r.get("rank") if isinstance(r, Mapping) else None
    why = r.get("reason", "no reason given") if isinstance(r, Mapping) else repr(r)
    return AdapterReport.unchecked_because(f"vLLM worker rank {rank} does not verify ({why}): adapter {aid} not checked",
                                                session=f"adapter {aid}", version=version)


def audit_adapters(engine: Any, *, mode: VerifyMode | str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> list[AdapterAudit]:
    """List, per worker, the adapters active in LoRA slots now and whether the trainer verified each.

    An active adapter never verified on that worker (a request served with an id the trainer never
    checked), or one whose slot holds other bytes than when it verified (replaced under the same
    id), fails the audit.

    Args:
        engine: what :func:`refit_verify.refit` accepts (LLM, Ray handle, HTTP URL, ...).
        mode: ``off`` / ``log`` / ``enforce``; default ``REFIT_VERIFY``.
        timeout_s: bound on the call to the workers, seconds.

    Returns:
        list[AdapterAudit]: one per worker; empty with ``off``.

    Raises:
        AuditError: ``enforce`` and a worker's audit failed (``log`` warns).
        RefitConfigError: ``enforce`` and a worker does not verify.
        RefitTimeoutError: no answer within ``timeout_s``.
    """
    m = _mode(mode)
    if not m.verifies:
        return []
    out: list[AdapterAudit] = []
    for r in verifying_answers(engine, AUDIT_METHOD, "cannot audit its adapters", m, timeout_s):
        out.append(from_wire(r["audit"], AdapterAudit))
    return settle(out, m)
