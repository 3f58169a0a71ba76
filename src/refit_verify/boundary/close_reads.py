"""One close's reads of engine memory: one pass where the regions to read are known before it.

A session's close reads the engine for three things: the engine-state snapshot (every parameter
and persistent buffer whole: the audit baseline, the close audit, the certificate), the read-back
(each region a loader wrote, in the engine's layout) and, for announced names no ``load_weights``
delivered, the layout map's regions (:func:`refit_verify.boundary.layout.judge`; a delta's other
regions too). A region that is a whole parameter takes the snapshot's digest. A region inside a
parameter (``q_proj`` rows of a fused ``qkv_proj``) has another digest than its parameter (digest
v1 binds shape and byte length, ``docs/digest-spec.md`` §3), so it must be read itself: the close
plans those regions before anything is read (:class:`CloseReads`), the snapshot reads them in its
own launch, beside the state, and the later steps take their digests from it. On a kernel device
(CUDA) a region at a 512 KiB multiple of its parameter (the rows of a fused parameter in typical
shapes) reads no byte twice: its whole 512 KiB superblocks take the parameter's leaf outputs
(``digest.kernels.launch.plan_views(derive=True)``) and only a partial last one is read again; the
CPU's compiled batch (small engines) reads each region again. :attr:`CloseReads.nbytes` counts the
bytes read. Every byte is read
after the session ended (the close holds the worker's lock; nothing is written in between), so no
digest precedes the bytes it covers.

What the close could not read in that pass (the snapshot failed, a region no step planned, a
region a kept set cannot read: not contiguous) is read by the step that needs it, as another
pass, said in the manifest (:class:`~refit_verify.manifest.EngineReads`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from refit_verify.digest.batch import DigestBatch
from refit_verify.manifest import EngineReads

__all__ = ["ONE_PASS", "CloseReads", "RegionBatch", "map_regions", "session_regions"]

ONE_PASS = True
"""False: the close plans nothing ahead, and each step reads its regions in its own pass (the
behaviour before one-pass closes; benchmarks compare the two in one process)."""


def _geometry(g: Any) -> tuple:
    """A region ``(element offset, shape, strides)`` as hashable ints."""
    return (int(g[0]), tuple(int(x) for x in g[1]), tuple(int(x) for x in g[2]))


def _whole(p: torch.Tensor, g: tuple) -> bool:
    return g[0] == 0 and g[1] == tuple(p.shape) and g[2] == tuple(p.stride())


class CloseReads:
    """The reads of one close: what the state's pass reads beside the state, what it got, and every pass.

    Attributes:
        planned: ``{role: [(parameter name, region)]}`` to read in the snapshot's launch (regions
            that are not whole parameters; whole ones take the snapshot's digests).
        got: ``{(id(parameter tensor), region): 32-hex}`` read in the snapshot's launch; a step
            takes a region from here (:meth:`take`) instead of reading it again. Keyed by the live
            tensor (the model index holds it for the whole close).
        passes, nbytes, state_bytes, why: as :class:`~refit_verify.manifest.EngineReads`.
    """

    __slots__ = ("_whole", "got", "nbytes", "passes", "pending", "planned", "stated", "state_bytes", "states", "why")

    def __init__(self) -> None:
        self.planned: dict[str, list[tuple[str, tuple]]] = {}
        self.pending: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}  # role -> (module session, live): planned on demand
        self.got: dict[tuple[int, tuple], str] = {}
        self.states: list[tuple[list[torch.Tensor], list[str]]] = []  # (state tensors, their digests) the snapshot read
        self._whole: dict[int, str] | None = None  # id(state tensor) -> its digest, made from ``states`` at the first need
        self.passes = self.nbytes = self.state_bytes = 0
        self.stated = False  # the snapshot's pass was counted
        self.why: list[str] = []

    def plan(self, role: str, regions: Iterable[tuple[str, Any]]) -> None:
        """Add ``regions`` (``(parameter name, (offset, shape, strides))``) of module ``role`` to the state's pass."""
        if not ONE_PASS:
            return
        have = self.planned.setdefault(role, [])
        seen = set(have)
        for pname, g in regions:
            r = (pname, _geometry(g))
            if r not in seen:
                seen.add(r)
                have.append(r)

    def plan_session(self, role: str, ms: Any, live: dict[str, torch.Tensor]) -> None:
        """Plan the regions module session ``ms``'s read-back will read (:func:`session_regions`), when
        the snapshot asks for them (:meth:`regions`: not when it reads a kept read-back program's)."""
        if ONE_PASS:
            self.pending[role] = (ms, live)

    def regions(self, role: str) -> list[tuple[str, tuple]]:
        """The regions of module ``role`` planned for the state's pass."""
        pend = self.pending.pop(role, None)
        if pend is not None:
            self.plan(role, session_regions(*pend))
        return self.planned.get(role, [])

    def state_pass(self, state_bytes: int, region_bytes: int) -> None:
        """Count the snapshot's read: ``state_bytes`` of state, ``region_bytes`` of regions beside it.
        Every module's launch of one snapshot is one pass."""
        if not self.stated:
            self.stated = True
            self.passes += 1
        self.state_bytes += state_bytes
        self.nbytes += state_bytes + region_bytes

    def other_pass(self, nbytes: int, why: str) -> None:
        """Count a read after (or without) the state's pass: ``nbytes`` read, and why they were not read with the state."""
        self.passes += 1
        self.nbytes += nbytes
        self.why.append(why[:300])

    def take(self, p: torch.Tensor, g: Any) -> str | None:
        """The digest of region ``g`` of live parameter ``p`` read in the state's pass (a region
        planned beside the state, or the whole parameter: its state digest), or None."""
        g = _geometry(g)
        h = self.got.get((id(p), g)) if self.got else None
        if h is None and self.states and _whole(p, g):
            if self._whole is None:
                self._whole = {id(t): x for ts, hexes in self.states for t, x in zip(ts, hexes)}
            h = self._whole.get(id(p))
        return h

    def summary(self) -> EngineReads:
        return EngineReads(passes=self.passes, bytes=self.nbytes, state_bytes=self.state_bytes, why=list(self.why))


