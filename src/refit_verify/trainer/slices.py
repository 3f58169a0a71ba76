"""The trainer's side of slices judged by the engine state: tensor-parallel shards in the layout map.

A worker whose layout map puts an announced name in regions that hold *slices* of it (a rank's rows of
a column-parallel ``qkv_proj``, its columns of a row-parallel ``down_proj``, its rows of a
vocab-parallel embedding) cannot compare them: it does not know a slice's digest. Its close reply
carries, per such name, each region's slice of the trainer's tensor (offset, shape, strides into the
tensor taken contiguous) and the digest of what the region holds (``ModuleManifest.state_slices``).
:func:`resolve` digests those slices of the trainer's own tensors, every worker's at once (one
:class:`~refit_verify.digest.batch.DigestBatch`, one launch per device; a strided slice is copied to its
logical bytes at its add), and writes the verdict into a copy of each manifest, as a whole-tensor
judgement would have left it:

* every slice equal: the name verified (its digest the trainer's), the regions' bytes proven;
* a slice differs, and every slice holds what the worker's last close read there: not written by
  this refit (the name ``missing``, its parameters ``unwritten``);
* else: the name ``mismatched``, each differing region's parameter ``engine_mismatched``, and the
  report's problem names the HF name, parameter, region, slice and worker rank;
* the trainer no longer holds the tensor (it was not kept, or changed after ``r.add``: its version
  counter moved, or its bytes now differ from its digest then): not provable.

A manifest with no ``state_slices`` (every TP=1 worker) is returned as it is: nothing runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import torch

from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.tensors import as_view, version_of
from refit_verify.manifest import ParamState, SessionManifest

__all__ = ["resolve"]

Kept = Mapping[str, Mapping[str, tuple[torch.Tensor, int | None]]]
"""``{module: {name: (tensor as added, its version counter then)}}``."""


def _why_unkept(kept: Kept, module: str, name: str, shape: list[int] | None) -> str | None:
    got = kept.get(module, {}).get(name)
    if got is None:
        return ("its regions hold slices of it (tensor-parallel shards) and the trainer did not keep the tensor to digest "
                "them (refit_verify keeps the added tensors when the engine has several workers)")
    t, version = got
    if version is not None and version_of(t) != version:
        return "its regions hold slices of it, and the trainer's tensor changed after r.add: its slices cannot be digested as pushed"
    if shape is not None and list(t.shape) != list(shape):
        return f"the trainer's tensor has shape {list(t.shape)}, the slices were mapped on {list(shape)}"
    return None


def resolve(manifests: list[SessionManifest], expected: Mapping[str, Mapping[str, str]], kept: Kept,
            specs: Mapping[str, Mapping[str, tuple[Any, Any]]] | None = None) -> list[SessionManifest]:
    """Judge every worker's sliced names (``state_slices``) against the trainer's tensors.

    Args:
        manifests: the workers' manifests (not edited: a judged one is returned as a new manifest).
        expected: ``{module: {name: trainer's 32-hex}}`` (the whole tensor's digest).
        kept: the trainer's tensors as added, with their version counters then.
        specs: ``{module: {name: (shape, dtype)}}`` announced (a kept tensor of another shape is not provable).

    Returns:
        list[SessionManifest]: one per manifest, in order.
    """
    if not any(mm.state_slices for man in manifests for mm in man.modules.values()):
        return manifests
    batch = DigestBatch(hold_cpu=True)
    keys: dict[tuple, str] = {}
    unkept: dict[tuple[str, str], str] = {}
    views: list[torch.Tensor] = []  # contiguous copies stay alive until the launch
    for man in manifests:
        for module, mm in man.modules.items():
            for name, slices in mm.state_slices.items():
                shape = list((specs or {}).get(module, {}).get(name, (None,))[0] or []) or None
                why = unkept.get((module, name)) if (module, name) in unkept else _why_unkept(kept, module, name, shape)
                if why is not None:
                    unkept[(module, name)] = why
                    continue
                t = kept[module][name][0].detach()
                if not t.is_contiguous():
                    t = t.contiguous()
                whole = ("whole", module, name)  # the tensor as it is now, against its digest at r.add
                if whole not in keys and expected.get(module, {}).get(name) is not None:
                    keys[whole] = str(len(keys))
                    views.append(t)
                    batch.add(keys[whole], t)
                for s in slices:
                    k = (module, name, s.src[0], tuple(s.src[1]), tuple(s.src[2]))
                    if k in keys:
                        continue
                    try:
                        v = as_view(t, (s.src[0], tuple(s.src[1]), tuple(s.src[2])))
                    except RuntimeError as e:
                        unkept[(module, name)] = f"its slice {s.slice} is not a view of the trainer's tensor: {e}"[:300]
                        break
                    keys[k] = str(len(keys))
                    views.append(v)
                    batch.add(keys[k], v)
    got = batch.hexdigests() if len(batch) else {}
    for key, k in keys.items():
        if key[0] == "whole" and got.get(k) != expected[key[1]][key[2]]:
            unkept[key[1:]] = ("its regions hold slices of it, and the trainer's tensor holds other bytes than it did at r.add "
                               "(a write its version counter did not see): its slices cannot be digested as pushed")
    return [_judged(man, expected, keys, got, unkept) for man in manifests]


def _judged(man: SessionManifest, expected: Mapping[str, Mapping[str, str]], keys: dict[tuple, str], got: dict[str, str],
            unkept: dict[tuple[str, str], str]) -> SessionManifest:
    if not any(mm.state_slices for mm in man.modules.values()):
        return man
    engine = man.engine
    params = dict(engine.params) if engine is not None else {}
    proven = engine.proven_bytes if engine is not None else 0
    unproven = engine.unproven_bytes if engine is not None else 0
    modules = {}
    for module, mm in man.modules.items():
        if not mm.state_slices:
            modules[module] = mm
            continue
        prefix = "" if module == "model" else f"{module}:"
        digests, by_state, not_provable = dict(mm.digests), dict(mm.by_state), dict(mm.not_provable)
        unwritten = list(mm.unwritten)
        for name, slices in mm.state_slices.items():
            why = unkept.get((module, name))
            if why is not None:
                not_provable[name] = why
                by_state.pop(name, None)
                continue
            want = expected.get(module, {}).get(name)
            bad = [s for s in slices if got.get(keys[(module, name, s.src[0], tuple(s.src[1]), tuple(s.src[2]))]) != s.hex]
            if not bad:
                digests[name] = want
                for s in slices:
                    st = params.get(prefix + s.param)
                    if st is None or st.status == "verified":
                        blocks = [*(st.blocks if st is not None else []), (name, f"{s.region} <- {s.slice}")]
                        params[prefix + s.param] = ParamState("verified", None, (st.bytes if st is not None else 0) + s.bytes, blocks)
                        proven += s.bytes
                    else:
                        unproven += s.bytes
            elif all(s.unchanged for s in slices):  # every region as the last close left it: not written by this refit
                by_state.pop(name, None)
                for s in slices:
                    if s.param not in unwritten:
                        unwritten.append(s.param)
            else:
                digests[name] = bad[0].hex
                by_state[name] = "; ".join(f"{s.param} {s.region} (its slice {s.slice})" for s in bad)
                for s in slices:
                    st = params.get(prefix + s.param)
                    differs = s in bad
                    if differs or (st is not None and st.status == "mismatch"):
                        why = (f"the engine holds other bytes than the trainer's slice {s.slice} of {name} in {s.region}" if differs
                               else st.why)
                        if st is not None and st.status == "mismatch" and differs:
                            why = f"{st.why}; {why}"
                        if st is not None and st.status == "verified":
                            proven -= st.bytes
                            unproven += st.bytes
                        params[prefix + s.param] = ParamState("mismatch", why, (st.bytes if st is not None else 0) + s.bytes,
                                                              list(st.blocks) if st is not None else [])
                        unproven += s.bytes
                    else:
                        params[prefix + s.param] = ParamState("verified", None, (st.bytes if st is not None else 0) + s.bytes,
                                                              [*(st.blocks if st is not None else []), (name, s.region)])
                        proven += s.bytes
        modules[module] = msgspec.structs.replace(mm, digests=digests, by_state=by_state, not_provable=not_provable,
                                                  unwritten=unwritten)
    # (no read-back on the worker: the verdict on the names stands, no bytes are counted proven)
    new_engine = (msgspec.structs.replace(engine, params=params, proven_bytes=proven, unproven_bytes=unproven)
                  if engine is not None else None)
    return msgspec.structs.replace(man, modules=modules, engine=new_engine)
