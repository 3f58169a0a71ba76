"""Derived views on CUDA (``refit_verify.digest.kernels.launch.plan_views(derive=True)``): regions of a
fused parameter read in its launch take its whole 512 KiB superblocks from the parameter's leaf
pass (a gather launch before the upper stage). The compiled kernels give the CPU path's digests
(numba: independent of the launches under test), in a plan whose regions cross the parameter's
chunk boundary and span chunks of their own; a kept set with regions stays right through its JIT
runs, its checked direct launches and its CUDA graph replays while the memory changes. Needs a
CUDA GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

if torch.cuda.is_available():
    from refit_verify.config import CUDA_GRAPHS_ENV_VAR, DIRECT_LAUNCH_ENV_VAR
    from refit_verify.digest import reference as ref
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.digest.kept import DigestSet
    from refit_verify.digest.kernels import direct, replay
    from refit_verify.digest.kernels import launch as kd

SB = 512 * 1024


def _cpu(u: torch.Tensor) -> str:
    return tensor_digest(u.cpu())


def test_derived_views_cross_chunks_and_equal_the_cpu_path():
    """A parent of 40 superblocks + 3 bytes (three chunks) and regions of it: full superblocks only,
    a partial last one, regions crossing the parent's chunk boundaries and spanning two chunks of
    their own (the second with whole superblocks), unaligned and small ones (read), an unrelated view."""
    g = torch.Generator(device="cuda").manual_seed(5)
    buf = torch.randint(0, 256, (40 * SB + 3,), dtype=torch.uint8, device="cuda", generator=g)
    views = [buf, buf[: 2 * SB], buf[SB : 2 * SB + 1003], buf[15 * SB : 34 * SB + 5], buf[3 * SB : 40 * SB + 3],
             buf[8 : 8 + 3 * SB], buf[5 * SB : 5 * SB + 4096], buf[31 * SB : 33 * SB],
             torch.randint(0, 256, (70_001,), dtype=torch.uint8, device="cuda", generator=g)]
    seeds = [ref.seed("uint8", (u.numel(),), u.numel()) for u in views]
    p = kd.plan_views(views, seeds, derive=True)
    assert p.G == 2 + 1 + 19 + 37 + 2
    want = [_cpu(u) for u in views]
    assert kd.to_hex(kd.run_plan(p)) == want
    assert kd.to_hex(kd.digest_views(views, seeds)) == want  # the same views, every one read


@pytest.mark.parametrize("graphs", ["0", "1"])
def test_a_kept_set_of_a_fused_parameter_and_its_rows_through_direct_launches_and_graphs(monkeypatch, graphs):
    """A Qwen-like fused ``qkv_proj`` (q 4096 rows, k and v 1024 rows of 2560 bf16, + 3 padding rows)
    and its rows in one kept set: runs 1-2 through the JIT (the second checks the direct launches or
    captures the graph), then direct launches or replays; a row changed between runs is read."""
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, graphs)
    monkeypatch.delenv(DIRECT_LAUNCH_ENV_VAR, raising=False)
    monkeypatch.setattr(direct, "_OFF", None)
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    p = torch.randn(6144 + 3, 2560, device="cuda").to(torch.bfloat16)
    rows = [(0, 4096), (4096, 5120), (5120, 6147), (1, 4096)]
    regions = [(0, tuple(p.shape), p.stride())] + [(a * 2560, (b - a, 2560), (2560, 1)) for a, b in rows]
    s = DigestSet([p] * 5, regions)
    assert s.saved == (4096 * 5120 // SB + 1024 * 5120 // SB + 1027 * 5120 // SB) * SB  # the off rows are read
    try:
        for r in range(6):
            p[(r * 977) % p.shape[0], r] += 1
            assert s.digest() == [_cpu(p[a:b]) for a, b in [(0, p.shape[0]), *rows]], f"run {r + 1}"
        (_pos, kept, _backend, _large), = s._groups
        if graphs == "1":
            assert kept.graph not in (None, False)
        else:
            assert kept.direct not in (None, False)
    finally:
        replay.release_all()
