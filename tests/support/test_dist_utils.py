"""How the multi-process tests wait for their ranks (``dist_utils._join``): a failed rank or the deadline
ends the wait at once, names the rank and ends the others; a rank's traceback is in the failure."""

from __future__ import annotations

import multiprocessing
import time

import pytest

from tests.support.dist_utils import _join, _run_rank


def _fails(rank: int, port: int, out_dir: str) -> None:
    raise ValueError(f"rank {rank} broke")


def _hangs(rank: int, port: int, out_dir: str) -> None:
    time.sleep(120)  # a rank stuck in a collective


def _either(rank: int, port: int, out_dir: str) -> None:
    (_hangs if rank == 0 else _fails)(rank, port, out_dir)


def _start(worker, world: int, out_dir: str) -> list:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_run_rank, args=(worker, r, 0, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def test_a_failed_rank_ends_the_wait_with_its_traceback_and_the_others(tmp_path) -> None:
    procs = _start(_either, 2, str(tmp_path))
    with pytest.raises(AssertionError, match=r"(?s)rank 1 exited with code 1\n.*ValueError: rank 1 broke"):
        _join(procs, str(tmp_path), timeout_s=100.0)
    assert procs[0].exitcode is not None and procs[0].exitcode < 0  # killed, not waited out


def test_the_deadline_ends_the_wait_and_the_ranks(tmp_path) -> None:
    procs = _start(_hangs, 1, str(tmp_path))
    with pytest.raises(AssertionError, match="ranks still running after 1 s"):
        _join(procs, str(tmp_path), timeout_s=1.0)
    assert procs[0].exitcode is not None and procs[0].exitcode < 0
