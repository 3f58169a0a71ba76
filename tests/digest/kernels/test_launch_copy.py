"""The COPY variant of the leaf kernels (``plan_views(..., dsts=...)``): one read of each view gives its
digest v1 (equal to the reference) and its bytes in the destination (zeros in the last lane's padding,
nothing past it, nothing past a masked lane), for the sizes around every structural boundary, views at
odd storage offsets (funnel-shift loader) and several views per launch; bad destinations are refused.

Without CUDA the kernels run under the Triton interpreter on CPU tensors (sizes kept small: the one
input over a leaf superblock, which takes a FAST program and a general one, is the slowest); with
CUDA (no ``TRITON_INTERPRET``) the same tests run the compiled kernels on the GPU.

Source: docs/digest-spec.md §2, §6.1
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_interp import kernel_module

kd, DEV, pytestmark = kernel_module()  # the interpreter on CPU (set before triton's import), CUDA compiled

from refit_verify.digest import reference as ref  # noqa: E402

L = 8
FILL = 0xA5  # what the destination holds before the run: bytes the kernels must not touch keep it
SB = 65536  # lanes of a leaf superblock
# 0, lane boundaries, a level-0 block, a small chunk with a tail, one lane over a superblock plus a tail
SIZES = [0, 1, 7, 8, 9, 4095, 4096 * 16 + 3, (SB + 1) * L + 3]


def _rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(DEV)


def _expect(u: torch.Tensor) -> str:
    return ref.digest_bytes(u.cpu().numpy().tobytes(), "uint8", (u.numel(),))


def _lanes_bytes(n: int) -> int:
    return (n + L - 1) // L * L


def _copy_run(views: list[torch.Tensor], dsts: list[torch.Tensor]) -> list[str]:
    seeds = [ref.seed("uint8", (u.numel(),), u.numel()) for u in views]
    return kd.to_hex(kd.digest_views(views, seeds, dsts=dsts))


def _check_dst(dst: torch.Tensor, u: torch.Tensor) -> None:
    n, r = u.numel(), _lanes_bytes(u.numel())
    d = dst.cpu()
    assert torch.equal(d[:n], u.cpu()), "the copied bytes differ from the view's"
    assert bool((d[n:r] == 0).all()), "the last lane's padding is not zero"
    assert bool((d[r:] == FILL).all()), "bytes past the last lane were written"


def _dst(n: int, extra: int = 24) -> torch.Tensor:
    return torch.full((_lanes_bytes(n) + extra,), FILL, dtype=torch.uint8, device=DEV)


@pytest.mark.parametrize("nbytes", SIZES)
def test_copy_and_digest_match_reference_and_source(nbytes: int) -> None:
    u = _rand(nbytes, nbytes)
    dst = _dst(nbytes)
    p = kd.plan_views([u], [ref.seed("uint8", (nbytes,), nbytes)], dsts=[dst])
    if nbytes == (SB + 1) * L + 3:
        assert p.F == 1 and p.P == 2  # the FAST kernel's COPY path and the general one's, both exercised
    got = kd.to_hex(kd.run_plan(p))
    assert got == [_expect(u)]
    _check_dst(dst, u)


@pytest.mark.parametrize("offset", [1, 3, 7])
def test_misaligned_views_copy_through_the_funnel_loader(offset: int) -> None:
    buf = _rand(4096 * 16 + 3 + 16, offset)
    for n in (1, 9, 4095, 4096 * 16 + 3):
        u = buf[offset : offset + n]
        assert u.data_ptr() % L == offset % L
        dst = _dst(n)
        assert _copy_run([u], [dst]) == [_expect(u)], (offset, n)
        _check_dst(dst, u)


def test_several_views_in_one_launch_into_one_staging_buffer() -> None:
    """Slots of one buffer, packed as the Packer does (offsets rounded up to 16): each gets its own view's bytes."""
    src = _rand(70000, 5)
    cases = [(0, 13), (1, 0), (3, 4097 * L + 5), (8, 8), (517, 7), (5, 61441 * L // 8)]
    views = [src[o : o + n] for o, n in cases]
    offs, used = [], 0
    for v in views:
        offs.append(used)
        used += (v.numel() + 15) // 16 * 16
    staging = torch.full((used + 64,), FILL, dtype=torch.uint8, device=DEV)
    dsts = [staging[o : o + _lanes_bytes(v.numel())] for o, v in zip(offs, views)]
    assert _copy_run(views, dsts) == [_expect(v) for v in views]
    for o, v in zip(offs, views):
        n = v.numel()
        assert torch.equal(staging[o : o + n].cpu(), v.cpu())
        assert bool((staging[o + n : o + _lanes_bytes(n)] == 0).all())
    assert bool((staging[used:] == FILL).all())


def test_copy_plan_runs_again_on_new_bytes() -> None:
    """A kept copy plan (the same slots at every refit) copies and digests what the memory holds at each run."""
    u = _rand(4096 + 5, 11)
    dst = _dst(u.numel())
    p = kd.plan_views([u], [ref.seed("uint8", (u.numel(),), u.numel())], dsts=[dst])
    for k in range(2):
        u[k * 100] ^= 0xFF
        assert kd.to_hex(kd.run_plan(p)) == [_expect(u)]
        _check_dst(dst, u)


def test_bad_destinations_are_refused() -> None:
    u = _rand(100, 1)
    s = [ref.seed("uint8", (100,), 100)]
    buf = torch.zeros(256, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="needs 104"):
        kd.plan_views([u], s, dsts=[buf[:100]])  # no room for the last lane
    with pytest.raises(ValueError, match="not 8-byte aligned"):
        kd.plan_views([u], s, dsts=[buf[4:120]])
    with pytest.raises(TypeError, match="uint8"):
        kd.plan_views([u], s, dsts=[buf.view(torch.int64)])
    with pytest.raises(ValueError, match="overlaps a view"):
        kd.plan_views([buf[3:103]], s, dsts=[buf[96:200]])
    with pytest.raises(ValueError, match="overlaps destination"):
        kd.plan_views([u, u], s * 2, dsts=[buf[:104], buf[96:200]])
    with pytest.raises(ValueError, match="derive"):
        kd.plan_views([u], s, derive=True, dsts=[buf[:104]])
    with pytest.raises(ValueError, match="destinations"):
        kd.plan_views([u], s, dsts=[])
