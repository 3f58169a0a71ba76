"""The layout map: which trainer tensor (HF name) each region of each engine parameter holds.

The model boundary proves what reaches ``load_weights``; a framework that writes parameters
directly (``param.data[rows].copy_(t)`` from a worker extension, NCCL or NIXL into parameter
storage, a restore from elsewhere) never calls it. To judge those writes by their result, each
module of a worker keeps a :class:`LayoutMap`: for every trainer name, the engine regions
``(parameter, element offset, shape, strides)`` that hold it, and what could not be mapped and
why. The verdict is then "the engine holds the trainer's tensors, mapped through the engine's
layout": at a session's close every announced name that ``load_weights`` did not deliver is read
where the map says it lives and compared with the trainer's digest (:func:`judge`).

Where a map comes from:

* a watched ``load_weights`` session (:func:`learn_session`): every region a loader copied a whole
  delivered tensor into, exactly (fused ``qkv_proj`` / ``gate_up_proj`` blocks, plain parameters),
  in a parameter the session's read-back verified. Fills (vocab padding rows) are recorded as
  padding: not any trainer tensor's, excluded from the map and said so. A parameter written by a
  conversion (another dtype, a loader known to transform) is recorded with why and its loader's
  name: its content is a function of the tensor, not a slice of it. A name copied in part (a
  tensor-parallel shard: rows of a column-parallel or vocab-parallel parameter, columns of a
  row-parallel ``o_proj`` / ``down_proj``) is mapped as slices (:attr:`LayoutMap.slices`): each region
  with the view of the trainer's tensor it holds (offset, shape, strides into the tensor taken
  contiguous), read from the loader's own ``narrow`` of the delivered tensor (the tap's source
  region). The worker cannot know a slice's digest; it reports what each region holds and the trainer
  digests the same slices of its tensors and compares (:mod:`refit_verify.trainer.slices`). A part
  whose source is not a view of a contiguous delivered tensor stays not mapped (:attr:`LayoutMap.sliced`).
* a dry learn (:func:`dry_learn`), so a direct-write path needs no prior load: the model's own
  ``load_weights`` runs on placeholder tensors of the announced names, shapes and dtypes, with the
  loader tap recording placements and every write into the model's tensors blocked
  (:class:`_NoWrites`, a ``TorchDispatchMode``). A loader that changes the model another way (a
  parameter's ``.data`` reassigned, one replaced) is caught after the run and makes every name of
  that run not provable, never passed.

A map belongs to one :class:`~refit_verify.boundary.model_index.ModelIndex` (held weakly): a model
whose parameters changed gets a new one. A name announced with another shape or dtype than mapped
is learned again (dry). What was (re-)learned is said in the manifest (``ModuleManifest.layout``).

Nothing here imports vLLM.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_verify.boundary.close_reads import RegionBatch
from refit_verify.boundary.placement import WHOLE, Copy
from refit_verify.boundary.plan import spec_of
from refit_verify.digest.tensors import PLAIN, Geometry, as_view, check_tensor, dtype_name

__all__ = ["LayoutMap", "Region", "SliceRegion", "describe_region", "describe_slice", "dry_learn", "judge", "learn_session",
           "read_regions"]

Region = tuple[str, Geometry]
"""``(engine parameter, dest geometry)``: one region of one parameter."""

SliceRegion = tuple[str, Geometry, Geometry]
"""``(engine parameter, dest geometry, source geometry)``: a region holding a slice of a trainer tensor, the
source as a view of that tensor taken contiguous (offset from its first element, shape, strides in elements)."""


class LayoutMap:
    """Where one module's parameters hold each trainer tensor.

    Attributes:
        entries: ``{name: ((parameter, dest geometry), ...)}``: the regions holding the whole tensor
            ``name`` (one, or several for a tensor copied whole into several places).
        spec: ``{name: (shape, dtype name)}`` of the tensor each entry holds.
        params: ``{parameter: (shape, strides, storage offset, dtype name)}`` as mapped (a parameter
            replaced or re-viewed since is not read through its old layout).
        padding: ``{parameter: [dest geometry]}`` of regions a loader filled (vocab padding): no
            trainer tensor's, excluded from the map.
        conversions: ``{parameter: why}`` of parameters a loader wrote with a conversion (its
            loader's name in ``why``): not a slice of any tensor.
        slices: ``{name: ((parameter, dest geometry, source geometry), ...)}``: the regions holding a
            slice of ``name`` (a tensor-parallel shard; a region holding it whole is the trivial slice when
            another holds a part), the source a view of the trainer's tensor taken contiguous.
        sliced: ``{name: why}`` of names copied in part whose slice could not be told (a source that is
            not a view of a contiguous delivered tensor): not mapped.
        (A tied parameter's other name, ``lm_head.weight`` beside ``model.embed_tokens.weight``, maps to
        the regions of the name that filled it whole: the engine holds one tensor for both.)
        unlearned: ``{name: why}`` of names no load placed (skipped by the model, a dry learn that failed).
        source: ``{name: how it was learned}`` (``"session <id>"`` or ``"dry learn"``).
    """

    __slots__ = ("conversions", "entries", "index", "padding", "params", "sliced", "slices", "source", "spec", "unlearned")

    def __init__(self, index: Any) -> None:
        self.index = weakref.ref(index) if index is not None else (lambda: None)
        self.entries: dict[str, tuple[Region, ...]] = {}
        self.spec: dict[str, tuple[tuple[int, ...], str]] = {}
        self.params: dict[str, tuple[tuple, tuple, int, str]] = {}
        self.padding: dict[str, list[Geometry]] = {}
        self.conversions: dict[str, str] = {}
        self.slices: dict[str, tuple[SliceRegion, ...]] = {}
        self.sliced: dict[str, str] = {}
        self.unlearned: dict[str, str] = {}
        self.source: dict[str, str] = {}

    def unlearn(self, name: str, why: str) -> None:
        """Map ``name`` nowhere (no entry, no slices), ``why`` (one sentence) kept for :meth:`why_not`."""
        self.entries.pop(name, None)
        self.slices.pop(name, None)
        self.unlearned[name] = why

    def why_not(self, name: str) -> str:
        """Why ``name`` has no entry (one sentence)."""
        for table in (self.sliced, self.unlearned):
            if name in table:
                return table[name]
        return "no load placed it into the engine (a name the model does not know?)"

    def summary(self) -> dict[str, Any]:
        """The map as builtins: ``entries`` ``{name: ["parameter slice", ...]}``, ``slices`` ``{name:
        ["parameter region <- slice of the tensor", ...]}``, ``padding``, ``conversions``, ``sliced``,
        ``unlearned`` (what ``refit_verify_layout`` returns)."""
        shapes = {p: v[0] for p, v in self.params.items()}
        return {"entries": {n: [f"{p} {describe_region(g, shapes.get(p))}" for p, g in rs] for n, rs in self.entries.items()},
                "slices": {n: [f"{p} {describe_region(g, shapes.get(p))} <- {describe_slice(src, self.spec[n][0])}"
                               for p, g, src in rs] for n, rs in self.slices.items()},
                "padding": {p: [describe_region(g, shapes.get(p)) for g in gs] for p, gs in self.padding.items()},
                "conversions": dict(self.conversions), "sliced": dict(self.sliced), "unlearned": dict(self.unlearned)}


def describe_region(g: Geometry, pshape: tuple | None = None) -> str:
    """A region as a report names it: ``"rows 128:192"`` for a block of whole rows of a row-major
    parameter of shape ``pshape``, ``"whole"`` for all of it, else offset, shape and strides."""
    off, shape, stride = g[0], tuple(g[1]), tuple(g[2])
    if pshape is not None and len(shape) == len(pshape) >= 1 and shape[1:] == tuple(pshape[1:]):
        row = 1
        for s in pshape[1:]:
            row *= s
        expect, contiguous = 1, True
        for n, st in zip(reversed(shape), reversed(stride)):
            if n != 1 and st != expect:
                contiguous = False
            expect *= n
        if contiguous and row and off % row == 0:
            a = off // row
            return "whole" if (a, shape[0]) == (0, pshape[0]) else f"rows {a}:{a + shape[0]}"
    return f"offset {off} shape {list(shape)} stride {list(stride)}"


def _contiguous_strides(shape: tuple) -> tuple[int, ...]:
    out, step = [], 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _as_geometry(g) -> tuple:
    """``(offset, shape, strides)`` with tuples, so that two geometries compare equal by value."""
    return (int(g[0]), tuple(g[1]), tuple(g[2]))


def describe_slice(src: Geometry, shape: tuple | None) -> str:
    """A slice of a trainer tensor of ``shape`` (taken contiguous) as a report names it: ``"whole"``,
    ``"dim 1 [64:128]"`` for a block along one dim, else ``"offset .. shape .. stride .."``."""
    off, sh, st = src[0], tuple(src[1]), tuple(src[2])
    if shape is not None and len(sh) == len(shape):
        shape = tuple(shape)
        full = _contiguous_strides(shape)
        dims = [d for d in range(len(sh)) if sh[d] != shape[d]]
        if all(st[d] == full[d] for d in range(len(sh)) if sh[d] > 1):
            if not dims and off == 0:
                return "whole"
            if len(dims) == 1 and off % full[dims[0]] == 0:
                d = dims[0]
                a = off // full[d]
                return f"dim {d} [{a}:{a + sh[d]}]"
    return f"offset {off} shape {list(sh)} stride {list(st)}"


def _geometry_of(p: torch.Tensor) -> tuple[tuple, tuple, int, str]:
    return (tuple(p.shape), tuple(p.stride()), p.storage_offset(), dtype_name(p.dtype))


def learn_session(old: LayoutMap | None, ms: Any, index: Any, source: str, verified: Callable[[str], bool] | None = None,
                  loaders: dict[str, str] | None = None, skip: Iterable[str] = ()) -> LayoutMap | None:
    """The map of module session ``ms`` merged over ``old`` (kept when it is of the same ``index``).

    Args:
        ms: a closed :class:`~refit_verify.boundary.record.ModuleSession` (its records: ``placed``,
            ``inexact``, ``delivered``, ``unconsumed``).
        index: the model index the session ran on.
        source: how it was learned, recorded per name.
        verified: ``f(parameter) -> bool``: the session's read-back found it holding what was
            written (None: every parameter). A name with a region in another one is not learned
            from this session (a misplacing load does not teach the map).
        loaders: ``{parameter: loader name}`` (the tap's), named with a conversion.
        skip: names whose records teach nothing (judged by the state through the map itself).

    Returns:
        LayoutMap | None: None when there is neither an old map nor anything to learn.
    """
    m = old if old is not None and old.index() is index and index is not None else LayoutMap(index)
    live = index.params if index is not None else {}
    whole: dict[str, list[Region]] = {}
    part: dict[str, list[SliceRegion]] = {}
    shape_of: dict[str, tuple[int, ...]] = {}
    block_src = getattr(ms, "block_src", None) or {}
    bad: dict[str, str] = {}
    for pname, entries in ms.placed.items():
        p = live.get(pname)
        if p is None:
            continue
        ok = verified is None or verified(pname)
        for c, key, src in entries:
            if src in skip:
                continue
            if c.fill:
                if not c.numel():  # an empty fill (a vocab with no padding rows): nothing to exclude
                    continue
                pad = m.padding.setdefault(pname, [])
                if c.dest not in pad:
                    pad.append(c.dest)
                continue
            if not ok:
                bad.setdefault(src, f"its region in {pname} did not hold what was written when it was learned")
            elif key == WHOLE + src:
                rs = whole.setdefault(src, [])
                if (pname, c.dest) not in rs:
                    rs.append((pname, c.dest))
            elif key in block_src:  # a slice of the delivered tensor (a shard)
                g_src, shape_of[src] = block_src[key]
                ps = part.setdefault(src, [])
                if (pname, c.dest, g_src) not in ps:
                    ps.append((pname, c.dest, g_src))
            else:
                bad[src] = (f"it is copied in part into {pname} from a source that is not a view of a contiguous delivered "
                            "tensor: which slice of the trainer's tensor the region holds cannot be told")
        m.params[pname] = _geometry_of(p)
    for pname, why in ms.inexact.items():
        loader = (loaders or {}).get(pname)
        m.conversions[pname] = why + (f" (loader {loader})" if loader else "")
        m.padding.pop(pname, None)
    for name, why in bad.items():
        whole.pop(name, None)
        part.pop(name, None)
        if name not in m.entries and name not in m.slices:
            (m.sliced if "in part" in why else m.unlearned)[name] = why
    for name in getattr(ms, "unconsumed", ()):
        if name not in whole and name not in part and name not in m.entries and name not in m.slices:
            m.unlearned[name] = "the model's load_weights skipped it (no parameter consumed it)"
    for name, ps in list(part.items()):  # a "slice" that is all of the tensor, in its shape (a TP=1 narrow): a whole copy
        shape = tuple(shape_of[name])
        full = (0, shape, _contiguous_strides(shape))
        if all(_as_geometry(g_src) == _as_geometry(full) and tuple(g[1]) == shape for _, g, g_src in ps):
            rs = whole.setdefault(name, [])
            rs.extend((pn, g) for pn, g, _ in ps if (pn, g) not in rs)
            del part[name]
    for name, ps in part.items():  # a name copied in part: every region of it as a slice (a whole copy as the trivial one)
        shape = shape_of[name]
        full = (0, shape, _contiguous_strides(shape))
        regions = [*ps, *((pn, g, full) for pn, g in whole.pop(name, ()))]
        m.slices[name] = tuple(regions)
        m.spec[name] = (shape, m.params[regions[0][0]][3])
        m.source[name] = source
        for table in (m.entries, m.sliced, m.unlearned):
            table.pop(name, None)
    for name, regions in whole.items():
        pname, g = regions[0]
        m.entries[name] = tuple(regions)
        m.spec[name] = (tuple(g[1]), m.params[pname][3])
        m.source[name] = source
        m.slices.pop(name, None)
        m.sliced.pop(name, None)
        m.unlearned.pop(name, None)
    # tied parameters: the engine holds one tensor under both names (vLLM loads one name of a tied pair and
    # skips the other); a skipped name that is the other name of a parameter one name alone fills holds that tensor too
    for alias, pname in (getattr(index, "aliases", None) or {}).items():
        if alias in m.entries or alias in skip:
            continue
        into = [n for n, rs in m.entries.items() if any(p == pname for p, _g in rs)]  # the names mapped into it
        whole_of = into[0] if len(into) == 1 and len(m.entries[into[0]]) == 1 else None
        sliced_into = [n for n, rs in m.slices.items() if any(p == pname for p, _g, _s in rs)]
        if whole_of is not None:
            m.entries[alias], m.spec[alias] = m.entries[whole_of], m.spec[whole_of]
            m.source[alias] = f"tied to {whole_of} ({m.source[whole_of]})"
            m.unlearned.pop(alias, None)
        elif not into and len(sliced_into) == 1 and alias not in m.slices:  # a shard of a tied vocab-parallel embedding
            m.slices[alias], m.spec[alias] = m.slices[sliced_into[0]], m.spec[sliced_into[0]]
            m.source[alias] = f"tied to {sliced_into[0]} ({m.source[sliced_into[0]]})"
            m.unlearned.pop(alias, None)
    if not m.entries and not m.slices and not m.padding and not m.conversions and not m.sliced and not m.unlearned:
        return old
    return m


# --------------------------------------------------------------------------- dry learn


def _written_args(func, args: tuple, kwargs: dict) -> list:
    """The tensors an op writes (its schema's mutable arguments), flattened."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.is_mutable:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        info = a.alias_info
        if info is None or not info.is_write:
            continue
        v = args[i] if i < len(args) else kwargs.get(a.name)
        out.extend(v if isinstance(v, (list, tuple)) else [v])
    return [t for t in out if isinstance(t, torch.Tensor)]


def _ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _NoWrites(TorchDispatchMode):
    """Blocks every op that writes into one of ``storages`` (the model's tensors): the op is not run
    and its written argument is returned as it is. Ops on other tensors run."""

    def __init__(self, storages: set[int]) -> None:
        super().__init__()
        self.storages = storages
        self.blocked = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written_args(func, args, kwargs)
        if written and any(_ptr(t) in self.storages for t in written):
            self.blocked += 1
            return written[0] if len(written) == 1 else tuple(written)
        return func(*args, **kwargs)


def _signatures(index: Any) -> list[tuple]:
    return [(name, id(t), _ptr(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype) for name, t, _ in index.state]


def dry_learn(boundary: Any, specs: dict[str, tuple[tuple[int, ...], str]], record: Callable[[], Any]) -> tuple[Any, dict[str, str]]:
    """Run ``boundary``'s model's ``load_weights`` on placeholders of ``specs`` with no write reaching it.

    Args:
        boundary: the :class:`~refit_verify.boundary.model.ModelBoundary` (its model, tap, index).
        specs: ``{name: (shape, dtype name)}`` announced by the trainer.
        record: makes the module session the tap's records go to (a fresh, unsessioned-looking one).

    Returns:
        ``(module session with the recorded placements, {name: why it could not be learned})``.
        Each name is loaded in a call of its own (one the model refuses fails alone). Every op
        writing into the model's parameters or buffers is blocked; afterwards the model's tensors
        are checked (same objects, storages, geometry): a change there makes every name unlearned.
    """
    model = boundary.model
    idx = boundary.index()
    failed: dict[str, str] = {}
    ms = record()
    if model is None or idx is None:
        return ms, {n: "the model is gone" for n in specs}
    load = getattr(model.load_weights, "__refit_verify_original__", model.load_weights)
    device = next((t.device for _, t in idx.all_params if t.numel()), torch.device("cpu"))
    storages = {p for p in (_ptr(t) for _, t, _ in idx.state) if p not in (None, 0)}
    before = _signatures(idx)
    tap = boundary.tap
    bound = (tap.on_write, tap.on_route, tap.enabled)
    boundary.install()
    tap.on_write, tap.on_route, tap.enabled = ms.on_write, ms.on_route, True
    guard = _NoWrites(storages)
    try:
        for name, (shape, dt) in specs.items():
            dtype = getattr(torch, dt, None)
            if not isinstance(dtype, torch.dtype):
                failed[name] = f"announced with dtype {dt!r}, which is not a torch dtype"
                continue
            with PLAIN():
                t = torch.empty(tuple(shape), dtype=dtype, device=device)
            call = ms.begin_call(lazy=False)
            ms.deliver(name, t, call, "dry")  # recorded, not digested: a placeholder's bytes mean nothing
            ms.spec[name] = spec_of(t)  # what the first session's replay of a plan learned here matches (plan.learn_dry)
            try:
                with guard:
                    load([(name, t)])
            except Exception as e:  # noqa: BLE001 - this name is not learned; the others go on
                failed[name] = f"the model's load_weights raised {type(e).__name__} on a placeholder: {e}"[:300]
            finally:
                ms.end_call(call)
    finally:
        tap.on_write, tap.on_route, tap.enabled = bound
    if boundary.model is not None and _signatures(boundary.index()) != before:
        why = ("a dry learn changed the model's tensors other than through a blocked write (a loader that replaces a "
               "parameter or reassigns its .data): its map cannot be learned dry")
        failed.update({n: why for n in specs})
        ms.placed.clear()
    return ms, failed


# --------------------------------------------------------------------------- judging by the state


def judge(ms: Any, m: LayoutMap, expected: dict[str, str], live: dict[str, torch.Tensor],
          table: dict[Region, str], reads: Any = None) -> tuple[dict[Region, str], float]:
    """Judge the names of ``expected`` (``{name: trainer's 32-hex}``) by what the engine holds where
    ``m`` maps them, recording the result in module session ``ms``.

    A name mapped as slices (:attr:`LayoutMap.slices`, a tensor-parallel shard) is read the same way, but
    its regions cannot be compared here (the worker does not know a slice's digest): each is recorded
    in ``ms.state_slices`` with what it holds and whether the last close read the same there, the name
    counted written there (coverage), and the trainer compares (:mod:`refit_verify.trainer.slices`).

    For each name: its regions are read now (one batch). All equal to the trainer's digest, or some
    not: the name is recorded as written there (coverage, and the session's read-back compares the
    regions with the trainer's digest: a ``mismatch`` names the parameter and region), its digest is
    the region's (``ms.state_hex``), its location said (``ms.state_where``); the padding a loader
    fills in its parameters counts as written and is said (``ms.state_padding``: not compared). Not equal, and every
    region still holding what the last close read there (``table``): not written by this refit, so
    left unwritten (the trainer finds it missing). No map entry, or a parameter replaced or re-viewed
    since it was mapped: ``ms.not_provable[name]``, never passed.

    Returns:
        ``({region: 32-hex} read now, host seconds)``.
    """
    t0 = time.perf_counter()
    batch = RegionBatch(reads, "judging by the state")  # (a region the close's state pass read is taken from ``reads``)
    keys: dict[str, list[tuple[str, Region]]] = {}
    srcs: dict[str, list[Geometry]] = {}
    for name in expected:
        regions = m.entries.get(name)
        if regions is None and name in m.slices:
            srcs[name] = [src for _p, _g, src in m.slices[name]]
            regions = tuple((p, g) for p, g, _src in m.slices[name])
        if regions is None:
            ms.not_provable[name] = m.why_not(name)
            continue
        why = None
        for pname, _g in regions:
            p = live.get(pname)
            mapped = m.params.get(pname)
            if p is None:
                why = f"{pname} is not a parameter of the model any more"
            elif mapped is not None and _geometry_of(p) != mapped:
                why = f"{pname} was replaced, re-viewed or converted since the layout was learned"
            if why is not None:
                break
        if why is not None:
            ms.not_provable[name] = why
            continue
        ks = []
        try:
            with PLAIN():
                for i, (pname, g) in enumerate(regions):
                    view = as_view(live[pname].detach(), g)
                    check_tensor(view)
                    k = f"{i}:{name}"
                    batch.add(k, view, checked=True, of=(live[pname], g))
                    ks.append((k, (pname, g)))
        except (RuntimeError, ValueError) as e:
            ms.not_provable[name] = f"its region cannot be read: {e}"[:300]
            continue
        keys[name] = ks
    got = batch.hexdigests() if len(batch) else {}
    read: dict[Region, str] = {}
    for name, ks in keys.items():
        hexes = [got[k] for k, _ in ks]
        read.update({r: h for (_, r), h in zip(ks, hexes)})
        regions = [r for _, r in ks]
        want = expected[name]
        shapes = {pname: m.params[pname][0] for pname, _ in regions}
        if name in srcs:  # slices: the trainer compares (it digests the same slices of its tensor)
            ms.state_slices[name] = [(pname, g, src, h, table.get((pname, g)) == h, describe_region(g, shapes[pname]),
                                      describe_slice(src, m.spec[name][0]))
                                     for (pname, g), src, h in zip(regions, srcs[name], hexes)]
            ms.state_where[name] = "; ".join(f"{pname} {describe_region(g, shapes[pname])} <- {describe_slice(src, m.spec[name][0])}"
                                             for (pname, g), src in zip(regions, srcs[name]))
            _record_write(ms, name, regions, live, m, place=False)
            continue
        if any(h != want for h in hexes) and all(table.get(r) == h for r, h in zip(regions, hexes)):
            ms.state_unwritten[name] = "its regions hold what the last session's close read there: not written by this refit"
            continue
        ms.by_state[name] = want
        ms.state_hex[name] = next((h for h in hexes if h != want), want)
        ms.state_where[name] = "; ".join(f"{pname} {describe_region(g, shapes[pname])}" for pname, g in regions)
        _record_write(ms, name, regions, live, m)
    judged = [p for name in ms.by_state for p, _g in m.entries[name]] + [p for name in ms.state_slices for p, *_ in m.slices[name]]
    for pname in dict.fromkeys(judged):  # padding: no trainer tensor's, counted, said
        pads = m.padding.get(pname)
        if pads:
            ms.written[pname] = {**ms.written.get(pname, {}), **{g: _numel(g[1]) for g in pads}}
            ms.state_padding[pname] = ", ".join(describe_region(g, m.params[pname][0]) for g in pads)
    return read, time.perf_counter() - t0


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def read_regions(live: dict[str, torch.Tensor], regions: Iterable[Region], reads: Any = None) -> dict[Region, str]:
    """``{region: 32-hex}`` of ``regions`` of the live parameters, read at once (or taken from the
    close's state pass, ``reads``); a region that cannot be read (its parameter gone or resized) is left out."""
    batch = RegionBatch(reads, "a delta's other regions")
    keys: dict[str, Region] = {}
    with PLAIN():
        for r in regions:
            p = live.get(r[0])
            if p is None:
                continue
            try:
                view = as_view(p.detach(), r[1])
                check_tensor(view)
            except (RuntimeError, ValueError):
                continue
            k = str(len(keys))
            keys[k] = r
            batch.add(k, view, checked=True, of=(p, r[1]))
    got = batch.hexdigests() if len(batch) else {}
    return {r: got[k] for k, r in keys.items()}


def _record_write(ms: Any, name: str, regions: Iterable[Region], live: dict[str, torch.Tensor], m: LayoutMap,
                  place: bool = True) -> None:
    """Record ``name`` as written whole into ``regions`` (what a watched load's records would say);
    ``place=False`` (slices, which the trainer compares): coverage only, nothing for read-back to compare."""
    shape, _dt = m.spec[name]
    for pname, g in regions:
        p = live[pname]
        c = Copy(g, (0, tuple(g[1]), tuple(g[2])))
        # new containers: a session that replayed its whole plan shares the plan's (boundary.plan.expand)
        ms.written[pname] = {**ms.written.get(pname, {}), g: c.numel()}
        if place:
            ms.placed[pname] = [*ms.placed.get(pname, ()), (c, WHOLE + name, name)]
        else:
            ms.slice_params.add(pname)
        if pname not in ms.param_numel:
            ms.param_numel[pname] = p.numel()
            ms.param_dtype[pname] = p.dtype
        ms.param_geometry.setdefault(pname, (tuple(p.shape), tuple(p.stride()), p.storage_offset()))
        ms.replicated.setdefault(pname, tuple(g[1]) == tuple(p.shape) and tuple(shape) == tuple(p.shape))
