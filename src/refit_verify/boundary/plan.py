"""Plan replay: a steady-state refit verified without the loader tap.

An RL trainer refits the same names, shapes and dtypes every step, and vLLM's loaders put each
tensor in the same place every time. After a session of one model module in which every
delivered tensor came in a list, was copied whole and exactly into parameter regions (no shard,
no conversion, no padding of its own) and nothing else happened (no name skipped, refused,
delivered twice or transformed, no error, every landed region read back), the module keeps that
session's :class:`RefitPlan`: for each name, its tensor's type, shape, strides, dtype and device,
and the parameter regions it landed in. The next session on the same model index **replays** it:
the :class:`~refit_verify.boundary.placement.LoaderTap` stays off, each list handed to ``load_weights`` is
checked against the plan (every name known, none delivered yet in this session, same geometry)
and recorded with the plan's regions, and the read-back at close digests those regions, as it
does after a session the tap watched (:data:`~refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`).
The first session replays a plan learned dry at engine start (:func:`learn_dry`), its close audit
against the engine state read then (``WorkerBoundary.start``).

Why a replayed session proves what a watched one does:

* the digest a replayed name gets is read from the engine region where the plan says it lands,
  and the trainer compares it with its own digest of what it sent: equal means the engine holds
  the trainer's bytes there, whatever the loader did this time. A loader that skipped the name,
  put it elsewhere or wrote something else there leaves other bytes (the previous version, another
  tensor's): a mismatch, unless the bytes there equal the trainer's anyway (then the engine holds
  the trainer's bytes);
* a write into a parameter the plan does not name is seen by the close's engine-state snapshot:
  a parameter no session write covers that changed since the last close is reported
  (:data:`~refit_verify.manifest.CLOSE_AUDIT`). Replay is therefore used only where the worker
  takes that snapshot;
* anything the plan does not describe ends the replay for the rest of the session before the
  call runs: a name outside the plan or delivered twice, another geometry, an iterator, a tensor
  refused by the check before loading (our transport sends its digests ahead of the bytes: each
  call is checked first, then replayed when nothing was refused). That call and the later ones
  are watched by the tap as usual; the manifest says why (``ModuleManifest.replay_left``).

What replay gives up is diagnosis, not detection: a mismatch in a replayed session does not tell
a corrupted delivery from a misplaced write, so the trainer's next session after a failed one is
watched again (``replay=False`` in its open) and relearns the plan. ``REFIT_VERIFY_REPLAY=0`` in a
worker's environment turns replay off there.

Nothing here imports vLLM.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import torch

from refit_verify.boundary import placement as _placement  # its DERIVE_DEVICE_TYPES read at each use (tests widen it)
from refit_verify.errors import RefitConfigError

__all__ = ["REPLAY_ENV_VAR", "RefitPlan", "expand", "learn", "learn_dry", "replay_call", "replay_from_env", "spec_of"]

REPLAY_ENV_VAR = "REFIT_VERIFY_REPLAY"


def replay_from_env(environ: Any = None) -> bool:
    """Whether plan replay is on in this process: ``REFIT_VERIFY_REPLAY`` unset or ``1`` (on), ``0`` (off).

    Raises:
        RefitConfigError: any other value.
    """
    v = (os.environ if environ is None else environ).get(REPLAY_ENV_VAR)
    if v is None or v == "1":
        return True
    if v == "0":
        return False
    raise RefitConfigError(f"{REPLAY_ENV_VAR}={v!r} is not accepted; accepted values: '0' (off), '1' (on, the default)")


def spec_of(t: torch.Tensor) -> tuple:
    """What a delivered tensor must match to be replayed: (type, shape, strides, dtype, device).
    The caller runs on plain tensor ops (:func:`~refit_verify.digest.tensors.plain_tensor_ops`)."""
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


class RefitPlan:
    """Where one module's loads put each delivered tensor (learned from a watched session).

    Attributes:
        index: a weak reference to the :class:`~refit_verify.boundary.model_index.ModelIndex` it was learned
            on (identity: a rebuilt index, i.e. a model whose parameters changed, ends the plan; the
            plan keeps no parameter alive).
        spec: ``{name: spec_of(tensor)}``.
        nbytes: ``{name: bytes delivered}``.
        writes: ``{name: ((parameter, Copy, block key, numel), ...)}``: every placed write of that name.
        regions: ``{name: [(parameter, dest geometry)]}``: where it landed whole (read back at close).
        params: ``{parameter: (numel, dtype, (shape, stride, storage offset), written whole from one tensor)}``.
        covered: ``{parameter: elements written}`` by a session that replayed every name of the plan
            (the same regions every time), filled by the first such session's manifest.
        order: the names in the order the watched session delivered them.
    """

    __slots__ = ("_whole", "covered", "index", "nbytes", "order", "params", "regions", "spec", "writes")

    def __init__(self, index: Any, spec: dict, nbytes: dict, writes: dict, regions: dict, params: dict) -> None:
        self.index = weakref.ref(index) if index is not None else (lambda: None)
        self.spec, self.nbytes = spec, nbytes
        self.writes, self.regions, self.params = writes, regions, params
        self.covered: dict[str, int] = {}
        self.order = tuple(spec)
        self._whole: dict[str, Any] | None = None

    def __len__(self) -> int:
        return len(self.spec)


def learn(ms: Any, index: Any) -> tuple[RefitPlan | None, str]:
    """The plan of closed session ``ms`` (read back already), or ``(None, why not)``."""
    why = _unlearnable(ms)
    if why is not None:
        return None, why
    names = list(ms.delivered) + [n for n in ms.replayed if n not in ms.delivered]
    writes: dict[str, list] = {n: [] for n in names}
    for pname, entries in ms.placed.items():
        for c, key, src in entries:
            writes[src].append((pname, c, key, c.numel()))
    params = {p: (ms.param_numel[p], ms.param_dtype[p], ms.param_geometry[p], ms.replicated.get(p, False)) for p in ms.written}
    regions = {n: list(ms.derived[n]) if n in ms.derived else list(ms.delivered[n].regions) for n in names}
    spec = {n: ms.spec[n] for n in names}
    nbytes = {n: ms.nbytes[n] for n in names}
    return RefitPlan(index, spec, nbytes, {n: tuple(w) for n, w in writes.items()}, regions, params), ""


def learn_dry(ms: Any, index: Any, failed: dict[str, str]) -> tuple[RefitPlan | None, str]:
    """The plan of a dry learn's record ``ms`` (:func:`~refit_verify.boundary.layout.dry_learn`: the
    model's ``load_weights`` on contiguous placeholders on its device, every write blocked) for
    the first session to replay, or ``(None, why not)``.

    A name enters it only where a watched session's plan would hold it: learned (not in
    ``failed``), consumed by a loader, copied whole and exactly into regions of parameters of
    ``index`` (by their index names, whose dtype and geometry the record saw), on a device type of
    :data:`~refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`, into parameters nothing inexact
    or opaque wrote. Other names are left out: delivered in a session, they end its replay before
    their call runs. Its replay is proven as any other's (the close's read-back of the plan's
    regions; the close audit against the state read when the plan was learned)."""
    if ms.errors:
        return None, "the dry learn recorded errors"
    params = index.params
    bad_params = set(ms.inexact) | set(ms.opaque) | set(ms.unexplained)
    skipped = set(ms.unconsumed) | set(ms.unattributed) | set(failed)
    by_name: dict[str, list] = {}
    for pname, entries in ms.placed.items():
        for c, key, src in entries:
            by_name.setdefault(src, []).append((pname, c, key))
    names = []
    for name, d in ms.delivered.items():
        sp = ms.spec.get(name)
        placed = by_name.get(name, ())
        if (name in skipped or sp is None or sp[4].type not in _placement.DERIVE_DEVICE_TYPES or d.other or not d.regions
                or not placed):
            continue
        ok = True
        for pname, c, key in placed:
            live = params.get(pname)
            if (live is None or pname in bad_params or (c.fill and c.value is None) or (not c.fill and key != _placement.WHOLE + name)
                    or ms.param_dtype.get(pname) != live.dtype or ms.param_numel.get(pname) != live.numel()
                    or ms.param_geometry.get(pname) != (tuple(live.shape), live.stride(), live.storage_offset())):
                ok = False
                break
        if ok:
            names.append(name)
    if not names:
        return None, "the dry learn placed no name whole and exactly"
    keep = set(names)
    writes: dict[str, list] = {n: [] for n in names}
    for pname, entries in ms.placed.items():
        for c, key, src in entries:
            if src in keep:
                writes[src].append((pname, c, key, c.numel()))
    written = {p for n in names for p, *_ in writes[n]}
    plan_params = {p: (ms.param_numel[p], ms.param_dtype[p], ms.param_geometry[p], ms.replicated.get(p, False)) for p in written}
    regions = {n: list(ms.delivered[n].regions) for n in names}
    spec = {n: ms.spec[n] for n in names}
    nbytes = {n: ms.delivered[n].nbytes for n in names}
    return RefitPlan(index, spec, nbytes, {n: tuple(w) for n, w in writes.items()}, regions, plan_params), ""


def _unlearnable(ms: Any) -> str | None:
    checks = (
        (not ms.sessioned or not ms.derive, "the session's read-back did not run"),
        (bool(ms.errors), "the session recorded errors"),
        (bool(ms.refused or ms.withheld), "a tensor was refused or withheld"),
        (bool(ms.inexact or ms.opaque), "a parameter was written by a conversion, a shard or an op that is not a copy"),
        (bool(getattr(ms, "quantized", None) or getattr(ms, "read_early", None)), "a layer was quantized on load"),
        (bool(getattr(ms, "forward", None)), "a linear weight was handed to its GEMM kernel after loading"),
        (bool(ms.unconsumed or ms.unattributed), "a delivered tensor was skipped or transformed by the model"),
        (ms.n_blocks > 0, "a delivered tensor was copied in part (a shard or a block)"),
        (ms.lazy_calls > 0, "a load_weights call was handed an iterator"),
        (ms.redelivered > 0, "a name was delivered twice"),
        (bool(ms.underived), "a landed region could not be read back"),
        (not ms.delivered and not ms.replayed, "nothing was delivered"),
    )
    for bad, why in checks:
        if bad:
            return why

    for name, d in ms.delivered.items():
        if name not in ms.spec or ms.spec[name][4].type not in _placement.DERIVE_DEVICE_TYPES:
            return f"{name} is on a device whose landed regions are not read back in place (placement.DERIVE_DEVICE_TYPES)"
        if d.other or not d.regions:
            return f"{name} was not copied whole and exactly into the engine"
    for entries in ms.placed.values():
        for c, key, src in entries:
            if not c.fill and key != _placement.WHOLE + src:
                return "a parameter region was written from part of a delivered tensor"
    return None


def replay_call(ms: Any, plan: RefitPlan, weights: list | tuple) -> str | None:
    """Record one ``load_weights`` list of a replayed session from the plan; return None, or why the
    plan does not describe it (then nothing is recorded and the call is watched as usual).

    Per tensor: its name is a name of the plan not replayed yet in this session, and its
    :func:`spec_of` is the plan's. Only the names are recorded here (``ms.replayed``); what the plan
    says they wrote is filled in by :func:`expand` before anything reads it. The caller runs on
    plain tensor ops."""
    spec, seen = plan.spec, ms.replayed
    n = len(weights)
    for item in weights:
        if type(item) is not tuple or len(item) != 2:
            return "load_weights was handed an item that is not a (name, tensor) pair"
        name, t = item
        s = spec.get(name) if isinstance(name, str) else None
        if s is None:
            return f"{name!r:.120} is not a name of the plan"
        if name in seen:
            return f"{name} was delivered twice"
        if not isinstance(t, torch.Tensor) or spec_of(t) != s:
            return f"{name} came with another type, shape, strides, dtype or device than the plan's"
    if n > 1 and len({item[0] for item in weights}) != n:
        return "a name was delivered twice in one load_weights call"
    names = [item[0] for item in weights]
    seen.update(dict.fromkeys(names))
    ms.unexpanded.extend(names)  # the names themselves: a concurrent expand (an open-update check) takes what is there
    return None


def expand(ms: Any, plan: RefitPlan, whole: bool = False) -> None:
    """Fill in what the plan says the names :func:`replay_call` recorded since the last expand wrote
    (coverage, placements, landed regions, geometry, counts), as a watched session records them.

    ``whole``: the session is closing; when it replayed every name of the plan in the plan's order
    and recorded nothing else, the plan's records are taken as a whole (:meth:`RefitPlan` keeps
    them after the first such session), not name by name."""
    queue = ms.unexpanded  # taken from, never swapped: a replaying thread may be adding to it right now
    n = len(queue)
    if not n:
        return
    names = queue[:n]
    del queue[:n]
    if whole and len(names) == len(plan) and not ms.written and not ms.delivered and tuple(names) == plan.order:
        w = plan._whole
        if w is None:
            scratch = _Scratch()
            _expand_names(scratch, plan, names)
            w = plan._whole = vars(scratch)
        ms.written, ms.placed, ms.derived = dict(w["written"]), dict(w["placed"]), dict(w["derived"])
        ms.spec, ms.nbytes = dict(w["spec"]), dict(w["nbytes"])
        ms.param_numel, ms.param_dtype = dict(w["param_numel"]), dict(w["param_dtype"])
        ms.param_geometry, ms.replicated = dict(w["param_geometry"]), dict(w["replicated"])
        ms.tensors += w["tensors"]
        ms.bytes += w["bytes"]
        return
    _expand_names(ms, plan, names)


class _Scratch:
    """The records of a whole replay, filled once per plan (:func:`expand`; read, never changed)."""

    def __init__(self) -> None:
        self.written: dict = {}
        self.placed: dict = {}
        self.derived: dict = {}
        self.spec: dict = {}
        self.nbytes: dict = {}
        self.param_numel: dict = {}
        self.param_dtype: dict = {}
        self.param_geometry: dict = {}
        self.replicated: dict = {}
        self.tensors = 0
        self.bytes = 0


def _expand_names(ms: Any, plan: RefitPlan, names: list[str]) -> None:
    written, placed, derived, regions = ms.written, ms.placed, ms.derived, plan.regions
    params, numel = plan.params, ms.param_numel
    for name in names:
        for pname, c, key, n in plan.writes[name]:
            w = written.get(pname)
            if w is None:
                w = written[pname] = {}
                p = params[pname]
                numel[pname], ms.param_dtype[pname], ms.param_geometry[pname], ms.replicated[pname] = p
                placed[pname] = []
            w[c.dest] = n
            placed[pname].append((c, key, name))
        derived[name] = regions[name]
        ms.spec[name] = plan.spec[name]
        ms.nbytes[name] = nb = plan.nbytes[name]
        ms.tensors += 1
        ms.bytes += nb
