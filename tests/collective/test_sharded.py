"""Sharded digest evaluation (docs/digest-spec.md §7.1): chunk roots of dim-0 shards, chained with
the full tensor's seed, equal ``tensor_digest`` of the gathered tensor; a layout that breaks the
shard rule falls back to gathering the bytes (or raises, on request).

In-process tests cover the roots entries and the combine; a module fixture runs the
``torch.distributed`` helper once on three gloo CPU processes (loopback only) and the tests below
check what each rank saw.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from tests.support.dist_utils import init_rank, rank_result, spawn_ranks

from refit_verify import tensor_digest

from refit_verify.digest import _torch as _torch_digest

from refit_verify.digest import reference
from refit_verify.collective.sharded import (
    CHUNK_BYTES,
    ShardLayoutError,
    check_shard_layout,
    combine_chunk_roots,
    dim0_byte_ranges,
    shard_chunk_roots,
    sharded_digest,
)

MiB = 1 << 20


def _tensor(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-128, 128, shape, dtype=torch.int64, generator=g).to(dtype)


# ------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 13, 8 * 16 + 3, 8 * 4097 + 5])
def test_roots_entries_match_reference(nbytes: int) -> None:
    u8 = _tensor(torch.uint8, (nbytes,), nbytes)
    lanes = reference.lanes(u8.numpy().tobytes()) if nbytes else []
    want = [(reference.chunk_root(0, lanes), reference.chunk_root(1, lanes))] if nbytes else []
    assert _torch_digest.chunk_roots_u8(u8) == want
    nd = pytest.importorskip("refit_verify.digest._numba")
    assert nd.chunk_roots_u8(u8) == want


def test_roots_entries_agree_on_chunks_and_odd_offsets() -> None:
    nd = pytest.importorskip("refit_verify.digest._numba")
    base = _tensor(torch.uint8, (2 * CHUNK_BYTES + 8 * 70000 + 3 + 1,), 1)
    u8 = base[1:]  # odd storage offset: both entries copy to aligned lanes
    r = nd.chunk_roots_u8(u8)
    assert len(r) == 3
    assert r == _torch_digest.chunk_roots_u8(u8)


@pytest.mark.parametrize(
    "dtype,shape,cut_rows",
    [
        (torch.int8, (24 * 1024, 1024), [8 * 1024, 16 * 1024]),  # 3 full chunks, 3 shards
        (torch.int8, (24 * 1024 + 77, 1024), [8 * 1024, 16 * 1024]),  # last shard longer
        (torch.bfloat16, (8 * 1024 + 3, 1024), [4 * 1024]),  # 16 MiB + 6 KiB: 3 chunks, 2 shards
        (torch.bfloat16, (8 * 1024, 1024), [0, 4 * 1024, 4 * 1024, 8 * 1024]),  # empty shards
        (torch.float32, (2 * MiB + 1,), [2 * MiB]),  # 1-D, 4-byte tail shard
    ],
)
def test_combined_roots_equal_full_digest(dtype, shape, cut_rows) -> None:
    t = _tensor(dtype, shape, 7)
    cuts = [0, *cut_rows, shape[0]]
    shards = [t[a:b] for a, b in zip(cuts[:-1], cuts[1:])]
    row_bytes = t[0].numel() * t.element_size()
    ranges = dim0_byte_ranges([s.shape[0] for s in shards], row_bytes)
    assert check_shard_layout(ranges, t.numel() * t.element_size()) is None
    roots = [r for s, (off, _) in zip(shards, ranges) for r in shard_chunk_roots(s, byte_offset=off)]
    assert combine_chunk_roots(roots, t.dtype, t.shape) == tensor_digest(t)
    assert combine_chunk_roots(roots, dtype_name := str(t.dtype).removeprefix("torch."), list(t.shape),
                               t.numel() * t.element_size()) == tensor_digest(t), dtype_name


def test_combine_small_and_empty() -> None:
    for t in (torch.zeros(0, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8), torch.tensor(1.5)):
        u8 = t.reshape(-1).view(torch.uint8)
        assert combine_chunk_roots(shard_chunk_roots(t, byte_offset=0), t.dtype, t.shape) == tensor_digest(t)
        assert combine_chunk_roots(_torch_digest.chunk_roots_u8(u8), t.dtype, t.shape) == tensor_digest(t)


def test_roots_order_and_count_matter() -> None:
    t = _tensor(torch.int8, (16 * 1024, 1024), 3)
    roots = shard_chunk_roots(t, byte_offset=0)
    assert len(roots) == 2
    assert combine_chunk_roots(roots[::-1], t.dtype, t.shape) != tensor_digest(t)
    with pytest.raises(ShardLayoutError, match="2 chunk roots"):
        combine_chunk_roots(roots, t.dtype, (24 * 1024, 1024))
    with pytest.raises(ShardLayoutError, match="1 chunk roots"):
        combine_chunk_roots(roots[:1], t.dtype, t.shape)


def test_shard_rule() -> None:
    C = CHUNK_BYTES
    assert check_shard_layout([(0, C), (C, C), (2 * C, 5)], 2 * C + 5) is None
    assert check_shard_layout([(0, 2 * C), (2 * C, 0), (2 * C, C + 1)], 3 * C + 1) is None
    assert check_shard_layout([(0, 17)], 17) is None
    assert check_shard_layout([], 0) is None
    assert "not a multiple" in check_shard_layout([(0, C - 8), (C - 8, C + 8)], 2 * C)
    assert "not a multiple" in check_shard_layout([(0, C + 8), (C + 8, 8)], C + 16)
    with pytest.raises(ShardLayoutError, match="tile"):
        check_shard_layout([(0, C), (C + 8, 8)], C + 16)
    with pytest.raises(ShardLayoutError, match="cover"):
        check_shard_layout([(0, C)], 2 * C)
    with pytest.raises(ShardLayoutError, match="multiple"):
        shard_chunk_roots(torch.zeros(8, dtype=torch.uint8), byte_offset=C // 2)
    assert shard_chunk_roots(torch.zeros(0, dtype=torch.uint8), byte_offset=3) == []


# ------------------------------------------------------------------------- three gloo processes

WORLD = 3

# name -> (dtype, full shape, rows per rank, fallback)
CASES = {
    "int8_3chunks": (torch.int8, (24 * 1024, 1024), [8 * 1024, 8 * 1024, 8 * 1024], "gather"),
    "int8_long_last": (torch.int8, (24 * 1024 + 77, 1024), [8 * 1024, 8 * 1024, 8 * 1024 + 77], "gather"),
    "bf16_tail": (torch.bfloat16, (8 * 1024 + 3, 1024), [4 * 1024, 4 * 1024, 3], "gather"),
    "bf16_empty_middle": (torch.bfloat16, (8 * 1024 + 3, 1024), [8 * 1024, 0, 3], "gather"),
    "int8_misaligned": (torch.int8, (20000, 1024), [7000, 7000, 6000], "gather"),
    "bf16_misaligned": (torch.bfloat16, (8 * 1024 + 3, 1024), [4 * 1024 + 1, 4 * 1024 - 1, 3], "gather"),
    "int8_misaligned_raise": (torch.int8, (20000, 1024), [7000, 7000, 6000], "raise"),
}


def _sharded_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    init_rank(rank, WORLD, port, one_numba_thread=True)  # three processes on a small machine: no oversubscription
    try:
        with rank_result(out_dir, rank) as out:
            for name, (dtype, shape, rows, fallback) in CASES.items():
                full = _tensor(dtype, shape, zlib.crc32(name.encode()) % 1000)
                a = sum(rows[:rank])
                shard = full[a : a + rows[rank]]
                try:
                    res = sharded_digest(shard, shape, dst=1, fallback=fallback)
                    out[name] = {"digest": res.digest, "path": res.path, "reason": res.reason,
                                 "want": tensor_digest(full) if rank == 1 else None}
                except Exception as e:  # noqa: BLE001
                    out[name] = {"error": type(e).__name__, "message": str(e)}
            # metadata disagreement: one rank holds other trailing dims
            bad = torch.zeros((4, 8 if rank != 2 else 9), dtype=torch.int8)
            try:
                sharded_digest(bad, (12, 8))
                out["bad_shape"] = {"error": None}
            except Exception as e:  # noqa: BLE001
                out["bad_shape"] = {"error": type(e).__name__, "message": str(e)}
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_sharded_worker, WORLD, str(tmp_path_factory.mktemp("sharded")))


@pytest.mark.parametrize("case", ["int8_3chunks", "int8_long_last", "bf16_tail", "bf16_empty_middle"])
def test_distributed_roots_path_equals_gathered_digest(ranks, case) -> None:
    dst = ranks[1][case]
    assert dst["path"] == "roots" and dst["reason"] is None
    assert dst["digest"] == dst["want"]
    for r in (0, 2):
        assert ranks[r][case]["digest"] is None and ranks[r][case]["path"] == "roots"


@pytest.mark.parametrize("case", ["int8_misaligned", "bf16_misaligned"])
def test_distributed_misaligned_falls_back_to_gather(ranks, case) -> None:
    dst = ranks[1][case]
    assert dst["path"] == "gather" and "not a multiple" in dst["reason"]
    assert dst["digest"] == dst["want"]
    assert all(ranks[r][case]["path"] == "gather" and ranks[r][case]["digest"] is None for r in (0, 2))


def test_distributed_misaligned_raise_on_every_rank(ranks) -> None:
    for r in range(WORLD):
        got = ranks[r]["int8_misaligned_raise"]
        assert got["error"] == "ShardLayoutError" and "shard rule does not hold" in got["message"]


def test_distributed_metadata_disagreement_raises_everywhere(ranks) -> None:
    for r in range(WORLD):
        assert ranks[r]["bad_shape"]["error"] == "ShardLayoutError"
        assert "group rank 2" in ranks[r]["bad_shape"]["message"]
