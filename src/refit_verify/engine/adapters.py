"""LoRA adapters as the engine holds them: digests of slot regions, their padding, and what each
worker remembers of the adapters it verified (no vLLM here; the plugin's ``worker_adapters`` finds
the regions in vLLM's LoRA layers).

vLLM keeps every adapter in per-layer slot tensors (``lora_a_stacked`` / ``lora_b_stacked``, one slot
per active adapter, padded to ``max_lora_rank``). For one slot, one layer and one slice (q, k or v
of a fused ``qkv_proj``) the plugin hands over two 2-D matrices in PEFT's orientation:
``A`` of shape ``(max_lora_rank, in_features)`` and ``B`` of shape ``(out_features, max_lora_rank)``.
A PEFT tensor of shape ``(r, in)`` lands in ``A[:r, :in]``, one of ``(out, r)`` in ``B[:out, :r]``;
everything else in the matrix is padding and must hold zeros.

At tensor parallelism a rank's slot holds a slice of the PEFT tensor (its output rows of a
column-parallel layer's ``lora_B``, its input columns of a row-parallel layer's ``lora_A``).
:func:`selection` turns what vLLM's own slicing function picks out of an index map into that slice.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_verify.digest.batch import digest_tensors

__all__ = ["AdapterLedger", "RegionCheck", "check_regions", "index_map", "nonzero", "outside", "selection", "slot_fingerprint"]

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def nonzero(t: torch.Tensor) -> bool:
    """True iff any byte of ``t`` is not zero (a ``-0.0`` counts as not zero: padding vLLM resets
    holds ``+0.0``). Empty tensors are zero."""
    if t.numel() == 0:
        return False
    as_int = _INT_OF_SIZE.get(t.element_size())
    if as_int is None or t.is_complex() or t.dtype == torch.bool:
        return bool(torch.any(t != 0))
    try:
        return bool(torch.any(t.view(as_int) != 0))
    except RuntimeError:  # a view whose last dim is not contiguous cannot change dtype: copy it
        return bool(torch.any(t.contiguous().view(as_int) != 0))


def outside(m: torch.Tensor, rows: int, cols: int) -> list[torch.Tensor]:
    """The parts of 2-D ``m`` outside its top-left ``[:rows, :cols]`` block (views, possibly empty)."""
    return [m[rows:, :], m[:rows, cols:]]


def index_map(shape: Sequence[int]) -> torch.Tensor:
    """An int64 tensor of 2-D ``shape`` (rows, cols) whose element ``[i, j]`` is ``i * cols + j``: handed
    to a slicing function in place of a PEFT tensor, what it returns says which elements it takes."""
    rows, cols = (int(x) for x in shape)
    return torch.arange(rows * cols, dtype=torch.int64).view(rows, cols)


def _runs(ids: torch.Tensor) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of the runs of consecutive increasing ints in 1-D ``ids``."""
    out: list[tuple[int, int]] = []
    for i in ids.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def selection(picked: torch.Tensor, shape: Sequence[int]) -> tuple[int, list[tuple[int, int]]] | str | None:
    """Which part of a 2-D tensor of ``shape`` a slicing function took, from what it returned for
    :func:`index_map` (``picked``: flat indices ``row * cols + col``).

    Returns:
        None when ``picked`` is the whole tensor in order; ``(dim, [(start, stop), ...])`` when it is
        the concatenation along ``dim`` (0: rows, 1: columns) of those ranges, the other dim whole;
        else a sentence saying why it is neither (empty, another shape, elements of both dims picked).
    """
    rows, cols = (int(x) for x in shape)
    if not isinstance(picked, torch.Tensor) or picked.dim() != 2 or picked.dtype != torch.int64:
        return "the slicing function returned no 2-D index tensor"
    if picked.numel() == 0:
        return f"this rank's slice of it is empty ({list(picked.shape)})"
    row_ids, col_ids = picked[:, 0] // cols, picked[0, :] % cols
    if not torch.equal(picked, row_ids[:, None] * cols + col_ids[None, :]):
        return "the slice is not a selection of rows and columns"
    whole_rows = torch.equal(row_ids, torch.arange(rows))
    whole_cols = torch.equal(col_ids, torch.arange(cols))
    if whole_rows and whole_cols:
        return None
    if whole_cols:
        return 0, _runs(row_ids)
    if whole_rows:
        return 1, _runs(col_ids)
    return "the slice takes part of both rows and columns"


@dataclass
class RegionCheck:
    """What one adapter's regions hold on one worker, against the trainer's digests.

    Attributes:
        digests: ``{PEFT name: 32-hex}`` of the region each name landed in (PEFT's shape and dtype).
        padding: regions whose padding (beyond the adapter's rank) is not zero.
        unexpected: ``{slot area: why}`` of areas no trainer tensor maps to that are not zero.
        proven_bytes: bytes of the regions digested.
    """

    digests: dict[str, str] = field(default_factory=dict)
    padding: list[str] = field(default_factory=list)
    unexpected: dict[str, str] = field(default_factory=dict)
    proven_bytes: int = 0


