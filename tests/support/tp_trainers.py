"""Trainer ranks for colocated tensor-parallel refits (tests/e2e/test_tp2.py, benchmarks/bench_refit.py --tp).

The reference design's topology: a trainer of ``world`` ranks (one process each, a
``torch.distributed`` group: NCCL on GPUs, gloo on CPUs), rank ``r`` on ``cuda:r`` beside the vLLM
worker of rank ``r``. Rank 0 builds the state dict and broadcasts it over the trainer group (every
rank then holds the full state dict, as after an FSDP all-gather); on each command every rank
streams it through its own :class:`~refit_verify.transport.RefitSender` to
``endpoint.format(rank=r)``, which the worker of the same rank reads through
``collective_rpc("refit_verify_receive", (endpoint, ...))``.

Processes are persistent, so a benchmark pays the start-up (imports, NCCL init) once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import traceback
from typing import Any

import torch


def _report_dict(rank: int, out: Any, wall: float, stats: dict) -> dict:
    """Plain-data view of a sender's outcome (a report or an exception) for the parent process."""
    from refit_verify.errors import RefitVerificationError

    d: dict[str, Any] = {"rank": rank, "wall_s": wall, "digest_s": float(stats.get("digest_s", 0.0)), "error": None}
    report = out.report if isinstance(out, RefitVerificationError) else out
    if isinstance(out, BaseException):
        d["error"] = {"type": type(out).__name__, "message": str(out)}
    if report is not None and not isinstance(report, BaseException):
        d.update(ok=report.ok, verified=report.verified, report_rank=report.rank, mismatched=list(report.mismatched),
                 missing=list(report.missing), unexpected=list(report.unexpected), problems=list(report.problems),
                 version=report.version)
    return d


def _trainer_main(rank: int, world: int, port: int, backend: str, cfg: dict, seed: int, endpoint: str,
                  commands: mp.Queue, results: mp.Queue) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    from refit_verify import RefitConfig

    from refit_verify.testing import models
    from refit_verify.cli.demo import OneByteFlipSender
    from refit_verify.transport import RefitSender
    from tests.support.dist_utils import init_rank

    try:
        device = init_rank(rank, world, port, backend, timeout_s=300.0)
        if rank == 0:
            weights = models.random_state_dict(cfg, seed=seed, device=device)
        else:
            weights = {n: torch.empty(s, dtype=torch.bfloat16, device=device) for n, s in models.param_shapes(cfg).items()}
        for t in weights.values():  # the trainer group hands rank 0's weights to every rank
            dist.broadcast(t, src=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        results.put({"rank": rank, "ready": True, "tensors": len(weights),
                     "bytes": sum(t.numel() * t.element_size() for t in weights.values())})
        while True:
            cmd = commands.get()
            if cmd is None:
                break
            rc = RefitConfig.build(**cmd["config"])
            fault = cmd.get("fault")
            ep = endpoint.format(rank=cmd.get("bind", {}).get(rank, rank))  # another rank's endpoint: a wiring fault
            version = cmd.get("versions", {}).get(rank)
            if fault and fault["rank"] == rank:
                sender = OneByteFlipSender(config=rc, device=device, endpoint=ep, rank=rank, target=fault["target"],
                                           byte_index=fault["byte_index"])
            else:
                sender = RefitSender(config=rc, device=device, endpoint=ep, rank=rank)
            results.put({"rank": rank, "bound": ep})  # the endpoint exists before the workers are asked to connect
            t0 = time.perf_counter()
            try:
                out: Any = sender.send(weights.items(), version=version)
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = e
            finally:
                sender.close()
            results.put(_report_dict(rank, out, time.perf_counter() - t0, getattr(sender, "last_stats", None) or {}))
    except Exception:  # noqa: BLE001 - reported to the parent
        results.put({"rank": rank, "crash": traceback.format_exc()})
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class TrainerRanks:
    """``world`` persistent trainer processes, each a sender of the full state dict to its own worker.

    Args:
        world: number of trainer ranks (= the engine's tensor-parallel size).
        cfg: HF config dict of the model (``refit_verify.testing.models`` builds the state dict from it).
        seed: seed of rank 0's random weights.
        endpoint: ZMQ endpoint with ``{rank}``, e.g. ``ipc:///tmp/x/r{rank}.sock``.
        backend: ``nccl`` (rank r on ``cuda:r``) or ``gloo`` (CPU); default by CUDA availability.
        start_timeout_s: seconds to wait for every rank to be up and hold the weights.

    Raises:
        RuntimeError: a rank crashed or did not come up in time (its traceback in the message).
    """

    def __init__(self, world: int, cfg: dict, seed: int, endpoint: str, backend: str | None = None,
                 start_timeout_s: float = 240.0) -> None:
        from tests.support.dist_utils import free_port, warm_numba_cache

        self.world, self.endpoint = world, endpoint
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        warm_numba_cache()
        ctx = mp.get_context("spawn")
        self._results: mp.Queue = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self._procs = [ctx.Process(target=_trainer_main, daemon=True, name=f"trainer-rank{r}",
                                   args=(r, world, port, self.backend, cfg, seed, endpoint, self._commands[r], self._results))
                       for r in range(world)]
        for p in self._procs:
            p.start()
        self.info = self._collect(start_timeout_s)

    def _collect(self, timeout_s: float) -> dict[int, dict]:
        got: dict[int, dict] = {}
        deadline = time.monotonic() + timeout_s
        while len(got) < self.world:
            try:
                d = self._results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"trainer ranks {sorted(set(range(self.world)) - set(got))} silent for {timeout_s} s") from None
            if "crash" in d:
                raise RuntimeError(f"trainer rank {d['rank']} crashed:\n{d['crash']}")
            got[d["rank"]] = d
        return got

    def start_send(self, config: dict, fault: dict | None = None, bind: dict[int, int] | None = None,
                   versions: dict[int, int] | None = None) -> None:
        """Make every rank send once with ``RefitConfig.build(**config)``; return once every rank's
        sender bound its endpoint. ``fault``: ``{"rank", "target", "byte_index"}`` makes that rank a
        :class:`~refit_verify.cli.demo.OneByteFlipSender`; ``bind``: ``{rank: other rank}`` binds that
        rank's sender to the other rank's endpoint (its worker gets this rank's payload); ``versions``:
        ``{rank: weight version}`` that rank sends (default unversioned)."""
        for q in self._commands:
            q.put({"config": config, "fault": fault, "bind": dict(bind or {}), "versions": dict(versions or {})})
        self._collect(60.0)  # every rank bound its endpoint

    def results(self, timeout_s: float = 300.0) -> dict[int, dict]:
        """Wait for every rank's outcome of the last :meth:`start_send` (see ``_report_dict``)."""
        return self._collect(timeout_s)

    def close(self) -> None:
        for q in self._commands:
            q.put(None)
        for p in self._procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> TrainerRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
