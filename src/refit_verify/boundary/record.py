"""What one model module of a vLLM worker received within one refit session (the model boundary's record).

:class:`ModuleSession` holds, for one module (main model or drafter) and one session: the digest of
every delivered ``(name, tensor)`` (digested as the loader pulls it, or before the load when the
sender's digests came first), which delivered tensors a parameter consumed and which parameters
were written (coverage), where each block landed (for read-back), the apply-time digests of loads
vLLM's layerwise reload defers, what was refused before loading and what was withheld with a layer
put back whole. :mod:`refit_verify.boundary.worker` owns the sessions and the wrappers that feed it.

The module stays whole: it is one record, whose delivery, write and close steps all read and update
the same per-session tables.
"""

from __future__ import annotations

import fnmatch
import time
import weakref
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from refit_verify.boundary import placement as _placement  # its DERIVE_DEVICE_TYPES read at each use (tests widen it)
from refit_verify.boundary.placement import WHOLE, Copy, Placement
from refit_verify.boundary.plan import RefitPlan, expand, spec_of
from refit_verify.boundary.regions import _extent, _storage_ptr, _write_plan, covered, unwritten_slices
from refit_verify.digest.batch import DigestBatch, tensor_digest
from refit_verify.digest.incremental import CopyingBatch, digest_now
from refit_verify.digest.kept import DigestSet
from refit_verify.digest.tensors import as_view, check_tensor, plain_tensor_ops, version_of
from refit_verify.errors import RefitProtocolError
from refit_verify.manifest import ModuleManifest, StateSlice

__all__ = ["ModuleSession", "match_any"]


