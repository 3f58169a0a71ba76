"""The kept sets of held flushes: one :class:`~refit_verify.digest.kept.DigestSet` per list of names, process-wide.

A trainer exports the same memory at every refit, and a receiver checks the same staging slots (or
the CPU's clones of them, laid out alike) before loading: :class:`~refit_verify.digest.incremental.HeldBatch`
and :func:`~refit_verify.digest.incremental.digest_now` look each flush's names up here and, when its
tensors still have the kept set's signatures (or, on the CPU, its layout elsewhere), launch that
set's plan instead of checking and planning every tensor again. A flush that went the general way
is remembered (:func:`_keep_held`): its signatures the first time, a set built over its tensors
when the same names come again alike. Entries hold signatures and launch plans, never tensors.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from refit_verify.digest.kept import DigestSet, could_relocate, same_layout

__all__ = ["KEPT_HELD_TENSORS", "kept_set"]

KEPT_HELD_TENSORS = 1 << 17
"""Tensors over all the flush signatures and sets :class:`~refit_verify.digest.incremental.HeldBatch` keeps (one entry per flush of a
trainer's export, least recently used dropped beyond this): an entry holds no tensor, only signatures
and a launch plan, so a whole large model's flushes fit (a 7B model in bf16 is about 56 flushes of
256 MiB; a bound by entries would drop each flush's entry just before it comes again)."""
_HELD_SETS: OrderedDict[tuple[str, ...], DigestSet | list[tuple]] = OrderedDict()
_HELD_TENSORS = 0  # tensors over the entries of _HELD_SETS
_HELD_LOCK = threading.Lock()


def _kept_held(names: tuple[str, ...], columns: tuple[list, ...] | None,
               tensors: Sequence[torch.Tensor]) -> tuple[DigestSet, bool] | None:
    """The kept set of a flush of ``names`` whose ``tensors`` have the signature fields ``columns``
    (:func:`~refit_verify.digest.kept._signature_columns`), and whether they moved (a relocatable set
    of their layout elsewhere, :meth:`DigestSet.moved`), or None."""
    ds = kept_set(names) if columns is not None else None
    if ds is None:
        return None
    if ds.valid(tensors, columns):
        return ds, False
    return (ds, True) if ds.moved(tensors, columns) else None


def kept_set(names: tuple[str, ...]) -> DigestSet | None:
    """The kept set of ``names`` (marked most recently used), or None when there is none (or only the
    signatures of one flush so far)."""
    with _HELD_LOCK:
        ds = _HELD_SETS.get(names)
        if not isinstance(ds, DigestSet):
            return None
        _HELD_SETS.move_to_end(names)
        return ds


def _keep_held(names: tuple[str, ...], sigs: list[tuple], tensors: list[torch.Tensor]) -> None:
    """Remember a flush that went the general way: its signatures the first time; a set over its
    tensors (no tensors held) when the same names come again with the same signatures, or with the
    same layout elsewhere when a set can follow it (:func:`~refit_verify.digest.kept.could_relocate`:
    CPU clones made at every refit). Memory that moves at every refit where no set can follow it
    (a sharded gather's on a GPU, a large CPU tensor's) is never planned for nothing."""
    with _HELD_LOCK:
        prev = _HELD_SETS.get(names)
    entry: DigestSet | list[tuple] = sigs
    before = None if prev is None else prev if isinstance(prev, list) else prev.signatures
    same = before == sigs
    # memory that moves at every refit gets a set only where one can follow it (the CPU's compiled batch):
    # a sharded gather's on a GPU, or a large CPU tensor's, is never planned for nothing
    if same or (before is not None and same_layout(before, sigs) and could_relocate(tensors)):
        try:
            entry = DigestSet(tensors, hold=False)
        except (RuntimeError, ValueError):  # not contiguous, not on a device with kept plans: the general path each time
            entry = sigs
    with _HELD_LOCK:
        global _HELD_TENSORS
        old = _HELD_SETS.pop(names, None)
        _HELD_TENSORS -= len(names) if old is not None else 0
        _HELD_SETS[names] = entry
        _HELD_TENSORS += len(names)
        while _HELD_TENSORS > KEPT_HELD_TENSORS and len(_HELD_SETS) > 1:
            dropped, _ = _HELD_SETS.popitem(last=False)
            _HELD_TENSORS -= len(dropped)