def session_regions(ms: Any, live: dict[str, torch.Tensor]) -> list[tuple[str, tuple]]:
    """The regions the read-back of module session ``ms`` will read that are not whole parameters
    (``live``: ``{name: parameter}``): each region a delivered block was copied into, in the
    parameters written, each region a loader filled (padding: read back against its fill), and
    each region a name digested where it landed was copied into."""
    out: dict[tuple[str, tuple], None] = {}
    skip = set(ms.inexact) | set(getattr(ms, "unexplained", ())) | set(getattr(ms, "quantized", None) or ())
    for pname in ms.written:
        p = live.get(pname)
        if p is None or pname in skip:
            continue
        for copy, _key, _src in ms.placed.get(pname, ()):
            g = _geometry(copy.dest)
            if not _whole(p, g):
                out[(pname, g)] = None
    for regions in ms.derived.values():
        for pname, where in regions:
            p = live.get(pname)
            if p is not None and pname not in skip:
                g = _geometry(where)
                if not _whole(p, g):
                    out[(pname, g)] = None
    return list(out)


def map_regions(m: Any, names: Iterable[str], live: dict[str, torch.Tensor]) -> list[tuple[str, tuple]]:
    """The regions layout map ``m`` puts ``names`` in (whole copies and slices) that are not whole parameters."""
    out: list[tuple[str, tuple]] = []
    slices = getattr(m, "slices", None) or {}
    for name in names:
        regions = m.entries.get(name)
        if regions is None and name in slices:
            regions = [(pname, g) for pname, g, *_src in slices[name]]
        for pname, g in regions or ():
            p = live.get(pname)
            if p is not None and not _whole(p, _geometry(g)):
                out.append((pname, g))
    return out


class RegionBatch:
    """A :class:`~refit_verify.digest.batch.DigestBatch` (``hold_cpu``) of regions of live parameters
    that takes each region the close's state pass read (:meth:`CloseReads.take`) from there and reads
    the rest itself, counted as another pass of ``reads`` (``what`` reads it). ``reads`` None: a
    plain batch."""

    __slots__ = ("batch", "nbytes", "reads", "taken", "what")

    def __init__(self, reads: CloseReads | None, what: str) -> None:
        self.batch = DigestBatch(hold_cpu=True)
        self.reads, self.what = reads, what
        self.taken: dict[Any, str] = {}
        self.nbytes = 0

    def add(self, key: Any, view: torch.Tensor, checked: bool = False, of: tuple[torch.Tensor, Any] | None = None) -> None:
        """Queue ``view`` under ``key``; ``of``: ``(parameter, region)`` it shows, taken from the state pass when read there."""
        if of is not None and self.reads is not None:
            h = self.reads.take(*of)
            if h is not None:
                self.taken[key] = h
                return
        self.batch.add(key, view, checked=checked)
        self.nbytes += view.numel() * view.element_size()

    def __len__(self) -> int:
        return len(self.batch) + len(self.taken)

    def hexdigests(self) -> dict[Any, str]:
        out = self.batch.hexdigests() if len(self.batch) else {}
        if len(self.batch) and self.reads is not None:
            r = self.reads
            why = ("one-pass closes are off" if not ONE_PASS else "the engine-state snapshot did not run or failed"
                   if not r.stated else "not planned before the snapshot, or not readable in its launch (not contiguous)")
            r.other_pass(self.nbytes, f"{self.what}: {len(self.batch)} regions ({self.nbytes} bytes) read after the state's "
                                      f"pass: {why}")
        if self.taken:
            out.update(self.taken)
        return out
