"""Shared helpers of the multi-process (torch.distributed) tests: ports, numba warm-up, spawn."""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import traceback
from datetime import timedelta
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


def spawn_ranks(worker: Callable, world: int, out_dir: str, *extra: object) -> list[dict]:
    """Run ``worker(rank, port, out_dir, *extra)`` on ``world`` spawned processes; return each
    rank's pickled result dict (``out_dir/rank{r}.pkl``), failing on a recorded crash."""
    import torch.multiprocessing as mp

    warm_numba_cache()
    mp.spawn(worker, args=(free_port(), out_dir, *extra), nprocs=world, join=True)
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