def match_any(name: str, patterns: Iterable[str]) -> bool:
    """True iff ``name`` matches one of the ``fnmatch`` patterns (``"lm_head.*"``, ``"*.bias"``)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


CHANGED_IN_PLACE = ("the model's load_weights changed the delivered tensor in place before its loader wrote it (its "
                    "version counter moved): what landed cannot be compared with what was delivered")
"""Why a parameter written from a delivered tensor the model changed in place first is not coverable."""


class _Delivered:
    """One delivered tensor of a session (a weak reference only)."""

    __slots__ = ("name", "call", "seq", "ref", "ptr", "extent", "routed", "rechecked", "nbytes", "hex", "regions", "other", "version",
                 "__weakref__")

    def __init__(self, name: str, t: torch.Tensor, call: int, seq: int = 0, hexd: str | None = None) -> None:
        self.name, self.call, self.seq, self.hex = name, call, seq, hexd
        try:
            self.ref = weakref.ref(t)
        except TypeError:
            self.ref = lambda: None
        self.ptr = _storage_ptr(t)
        self.extent = _extent(t)
        self.routed = False
        self.rechecked = False
        self.nbytes = t.numel() * t.element_size()
        self.regions: list[tuple[str, tuple]] = []  # (parameter, dest) it was copied to whole, in this call
        self.other = False  # some write of it was not a whole exact copy (a block, a conversion)
        self.version = version_of(t)  # its version counter when delivered (None: an inference tensor has none)


class _Call:
    """One ``load_weights`` call. ``lazy``: its weights come from an iterator, which may refill a
    tensor's memory before the next pull, so every digest of it is launched at once; a list's
    tensors stay as they are for the call, so their digests are launched together at its end."""

    __slots__ = ("id", "names", "unattributed", "lazy", "pending")

    def __init__(self, call_id: int, lazy: bool = True) -> None:
        self.id = call_id
        self.names: list[str] = []
        self.unattributed = 0
        self.lazy = lazy
        self.pending: list[tuple[_Delivered, torch.Tensor]] = []  # digests decided at the end of the call


WORKER_FLUSH_BYTES = 64 << 20
"""Bytes of tensor copies a worker holds on the device before their digests are launched (64 MiB)."""

class BoundaryModule(Protocol):
    """What a :class:`ModuleSession` reads of its module (:class:`refit_verify.boundary.model.ModelBoundary`)."""

    model: Any
    role: str
    plan: Any
    landed_kept: Any
    numel_hint: Any


class ModuleSession:
    """What one module received within one session (or, outside sessions, the unsessioned record)."""

    def __init__(self, module: BoundaryModule, sessioned: bool, derive: bool = False, plan: RefitPlan | None = None) -> None:
        self.module = module
        self.sessioned = sessioned
        self.derive = derive  # read-back will run at close: whole exact copies are digested where they landed
        self.plan = plan  # replayed while not None (refit_plan): the loader tap is off
        self.replayed: dict[str, None] = {}  # names recorded from the plan, not watched
        self.prechecked: dict[str, str] = {}  # name -> its digest checked before loading (and loaded)
        self.unexpanded: list[str] = []  # replayed names whose records are not filled in yet (refit_plan.expand)
        self.replay_left: str | None = None  # why this session stopped replaying its plan
        self.spec: dict[str, tuple] = {}  # name -> refit_plan.spec_of(tensor), when derive
        self.nbytes: dict[str, int] = {}  # name -> bytes delivered, when derive
        self.lazy_calls = 0
        self.redelivered = 0
        self.derived: dict[str, list[tuple[str, tuple]]] = {}  # name -> [(parameter, dest)] (see DERIVE_DEVICE_TYPES)
        self.derived_hex: dict[str, str] = {}  # name -> digest of the region it landed in (set by read-back)
        self.underived: dict[str, str] = {}  # name -> why its landed region could not be read back
        self.param_dtype: dict[str, torch.dtype] = {}  # parameter -> its dtype when it was written
        self.param_geometry: dict[str, tuple] = {}  # parameter -> (shape, stride, storage offset) at its last write
        self.where = "load_weights"  # outside sessions: what was running (e.g. "reload_weights")
        # every CUDA tensor is copied as it is handed over and the copies digested in batches
        # (CopyingBatch): no kernel launch per tensor, and what was digested is what it held then
        self.batch = CopyingBatch(WORKER_FLUSH_BYTES)  # delivered digests
        self.blocks = CopyingBatch(WORKER_FLUSH_BYTES)  # partial source blocks of exact placements, for read-back
        self.recheck = CopyingBatch(WORKER_FLUSH_BYTES)  # apply-time digests of deferred loads
        self.delivered: dict[str, _Delivered] = {}
        self.by_id: dict[int, _Delivered] = {}
        self.by_ptr: dict[int, list[_Delivered]] = {}
        self.calls = 0
        self.pulls = 0  # tensors pulled so far; a delivered tensor applied after a later pull may have been refilled
        self.tensors = 0
        self.bytes = 0
        self.digest_s = 0.0
        self.current: _Call | None = None
        self.unconsumed: list[str] = []
        self.unattributed: list[str] = []
        self.written: dict[str, dict[tuple, int]] = {}  # pname -> {dest region: numel written} (see covered)
        self.in_part: set[str] = set()  # written, not whole (filled by manifest(), ``allow`` or not)
        self.opaque: dict[str, str] = {}  # pname -> why which of its elements were written is unknown
        self.placed: dict[str, list[tuple[Copy, str | None, str]]] = {}  # pname -> [(copy, block key, source name)]
        self.inexact: dict[str, str] = {}  # pname -> why it cannot be proven bytewise
        self.unexplained: dict[str, str] = {}  # pname -> why its loader's output cannot be explained (a failure)
        self.assumed: dict[str, str] = {}  # pname -> why it is held to the bytes its loader was handed (placement.judged)
        self.aliases: dict[str, str] = {}  # tied parameter's other name -> the name the index uses (fold_aliases)
        self.param_numel: dict[str, int] = {}
        self.replicated: dict[str, bool] = {}  # pname -> written whole from one whole delivered tensor
        self.n_blocks = 0
        self.errors: list[str] = []
        self.refused: dict[str, tuple[str, str]] = {}  # name -> (digest of what arrived, why): checked first, never loaded
        self.withheld: dict[str, str] = {}  # delivered, but its layer was put back (a fused sibling was refused): never landed
        # judged by the engine state through the layout map at the close (boundary.layout.judge): names load_weights did not deliver
        self.by_state: dict[str, str] = {}  # name -> the trainer's digest (what its regions must hold; read-back compares)
        self.state_hex: dict[str, str] = {}  # name -> what its regions hold (the first that differs from the trainer's)
        self.state_where: dict[str, str] = {}  # name -> "parameter rows a:b" of its regions
        self.state_unwritten: dict[str, str] = {}  # name -> why it counts as not written (its regions are as the last close left them)
        self.not_provable: dict[str, str] = {}  # name -> why it cannot be judged by the state (no map entry, ...)
        self.state_padding: dict[str, str] = {}  # parameter -> its padding regions, counted written for names judged by the state
        self.layout: str | None = None  # what the close learned of the layout map (ModuleManifest.layout)
        self.region_hex: dict[tuple, str] = {}  # (parameter, dest) -> 32-hex of each region the read-back read
        # block key -> (its source region as a view of the delivered tensor, that tensor's shape), for a contiguous
        # delivered tensor: which slice of the trainer's tensor the block is (boundary.layout maps shards by it)
        self.block_src: dict[str, tuple[tuple, tuple[int, ...]]] = {}
        # judged by the state through slices (a shard): name -> [(parameter, dest, src geometry in the trainer's tensor, 32-hex
        # read now, equal to what the last close read there, the region and the slice as a report names them)]; the trainer
        # digests the slices and compares (trainer.slices)
        self.state_slices: dict[str, list[tuple[str, tuple, tuple, str, bool, str, str]]] = {}
        self.slice_params: set[str] = set()  # parameters holding such slices (read-back leaves those only they wrote to the trainer)
        # quantized on load (engine.quantized.settle): parameter -> (block key of what the engine's quantization
        # produced, source names, what quantized it); the close reads the engine's copy whole against it
        self.quantized: dict[str, tuple[str, list[str], str]] = {}
        self.read_early: set[str] = set()  # derived names read where they landed before their parameter was quantized
        # linear weights the engine handed to its GEMM kernel after loading (an empty parameter left): parameter ->
        # engine.forward.Probe; the close proves them through the layer's own forward
        self.forward: dict[str, Any] = {}

    # -- delivery ---------------------------------------------------------------------------

    def begin_call(self, lazy: bool = True) -> _Call:
        self.calls += 1
        self.lazy_calls += lazy
        self.current = _Call(self.calls, lazy)
        return self.current

    def end_call(self, call: _Call) -> None:
        if self.current is call:
            self.current = None
        t0 = time.perf_counter()
        for d, t in call.pending:
            if self.delivered.get(d.name) is not d:
                continue  # delivered again later in the call: the later one is what lands
            if d.regions and not d.other:
                self.derived[d.name] = list(d.regions)  # digested where it landed, at close
            else:
                self.derived.pop(d.name, None)
                if d.hex is None:  # else digested before loading
                    self.batch.add(d.name, t)
        call.pending.clear()
        self.digest_s += time.perf_counter() - t0
        for name in call.names:
            d = self.delivered.get(name)
            if d is None or d.routed or d.call != call.id:
                continue
            (self.unattributed if call.unattributed else self.unconsumed).append(name)

    def land_pending(self, pnames: set[str]) -> None:
        """Decide now, as :meth:`end_call` will, for the current call's tensors that landed whole and
        only in parameters ``pnames``: they are digested where they landed (``derived``), and that
        read happens before the engine replaces those parameters (quantized on load, inside this
        call: :func:`refit_verify.engine.quantized.settle`)."""
        cur = self.current
        if cur is None or not cur.pending:
            return
        keep = []
        for d, t in cur.pending:
            if self.delivered.get(d.name) is d and d.regions and not d.other and all(p in pnames for p, _ in d.regions):
                self.derived[d.name] = list(d.regions)
            else:
                keep.append((d, t))
        cur.pending[:] = keep

    @plain_tensor_ops
    def deliver(self, name: str, t: torch.Tensor, call: _Call, hexd: str | None = None) -> None:
        """Digest one delivered tensor (launched in stream order now; no reference is kept).

        ``hexd``: its digest, when the call's tensors were digested before the load (verify before load)."""
        t0 = time.perf_counter()
        if not isinstance(name, str):
            raise RefitProtocolError(f"load_weights was handed a name that is not a str: {name!r:.80}")
        old = self.delivered.get(name)
        if old is not None or name in self.replayed:  # a second delivery of a name: the later one is what lands
            if old is not None:
                self.by_id.pop(id(old.ref()), None)
            if name in self.replayed:  # its replayed write is recorded from the plan: the tap records the later one
                self._unplace(name)
                self.replayed.pop(name, None)
            self.derived.pop(name, None)
            self.redelivered += 1
        self.pulls += 1
        d = _Delivered(name, t, call.id, self.pulls, hexd)
        if self.derive:
            self.spec[name], self.nbytes[name] = spec_of(t), d.nbytes
        if self.derive and not call.lazy and ("cuda" if t.is_cuda else t.device.type) in _placement.DERIVE_DEVICE_TYPES:
            call.pending.append((d, t))  # a list's tensors stay as they are for the call
        elif hexd is None:
            self.batch.add(name, t)
        self.delivered[name] = d
        self.by_id[id(t)] = d
        cands = self.by_ptr.get(d.ptr)
        if cands is None:
            self.by_ptr[d.ptr] = [d]
        else:
            cands.append(d)
        call.names.append(name)
        self.tensors += 1
        self.bytes += d.nbytes
        self.digest_s += time.perf_counter() - t0

    def match(self, loaded: torch.Tensor) -> _Delivered | None:
        """The delivered tensor ``loaded`` is, or is a view of (None if it derives from none)."""
        d = self.by_id.get(id(loaded))
        if d is not None and d.ref() is loaded:
            return d
        cands = self.by_ptr.get(_storage_ptr(loaded))
        if not cands:
            return None
        lo, hi = _extent(loaded)
        for d in reversed(cands):
            if d.extent[0] <= lo and hi <= d.extent[1] and d.ref() is not None:
                return d
        return None

    def withhold(self, withheld: dict[str, str]) -> None:
        """Record delivered names that never landed (``{name: why}``: their layer was put back). A
        replayed one leaves the regions the plan says it wrote: nothing is read back for it and its
        parameters count as not written."""
        self.withheld.update(withheld)
        for name in withheld:
            if name in self.replayed:
                self._unplace(name)

    def _unplace(self, name: str) -> None:
        """Take back what the plan says replayed name ``name`` wrote (regions, placements, its read-back)."""
        self.expand()
        plan = self.plan or self.module.plan
        self.derived.pop(name, None)
        for pname, c, _key, _n in (plan.writes.get(name, ()) if plan is not None else ()):
            w = self.written.get(pname)
            if w is not None:
                w.pop(c.dest, None)
                if not w:
                    del self.written[pname]
            if pname in self.placed:
                self.placed[pname] = [e for e in self.placed[pname] if e[2] != name]

    def withhold_kept(self, kept: dict[str, str]) -> None:
        """Withhold the replayed names the plan says write into a parameter of ``kept`` (``{parameter:
        why}``: put back whole, so nothing of those names landed)."""
        self.expand()
        plan = self.plan or self.module.plan
        if plan is None or not self.replayed:
            return
        out = {}
        for name in self.replayed:
            hit = next((p for p, *_ in plan.writes.get(name, ()) if p in kept), None) if name not in self.withheld else None
            if hit is not None:
                out[name] = f"not applied: {hit} keeps the previous version ({kept[hit]}; a layer's parts land together or not at all)"
        if out:
            self.withhold(out)

    # -- loader callbacks -------------------------------------------------------------------

    def on_route(self, pname: str, loaded: torch.Tensor) -> None:
        d = self.match(loaded)
        if d is not None:
            d.routed = True
        elif self.current is not None:
            self.current.unattributed += 1

    def _applied(self, d: _Delivered) -> None:
        """Delivered tensor ``d`` was just written into a parameter: if another tensor was pulled from
        an iterator since it was (vLLM's layerwise reload deferring a layer), or its delivering call
        returned, its source may have been refilled since, so it is digested again now."""
        cur = self.current
        if cur is not None and cur.id == d.call and (d.seq == self.pulls or not cur.lazy):
            # applied right after it was pulled (nothing pulled since: an immediate write), or within
            # the list call that delivered it (a list's tensors stay as they are for the call)
            return
        tensor = d.ref()
        if tensor is None:
            return
        d.rechecked = True  # applied after the load_weights call that delivered it: digest it again now
        t0 = time.perf_counter()
        self.recheck.add(d.name, tensor)
        self.digest_s += time.perf_counter() - t0

    def on_write(self, pname: str, param: torch.Tensor, loaded: torch.Tensor, placement: Placement) -> None:
        """One weight-loader call wrote ``loaded`` into ``param`` as ``placement`` says: route it to its
        delivered tensor, check when it was applied (:meth:`_applied`) and record the write."""
        d = self.match(loaded)
        if d is not None:
            d.routed = True
            if not d.rechecked:
                self._applied(d)
        elif self.current is not None:  # transformed by the model's load_weights before its loader (a cast, a permute)
            self.current.unattributed += 1
        pshape, pstride = param.shape, param.stride()
        if pname not in self.param_numel:
            self.param_numel[pname] = param.numel()
            self.param_dtype[pname] = param.dtype
        self.param_geometry[pname] = (tuple(pshape), pstride, param.storage_offset())
        plan = _write_plan(placement, pshape, pstride, loaded.shape, loaded.stride())
        if plan.outside is not None:  # into another tensor of the same storage: not this parameter's bytes
            self.inexact.setdefault(pname, plan.outside)
            if d is not None:
                d.other = True
            return
        regions = self.written.get(pname)
        if regions is None:
            regions = self.written[pname] = {}
        regions.update(plan.regions)
        if placement.opaque:  # which elements it wrote is unknown: counted whole, and said so
            self.opaque.setdefault(pname, placement.why or "the loader writes it with an op that is not a copy")
        # changed in place since its delivery (the model's load_weights scaled or zeroed it before the
        # loader): the source blocks read now are not the delivered bytes, so nothing here is proven
        changed = d is not None and d.version is not None and version_of(loaded) != d.version
        if not placement.exact or changed:
            self.inexact.setdefault(pname, (placement.why or "not a plain copy") if not placement.exact else CHANGED_IN_PLACE)
            if placement.unexplained:
                self.unexplained.setdefault(pname, placement.why or "not a plain copy")
            if d is not None:
                d.other = True
            return
        if placement.assumed is not None:
            self.assumed[pname] = placement.assumed
        if d is None:
            self.inexact.setdefault(pname, "the loaded tensor is not (a view of) a delivered tensor")
            return
        self.replicated[pname] = plan.replicated
        t0 = time.perf_counter()
        placed = self.placed.get(pname)
        if placed is None:
            placed = self.placed[pname] = []
        itself = d.ref() is loaded
        for c, fill, whole in plan.copies:
            if fill:
                placed.append((c, None, d.name))
                continue
            if whole and itself:
                key = WHOLE + d.name  # the block is the delivered tensor itself: its own digest is the expected one
                d.regions.append((pname, c.dest))
            else:
                d.other = True
                self.n_blocks += 1
                key = f"{pname}#{self.n_blocks}"
                self.blocks.add(key, as_view(loaded, c.src))
                base = d.ref()
                if base is not None and base.is_contiguous():  # the block as a slice of the delivered tensor
                    shift = loaded.storage_offset() - base.storage_offset()
                    self.block_src[key] = ((c.src[0] + shift, c.src[1], c.src[2]), tuple(base.shape))
            placed.append((c, key, d.name))
        self.digest_s += time.perf_counter() - t0

    # -- close --------------------------------------------------------------------------------

    def fold_aliases(self, aliases: dict[str, str]) -> None:
        """Record writes under a tied parameter's other name as writes into that parameter under the
        name the model index uses (``aliases``: ``{other name: index name}``, e.g. ``{"lm_head.weight":
        "model.embed_tokens.weight"}``); keep ``aliases`` for :meth:`_tied`. Call once, at the close.

        vLLM's layerwise reload restores each module's parameters as copies of their own, so a tied
        ``lm_head.weight`` is written through its own copy, into the embeddings' memory."""
        self.aliases = aliases
        hit = [a for a in aliases if a in self.written or a in self.inexact or a in self.param_numel]
        for alias in hit:
            p = aliases[alias]
            if alias in self.written:
                self.written.setdefault(p, {}).update(self.written.pop(alias))
            if alias in self.placed:
                self.placed.setdefault(p, []).extend(self.placed.pop(alias))
            for rec in (self.inexact, self.unexplained, self.assumed, self.opaque, self.param_numel, self.param_dtype,
                        self.param_geometry, self.replicated):
                if alias in rec:
                    rec.setdefault(p, rec.pop(alias))
        if hit:
            for name, regions in self.derived.items():
                self.derived[name] = [(aliases.get(pn, pn), where) for pn, where in regions]
            for d in self.delivered.values():
                d.regions = [(aliases.get(pn, pn), where) for pn, where in d.regions]

    def _tied(self, digests: dict[str, str], allow: tuple[str, ...]) -> None:
        """Check the delivered names of each tied parameter (:meth:`fold_aliases`): the engine holds
        one tensor for them, so the names this session sent for it (loaded, or skipped by the model:
        vLLM loads one name of a tied pair) must carry equal bytes. A skipped name equal to a loaded
        one is consumed through the tie (taken out of ``unconsumed``); a difference, or a skipped
        name whose parameter nothing wrote, is an error naming them."""
        if not self.aliases:
            return
        role = self.module.role
        tied: dict[str, list[str]] = {}
        for alias, p in self.aliases.items():
            tied.setdefault(p, [p]).append(alias)
        unconsumed = set(self.unconsumed)
        for p, names in tied.items():
            sent = [n for n in names if n in digests]
            skipped = [n for n in sent if n in unconsumed]
            placed = [src for c, _key, src in self.placed.get(p, ()) if not c.fill and src in digests]
            loaded = list(dict.fromkeys(placed + [n for n in sent if n not in unconsumed]))
            if not skipped and len(loaded) < 2:
                continue
            hexes = {n: digests[n] for n in loaded + skipped}
            if len(set(hexes.values())) > 1:
                holds = (f"the model loaded {', '.join(loaded)} and skipped {', '.join(skipped)}: the engine holds "
                         f"{' / '.join(loaded)} for all" if skipped else "the engine holds one of them for all (read-back "
                         "names the parameter)")
                self.errors.append(f"{role}: {', '.join(names)} are one tensor in the engine (tied), and this refit sent "
                                   "them with different bytes (" + ", ".join(f"{n} {h}" for n, h in hexes.items())
                                   + f"); {holds}")
            elif loaded:
                self.unconsumed = [n for n in self.unconsumed if n not in skipped]
            elif p not in self.written and not all(match_any(n, allow) for n in skipped):
                self.errors.append(f"{role}: {', '.join(skipped)} is tied to {p} in the engine; the model skipped it (vLLM "
                                   f"loads one name of a tied pair) and nothing wrote {p} in this session: the engine "
                                   "keeps its previous bytes, not the ones sent")

    @property
    def replayed_all(self) -> bool:
        """True iff this session replayed its plan from the first call to the close, every name of
        it (nothing was watched): the regions written are the plan's, as in every such session."""
        return self.plan is not None and not self.delivered and len(self.replayed) == len(self.plan)

    def digests(self) -> dict[str, str]:
        """``{name: 32-hex}`` of what was delivered (pre-checked or digested as pulled) and of what was
        refused before loading (the digest of what arrived: the verdict names it mismatched); a
        withheld name (delivered, never landed) is left out."""
        pulled = self.batch.hexdigests()
        out: dict[str, str] = {}
        for name, d in self.delivered.items():
            if name in self.derived:  # landed whole: what the engine holds where it landed (None: unread)
                h = self.derived_hex.get(name)
            elif d.hex is not None:  # checked before loading
                h = d.hex
            else:
                h = pulled.get(name)
            if h is not None and name not in self.withheld:
                out[name] = h
        for name in self.replayed:  # from the plan: what the engine holds where it lands (None: unread)
            h = self.derived_hex.get(name)
            if h is not None and name not in self.withheld:
                out[name] = h
        for name, (h, _why) in self.refused.items():
            out.setdefault(name, h)
        for name, h in self.state_hex.items():  # judged by the state: what the engine holds where the layout map puts it
            out.setdefault(name, h)
        return out

    def expand(self, whole: bool = False) -> None:
        """Fill in the records of the names replayed since the last call (:func:`refit_plan.expand`);
        ``whole``: the session is closing."""
        if self.unexpanded and self.plan is not None:
            expand(self, self.plan, whole)

    @plain_tensor_ops
    def landed_now(self) -> dict[str, str]:
        """``{name: 32-hex}`` of the tensors left to read-back, read where they landed, now (the check
        of a session still open: vLLM's native update before ``finish_weight_update``). A region that
        cannot be read is left out (missing in that check; the close names it).

        The parameters are walked here, apart from the module's model index: inside an open update
        vLLM's layerwise reload is swapping them, and the index (with what the close keeps on it,
        :mod:`refit_verify.engine.state`) stays the one taken outside updates."""
        self.expand()
        model = self.module.model
        todo = [n for n in self.derived if n not in self.derived_hex]
        if model is None or not todo:
            return {}
        live = dict(model.named_parameters())
        regions = tuple((name, i, pname, where, self.param_dtype.get(pname)) for name in todo for i, (pname, where) in enumerate(self.derived[name]))
        got = self._landed_kept(regions, live)
        if got is None:
            items, params, wheres = [], [], []
            for name, i, pname, where, _ in regions:
                p = live.get(pname)
                if p is None or p.dtype != self.param_dtype.get(pname, p.dtype):
                    continue
                try:
                    view = as_view(p.detach(), where)
                    check_tensor(view)
                except (RuntimeError, ValueError):
                    continue
                items.append((f"{i}:{name}", view))
                params.append(p.detach())
                wheres.append(where)
            whole = True
            try:  # read at once, nothing in between
                got = digest_now(items, space="landed now")
            except (RuntimeError, ValueError):  # one region cannot be read after all: each on its own, that one left out
                got, whole = _each_readable(items), False
            self.module.landed_kept = None
            if whole and len(items) == len(regions):  # every region read: the same regions of the same memory next time are a kept set
                try:
                    self.module.landed_kept = (regions, DigestSet(params, wheres, hold=False))
                except (RuntimeError, ValueError):  # a region the kept set cannot read in place: the general path each time
                    pass
        out = {}
        for name in todo:  # every region it landed in must hold the same bytes, else it is left out
            hexes = {got.get(f"{i}:{name}") for i in range(len(self.derived[name]))}
            if len(hexes) == 1 and None not in hexes:
                out[name] = hexes.pop()
        return out

    def _landed_kept(self, regions: tuple, live: dict[str, torch.Tensor]) -> dict[str, str] | None:
        """:meth:`landed_now`'s digests through the kept set of the last check, or None (taken the
        general way then): only when this check reads the same regions (names, parameters,
        geometries and loaded dtypes, in the same order) and every parameter still has the signature the set was
        built on (same memory, shape, strides, dtype, storage: every region view still shows its
        parameter's bytes). One signature per region, one launch."""
        kept = self.module.landed_kept
        if kept is None or kept[0] != regions:
            return None
        ts = [live.get(pname) for _, _, pname, _, _ in regions]
        if any(t is None for t in ts):
            return None
        ts = [t.detach() for t in ts]
        hexes = kept[1].digest(tensors=ts)
        if hexes is None:
            return None
        return {f"{i}:{name}": h for (name, i, *_), h in zip(regions, hexes)}

    def _slices_note(self, pname: str, p: torch.Tensor, regions: dict[tuple, int]) -> str:
        """For a stacked parameter (3 or more dims: a fused-MoE ``w13_weight`` / ``w2_weight``, one
        expert per index of dim 0) written in part: ``"dim-0 slices [2, 5] not written whole; "``,
        which experts the refit left stale (at most 16 listed); else ``""``."""
        shape, stride, _off = self.param_geometry.get(pname) or (tuple(p.shape), tuple(p.stride()), 0)
        if len(shape) < 3:
            return ""
        idx = unwritten_slices(regions, shape, stride)
        if not idx:
            return ""
        shown = ", ".join(map(str, idx[:16])) + (", …" if len(idx) > 16 else "")
        return f"dim-0 slices [{shown}] not written whole; "

    def manifest(self, params: dict[str, torch.Tensor], allow: Iterable[str]) -> ModuleManifest:
        t0 = time.perf_counter()
        digests = self.digests()
        allow = tuple(allow)
        self._tied(digests, allow)
        changed = []
        if len(self.recheck):
            for name, h in self.recheck.hexdigests().items():
                if digests.get(name) != h:
                    changed.append(name)
        unwritten = []
        written = 0
        hint = self.module.numel_hint
        kept = self.plan.covered if self.replayed_all else None
        for pname, p in params.items():
            total = self.param_numel.get(pname) or max(p.numel(), hint.get(pname, 0))
            w = self.written.get(pname)
            if w is None:
                got = 0
            elif kept is None:
                got = min(total, covered(w))
            else:
                c = kept.get(pname)
                if c is None:
                    c = kept[pname] = covered(w)
                got = min(total, c)
            if got >= total:
                written += 1
                continue
            if got:
                self.in_part.add(pname)
            if not match_any(pname, allow):
                unwritten.append(pname if got == 0 else f"{pname} ({self._slices_note(pname, p, w)}{got} of {total} elements)")
        for name in self.derived:
            if name not in self.derived_hex and name not in self.withheld:
                why = self.underived.get(name, "the read-back did not run")
                self.errors.append(f"{self.module.role}: {name} was copied whole into the engine and is proven only where it "
                                   f"landed, which could not be read back ({why}): neither its delivery nor the engine's copy "
                                   "is proven")
        self.digest_s += time.perf_counter() - t0
        return ModuleManifest(
            digests=digests, params=len(params), written=written,
            unconsumed=[n for n in self.unconsumed if not match_any(n, allow)],
            unattributed=list(self.unattributed), unwritten=unwritten, changed_after_delivery=changed,
            coverage_unknown={n: w for n, w in self.opaque.items() if n in params},
            calls=self.calls, bytes=self.bytes, digest_s=self.digest_s,
            in_place=[n for n in self.derived if n in digests],
            replayed=len(self.replayed), replay_left=self.replay_left,
            by_state=dict(self.state_where), not_provable=dict(self.not_provable), layout=self.layout,
            state_padding=dict(self.state_padding), state_slices=self._state_slices())

    def _state_slices(self) -> dict[str, list[StateSlice]]:
        """:attr:`state_slices` as the manifest carries them (regions named as a report names them)."""
        return {name: [StateSlice(param=p, region=where, src=(src[0], list(src[1]), list(src[2])), slice=what, hex=h,
                                  bytes=_numel(g[1]) * self.param_dtype[p].itemsize, unchanged=same)
                       for p, g, src, h, same, where, what in regions]
                for name, regions in self.state_slices.items()}


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _each_readable(items: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """``{key: 32-hex}`` of the ``(key, tensor)`` pairs a :class:`DigestBatch` takes; the others left out."""
    batch = DigestBatch(hold_cpu=True)
    for key, t in items:
        try:
            batch.add(key, t)
        except (RuntimeError, ValueError):
            continue
    if not len(batch):
        return {}
    try:
        return batch.hexdigests()
    except (RuntimeError, ValueError):  # one the launch reads raised (a queued one): each in a batch of its own
        out = {}
        for key, t in items:
            try:
                out[key] = tensor_digest(t)
            except (RuntimeError, ValueError):
                continue
        return out
