"""Region geometry of the model boundary: which dim-0 slices (experts of a stacked fused-MoE
parameter) a session's writes leave unwritten (:func:`refit_verify.boundary.regions.unwritten_slices`)."""

from __future__ import annotations

import torch

from refit_verify.boundary.regions import covered, unwritten_slices
from refit_verify.digest.tensors import geometry

E, ROWS, COLS = 4, 6, 8  # a w13_weight-like stack: 4 experts of [gate 3 rows; up 3 rows] x 8


def _stack() -> torch.Tensor:
    return torch.zeros(E, ROWS, COLS, dtype=torch.bfloat16)


def _writes(p: torch.Tensor, experts, halves=("gate", "up")) -> dict[tuple, int]:
    """The regions a fused-MoE expert loader writes: ``p[e].narrow(0, 0 or 3, 3)`` per expert and half."""
    out = {}
    for e in experts:
        for h in halves:
            v = p[e].narrow(0, 0 if h == "gate" else ROWS // 2, ROWS // 2)
            out[geometry(v, p)] = v.numel()
    return out


def test_every_expert_written_leaves_no_slice():
    p = _stack()
    regions = _writes(p, range(E))
    assert covered(regions) == p.numel() and unwritten_slices(regions, p.shape, p.stride()) == []


def test_a_dropped_expert_is_named_by_its_index():
    p = _stack()
    regions = _writes(p, [0, 1, 3])
    assert unwritten_slices(regions, p.shape, p.stride()) == [2]
    assert covered(regions) == 3 * ROWS * COLS


def test_an_expert_written_in_part_is_named_too():
    """Only the gate half of expert 1 (its up half stale), nothing of expert 3."""
    p = _stack()
    regions = {**_writes(p, [0, 2]), **_writes(p, [1], halves=("gate",))}
    assert unwritten_slices(regions, p.shape, p.stride()) == [1, 3]


def test_a_column_block_of_every_expert_leaves_every_slice_unwritten():
    """A TP rank's column shard written into every expert: no slice is whole."""
    p = _stack()
    regions = {}
    for e in range(E):
        v = p[e, :, : COLS // 2]
        regions[geometry(v, p)] = v.numel()
    assert unwritten_slices(regions, p.shape, p.stride()) == [0, 1, 2, 3]


def test_what_cannot_be_told_is_none_never_a_guess():
    p = _stack()
    regions = _writes(p, [0, 1, 2, 3])
    assert unwritten_slices({**regions, ("opaque",): 5}, p.shape, p.stride()) is None  # an opaque write
    t = p.transpose(1, 2)  # not contiguous
    assert unwritten_slices(regions, t.shape, t.stride()) is None
    assert unwritten_slices({}, p.shape, p.stride()) == [0, 1, 2, 3]
