"""``refit_verify.digest.kernels.launch.chunk_roots`` (leaf + upper kernels, no chain) vs the CPU roots.

Without CUDA the kernels run under the Triton interpreter on CPU tensors; with CUDA, compiled.
The roots feed sharded digests (spec §7.1): roots of dim-0 shards cut on 8 MiB boundaries,
combined, equal the full tensor's digest.

Source: docs/digest-spec.md §6, §7.1
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from refit_verify.digest import _torch as td  # noqa: E402
from refit_verify.digest import reference as ref  # noqa: E402
from refit_verify.collective import sharded  # noqa: E402
from refit_verify.digest.kernels import launch as kd  # noqa: E402

DEV = "cpu" if kd._INTERPRETED else "cuda"
L = 8
CHUNK = ref.CHUNK_LANES * L  # 8 MiB


def _rand(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(DEV)


def _pairs(words: torch.Tensor) -> list[tuple[int, int]]:
    return [(a & ref.MASK64, b & ref.MASK64) for a, b in words.cpu().tolist()]


def test_roots_match_cpu_roots_batched() -> None:
    """Small views of every leaf path (one lane, a block, a leaf program, a byte tail, odd
    offsets), batched in one call: rows in view order, empty views give none."""
    buf = _rand(65537 * L + 64, 3)
    views = [buf[:1], buf[:0], buf[5 : 5 + 4097 * L + 5], buf[:65537 * L], _rand(300, 4), buf[3:4]]
    got = kd.chunk_roots(views)
    assert got.dtype == torch.int64 and tuple(got.shape) == (5, 2) and got.device == views[0].device
    want = [r for v in views for r in td.chunk_roots_u8(v.cpu())]
    assert _pairs(got) == want
    assert tuple(kd.chunk_roots([]).shape) == (0, 2)
    with pytest.raises(TypeError):
        kd.chunk_roots([buf[::2]])


def test_two_chunks_roots_and_sharded_combine(monkeypatch) -> None:
    """A 2-chunk byte string with a tail: the kernel's roots equal the CPU roots; cut at 8 MiB, the
    second shard's kernel root (``sharded``'s route on CUDA, at its byte offset) and the first chunk's
    combine into the full tensor's digest."""
    full = _rand(CHUNK + 4097 * L + 3, 11)
    got = _pairs(kd.chunk_roots([full]))
    assert len(got) == 2 and got == td.chunk_roots_u8(full.cpu())
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({DEV}))  # route sharded's roots to the kernels
    # shard 0 is exactly chunk 0, whose kernel root is got[0]; shard 1 goes through sharded's kernel route at its offset
    # (shard 0 through sharded: tests/collective/test_sharded.py; a second 8 MiB interpreter pass here adds nothing)
    roots = got[:1] + sharded.shard_chunk_roots(full[CHUNK:], byte_offset=CHUNK)
    assert roots == got
    n = full.numel()
    assert sharded.combine_chunk_roots(roots, torch.uint8, (n,), n) == ref.digest_bytes(full.cpu().numpy().tobytes(), "uint8", (n,))
