"""Triton kernels for digest v1: many tensors per call, <= 4 launches, no host synchronisation.

Work split (all views of one call share each launch; kernels in ``_leaf.py`` and ``_upper.py``,
the arithmetic in ``_mix.py``):

* **leaf**: fold levels 0 and 1 of every chunk straight from the lanes, <= 4096 values per chunk
  and channel. Launched twice: the FAST launch (``_leaf_fast_kernel``, ``FAST_LEAF``) for aligned,
  tail-free programs of big chunks (the bulk), the general launch (``_digest_leaf_kernel``,
  ``LEAF_WARPS``) for the rest (funnel-shift loader, small chunks, one-lane chunks).
* **gather** (only with derived views, ``plan_views(derive=True)``): a view inside another view
  of the launch at a 512 KiB multiple (a region of a fused parameter read beside the parameter)
  takes its full superblocks' leaf outputs from that view's, so those bytes are read once (``_plan``).
* **upper** (one program per chunk): the remaining <= 3 fold levels, down to the chunk root.
* **chain** (one program per view): chunk chain from the metadata seed and the two finalisation mixes.

The FAST launch can be replaced for measurements (``_launch(..., fast=...)``): the variants it was
chosen from live in ``benchmarks/digest_variants.py`` (timed by ``benchmarks/bench_variants.py``).

Host work per call: one pass over the views (address, length), a plan (one numba call; numpy with
derived views: ``_plan``) and one pinned host-to-device copy of it (memoised per view set), <= 4
launches (a gather launch more with derived views).

Lanes are loaded as 64-bit words. Views that start off an 8-byte boundary, and the program that
holds a view's partial last lane, use a funnel-shift loader: it reads the 8-byte-aligned words
that contain the view's bytes (a few bytes outside the view, inside the same aligned word, are
read and masked off; such a word never crosses a page or allocation granule) — no host copy.

Source: docs/digest-spec.md
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

import refit_verify.digest.kernels._plan_numba as _plan_numba
import refit_verify.digest.kernels.direct as _direct
from refit_verify.digest import reference as _ref
from refit_verify.digest.tensors import first_overlap
from refit_verify.digest.kernels._leaf import FAST_LEAF, _digest_leaf_kernel, _leaf_fast_kernel
from refit_verify.digest.kernels._mix import KM, MID_N, SCR_N
from refit_verify.digest.kernels._upper import _digest_chain_kernel, _digest_gather_kernel, _digest_upper_kernel
from refit_verify.digest.kernels.replay import replay as _graph_replay

__all__ = ["Planned", "chunk_roots", "digest_views", "plan_views", "run_plan", "to_hex"]

# Launch shape of the general leaf kernel: a [256] uint64 row over 8 warps = 1 lane per thread per row.
LEAF_WARPS = 8

FastLaunch = Callable[[torch.Tensor, torch.Tensor, int, int, int, int], list]
"""``(plan, work, V, C, LO, F) -> launched kernels``: a FAST leaf launch over plan entries [LO, LO+F)."""


# ---------------------------------------------------------------------------------------------
# Host side.
# ---------------------------------------------------------------------------------------------
def _plan(addrs: list[int], sizes: list[int], seeds: list[tuple[int, int]],
          align: int = 8, parents: list[int] | None = None, dsts: list[int] | None = None) -> tuple[np.ndarray, int, int, int]:
    """Build the int64 plan read by all kernels (one host-to-device copy): :func:`_plan_numpy`'s,
    from one compiled call (:mod:`~refit_verify.digest.kernels._plan_numba`) when no view can be
    derived (``parents`` None) and numba is there.

    Raises:
        ValueError: ``2**24`` views or more (a leaf program's code holds its view in 24 bits).
    """
    if len(sizes) >= 1 << 24:
        raise ValueError(f"at most {(1 << 24) - 1} views per call, got {len(sizes)}")
    if parents is None:
        got = _plan_numba.plan(addrs, sizes, seeds, align, dsts)
        if got is not None:
            return got
    return _plan_numpy(addrs, sizes, seeds, align, parents, dsts)


def _plan_numpy(addrs: list[int], sizes: list[int], seeds: list[tuple[int, int]],
                align: int = 8, parents: list[int] | None = None, dsts: list[int] | None = None) -> tuple[np.ndarray, int, int, int]:
    """Build the int64 plan read by all kernels (one host-to-device copy), with numpy.

    Layout (V views, P leaf programs of which F fast, C chunks): ``[r*V:(r+1)*V]`` for r =
    0 address, 1 nbytes, 2 copy destination address (``dsts``; 0: none), 3 first global chunk, 4 seed0, 5 seed1 (int64 bits), 6-7 unused;
    then ``[8V : 8V+P]`` leaf program codes ``(q << 24) | view`` — the F fast ones first — and
    ``[8V+P : 8V+P+C]`` the view of each chunk (chunks numbered view-major). A chunk of n lanes has
    ceil(n/65536) leaf programs when n > 61440 (16 for a full chunk), else ceil(n/4096), so leaf
    program q of a view belongs to chunk q // 16. Fast: big chunk, 8-aligned view, and the
    program's 65536 lanes hold no partial lane; ``align`` (8, or 16 for ``vec`` variants): the
    view address alignment a fast program needs.

    ``parents`` (per view: another view's index, or -1): **derived views** (:func:`_parents`). View
    v with parent p is derived when it lies in p's bytes at a byte offset ``o * 512 KiB`` and holds
    at least one full 65536-lane superblock (``nbytes >= 512 KiB``), and p is not derived itself; else
    it is planned as any view. A full superblock's leaf output (levels 0+1, both channels) depends
    only on its 65536 lanes (tweaks by height and channel, never by position; padding only in a
    partial superblock: spec §4.2, §6.1), so superblock s of v *is* superblock ``o + s`` of p: v has
    no leaf program for its ``nbytes // 512 KiB`` full superblocks (only for a partial last one), and
    G gather entries ``[8V+P+C : 8V+P+C+G]`` (destination rows) and ``[8V+P+C+G : 8V+P+C+2G]``
    (source rows), in units of 256 ``mid`` values (row ``gc*16 + j`` = chunk gc's slot j), copy p's
    leaf outputs into v's ``mid`` slots before the upper stage (:func:`_digest_gather_kernel`).
    ``G = (len(plan) - 8V - P - C) // 2``. A derived view is only read, never copied elsewhere.

    Returns:
        (plan, P, F, C): plan is a 1-D int64 numpy array.
    """
    V = len(sizes)  # < 2**24: checked by _plan
    nb = np.asarray(sizes, dtype=np.int64)
    ad = np.asarray(addrs, dtype=np.uint64).view(np.int64)
    nl = (nb + 7) // 8
    nch = (nl + _ref.CHUNK_LANES - 1) // _ref.CHUNK_LANES
    last = nl - np.maximum(nch - 1, 0) * _ref.CHUNK_LANES  # lanes of the last chunk
    nb0 = (last + MID_N - 1) // MID_N
    last_progs = np.where(nb0 >= 16, (last + 65535) // 65536, nb0)
    nprog = np.where(nch > 0, (nch - 1) * 16 + last_progs, 0)
    P, C = int(nprog.sum()), int(nch.sum())
    pv = np.repeat(np.arange(V, dtype=np.int64), nprog)  # view of each leaf program
    q = np.arange(P, dtype=np.int64) - np.repeat(np.cumsum(nprog) - nprog, nprog)
    lo = q // 16 * _ref.CHUNK_LANES
    end = np.minimum(nl[pv], lo + _ref.CHUNK_LANES)
    sb0 = lo + q % 16 * 65536
    fast = (end - lo > 15 * MID_N) & (ad[pv] % align == 0) & (np.minimum(end, sb0 + 65536) <= nb[pv] // 8)
    codes = (q << 24) | pv
    first = np.cumsum(nch) - nch  # first global chunk of each view
    gather = _gather_rows(addrs, nb, first, parents) if parents is not None else None
    if gather is not None:  # derived views: no leaf program for their full superblocks (program q = superblock q)
        keep = q >= gather[2][pv]
        codes, fast, P = codes[keep], fast[keep], int(keep.sum())
    G = 0 if gather is None else len(gather[0])
    plan = np.zeros(8 * V + P + C + 2 * G, dtype=np.int64)
    plan[0:V] = ad
    plan[V : 2 * V] = nb
    if dsts is not None:
        plan[2 * V : 3 * V] = np.asarray(dsts, dtype=np.uint64).view(np.int64)
    plan[3 * V : 4 * V] = first
    sd = np.asarray(seeds, dtype=np.uint64).reshape(V, 2).view(np.int64)
    plan[4 * V : 5 * V] = sd[:, 0]
    plan[5 * V : 6 * V] = sd[:, 1]
    F = int(fast.sum())
    plan[8 * V : 8 * V + F] = codes[fast]
    plan[8 * V + F : 8 * V + P] = codes[~fast]
    plan[8 * V + P : 8 * V + P + C] = np.repeat(np.arange(V, dtype=np.int64), nch)
    if G:
        plan[8 * V + P + C : 8 * V + P + C + G] = gather[0]
        plan[8 * V + P + C + G :] = gather[1]
    return plan, P, F, C


SB_BYTES = 8 * MID_N * _ref.GROUP  # 512 KiB: one leaf superblock (65536 lanes)


def _gather_rows(addrs: list[int], nb: np.ndarray, first: np.ndarray,
                 parents: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The gather of derived views (see :func:`_plan`): ``(destination rows, source rows, full
    superblocks taken per view)``, rows in units of 256 ``mid`` values; None when no view is derived.
    The geometry is checked here from the addresses: a parent that does not hold the view at a
    superblock offset, or is derived itself, leaves the view planned as any view."""
    V = len(addrs)
    if len(parents) != V:
        raise ValueError(f"{V} views but {len(parents)} parents")
    nfull = np.zeros(V, dtype=np.int64)
    sb_off = np.zeros(V, dtype=np.int64)
    par = np.full(V, -1, dtype=np.int64)
    for v, p in enumerate(parents):
        if p is None or not 0 <= p < V or p == v or (parents[p] is not None and parents[p] >= 0):  # none, or derived itself
            continue
        off = int(addrs[v]) - int(addrs[p])
        n = int(nb[v])
        if off >= 0 and off % SB_BYTES == 0 and n >= SB_BYTES and off + n <= int(nb[p]):
            nfull[v], sb_off[v], par[v] = n // SB_BYTES, off // SB_BYTES, p
    G = int(nfull.sum())
    if not G:
        return None
    gv = np.repeat(np.arange(V, dtype=np.int64), nfull)
    s = np.arange(G, dtype=np.int64) - np.repeat(np.cumsum(nfull) - nfull, nfull)  # superblock of the view
    return first[gv] * 16 + s, first[par[gv]] * 16 + sb_off[gv] + s, nfull


def _parents(addrs: list[int], sizes: list[int]) -> list[int]:
    """For each view, a view of the same list whose bytes hold it at a byte offset that is a
    multiple of 512 KiB (a region of a parameter read beside the parameter), or -1: the parents
    :func:`_plan` derives views from. A parent is never derived itself (the outermost view is
    taken); a view holding no full superblock (< 512 KiB) gets -1."""
    out = [-1] * len(addrs)
    root, rend = -1, -1
    for i in sorted(range(len(addrs)), key=lambda i: (addrs[i], -sizes[i], i)):
        a, n = addrs[i], sizes[i]
        if n <= 0:
            continue
        if root >= 0 and a + n <= rend:
            if n >= SB_BYTES and (a - addrs[root]) % SB_BYTES == 0:
                out[i] = root
        else:
            root, rend = i, a + n
    return out


_PLANS: OrderedDict[tuple, tuple[torch.Tensor, int, int, int]] = OrderedDict()
_PLANS_MAX = 16  # device plans kept for repeated calls on the same views (e.g. every refit)


def _device_plan(dev: torch.device, addrs: list[int], sizes: list[int], seeds: list[tuple[int, int]],
                 align: int = 8, parents: list[int] | None = None, dsts: list[int] | None = None):
    """``_plan`` on ``dev`` (pinned, non-blocking copy), memoised on (device, addresses, sizes, seeds, align, parents, dsts)."""
    key = (dev, tuple(addrs), tuple(sizes), tuple(seeds), align, None if parents is None else tuple(parents),
           None if dsts is None else tuple(dsts))
    hit = _PLANS.get(key)
    if hit is not None:
        _PLANS.move_to_end(key)
        return hit
    plan_np, P, F, C = _plan(addrs, sizes, seeds, align, parents, dsts)
    plan = torch.from_numpy(plan_np)
    if dev.type != "cpu":
        plan = plan.pin_memory().to(dev, non_blocking=True)
    _PLANS[key] = hit = (plan, P, F, C)
    if len(_PLANS) > _PLANS_MAX:
        _PLANS.popitem(last=False)
    return hit


def digest_views(views: list[torch.Tensor], seeds: list[tuple[int, int]],
                 dsts: list[torch.Tensor] | None = None) -> torch.Tensor:
    """Digest v1 channel values of many byte views: <= 4 kernel launches, no host synchronisation.

    Launches (each skipped when empty): fast leaf, general leaf, upper, chain — for all views.
    The plan (addresses, lengths, seeds, work lists) is one pinned host-to-device copy, memoised
    for repeated calls on the same views.

    Args:
        views: 1-D contiguous uint8 tensors on one device (CUDA; CPU only under
            ``TRITON_INTERPRET=1``), each a tensor's logical bytes; any storage offset (odd ones
            included) and any length (0 included). They must stay alive and unmodified until
            the result is consumed (the kernels run asynchronously).
        seeds: per view, the two 64-bit chain seeds ``reference.seed(...)`` (ints in [0, 2**64)).
        dsts: None, or per view a copy destination (see :func:`plan_views`): the leaf kernels
            store every lane they read there, so each view is read once for its digest and its copy.

    Returns:
        torch.Tensor: int64 ``[len(views), 2]`` on the views' device; row i holds the finalised
        channel-0 and channel-1 values of view i as 64-bit patterns (value mod 2**64 as int64).

    Raises:
        ValueError: views and seeds differ in length; views on different devices; CPU views
            without the Triton interpreter.
        TypeError: a view is not a 1-D contiguous uint8 tensor.

    Source: docs/digest-spec.md
    """
    if len(views) != len(seeds):
        raise ValueError(f"{len(views)} views but {len(seeds)} seeds")
    if not views:
        return torch.empty((0, 2), dtype=torch.int64)
    if dsts is not None:
        return run_plan(plan_views(views, seeds, dsts=dsts))
    return _launch(views, seeds, chain=True)


def chunk_roots(views: list[torch.Tensor]) -> torch.Tensor:
    """Chunk roots (spec §6) of many byte views, both channels: leaf and upper kernels, no chain.

    Each view is a standalone byte string (lanes from its first byte, the last lane zero-padded),
    cut into chunks of 2^20 lanes (8 MiB); no seed, chain or finalisation — the building block
    of sharded digests (``refit_verify.collective.sharded``: a shard starting on a chunk boundary of the full
    tensor has exactly the full tensor's roots for its chunks). <= 3 kernel launches, no host
    synchronisation.

    Args:
        views: as for :func:`digest_views`.

    Returns:
        torch.Tensor: int64 ``[C, 2]`` on the views' device, ``C = sum(ceil(nbytes_i / 8 MiB))``;
        the chunks of view 0 in order, then those of view 1, ...; row = (root_0, root_1) as 64-bit
        patterns (value mod 2**64 as int64). Empty views contribute no rows.

    Raises:
        ValueError / TypeError: as :func:`digest_views`.

    Source: docs/digest-spec.md §6, §7.1
    """
    if not views:
        return torch.empty((0, 2), dtype=torch.int64)
    return _launch(views, [(0, 0)] * len(views), chain=False)


class Planned:
    """A launch plan of one set of views, kept to digest the same memory again (:func:`plan_views`).

    Attributes:
        plan: int64 plan on the views' device (see :func:`_plan`).
        P, F, C, V: leaf programs, fast leaf programs, chunks, views.
        G: gather entries of derived views (256 leaf outputs per channel each; see :func:`_plan`).
        saved: bytes of derived views taken from their parents' leaf pass, not read again (``G * 512 KiB``).
        device: the views' device.
        runs: how often :func:`run_plan` ran it chained on CUDA.
        graph: on CUDA, its captured graph once it ran twice (:mod:`~refit_verify.digest.kernels.replay`),
            False when its capture could not be set up or its first replay differed from plain launches, else None.
        direct: on CUDA, ``(compiled kernels, launch shape, from the kinds table)`` its launches go to once they
            were checked, as its own or as kinds checked before (:mod:`~refit_verify.digest.kernels.direct`),
            False when it stays on JIT launches, else None.
        copy: every run also copies each view's bytes to its destination (:func:`plan_views` ``dsts``).
    """

    __slots__ = ("plan", "P", "F", "C", "V", "G", "saved", "device", "runs", "graph", "direct", "copy", "__weakref__")

    def __init__(self, plan: torch.Tensor, P: int, F: int, C: int, V: int, device: torch.device, G: int = 0,
                 copy: bool = False) -> None:
        self.plan, self.P, self.F, self.C, self.V, self.device = plan, P, F, C, V, device
        self.G, self.saved = G, G * SB_BYTES
        self.runs, self.graph, self.direct = 0, None, None
        self.copy = copy


def plan_views(views: list[torch.Tensor], seeds: list[tuple[int, int]], align: int = 8, derive: bool = False,
               dsts: list[torch.Tensor] | None = None) -> Planned:
    """Check ``views`` and build (or take from the memo) their launch plan, for :func:`run_plan`.

    The plan holds the views' addresses, not the views: running it later digests whatever that
    memory holds then, so the caller keeps the memory alive and knows it is the same tensors.

    Args:
        views: non-empty list of 1-D contiguous uint8 tensors on one device (as :func:`digest_views`).
        seeds: per view, the two 64-bit chain seeds (ints in [0, 2**64)).
        align: view address alignment in bytes a FAST leaf program needs (8; 16 for ``vec`` variants).
        derive: a view lying inside another view of the list at a 512 KiB multiple (a region of a
            fused parameter beside the parameter, :func:`_parents`) takes the leaf outputs of its full
            superblocks from that view's (one read of those bytes, not two; :func:`_plan`). Digests
            are unchanged. Only for views that are read, never for a launch that copies them.
        dsts: None, or one copy destination per view: a 1-D contiguous uint8 tensor on the views'
            device, address 8-byte aligned, at least ``round_up(nbytes, 8)`` long, overlapping no
            view and no other destination. Every run of the plan stores view i's bytes to
            ``dsts[i][:nbytes]`` from the loads its digest folds (each byte read once), and zeros to
            ``dsts[i][nbytes : round_up(nbytes, 8)]`` (the partial last lane, zero-padded as §2);
            bytes past that are untouched. Like the views, they must stay alive until the run ends.

    Returns:
        Planned: the int64 plan on the views' device and its program / chunk counts.

    Raises:
        ValueError: views and seeds differ in length; views on different devices; CPU views
            without the Triton interpreter.
        TypeError: a view is not a 1-D contiguous uint8 tensor.
    """
    if len(views) != len(seeds):
        raise ValueError(f"{len(views)} views but {len(seeds)} seeds")
    dev = views[0].device
    u8 = torch.uint8
    addrs, sizes = [], []
    for u in views:
        if u.dtype is not u8 or u.dim() != 1 or not u.is_contiguous():
            raise TypeError(f"expected 1-D contiguous uint8 views, got {u.dtype} shape {tuple(u.shape)}")
        addrs.append(u.data_ptr())
        sizes.append(u.numel())
    if len({u.get_device() for u in views}) != 1:
        raise ValueError("all views of one digest_views call must be on one device")
    if dev.type == "cpu" and not _INTERPRETED:
        raise ValueError("CPU views need TRITON_INTERPRET=1 (use refit_verify.digest._torch for CPU tensors)")
    if dsts is not None and derive:
        raise ValueError("a plan that copies its views (dsts) reads every view itself: derive must be False")
    daddrs = None if dsts is None else _check_dsts(views, dsts, addrs, sizes)
    parents = _parents(addrs, sizes) if derive else None
    if parents is not None and max(parents, default=-1) < 0:
        parents = None
    plan, P, F, C = _device_plan(dev, addrs, sizes, seeds, align, parents, daddrs)
    V = len(views)
    return Planned(plan, P, F, C, V, dev, (plan.numel() - 8 * V - P - C) // 2, copy=dsts is not None)


def _check_dsts(views: list[torch.Tensor], dsts: list[torch.Tensor], addrs: list[int], sizes: list[int]) -> list[int]:
    """Check :func:`plan_views`' ``dsts`` against the views (addresses ``addrs``, byte lengths ``sizes``);
    return their addresses. Raises ValueError / TypeError as :func:`plan_views` says."""
    if len(dsts) != len(views):
        raise ValueError(f"{len(views)} views but {len(dsts)} destinations")
    out, spans = [], []
    for i, (d, n) in enumerate(zip(dsts, sizes)):
        if not isinstance(d, torch.Tensor) or d.dtype is not torch.uint8 or d.dim() != 1 or not d.is_contiguous():
            raise TypeError(f"destination {i}: expected a 1-D contiguous uint8 tensor, got {getattr(d, 'dtype', type(d))} "
                            f"shape {tuple(getattr(d, 'shape', ()))}")
        if d.device != views[i].device:
            raise ValueError(f"destination {i} is on {d.device}, its view on {views[i].device}")
        a, r = d.data_ptr(), (n + 7) // 8 * 8
        if a % 8:
            raise ValueError(f"destination {i}: address {a:#x} is not 8-byte aligned")
        if d.numel() < r:
            raise ValueError(f"destination {i}: {d.numel()} bytes, needs {r} (a {n}-byte view in whole 8-byte lanes)")
        out.append(a)
        if r:
            spans.append((a, a + r, i))
    hit = first_overlap(spans, [(a, a + n) for a, n in zip(addrs, sizes) if n])
    if hit is not None and hit[1] >= 0:
        raise ValueError(f"destination {hit[0]} overlaps destination {hit[1]}")
    if hit is not None:
        raise ValueError(f"destination {hit[0]} overlaps a view: a copy destination may overlap no view")
    return out


def run_plan(p: Planned, chain: bool = True, launch_fast: FastLaunch | None = None) -> torch.Tensor:
    """Launch the kernels of plan ``p`` (<= 4 launches, 5 with derived views; no synchronisation).

    On CUDA, a chained run of a plan run before is one replay of its captured graph
    (:func:`refit_verify.digest.kernels.replay.replay`: the same kernels and arguments, one launch).

    Returns:
        torch.Tensor: as :func:`digest_views` (``chain``) or :func:`chunk_roots` (not ``chain``).
    """
    dev, V, C = p.device, p.V, p.C
    work_len = max(1, 2 * C * (MID_N + SCR_N + 1))
    if chain and launch_fast is None and dev.type == "cuda":
        out = _graph_replay(p, work_len, lambda work, out: _run(p, work, out, None))
        if out is not None:
            return out
    work = torch.empty(work_len, dtype=torch.int64, device=dev)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        if not chain:
            _run(p, work, None, launch_fast)
            roots = work[2 * C * (MID_N + SCR_N) : 2 * C * (MID_N + SCR_N + 1)]  # channel 0 of every chunk, then channel 1
            return roots.view(2, C).t().contiguous()
        out = torch.empty((V, 2), dtype=torch.int64, device=dev)
        _run(p, work, out, launch_fast)
    return out


def _run(p: Planned, work: torch.Tensor, out: torch.Tensor | None, launch_fast: FastLaunch | None) -> None:
    """The launches of plan ``p`` on the current stream: leaf (fast, general), upper, and the chain
    into ``out`` (skipped when None: the roots stay in ``work``, see :func:`_digest_upper_kernel`).
    On CUDA, a plan run before goes straight to its compiled kernels (:mod:`~refit_verify.digest.kernels.direct`)."""
    launches = _launches(p, work, out)
    if launch_fast is not None:  # a measured variant replaces the production FAST launch
        if p.F:
            launch_fast(p.plan, work, p.V, p.C, 8 * p.V, p.F)
            launches = launches[1:]
        _direct.jit(launches)
    elif not _INTERPRETED and p.device.type == "cuda":
        _direct.run(p, launches, work, out)
    else:
        _direct.jit(launches)


def _launches(p: Planned, work: torch.Tensor, out: torch.Tensor | None) -> list[_direct.Launch]:
    """The launches :func:`_run` makes for ``p`` (the production FAST launch first), as data."""
    V, P, F, C, plan = p.V, p.P, p.F, p.C, p.plan
    L = _direct.Launch
    out_l = [_fast(plan, work, V, C, 8 * V, F, p.copy)] if F else []
    if P > F:
        out_l.append(L(_digest_leaf_kernel, (P - F,), (plan, work, V, C, 8 * V + F), (("FAST", False), ("COPY", p.copy)),
                       {"num_warps": LEAF_WARPS}))
    if p.G:  # derived views' full superblocks: the parents' leaf outputs (after both leaf launches)
        out_l.append(L(_digest_gather_kernel, (p.G,), (plan, work, C, 8 * V + P + C, p.G), (), {"num_warps": 2}))
    if C:
        out_l.append(L(_digest_upper_kernel, (C,), (plan, work, V, C, 8 * V + P), (), {"num_warps": 4}))
    if out is not None:
        out_l.append(L(_digest_chain_kernel, (V,), (plan, work, out, V, C), (("RB", _CHAIN_RB),), {"num_warps": 1}))
    return out_l


def _launch(views: list[torch.Tensor], seeds: list[tuple[int, int]], chain: bool,
            fast: tuple[int, FastLaunch] | None = None) -> torch.Tensor:
    """Plan and launch the leaf and upper kernels, then the chain (``chain``) or a copy of the roots.

    ``fast``: ``(align, launch)`` replacing the production FAST launch (``_launch_fast``, align 8):
    the view alignment a fast program needs, and the launch (``benchmarks/digest_variants.py``).
    """
    align, launch_fast = fast or (8, None)
    return run_plan(plan_views(views, seeds, align), chain, launch_fast)


def _fast(plan: torch.Tensor, work: torch.Tensor, V: int, C: int, LO: int, F: int, copy: bool = False) -> _direct.Launch:
    """The production FAST leaf launch (``FAST_LEAF``) over plan entries [LO, LO+F), as data (inline
    PTX and the register cap are GPU-only: the interpreter runs ``ASM=0`` without a cap); ``copy``:
    its COPY variant (stores every lane it reads to the view's destination)."""
    lf = FAST_LEAF
    cap = lf["copy_maxnreg"] if copy else lf["maxnreg"]
    opts = {"num_warps": lf["warps"]} if _INTERPRETED else {"num_warps": lf["warps"], "maxnreg": cap}
    S = _ref.STRIDE // lf["cols"]  # column slices per superblock
    return _direct.Launch(_leaf_fast_kernel, (F * S,), (plan, work, V, C, LO, *KM),
                          (("COLS", lf["cols"]), ("ASM", 0 if _INTERPRETED else lf["asm"]), ("COPY", copy)), opts)


def _launch_fast(plan: torch.Tensor, work: torch.Tensor, V: int, C: int, LO: int, F: int) -> list:
    """The production FAST leaf launch (``FAST_LEAF``) over plan entries [LO, LO+F), through the JIT."""
    return _direct.jit([_fast(plan, work, V, C, LO, F)])


_INTERPRETED = type(_digest_chain_kernel).__name__ == "InterpretedFunction"
_CHAIN_RB = 4 if _INTERPRETED else 16  # chunk roots per chain-kernel block (the interpreter pays per step)


def to_hex(words: torch.Tensor) -> list[str]:
    """Format ``digest_views`` output (int64 ``[N, 2]``) as 32 lowercase hex chars per row.

    One device-to-host copy (the only synchronisation). Source: docs/digest-spec.md §9.
    """
    m = _ref.MASK64
    return [_ref.hexdigest(a & m, b & m) for a, b in words.cpu().tolist()]
