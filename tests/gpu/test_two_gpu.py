"""Two GPUs, one process each, NCCL: the verified broadcast path (rank 0 sends from cuda:0, rank 1
receives on cuda:1, a byte flipped on rank 1 is named with its rank and parameter) and the
sharded digest of CUDA shards (roots path and the gather fallback, both equal to
``tensor_digest`` of the full tensor).

Skipped unless ``torch.cuda.device_count() >= 2``. Child processes run with
``NCCL_NVLS_ENABLE=0`` (NVLink multicast off, as the H200 machines require). Run with ``-s`` to
see the timings each rank printed.
"""

from __future__ import annotations

import os
import time
import zlib

import pytest
import torch

from tests.support.dist_utils import init_rank, rank_result, spawn_ranks
from tests.collective.test_broadcast import ALL, SRC, check_clean, check_fault_enforce, run_scenarios

WORLD = 2

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (one process per GPU, NCCL)"),
]

# name -> (dtype, full shape, rows per rank)
SHARD_CASES = {
    "int8_2chunks": (torch.int8, (16 * 1024, 1024), [8 * 1024, 8 * 1024]),
    "bf16_tail": (torch.bfloat16, (8 * 1024 + 3, 1024), [4 * 1024, 4 * 1024 + 3]),
    "bf16_256MiB": (torch.bfloat16, (32 * 1024, 4096), [16 * 1024, 16 * 1024]),
    "int8_misaligned": (torch.int8, (20000, 1024), [7000, 13000]),
}


def _full(dtype: torch.dtype, shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g).to(dtype)
    else:
        t = torch.randint(-128, 128, shape, dtype=torch.int64, generator=g).to(dtype)
    return t.to(device)


def _sharded_cases(rank: int, device: torch.device) -> dict:
    from refit_verify import tensor_digest
    from refit_verify.collective.sharded import shard_chunk_roots, sharded_digest

    out: dict = {}
    for name, (dtype, shape, rows) in SHARD_CASES.items():
        full = _full(dtype, shape, zlib.crc32(name.encode()) % 1000, device)
        a = sum(rows[:rank])
        shard = full[a : a + rows[rank]]
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = sharded_digest(shard, shape, dst=0)
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        out[name] = {"digest": res.digest, "path": res.path, "reason": res.reason, "seconds": dt,
                     "want": tensor_digest(full) if rank == 0 else None,
                     "want_cpu": tensor_digest(full.cpu()) if rank == 0 else None}
        if res.path == "roots" and rows[rank] and a * full[0].numel() * full.element_size() % (8 << 20) == 0:
            off = a * full[0].numel() * full.element_size()
            out[name]["roots_match_cpu"] = shard_chunk_roots(shard, byte_offset=off) == shard_chunk_roots(shard.cpu(), byte_offset=off)
        print(f"rank {rank} {name}: {res.path} {dt * 1e3:.1f} ms", flush=True)
    return out


def _worker(rank: int, port: int, out_dir: str, backend: str = "nccl") -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    import torch.distributed as dist

    device = init_rank(rank, WORLD, port, backend, timeout_s=120.0)  # gloo: a CPU rehearsal of the same code
    try:
        with rank_result(out_dir, rank) as out:
            t0 = time.perf_counter()
            out["broadcast"] = run_scenarios(rank, WORLD, device, fault_rank=1, timeout_group=False)
            out["broadcast_s"] = time.perf_counter() - t0
            out["sharded"] = _sharded_cases(rank, device)
            dist.barrier()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass


def spawn_two(out_dir: str, backend: str = "nccl") -> list[dict]:
    os.environ["NCCL_NVLS_ENABLE"] = "0"  # inherited by the spawned children
    return spawn_ranks(_worker, WORLD, out_dir, backend)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_two(str(tmp_path_factory.mktemp("two_gpu")))


def test_nccl_broadcast_clean(ranks) -> None:
    check_clean([r["broadcast"] for r in ranks], WORLD)


def test_nccl_broadcast_fault_named_with_rank(ranks) -> None:
    b = [r["broadcast"] for r in ranks]
    check_fault_enforce(b, WORLD, fault_rank=1)
    check_fault_enforce(b, WORLD, fault_rank=1, key="fault_oversized", param="lm_head.weight")


def test_nccl_broadcast_log_off_load_error_abort(ranks) -> None:
    b = [r["broadcast"] for r in ranks]
    log = b[SRC]["fault_log"]
    assert not log["reports"][1]["ok"] and log["reports"][1]["mismatched"] == ["model.embed_tokens.weight"]
    assert b[1]["fault_log"]["loaded"] == sorted(ALL)
    assert b[SRC]["off"]["reports"] is None and b[1]["off"]["manifest"] is None
    assert b[SRC]["load_error"]["error"]["type"] == "RefitProtocolError"
    assert b[SRC]["abort"]["error"]["type"] == "TypeError" and b[1]["abort"]["error"]["type"] == "RefitAbortedError"
    assert b[SRC]["after_abort"]["reports"][1]["ok"]


@pytest.mark.parametrize("case", ["int8_2chunks", "bf16_tail", "bf16_256MiB"])
def test_cuda_sharded_roots_equal_full_digest(ranks, case) -> None:
    got = ranks[0]["sharded"][case]
    assert got["path"] == "roots"
    assert got["digest"] == got["want"] == got["want_cpu"]
    assert ranks[1]["sharded"][case]["digest"] is None
    for r in range(WORLD):
        assert ranks[r]["sharded"][case].get("roots_match_cpu", True)


def test_cuda_sharded_misaligned_gathers(ranks) -> None:
    got = ranks[0]["sharded"]["int8_misaligned"]
    assert got["path"] == "gather" and got["reason"]
    assert got["digest"] == got["want"] == got["want_cpu"]
