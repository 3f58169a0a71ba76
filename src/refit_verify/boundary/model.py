"""The wrappers of one model module: ``load_weights`` and every parameter's ``weight_loader``.

:class:`ModelBoundary` is what :class:`refit_verify.boundary.worker.WorkerBoundary` attaches to each model
module of a worker (the main model, a drafter). Its ``load_weights`` wrapper hands the model a
list or iterator that digests each ``(name, tensor)`` as the loader pulls it (or, for verify
before load, digests the whole call first and leaves out refused tensors); its
:class:`~refit_verify.boundary.placement.LoaderTap` reports where each delivered tensor was written. What
it records goes to the :class:`~refit_verify.boundary.record.ModuleSession` of the session in progress
(or to the unsessioned record). See :mod:`refit_verify.boundary.worker` for the whole picture.

Nothing here imports vLLM.
"""

from __future__ import annotations

import functools
import logging
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from refit_verify.boundary import placement as _placement  # its DERIVE_DEVICE_TYPES read at each use (tests widen it)
from refit_verify.boundary.close_reads import session_regions
from refit_verify.boundary.layout import LayoutMap, Region, describe_region, dry_learn, judge, learn_session, read_regions
from refit_verify.boundary.model_index import ModelIndex
from refit_verify.boundary.placement import LoaderTap
from refit_verify.boundary.plan import RefitPlan, learn, learn_dry, replay_call, spec_of
from refit_verify.boundary.record import ModuleSession
from refit_verify.compare import check_digest
from refit_verify.digest.batch import MANY_MIN, DigestBatch
from refit_verify.digest.incremental import digest_now
from refit_verify.digest.kept import expect_layouts
from refit_verify.digest.tensors import PLAIN, PLAIN_TYPES
from refit_verify.manifest import ModuleManifest, Unsessioned

logger = logging.getLogger("refit_verify")

__all__ = ["MAX_UNSESSIONED_NAMES", "ModelBoundary"]

_MARK = "__refit_verify_boundary__"
CHECKED = "checked before loading"  # the space of the check before loading's kept sets (digest_now)
MAX_UNSESSIONED_NAMES = 64


class BoundaryOwner(Protocol):
    """What a :class:`ModelBoundary` reads of its owner (:class:`refit_verify.boundary.worker.WorkerBoundary`)."""

    verifying: bool
    open_session: Any
    loading_context: str | None

    def take_expected(self) -> Any: ...