def check_regions(regions: Mapping[str, torch.Tensor], pads: Mapping[str, Iterable[torch.Tensor]],
                  uncovered: Mapping[str, torch.Tensor]) -> RegionCheck:
    """Digest every region, check padding and uncovered areas for zeros.

    Args:
        regions: ``{PEFT name: view of the engine's bytes}`` in PEFT's orientation and shape.
        pads: ``{label: views that must hold zeros}`` (padding around each region).
        uncovered: ``{label: view}`` of slot areas that no trainer tensor maps to (they must hold zeros:
            vLLM resets a slot before it copies an adapter in).
    """
    out = RegionCheck()
    out.digests = digest_tensors(regions.items()) if regions else {}
    out.proven_bytes = sum(t.numel() * t.element_size() for t in regions.values())
    out.padding = [label for label, views in pads.items() if any(nonzero(v) for v in views)]
    out.unexpected = {label: "not zero, but the trainer sent no tensor for it" for label, t in uncovered.items() if nonzero(t)}
    return out


def slot_fingerprint(areas: Mapping[str, torch.Tensor]) -> str:
    """One 32-hex digest over every area of one adapter's slot (``{label: view}``, labels sorted):
    the same bytes in any slot give the same fingerprint."""
    digests = digest_tensors(sorted(areas.items()))
    h = hashlib.sha256()
    for k, v in sorted(digests.items()):
        h.update(f"{k}={v}\n".encode())
    return h.hexdigest()[:32]


@dataclass
class _Verified:
    version: int | None
    fingerprint: str | None
    at: float
    expected: Any = None  # verified in no slot: what was expected (to check the slot it is copied into)


class AdapterLedger:
    """What one worker verified of each adapter id: the version and the fingerprint of its slot.

    :meth:`judge` names, before a verification is recorded, an older version than one verified (a
    stale push) and an adapter still holding the bytes verified at an earlier version (the new
    version never replaced it: a stale adapter under a reused id). :meth:`audit` names active
    adapters never verified, adapters whose bytes changed since they verified and adapters whose
    last verification failed (:meth:`fail`).
    """

    def __init__(self) -> None:
        self._by_id: dict[int, _Verified] = {}
        self._failed: dict[int, int | None] = {}  # adapter id -> the version whose verification failed last

    def get(self, adapter_id: int) -> tuple[int | None, str | None] | None:
        """``(version, fingerprint)`` last verified for ``adapter_id``, or None."""
        v = self._by_id.get(adapter_id)
        return None if v is None else (v.version, v.fingerprint)

    def verified(self) -> dict[int, int | None]:
        """``{adapter id: version}`` of every adapter verified on this worker."""
        return {k: v.version for k, v in self._by_id.items()}

    def judge(self, adapter_id: int, version: int | None, fingerprint: str | None, ok: bool) -> list[str]:
        """Problems of verifying ``adapter_id`` at ``version`` when its slot's fingerprint is
        ``fingerprint`` (None: not in a slot) and the byte comparison gave ``ok``; one sentence each."""
        last = self._by_id.get(adapter_id)
        if last is None:
            return []
        out = []
        if version is not None and last.version is not None and version < last.version:
            out.append(f"stale adapter: version {version} of adapter {adapter_id} is older than version {last.version} "
                       "already verified on this worker")
        if not ok and fingerprint is not None and fingerprint == last.fingerprint and version != last.version:
            out.append(f"adapter {adapter_id} still holds the bytes verified at version {last.version}: the push of "
                       f"version {version} did not replace them (an old version still served under a reused id)")
        elif not ok and fingerprint is not None and last.fingerprint is not None and fingerprint != last.fingerprint \
                and version == last.version:
            out.append(f"adapter {adapter_id} was replaced under the same id: it holds other bytes than the ones verified "
                       f"at version {last.version}")
        return out

    def record(self, adapter_id: int, version: int | None, fingerprint: str | None, expected: Any = None) -> None:
        """Remember a verification that passed; ``expected``: with ``fingerprint`` None (verified in no
        slot), what it expected, handed back by :meth:`expectation` to check the slot later."""
        self._by_id[adapter_id] = _Verified(version, fingerprint, time.time(), expected if fingerprint is None else None)
        self._failed.pop(adapter_id, None)

    def fail(self, adapter_id: int, version: int | None) -> None:
        """Remember a verification of ``adapter_id`` at ``version`` that failed: until one passes, the
        audit names the adapter wherever it serves (what it holds is not that version)."""
        self._failed[adapter_id] = version

    def expectation(self, adapter_id: int) -> tuple[int | None, Any] | None:
        """``(version, expected)`` of ``adapter_id`` when it was last verified in no slot, or None."""
        v = self._by_id.get(adapter_id)
        return None if v is None or v.fingerprint is not None or v.expected is None else (v.version, v.expected)

    def audit(self, active: Mapping[int, str | None], skip: Iterable[int] = ()) -> tuple[list[int], list[int], list[str]]:
        """Check ``{adapter id: fingerprint of its slot}`` of the adapters active now (but ``skip``, named
        by the caller already).

        Returns:
            ``(never verified ids, changed ids, problems)``: one sentence per problem.
        """
        never, changed, problems = [], [], []
        skip = set(skip)
        for aid, fp in sorted(active.items()):
            last = self._by_id.get(aid)
            if aid in skip:
                continue
            if aid in self._failed:
                changed.append(aid)
                problems.append(f"adapter {aid} is active in a LoRA slot, and its last verification (version "
                                f"{self._failed[aid]}) failed: it does not serve the trainer's adapter")
            elif last is None:
                never.append(aid)
                problems.append(f"adapter {aid} is active in a LoRA slot but the trainer never verified it on this worker")
            elif fp is not None and last.fingerprint is not None and fp != last.fingerprint:
                changed.append(aid)
                problems.append(f"adapter {aid} holds other bytes than the ones verified at version {last.version} "
                                "(replaced under the same id?)")
        return never, changed, problems
