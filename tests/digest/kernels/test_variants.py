"""The FAST-leaf variant lab (``benchmarks/digest_variants.py``) gives the production kernels' bits.

Every variant replaces only the FAST launch of ``kernels.digest``; on a view with a full
superblock and a partial one (both FAST programs: ``full`` variants run their unmasked copy on the
first, the masked copy on the second) each must give the reference digest. Without CUDA the
kernels run under the Triton interpreter, where ``asm`` runs as 0 (inline PTX is GPU-only; the PTX
itself is checked by ``test_launch.py::test_ptx_sequences_match_reference``) and launch options
(warps, register cap) are dropped: variants whose FAST launches then hand their kernels the same
arguments run the same computation, which runs once per module (:func:`_interpreted_launch`).

Source: docs/digest-spec.md
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import digest_variants as dv  # noqa: E402

from refit_verify.digest import reference as ref  # noqa: E402
from refit_verify.digest.kernels import _leaf  # noqa: E402
from refit_verify.digest.kernels import launch as kd  # noqa: E402

DEV = "cpu" if kd._INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(
    DEV == "cuda" and not torch.cuda.is_available(),
    reason="triton was imported without TRITON_INTERPRET=1 and there is no CUDA device",
)
L = 8
_VAR_LANES = 65536 + 4097  # one full superblock + a partial one whose blocks 2..15 are zero values


@pytest.fixture(scope="module")
def variant_case() -> tuple[torch.Tensor, list[tuple[int, int]], str]:
    g = torch.Generator().manual_seed(21)
    u = torch.randint(0, 256, (_VAR_LANES * L,), dtype=torch.uint8, generator=g).to(DEV)
    seeds = [ref.seed("uint8", (u.numel(),), u.numel())]
    return u, seeds, ref.digest_bytes(u.cpu().numpy().tobytes(), "uint8", (u.numel(),))


_NAMES = [n for n in dv.LEAF_VARIANTS if n != "v1"] + list(dv.EXTRA_VARIANTS)


class _Recorder:
    """Stands for a jitted kernel in ``dv.launch``: records ``(kernel, grid, the arguments it takes)``."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            taken = {k: v for k, v in kwargs.items() if k in self.kernel.arg_names}  # as the interpreter's GridExecutor
            self.calls.append((self.kernel.__name__, tuple(grid), len(args), tuple(sorted(taken.items()))))
        return launch


def _interpreted_launch(lf: dict) -> tuple:
    """What variant ``lf``'s FAST launch runs under the interpreter: the view alignment its plan needs and,
    per kernel launched, (kernel, grid, the constexpr arguments the kernel takes); launch options
    (``num_warps``, ``maxnreg``, ``num_stages``), which the interpreter drops, are not part of it."""
    calls: list = []
    with pytest.MonkeyPatch.context() as mp:
        for k in ("_leaf_fused_kernel", "_leaf_l0_kernel", "_leaf_l1_kernel", "_digest_leaf_kernel"):
            mp.setattr(dv, k, _Recorder(getattr(dv, k), calls))
        dv.launch(lf, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 1, 1, 8, 1)
    return (dv._align(lf), tuple(calls))


@pytest.fixture(scope="module")
def variant_words(variant_case):
    """``name -> dv.digest_views`` words of ``variant_case``; under the interpreter, variants with the same
    :func:`_interpreted_launch` share one run (compiled on CUDA, every variant runs)."""
    u, seeds, _ = variant_case
    runs: dict = {}

    def words(name: str) -> torch.Tensor:
        lf = dv.LEAF_VARIANTS.get(name) or dv.EXTRA_VARIANTS[name]
        key = _interpreted_launch(lf) if kd._INTERPRETED else name
        if key not in runs:
            runs[key] = dv.digest_views([u], seeds, lf)
        return runs[key]

    return words


@pytest.mark.skipif(not kd._INTERPRETED, reason="the interpreter's launches")
def test_variants_sharing_a_run_launch_the_same_kernels() -> None:
    """The variants the interpreter runs once: the same kernels, grids and kernel arguments, and they differ
    only in options the interpreter does not run (``warps``, ``asm`` -> 0 there, ``maxnreg``); variants with
    other knobs do not share (12 runs for the 18 variants)."""
    keys = {n: _interpreted_launch(dv.LEAF_VARIANTS.get(n) or dv.EXTRA_VARIANTS[n]) for n in _NAMES}
    gpu_only = ("warps", "asm", "maxnreg", "stages")
    for a in _NAMES:
        for b in _NAMES:
            la, lb = (dv.LEAF_VARIANTS.get(n) or dv.EXTRA_VARIANTS[n] for n in (a, b))
            same_knobs = ({k: v for k, v in la.items() if k not in gpu_only} == {k: v for k, v in lb.items() if k not in gpu_only})
            assert (keys[a] == keys[b]) == same_knobs, (a, b)
    assert keys["f128w4-full"] == keys[dv.PRODUCTION] and keys["f256w8-full"] == keys["f256w8-full-asm6-r40"]
    assert len(set(keys.values())) == 12 and len(_NAMES) == 18


@pytest.mark.parametrize("name", _NAMES)
def test_leaf_variant_matches_reference(name: str, variant_case, variant_words) -> None:
    """Each variant on a 16-aligned view: the reference digest, as the production launch gives."""
    u, seeds, want = variant_case
    assert u.data_ptr() % 16 == 0
    assert kd.to_hex(variant_words(name)) == [want]


def test_production_is_the_named_variant(variant_case, variant_words) -> None:
    """``_leaf.FAST_LEAF`` is the lab's PRODUCTION variant (same knobs), and both give the same words
    as ``kernels.digest.digest_views``."""
    lf = dv.LEAF_VARIANTS[dv.PRODUCTION]
    assert {k: v for k, v in lf.items() if k not in ("mode", "full")} == {k: v for k, v in _leaf.FAST_LEAF.items() if k != "copy_maxnreg"}
    assert lf["mode"] == "fused" and lf["full"] is True
    u, seeds, want = variant_case
    words = kd.digest_views([u], seeds)
    assert torch.equal(variant_words(dv.PRODUCTION), words)
    assert kd.to_hex(words) == [want]


def test_unknown_mode_is_refused(variant_case) -> None:
    u, seeds, _ = variant_case
    with pytest.raises(ValueError, match="unknown LEAF mode 'bogus'"):
        dv.digest_views([u], seeds, dict(mode="bogus"))