class ModelBoundary:
    """The digest point of one model module of a worker (``"model"`` or ``"drafter"``).

    Args:
        owner: the worker's :class:`WorkerBoundary`.
        model: the ``torch.nn.Module`` whose ``load_weights`` refits go through.
        role: ``"model"`` for the main model, ``"drafter"`` for a draft / MTP module.
        default_loader: vLLM's ``default_weight_loader`` (for parameters with no ``weight_loader``).

    :meth:`install` is idempotent; the wrappers pass every call through unchanged while the owner
    does not verify.
    """

    def __init__(self, owner: BoundaryOwner, model: torch.nn.Module, role: str, default_loader: Callable | None,
                 extra_params: Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]] | None = None) -> None:
        self.owner = owner
        self.extra_params = extra_params
        self.model_ref = weakref.ref(model)
        self.role = role
        self.tap = LoaderTap(default_loader, on_write=lambda *a: None, on_error=self._on_tap_error)  # callbacks: _bind
        self.tap.enabled = owner.verifying
        self.session: ModuleSession | None = None
        self.outside = ModuleSession(self, sessioned=False)
        self.numel_hint: dict[str, int] = {}
        self._index: ModelIndex | None = None
        self.plan: RefitPlan | None = None  # the last watched session's, replayed by the next (refit_plan)
        self.plan_why = "no session has closed yet"  # why there is none
        self.landed_kept: tuple | None = None  # (regions, DigestSet) of the last open-update check (delivery.landed_now)
        self.layout: LayoutMap | None = None  # which trainer tensor each parameter region holds (boundary.layout)
        self.region_table: dict[Region, str] = {}  # (parameter, dest) -> 32-hex of what it held at the last close
        # the same as read at engine start (WorkerBoundary.prepare, with a plan learned ahead), until the first close
        self.region_start: dict[Region, str] = {}
        self.fills_ahead: list[tuple[torch.dtype, tuple[int, ...], Any]] = []  # (dtype, shape, value) of fills learned ahead
        self.own_s = 0.0  # host seconds in the load_weights wrapper outside the model's own (own_seconds)
        self.inner_s = 0.0  # host seconds in the model's own load_weights under the wrapper
        # host seconds recording what the engine did to loaded weights, inside its load or finalize (shims.record_into)
        self.record_s = 0.0
        self._bind()

    @property
    def model(self) -> torch.nn.Module | None:
        return self.model_ref()

    def index(self, refresh: bool = True, quick: bool = False) -> ModelIndex | None:
        """The model's :class:`~refit_verify.boundary.model_index.ModelIndex` (None when the model is gone);
        ``refresh``: re-check it against the model first (False: the caller checked it in this
        step, e.g. once per session close); ``quick``: with :meth:`ModelIndex.unchanged`, the
        partial check (a session's open: what it misses, the close's full check finds)."""
        model = self.model
        if model is None:
            return None
        idx = self._index
        if idx is None or (refresh and not (idx.unchanged(model) if quick else idx.fresh(model))):
            idx = self._index = ModelIndex(model)
        return idx

    def install(self, loaders: bool = True) -> None:
        """Wrap ``model.load_weights`` (instance level) and, with ``loaders``, every parameter's weight loader."""
        model = self.model
        if model is None:
            return
        current = vars(model).get("load_weights")
        if getattr(current, _MARK, None) is not self:
            original = model.load_weights
            object.__setattr__(model, "load_weights", self._wrap(original))
        if not loaders:
            return
        extra = list(self.extra_params(model)) if self.extra_params is not None else []
        self.tap.install(self.index().all_params, extra)
        self.numel_hint = {n: t.numel() for n, t in extra}

    def _bind(self) -> None:
        """Point the tap's callbacks straight at the record in use (the session's, or the unsessioned one)."""
        t = self._target()
        self.tap.on_write, self.tap.on_route = t.on_write, t.on_route

    def _target(self) -> ModuleSession:
        return self.session if self.session is not None else self.outside

    def _on_tap_error(self, message: str) -> None:
        logger.error("%s", message)
        self._target().errors.append(f"{self.role}: {message}")

    def _wrap(self, original: Callable) -> Callable:
        boundary = self

        def load_weights(*args, **kwargs):
            if not boundary.owner.verifying:
                return original(*args, **kwargs)
            t0, inner0 = time.perf_counter(), boundary.inner_s
            try:
                return watched(*args, **kwargs)
            finally:  # this call's time outside the model's own load_weights: ours
                boundary.own_s += time.perf_counter() - t0 - (boundary.inner_s - inner0)

        def watched(*args, **kwargs):
            owner = boundary.owner
            s = boundary.session
            if s is not None and s.plan is not None and len(args) == 1 and not kwargs:  # a replayed session, one pair a
                weights = args[0]  # call (TRL, OpenRLHF): replay_call's checks inline, no other Python in between
                if type(weights) is list and len(weights) == 1 and type(item := weights[0]) is tuple and len(item) == 2:
                    name, t = item
                    if type(t) in PLAIN_TYPES and type(name) is str and name not in s.replayed:
                        spec = s.plan.spec.get(name)
                        o = owner.open_session
                        if spec is not None and (o is None or o.expected is None) and spec == spec_of(t):
                            s.replayed[name] = None
                            s.unexpanded.append(name)
                            return boundary._replayed(s, original, args, kwargs)
            if "weights" not in kwargs and not args:
                return boundary._original(original, args, kwargs)
            target = boundary._target()
            weights = kwargs["weights"] if "weights" in kwargs else args[0]
            if target.plan is not None and isinstance(weights, (list, tuple)):  # a replayed session: the common case first
                s = owner.open_session
                if s is None or s.expected is None:  # no digests sent ahead (checked before loading): replay it
                    with PLAIN():
                        why = replay_call(target, target.plan, weights)
                    if why is None:
                        return boundary._replayed(target, original, args, kwargs)
                    boundary.end_replay(why)
            pending = boundary.owner.take_expected() if target.sessioned else None
            pre = None
            if pending is not None and isinstance(weights, (list, tuple)):
                n = len(weights)
                weights, pre = boundary._check_first(target, weights, *pending)
                if target.plan is not None and len(weights) == n:
                    # checked before loading, nothing refused: the plan says where it lands (read back at close)
                    with PLAIN():
                        why = replay_call(target, target.plan, weights)
                    if why is None:
                        if "weights" in kwargs:
                            kwargs["weights"] = weights
                        else:
                            args = (weights, *args[1:])
                        return boundary._replayed(target, original, args, kwargs)
                    boundary.end_replay(why)
            if target.plan is not None:  # what the plan does not describe: watched from here on
                boundary.end_replay("a tensor was refused before loading" if pre is not None
                                    else f"load_weights was handed {type(weights).__name__}, not a list")
            if pre is not None:
                weights = _DigestingList(boundary, weights, pre)
            elif isinstance(weights, (list, tuple)):
                try:
                    pre = boundary._cpu_first(target, weights)
                except Exception:  # noqa: BLE001 - e.g. a tensor that cannot be digested: it raises at its pull,
                    pre = None  # inside the call, where the session records why
                weights = _DigestingList(boundary, weights, pre)
            else:
                weights = boundary._digesting(weights)
            if "weights" in kwargs:
                kwargs["weights"] = weights
            else:
                args = (weights, *args[1:])
            if not target.sessioned and boundary.owner.loading_context:
                target.where = boundary.owner.loading_context
            call = target.begin_call(lazy=not isinstance(weights, (list, tuple)))
            try:
                return boundary._original(original, args, kwargs)
            except Exception as e:
                target.errors.append(f"{boundary.role}.load_weights raised {type(e).__name__}: {e}"[:500])
                raise
            finally:
                target.end_call(call)

        functools.update_wrapper(load_weights, original)
        setattr(load_weights, _MARK, self)
        load_weights.__refit_verify_original__ = original
        return load_weights

    def _original(self, original: Callable, args: tuple, kwargs: dict) -> Any:
        """Run the model's own ``load_weights``, its seconds counted in :attr:`inner_s`."""
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            self.inner_s += time.perf_counter() - t0

    def own_seconds(self) -> float:
        """Host seconds this boundary spent in its own code during loads, so far (monotonic): the wrapper
        of ``load_weights`` outside the model's own (digests checked first, bookkeeping), the loader
        tap's (:attr:`LoaderTap.own_s <refit_verify.boundary.placement.LoaderTap.own_s>`), and the
        records of what the engine did to loaded weights (``record_s``: a repacked or quantized
        weight read back inside vLLM's ``process_weights_after_loading``)."""
        return self.own_s + self.tap.own_s + self.record_s

    def _replayed(self, target: ModuleSession, original: Callable, args: tuple, kwargs: dict) -> Any:
        """Run one ``load_weights`` call the plan described (recorded already): no tap, no digests."""
        target.calls += 1
        try:
            return self._original(original, args, kwargs)
        except Exception as e:
            target.errors.append(f"{self.role}.load_weights raised {type(e).__name__}: {e}"[:500])
            raise

    def end_replay(self, why: str) -> None:
        """Watch the rest of the open session with the loader tap (what was replayed stays recorded)."""
        s = self.session
        if s is None or s.plan is None:
            return
        s.expand()
        s.plan, s.replay_left = None, why
        self.install()
        self.tap.enabled = self.owner.verifying

    def learn(self, s: ModuleSession, read_back: bool = True) -> None:
        """Keep the plan of closed session ``s`` (read back already) for the next session to replay,
        or none, with why (:func:`refit_plan.learn`); ``read_back``: the session's read-back completed."""
        if not read_back:
            self.plan, self.plan_why = None, "the session's read-back failed"
            return
        if s.by_state:
            self.plan, self.plan_why = None, "names were judged by the engine state (written directly, not through load_weights)"
            return
        bad = [n for n, h in s.prechecked.items() if s.derived_hex.get(n, h) != h]
        if bad:  # the bytes were right before loading and are not where the plan says they land: diagnose it watched
            self.plan = None
            self.plan_why = (f"{bad[0]} holds other bytes where it landed than were checked before loading "
                             f"({len(bad)} such): the next session is watched")
            return
        if s.plan is not None and not s.errors and not s.underived and s.plan.index() is self._index:
            return  # replayed throughout (a partial refit too), cleanly, on the same model: the same plan
        try:
            self.plan, self.plan_why = learn(s, self._index)
        except Exception as e:  # noqa: BLE001 - the plan only saves work: the next session is watched
            logger.exception("refit-verify: learning the refit plan of %s failed", self.role)
            self.plan, self.plan_why = None, f"learning the plan failed: {type(e).__name__}: {e}"[:300]

    # -- the layout map (judging what load_weights did not deliver) ----------------------------

    def learn_layout(self, s: ModuleSession, verified: Callable[[str], bool] | None, source: str) -> None:
        """Merge what closed session ``s``'s loads placed into the layout map (names judged by the
        state taught nothing; a session that replayed its whole plan adds nothing new)."""
        idx = self._index
        if not s.placed or (s.replayed_all and self.layout is not None and self.layout.index() is idx):
            return
        try:
            self.layout = learn_session(self.layout, s, idx, source, verified, self.tap.loader_of, skip=s.by_state)
        except Exception:  # noqa: BLE001 - the map only serves later judgements; a name it lacks is not provable
            logger.exception("refit-verify: learning the layout map of %s failed", self.role)

    def layout_for(self, specs: dict[str, tuple[tuple[int, ...], str]]) -> tuple[LayoutMap | None, list[str]]:
        """The layout map for ``specs`` (``{name: (shape, dtype name)}``), learned dry where it lacks a
        name or maps it with another shape or dtype; and what was (re-)learned, one sentence each."""
        idx = self.index()
        m = self.layout if self.layout is not None and self.layout.index() is idx else None
        notes = []
        if self.layout is not None and m is None:
            notes.append("the layout map was learned again: the model's parameters changed since it was learned")
        todo = {}
        for n, sp in specs.items():
            mapped = m is not None and (n in m.entries or n in m.slices)
            if mapped and m.spec.get(n) == sp:
                continue
            if mapped:
                notes.append(f"{n} was mapped as {list(m.spec[n][0])} {m.spec[n][1]} and is announced as {list(sp[0])} {sp[1]}: "
                             "learned again")
            elif m is not None and n in m.sliced:
                continue
            todo[n] = sp
        if todo:
            dry, failed = dry_learn(self, todo, lambda: ModuleSession(self, sessioned=True))
            m = learn_session(m, dry, idx, "dry learn", None, self.tap.loader_of) or m or LayoutMap(idx)
            for n, why in failed.items():
                if n not in m.entries or n in todo:
                    m.unlearn(n, why)
            got = sum(1 for n in todo if n in m.entries or n in m.slices)
            notes.append(f"dry learn of {len(todo)} names (the model's load_weights on placeholders, no write reaching the "
                         f"engine): {got} mapped" + (f", {len(todo) - got} not" if got < len(todo) else ""))
            self.layout = m
        return m, notes

    def learn_ahead(self, specs: dict[str, tuple[tuple[int, ...], str]]) -> tuple[int, dict[str, str], list[tuple[str, tuple]]]:
        """Learn the loaders' placements for ``specs`` (``{name: (shape, dtype name)}``, the checkpoint's
        tensors as a trainer would push them) before any refit: the dry learn of :func:`dry_learn` (the
        model's ``load_weights`` on placeholders, every write into the model blocked) under
        :meth:`LoaderTap.learning_ahead <refit_verify.boundary.placement.LoaderTap.learning_ahead>`, so the
        first refit's loads (the meta copies' loaders of vLLM's layerwise reload, too) take them instead of
        learning them. The check before loading expects ``specs`` in their order, as the CPU's fresh
        copies of a staged refit are handed to the model (:func:`~refit_verify.digest.kept.expect_layouts`:
        its first call reads through a set planned from that layout, once it found the tensors of it).
        Before any session closed it keeps the plan the first session replays (:func:`~refit_verify.boundary.plan.learn_dry`;
        none for a model that quantizes layers on load) and, with it, the layout map of the same record
        (what that session's close would learn; names it failed on unlearned). Returns ``(placements kept ahead,
        {name: why it was not learned}, regions)``: ``regions`` (``[(parameter name, (offset, shape,
        strides))]``) are those a close's read-back of such a refit reads that are not whole parameters
        (:func:`~refit_verify.boundary.close_reads.session_regions` of the dry record): a plan of what to
        read, for the caller to build that close's kept set ahead; nothing is read here. The fills its
        loaders wrote, ``(dtype, shape, value)``, are left in :attr:`fills_ahead` (for the caller to
        compute their digests ahead)."""
        expect_layouts(CHECKED, [(n, sh, getattr(torch, dt)) for n, (sh, dt) in specs.items()
                                 if isinstance(getattr(torch, dt, None), torch.dtype)])
        with self.tap.learning_ahead():
            ms, failed = dry_learn(self, specs, lambda: ModuleSession(self, sessioned=True))
        idx = self._index
        regions = session_regions(ms, idx.params) if idx is not None else []
        if idx is not None and self.plan is None:  # the first session replays what the dry learn placed whole
            why = _quantizing(self.model)
            self.plan, self.plan_why = (None, why) if why else learn_dry(ms, idx, failed)
            if self.plan is not None and self.layout is None:  # what its close would learn from the replayed plan's records
                m = learn_session(None, ms, idx, "dry learn at engine start", None, self.tap.loader_of)
                for n, why in failed.items() if m is not None else ():  # as layout_for: a name the dry learn failed on is not mapped
                    m.unlearn(n, why)
                self.layout = m
        if idx is not None:  # the fills such a refit's loaders write (vocab padding): their digests are computed ahead
            self.fills_ahead = list(dict.fromkeys(
                (idx.params[p].dtype, tuple(c.dest[1]), c.value) for p, placed in ms.placed.items() if p in idx.params
                for c, _k, _s in placed if c.fill and c.value is not None))
        return len(self.tap.ahead), failed, regions

    def rehearsal(self) -> ModuleSession | None:
        """A closed-looking record of a session that replayed the whole plan in its order (its records
        the plan's, nothing delivered), for a close's steps to build ahead what they keep for the next
        such session (:meth:`WorkerBoundary.prepare <refit_verify.boundary.worker.WorkerBoundary.prepare>`);
        None without a plan of the current index. Nothing of the module changes."""
        plan, idx = self.plan, self._index
        if plan is None or idx is None or plan.index() is not idx:
            return None
        ms = ModuleSession(self, sessioned=True, derive=True, plan=plan)
        ms.replayed = dict.fromkeys(plan.order)
        ms.unexpanded = list(plan.order)
        ms.expand(whole=True)
        return ms

    def state_map(self, s: ModuleSession, announced: dict[str, tuple[str, tuple[int, ...], str]]) -> LayoutMap | None:
        """The layout map for names ``announced`` (``{name: (trainer's 32-hex, shape, dtype name)}``),
        learned dry where it lacks them (:meth:`layout_for`); what was learned is said in ``s.layout``."""
        m, notes = self.layout_for({n: (tuple(sh), dt) for n, (_h, sh, dt) in announced.items()})
        if notes:
            s.layout = "; ".join(notes)
        return m

    def judge_state(self, s: ModuleSession, announced: dict[str, tuple[str, tuple[int, ...], str]],
                    since_last: bool = True, reads: Any = None, m: Any = None) -> dict[Region, str]:
        """Judge names ``announced`` (``{name: (trainer's 32-hex, shape, dtype name)}``) that no load of
        session ``s`` delivered by what the engine holds where the layout map puts them
        (:func:`refit_verify.boundary.layout.judge`); return the regions read, ``{region: 32-hex}``.
        ``since_last``: a name whose regions hold what the last close read there counts as not
        written (a refit); False: it differs (a check of the state, where nothing is written).
        ``reads``: the close's :class:`~refit_verify.boundary.close_reads.CloseReads` (regions its
        state pass read are taken from it); ``m``: the map :meth:`state_map` gave at this close."""
        if m is None:
            m = self.state_map(s, announced)
        idx = self.index(refresh=False)
        if m is None or idx is None:
            s.not_provable.update({n: "the model has no layout map" for n in announced})
            return {}
        read, secs = judge(s, m, {n: h for n, (h, _sh, _dt) in announced.items()}, idx.params,
                           self.region_table if since_last else {}, reads)
        s.digest_s += secs
        return read

    def unchanged_rest(self, pname: str, written: Iterable[tuple], reads: Any = None) -> tuple[int, list[str], list[str], dict[Region, str]]:
        """For parameter ``pname`` written in part: the layout map's other regions in it read now and
        compared with :attr:`region_table` (what the last close read there; before any close,
        :attr:`region_start`, what prepare read there at engine start). Returns ``(elements
        they cover, descriptions of those that changed, descriptions of those the last close did not
        read, {region: 32-hex} read now)``."""
        m, idx = self.layout, self.index(refresh=False)
        if m is None or idx is None or m.index() is not idx or pname not in idx.params:
            return 0, [], [], {}
        done = set(written)
        mapped = [*((p, g) for rs in m.entries.values() for p, g in rs), *((p, g) for rs in m.slices.values() for p, g, _s in rs)]
        rest = list(dict.fromkeys(g for p, g in mapped if p == pname and g not in done))
        read = read_regions(idx.params, [(pname, g) for g in rest], reads)
        shape = m.params.get(pname, (tuple(idx.params[pname].shape),))[0]
        table = self.region_table or self.region_start
        changed = [describe_region(g, shape) for g in rest if (pname, g) in read and table.get((pname, g)) not in
                   (None, read[(pname, g)])]
        unknown = [describe_region(g, shape) for g in rest if (pname, g) not in read or (pname, g) not in table]
        n = sum(_numel(g[1]) for g in rest)
        return n, changed, unknown, read

    def _digesting(self, weights: Any) -> Any:
        """Return what to hand the model's ``load_weights`` so that every pair is digested as pulled."""
        if isinstance(weights, (list, tuple)):
            return _DigestingList(self, weights)
        return _DigestingIter(self, weights)

    def _check_first(self, target: ModuleSession, weights: list | tuple, expected: dict[str, str | None],
                     enforce: bool) -> tuple[list, dict[int, str]]:
        """Digest every tensor of one call before the model sees any (one synchronisation), compare
        with the sender's ``expected`` digests and return what the model may load, with
        ``{id(tensor): 32-hex}`` of those checked.

        In ``enforce`` a tensor whose digest differs (or that came without one) is left out and
        recorded as refused; in ``log`` it is loaded (the verdict names it mismatched). Names the
        sender did not announce are digested as pulled (or replayed), as usual. The digests are
        read at once through :func:`~refit_verify.digest.incremental.digest_now` (nothing runs between
        the hand-over and the read): a call with the same names over the same memory as the last
        one (a staging slot handed over in place) launches a kept set, one signature per tensor;
        so do the layerwise reload's fresh clones on the CPU (a relocatable set read where they are
        now) and on CUDA when the allocator gives them the last refit's addresses; otherwise they
        take the general path (a plan per tensor).
        """
        t0 = time.perf_counter()
        checked = [item for item in weights
                   if isinstance(item, tuple) and len(item) == 2 and item[0] in expected and isinstance(item[1], torch.Tensor)]
        got = digest_now(checked, space=CHECKED)  # read before the model sees any: one synchronisation per device
        target.digest_s += time.perf_counter() - t0
        if [expected[n] for n in got] == list(got.values()):  # every one as the sender digested it: all loaded
            target.prechecked.update(got)
            return list(weights), {id(t): got[n] for n, t in checked}
        keep, pre = [], {}
        for item in weights:
            name = item[0] if isinstance(item, tuple) and len(item) == 2 else None
            if name not in got:
                keep.append(item)
                continue
            why = check_digest(got[name], expected[name])
            if why is not None and enforce:
                target.refused[name] = (got[name], why)
                logger.error("refit-verify: %s refused before loading: %s", name, why)
                continue
            pre[id(item[1])] = target.prechecked[name] = got[name]
            keep.append(item)
        return keep, pre

    def _cpu_first(self, target: ModuleSession, weights: list | tuple) -> dict[int, str] | None:
        """``{id(tensor): 32-hex}`` of the CPU tensors of a list, digested together before the model
        sees any (one compiled call for the small ones: ``DigestBatch(hold_cpu=True)``), as each is
        when handed over, before a loader could change it; None when the list has none (or the
        session digests CPU tensors where they land, :data:`~refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`), or
        when it is shorter than ``digest.MANY_MIN`` (then each is digested as it is pulled)."""
        if len(weights) < MANY_MIN or (target.derive and "cpu" in _placement.DERIVE_DEVICE_TYPES):
            return None  # a few (TRL's one per call): digested as pulled, one call each, is cheaper
        t0 = time.perf_counter()
        batch, keys, used = DigestBatch(hold_cpu=True), {}, set()
        with PLAIN():
            for item in weights:
                t = item[1] if isinstance(item, tuple) and len(item) == 2 else None
                if isinstance(t, torch.Tensor) and t.is_cpu and id(t) not in keys:
                    key = item[0] if isinstance(item[0], str) and item[0] not in used else (len(keys),)  # never a name
                    used.add(key)
                    keys[id(t)] = key
                    batch.add(key, t)
        if not keys:
            return None
        got = batch.hexdigests()
        target.digest_s += time.perf_counter() - t0
        return {i: got[k] for i, k in keys.items()}

    def _pull(self, name: str, tensor: Any, hexd: str | None = None) -> None:
        target = self._target()
        if isinstance(tensor, torch.Tensor) and target.current is not None:
            target.deliver(name, tensor, target.current, hexd)

    def delivered_name(self, t: Any) -> str | None:
        """The delivered name of the open session that ``t`` is (or is a view of), or None."""
        if not isinstance(t, torch.Tensor) or self.session is None:
            return None
        d = self.session.match(t)
        return d.name if d is not None else None

    # -- sessions -----------------------------------------------------------------------------

    def begin(self, derive: bool = False, replay: bool = False) -> None:
        """Start this module's record of a session; ``derive``: the session's read-back will run
        (see :data:`~refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`); ``replay``: replay the plan the last
        session left, if it is still the model's (:mod:`refit_verify.boundary.plan`)."""
        plan = self.plan if derive and replay else None
        if plan is not None:
            self.install(loaders=False)
            # the partial check: a change it misses leaves the plan describing other parameters than the
            # loader writes, which the close's full check and read-back of the live tensors find (a failed
            # verdict, never a passed one): tests/boundary/test_model_index.py
            if self.index(quick=True) is not plan.index():
                plan, self.plan, self.plan_why = None, None, "the model's parameters changed"
        if plan is None:
            self.install()
        self.session = ModuleSession(self, sessioned=True, derive=derive, plan=plan)
        self.tap.enabled = self.owner.verifying and plan is None
        self._bind()

    def end(self) -> ModuleSession:
        """Take this module's record of the closing session (read back next, then :meth:`manifest`)."""
        s = self.session if self.session is not None else ModuleSession(self, True)
        s.expand(whole=True)
        self.session = None
        self.tap.enabled = self.owner.verifying  # loads outside sessions are watched
        self._bind()
        return s

    def manifest(self, s: ModuleSession, allow: Iterable[str]) -> ModuleManifest:
        idx = self.index(refresh=False)
        return s.manifest(idx.params if idx is not None else {}, allow)

    def take_unsessioned(self) -> Unsessioned | None:
        o = self.outside
        if not o.calls:
            return None
        names = list(o.delivered)[:MAX_UNSESSIONED_NAMES]
        rec = Unsessioned(module=self.role, calls=o.calls, tensors=o.tensors, names=names, where=o.where)
        self.outside = ModuleSession(self, sessioned=False)
        self._bind()
        return rec


