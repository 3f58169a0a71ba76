"""Where a loader write lands in a parameter, as regions of elements (the model boundary's geometry).

A weight loader's write is recorded as a :class:`~refit_verify.boundary.placement.Placement`: copies whose
destination is a region ``(element offset, shape, strides)`` of the parameter's storage. This module
turns them into what a session records (:func:`_write_plan`, memoised: a loader writes the same
regions every refit) and counts the elements a set of regions covers (:func:`covered`). Pure
geometry: no tensor is read here, nothing imports vLLM.
"""

from __future__ import annotations

import functools
import itertools

import torch

from refit_verify.boundary.placement import Placement

__all__ = ["MAX_COVERAGE_SPANS", "covered", "unwritten_slices"]


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range ``[start, end)`` of ``t`` within its storage."""
    size = t.element_size()
    start = t.storage_offset() * size
    return start, start + _span(t.shape, t.stride()) * size


@functools.lru_cache(maxsize=1 << 14)
def _span(shape: tuple, stride: tuple) -> int:
    """Elements from a view's first element to one past its last (0 when it has none)."""
    if any(n == 0 for n in shape):
        return 0
    return sum((n - 1) * st for n, st in zip(shape, stride)) + 1


def _contiguous(shape: tuple, stride: tuple) -> bool:
    expect = 1
    for n, st in zip(reversed(shape), reversed(stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


MAX_COVERAGE_SPANS = 1 << 16
"""Row spans a non-contiguous region is split into to count its elements exactly (beyond: by size)."""


def _spans(g: tuple, n: int) -> list[tuple[int, int]] | None:
    """Element ranges ``[lo, hi)`` of region ``g`` = (offset, shape, stride); None when it is not a
    set of unit-stride rows that can be listed within :data:`MAX_COVERAGE_SPANS`."""
    off, shape, stride = g[0], tuple(g[1]), tuple(g[2])
    if n == 0:
        return []
    if _contiguous(shape, stride):
        return [(off, off + n)]
    unit = [k for k, (m, st) in enumerate(zip(shape, stride)) if st == 1 and m > 1]
    if not unit:
        return None
    k = unit[0]  # rows along the unit-stride axis (the last one row-major, the first column-major)
    rows = n // shape[k]
    if rows > MAX_COVERAGE_SPANS:
        return None
    others = [a for a in range(len(shape)) if a != k]
    out = []
    for idx in itertools.product(*(range(shape[a]) for a in others)):
        lo = off + sum(i * stride[a] for i, a in zip(idx, others))
        out.append((lo, lo + shape[k]))
    return out


@functools.lru_cache(maxsize=1 << 14)
def _inside_of(dest: tuple, pshape: tuple, pstride: tuple) -> bool:
    """True iff region ``dest`` (offset relative to the parameter's storage offset, shape, stride)
    lies within the elements a parameter of shape ``pshape`` and strides ``pstride`` spans (a write
    elsewhere hits another tensor of its storage). Memoised: a loader writes the same regions every refit."""
    if any(n == 0 for n in dest[1]):
        return True
    lo, hi = _bounds(dest)
    return lo >= 0 and not any(n == 0 for n in pshape) and hi <= _bounds((0, pshape, pstride))[1]


def _bounds(g: tuple) -> tuple[int, int]:
    """First and last element (inclusive) that region ``g`` = (offset, shape, stride) touches."""
    off, shape, stride = g
    return (off + sum((n - 1) * st for n, st in zip(shape, stride) if st < 0),
            off + sum((n - 1) * st for n, st in zip(shape, stride) if st > 0))


def covered(regions: dict[tuple, int]) -> int:
    """Elements of a parameter written by ``regions`` (``{dest geometry: numel}``), each counted
    once: the union of their element ranges (a non-contiguous region as its rows); a region that
    cannot be listed that way (no unit-stride rows, too many rows, an opaque write) by its size."""
    spans, other, bounds = [], [], []
    for g, n in regions.items():
        rows = _spans(g, n) if len(g) == 3 and isinstance(g[0], int) else None
        if rows is None:
            other.append((g, n))
        else:
            spans.extend(rows)
    # a region that cannot be listed counts by its size only when its bounding range overlaps no
    # other region (else only the largest such counts): never more than the union
    for g, n in other:
        if len(g) == 3 and isinstance(g[0], int):
            lo, last = _bounds(g)
            hi = last + 1
        else:
            lo, hi = -(1 << 62), 1 << 62  # an opaque write: anywhere
        bounds.append((lo, hi, n))
    extra = 0
    if bounds:
        def overlaps(a, b):
            return a[0] < b[1] and b[0] < a[1]
        alone = [b for b in bounds if not any(overlaps(b, c) for c in bounds if c is not b)
                 and not any(b[0] < hi and lo < b[1] for lo, hi in spans)]
        extra = sum(b[2] for b in alone)
        if len(alone) < len(bounds):
            extra += max(b[2] for b in bounds if b not in alone)
    spans.sort()
    total, end = 0, None
    for lo, hi in spans:
        if end is None or lo > end:
            total += hi - lo
            end = hi
        elif hi > end:
            total += hi - end
            end = hi
    return total + extra


def unwritten_slices(regions: dict[tuple, int], shape: tuple, stride: tuple) -> list[int] | None:
    """Indices along dim 0 of a contiguous parameter of ``shape`` / ``stride`` (a stacked one: the
    experts of a fused-MoE ``w13_weight`` / ``w2_weight``) that ``regions`` (``{dest geometry: numel}``,
    offsets relative to the parameter's first element) do not cover whole, in order; None when that
    cannot be told (the parameter is not contiguous or has no dim 0, a region is opaque or cannot be
    listed as rows). Never claims a slice written that is not."""
    shape, stride = tuple(shape), tuple(stride)
    if not shape or not _contiguous(shape, stride) or any(n == 0 for n in shape):
        return None
    spans: list[tuple[int, int]] = []
    for g, n in regions.items():
        rows = _spans(g, n) if len(g) == 3 and isinstance(g[0], int) else None
        if rows is None:
            return None
        spans.extend(rows)
    spans.sort()
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        elif hi > lo:
            merged.append([lo, hi])
    step = 1
    for n in shape[1:]:
        step *= n
    out, k = [], 0
    for i in range(shape[0]):
        lo, hi = i * step, (i + 1) * step
        while k < len(merged) and merged[k][1] <= lo:
            k += 1
        if not (k < len(merged) and merged[k][0] <= lo and merged[k][1] >= hi):  # spans are merged: one must hold it all
            out.append(i)
    return out


def _storage_ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0


class _WritePlan:
    """What one loader write means for the session, given its placement and the tensors' geometry
    (:func:`_write_plan`): the same for every refit that loads the same way."""

    __slots__ = ("placement", "outside", "regions", "replicated", "copies")

    def __init__(self, placement: Placement, pshape: tuple, pstride: tuple, lshape: tuple, lstride: tuple) -> None:
        self.placement = placement  # held: the key's id() stays this placement's
        out = [c for c in placement.copies if not _inside_of(c.dest, pshape, pstride)]
        self.outside = (f"the loader wrote outside the parameter (into its storage at {out[0].dest[0]:+d} elements, shape "
                        f"{list(out[0].dest[1])})") if out else None
        self.regions = {("opaque",): placement.numel} if placement.opaque else {c.dest: c.numel() for c in placement.copies}
        c0 = placement.copies[0] if placement.copies else None
        self.replicated = (len(placement.copies) == 1 and c0.src is not None and c0.src[0] == 0
                           and c0.src[1] == lshape == pshape)
        whole = (0, lshape, lstride)
        self.copies = tuple((c, c.fill, c.src == whole) for c in placement.copies)


_PLANS: dict[tuple, _WritePlan] = {}
_PLANS_MAX = 1 << 16


def _write_plan(placement: Placement, pshape: torch.Size, pstride: tuple, lshape: torch.Size, lstride: tuple) -> _WritePlan:
    """The memoised :class:`_WritePlan` of a write, keyed by the placement object (the plan holds it)
    and the parameter's and loaded tensor's shapes and strides."""
    key = (id(placement), pshape, pstride, lshape, lstride)
    plan = _PLANS.get(key)
    if plan is None or plan.placement is not placement:
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        plan = _PLANS[key] = _WritePlan(placement, tuple(pshape), tuple(pstride), tuple(lshape), tuple(lstride))
    return plan


