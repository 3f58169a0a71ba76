"""Padding a loader filled (``fill_`` / ``zero_``): the digest a filled region must have, and which
filled regions read-back can read (not overlapped by a delivered block or another fill).

Regions are ``(storage offset, shape, stride)`` in elements of the parameter; sizes in bytes.
"""

from __future__ import annotations

import struct

import torch

from refit_verify.boundary.placement import Copy, FillValue
from refit_verify.digest.batch import tensor_digest

__all__ = ["FILL_MAX_BYTES", "MASK_MAX", "Fills", "fill_hex", "fill_plan", "first_overlap", "overlap"]


_FILL_HEX: dict[tuple, str] = {}


_FILL_HEX_MAX = 256


FILL_MAX_BYTES = 1 << 28
"""A filled region larger than this (256 MiB) is not rebuilt on the host to get its expected digest."""


MASK_MAX = 1 << 20
"""Regions whose spans meet within this many elements are tested for a shared element exactly (a
host mask of that many bytes at most); beyond, they are not tested and may share one."""


def _value_key(v: FillValue) -> tuple:
    """A fill value as a key that tells apart what ``==`` does not (``-0.0`` / ``0.0``, NaN payloads)."""
    if isinstance(v, float):
        return (float, struct.pack("<d", v))
    if isinstance(v, complex):
        return (complex, struct.pack("<dd", v.real, v.imag))
    return (type(v), v)


def fill_hex(dtype: torch.dtype, shape: tuple, value: FillValue) -> str:
    """32-hex digest of a CPU tensor of ``dtype`` and ``shape`` filled with ``value`` as ``fill_`` fills
    it (the bytes a loader's fill leaves); kept per (dtype, shape, value) in a small module dict.

    Raises:
        RuntimeError / TypeError: ``value`` cannot be written into ``dtype``."""
    key = (dtype, tuple(shape), _value_key(value))
    h = _FILL_HEX.get(key)
    if h is None:
        if len(_FILL_HEX) >= _FILL_HEX_MAX:
            _FILL_HEX.clear()
        h = _FILL_HEX[key] = tensor_digest(torch.empty(tuple(shape), dtype=dtype).fill_(value))
    return h


def _span(g) -> tuple[int, int] | None:
    """``[first, last + 1)`` element of region ``g`` relative to its parameter, or None when it is empty."""
    off, shape, stride = g
    if 0 in shape:
        return None
    return off, off + sum((s - 1) * st for s, st in zip(shape, stride)) + 1


def overlap(a, b) -> bool | None:
    """True iff regions ``a`` and ``b`` of one parameter share an element, False iff they do not;
    None when their spans meet over more than :data:`MASK_MAX` elements (not tested: they may)."""
    sa, sb = _span(a), _span(b)
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False
    lo, hi = min(sa[0], sb[0]), max(sa[1], sb[1])
    if hi - lo > MASK_MAX:
        return None
    mask = torch.zeros(hi - lo, dtype=torch.bool)
    mask.as_strided(b[1], b[2], b[0] - lo).fill_(True)
    return bool(mask.as_strided(a[1], a[2], a[0] - lo).any())


def first_overlap(region, others: list) -> bool | None:
    """True iff ``region`` shares an element with one of ``others``; else None iff one of them may
    (:func:`overlap` could not test it); else False."""
    maybe = False
    for o in others:
        hit = overlap(region, o)
        if hit:
            return True
        if hit is None:
            maybe = None
    return maybe


def fill_plan(p: torch.Tensor, fills: list[tuple[tuple, Copy]], blocks: list[tuple]) -> tuple[list, list]:
    """Which filled regions of parameter ``p`` are read: ``([(region, value, expected 32-hex, bytes)],
    [(region, why not read, bytes)])``. ``fills``: ``(region, its last fill)``; ``blocks``: the
    regions written from delivered tensors. A region is read when its fill value is known, can be
    rebuilt on the host, and no block or fill of another value shares an element with it (what it
    should hold then is not one value)."""
    read, unread = [], []
    esize = p.element_size()
    last = {region: c for region, c in fills}
    for region, c in fills:
        nb = c.numel() * esize
        why = None
        if c.value is None:
            why = c.unknown or "the loader's fill value was not recorded"
        elif nb > FILL_MAX_BYTES:
            why = f"the filled region ({nb} bytes) is too large to rebuild on the host"
        elif (hit := first_overlap(region, blocks)) is not False:
            why = ("a delivered block was written over part of it" if hit else "a delivered block may share elements with it "
                   f"(regions spanning more than {MASK_MAX} elements are not tested)")
        elif (hit := first_overlap(region, [r for r, o in last.items() if r != region and (
                o.value is None or _value_key(o.value) != _value_key(c.value))])) is not False:
            why = ("another fill of another value was written over part of it" if hit else "a fill of another value may share "
                   f"elements with it (regions spanning more than {MASK_MAX} elements are not tested)")
        if why is None:
            try:
                read.append((region, c.value, fill_hex(p.dtype, region[1], c.value), nb))
                continue
            except (RuntimeError, TypeError, ValueError) as e:
                why = f"its fill value {c.value!r} cannot be rebuilt as {str(p.dtype).removeprefix('torch.')} ({e})"[:300]
        unread.append((region, why, nb))
    return read, unread


class Fills:
    """The filled regions of one parameter (:func:`_program`): ``entries`` (those read)
    ``[(digest key, expected 32-hex, region description, fill value)]``; ``held``: their bytes
    (counted as padding when they hold, unproven when the parameter is a mismatch); ``nbytes``:
    its state's ``bytes`` then."""

    __slots__ = ("entries", "held", "nbytes")

    def __init__(self, entries: list, held: int, nbytes: int) -> None:
        self.entries, self.held, self.nbytes = entries, held, nbytes