def _quantizing(model: Any) -> str | None:
    """Why the loads of ``model`` may be quantized or repacked after its loaders ran (a module with a
    ``quant_method`` that is not an unquantized one: vLLM's convention), or None. A dry learn sees
    only the loaders, so no plan is learned dry for such a model: its first session is watched."""
    for mod in (model.modules() if model is not None else ()):
        qm = getattr(mod, "quant_method", None)
        if qm is not None and not type(qm).__name__.startswith("Unquantized"):
            return f"a layer has the quant method {type(qm).__name__}: the first session is watched"
    return None


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


class _DigestingList(list):
    """A list handed to ``load_weights``: iterating it digests each pair (lists stay lists).

    ``pre``: ``{id(tensor): 32-hex}`` of tensors already digested (verify before load)."""

    def __init__(self, boundary: ModelBoundary, items, pre: dict[int, str] | None = None) -> None:
        super().__init__(items)
        self._boundary = boundary
        self._pre = pre or {}
        self._seen = False

    def __iter__(self):
        if self._seen:  # a loader iterating twice: digest the pairs once
            return super().__iter__()
        self._seen = True
        return _DigestingIter(self._boundary, super().__iter__(), self._pre)


class _DigestingIter:
    """Yields the pairs of ``inner`` unchanged, digesting each tensor as the loader pulls it."""

    def __init__(self, boundary: ModelBoundary, inner: Iterable, pre: dict[int, str] | None = None) -> None:
        self._boundary = boundary
        self._it: Iterator = iter(inner)
        self._pre = pre or {}

    def __iter__(self) -> _DigestingIter:
        return self

    def __next__(self):
        item = next(self._it)
        try:
            name, tensor = item
        except (TypeError, ValueError):
            return item
        self._boundary._pull(name, tensor, self._pre.get(id(tensor)))
        return item
