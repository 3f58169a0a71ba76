"""The FAST-leaf variant lab (``benchmarks/digest_variants.py``) gives the production kernels' bits.

Every variant replaces only the FAST launch of ``kernels.digest``; on a view with a full
superblock and a partial one (both FAST programs: ``full`` variants run their unmasked copy on the
first, the masked copy on the second) each must give the reference digest. Without CUDA the
kernels run under the Triton interpreter, where ``asm`` runs as 0 (inline PTX is GPU-only; the PTX
itself is checked by ``test_digest_kernel.py::test_ptx_sequences_match_reference``).

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


@pytest.mark.parametrize("name", [n for n in dv.LEAF_VARIANTS if n != "v1"] + list(dv.EXTRA_VARIANTS))
def test_leaf_variant_matches_reference(name: str, variant_case) -> None:
    """Each variant on a 16-aligned view: the reference digest, as the production launch gives."""
    u, seeds, want = variant_case
    assert u.data_ptr() % 16 == 0
    lf = dv.LEAF_VARIANTS.get(name) or dv.EXTRA_VARIANTS[name]
    assert kd.to_hex(dv.digest_views([u], seeds, lf)) == [want]


def test_production_is_the_named_variant(variant_case) -> None:
    """``_leaf.FAST_LEAF`` is the lab's PRODUCTION variant (same knobs), and both give the same words
    as ``kernels.digest.digest_views``."""
    lf = dv.LEAF_VARIANTS[dv.PRODUCTION]
    assert {k: v for k, v in lf.items() if k not in ("mode", "full")} == _leaf.FAST_LEAF
    assert lf["mode"] == "fused" and lf["full"] is True
    u, seeds, want = variant_case
    assert torch.equal(dv.digest_views([u], seeds, lf), kd.digest_views([u], seeds))
    assert kd.to_hex(kd.digest_views([u], seeds)) == [want]


def test_unknown_mode_is_refused(variant_case) -> None:
    u, seeds, _ = variant_case
    with pytest.raises(ValueError, match="unknown LEAF mode 'bogus'"):
        dv.digest_views([u], seeds, dict(mode="bogus"))
