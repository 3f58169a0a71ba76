"""Shared helpers of the multi-process (torch.distributed) tests: ports, numba warm-up, starting the ranks."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import time
import traceback
from datetime import timedelta
from pathlib import Path
from collections.abc import Callable, Iterator


def free_port() -> int:
    """Return a free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def warm_numba_cache() -> None:
    """Compile (or load) the numba digest in this process before spawning: concurrent first
    compilations of the same cached functions in several processes can leave a cache that
    segfaults later (numba issue #10128)."""
    from refit_verify.digest import backends

    try:
        backends.warmup_cpu()
    except ImportError:  # no numba: the torch path needs no warm-up
        return


def init_rank(rank: int, world: int, port: int, backend: str = "gloo", timeout_s: float = 60.0,
              one_numba_thread: bool = False):
    """Join the default ``torch.distributed`` group on loopback as ``rank`` of ``world``; return the
    rank's device: ``cuda:rank`` (made current) for NCCL, CPU for gloo. ``timeout_s`` bounds every
    collective; ``one_numba_thread`` keeps several CPU ranks on a small machine from oversubscribing."""
    import torch
    import torch.distributed as dist

    if one_numba_thread:
        try:
            import numba

            numba.set_num_threads(1)
        except Exception:  # noqa: BLE001 - no numba: the torch path has no thread pool to limit
            pass
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device = torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    return device


def _run_rank(worker: Callable, rank: int, port: int, out_dir: str, *extra: object) -> None:
    """In a rank (forked or spawned): run the worker; an exception's traceback goes to ``out_dir/rank{rank}.error``.

    A rank whose worker returned leaves through ``os._exit(0)``: its result file is written, and a
    spawned rank's interpreter teardown can abort in gloo's C++ destructors ("terminate called
    without an active exception", SIGABRT) after every rank has finished."""
    try:
        worker(rank, port, out_dir, *extra)
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.error"), "w") as f:
            f.write(traceback.format_exc())
        raise
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawned_rank(rank: int, worker: Callable, port: int, out_dir: str, *extra: object) -> None:
    """``torch.multiprocessing.spawn``'s entry (rank first): :func:`_run_rank`."""
    _run_rank(worker, rank, port, out_dir, *extra)


def _join(procs: list, out_dir: str, timeout_s: float) -> None:
    """Wait for every rank, at most ``timeout_s``; the first that fails (or the deadline) ends the others."""
    from multiprocessing.connection import wait

    deadline = time.monotonic() + timeout_s
    try:
        while any(p.exitcode is None for p in procs):
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"ranks still running after {timeout_s:.0f} s")
            wait([p.sentinel for p in procs if p.exitcode is None], timeout=left)
            for r, p in enumerate(procs):
                if p.exitcode not in (None, 0):
                    err = Path(out_dir) / f"rank{r}.error"
                    why = err.read_text() if err.exists() else ""
                    raise AssertionError(f"rank {r} exited with code {p.exitcode}\n{why}")
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
                p.join(5.0)


def spawn_ranks(worker: Callable, world: int, out_dir: str, *extra: object, timeout_s: float = 300.0) -> list[dict]:
    """Run ``worker(rank, port, out_dir, *extra)`` on ``world`` processes; return each rank's pickled
    result dict (``out_dir/rank{r}.pkl``), failing on a recorded crash, a failed rank or ``timeout_s``.

    Where the engine tests' preloaded server runs in this pytest process (``tests/support/preload.py``:
    torch and vLLM imported once; the e2e tests, which run first on each worker, start it) the ranks are
    its forks, not fresh Pythons that each import torch (about 5 s on 2 cores) and tear it down again;
    else (no server, CUDA, ``REFIT_VERIFY_TEST_SPAWN=1``) they are spawned (``torch.multiprocessing.spawn``)."""
    from tests.support import preload

    warm_numba_cache()
    port = free_port()
    if preload.applies() and preload.server_pid() is not None:
        ctx = preload.context()
        procs = [ctx.Process(target=_run_rank, args=(worker, r, port, out_dir, *extra)) for r in range(world)]
        for p in procs:
            p.start()
        _join(procs, out_dir, timeout_s)
    else:
        import torch.multiprocessing as mp

        mp.spawn(_spawned_rank, args=(worker, port, out_dir, *extra), nprocs=world, join=True)
    out = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.pkl"), "rb") as f:
            got = pickle.load(f)
        assert "crash" not in got, got.get("crash")
        out.append(got)
    return out


@contextlib.contextmanager
def rank_result(out_dir: str, rank: int) -> Iterator[dict]:
    """Yield a dict a spawned rank fills; on exit pickle it to ``out_dir/rank{rank}.pkl``, with the
    traceback under ``"crash"`` if the body raised (``spawn_ranks`` fails the test on it)."""
    out: dict = {}
    try:
        yield out
    except Exception:  # noqa: BLE001 - handed to the parent through the file
        out["crash"] = traceback.format_exc()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
