"""Per-call host cost of the model boundary inside a real refit: between vLLM's ``load_weights`` calls.

A trainer that pushes one parameter at a time (TRL colocate, OpenRLHF) runs ``r.add(name, t)`` and
``model.load_weights([(name, t)])`` 310 times a refit. Each of refit-verify's steps then runs right
after vLLM's loader code, which leaves the host's caches cold: the same ``r.add`` costs several times
what it costs in a tight loop. This benchmark times
those steps where they run, in one in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
``REFIT_VERIFY=enforce``, the refit replaying its learned plan), interleaved round by round:

* ``r.add, in the loop``: the trainer's ``r.add`` of each tensor, under ``refit(copy=False)`` (held;
  ``--trainer-copy``: ``refit(copy=True)``, a copy per add);
* ``append, in the loop``: a list append of ``(name, tensor, version)`` in its place: the floor of
  any per-call Python there;
* ``taken adds fed to the stream``: ``refit(copy=False)``'s adds only take a plain tensor and hand
  what they took to the stream in one loop (``RefitCheck._feed``), at the close or at a held flush
  inside an add (then in the ``r.add`` row too); per call of the refit;
* ``r.add, tight loop``: the same 310 adds to a fresh ``StreamDigests`` (of the same ``copy``) back to back;
* ``wrapper, in the loop``: the ``load_weights`` wrapper's own work before it hands the call to
  vLLM (from the call to ``ModelBoundary._replayed``).

Prints a Markdown table of µs per call: median and quartiles over the rounds (each round: the sum
over one refit's 310 calls, divided by 310), and the ratio to the same run's ``append`` median.

Usage: ``python benchmarks/bench_inloop.py [--rounds 20] [--device auto|cuda|cpu] [--model NAME] [--out FILE]``
(default model: the 310-tensor ``qwen3-0.6b-like`` set on CUDA, its 2 MiB ``qwen3-shaped-small`` twin on CPU).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _tables import emit, parse  # noqa: E402

ROUNDS = ("r.add, in the loop", "taken adds fed to the stream", "append, in the loop", "r.add, tight loop", "wrapper, in the loop")


def _extra(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", choices=("qwen3-0.6b-like", "qwen3-shaped-small"), default=None)
    ap.add_argument("--trainer-copy", action="store_true", help="refit(copy=True): a copy per r.add (default copy=False: held)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # the engine's process: the model directory


def child(a: argparse.Namespace, device: str) -> None:
    """Run in the engine's process: start it, refit it, time the steps; print one JSON line of seconds per round."""
    import _paths_worker as pw
    import torch

    from refit_verify.boundary import placement

    from refit_verify.boundary import model as model_boundary
    from refit_verify.trainer.exports import StreamDigests

    if device == "cpu":  # landed digests and plan replay as on CUDA (bench_paths --landed-cpu)
        placement.DERIVE_DEVICE_TYPES = frozenset({*placement.DERIVE_DEVICE_TYPES, "cpu"})
    import refit_verify

    ns = argparse.Namespace(mode="enforce", kind="inproc", device=device, config_dir=a.child, paths="boundary-per-param", seed=0,
                            bucket_bytes=64 << 20, gpu_memory_utilization=0.3, timeout_s=300.0, files_dir=None, profile=None,
                            timers=False, trainer_copy=False, native_tensors=False, staging_bytes=None)
    bench = pw.Bench(ns)
    model, items, pc = bench.model, bench.items, time.perf_counter
    raw_replayed = model_boundary.ModelBoundary._replayed
    mark, pre = [0.0], [0.0]

    def replayed(self, target, original, args, kwargs):  # the wrapper hands the call over here
        pre[0] += pc() - mark[0]
        return raw_replayed(self, target, original, args, kwargs)

    model_boundary.ModelBoundary._replayed = replayed
    from refit_verify.trainer import refit as check

    raw_feed, fed = getattr(check.RefitCheck, "_feed", None), [0.0]  # None: a tree before the taken adds (0 in its row)

    def feed(self):  # copy=False: what r.add took, handed to the stream in one loop (in the loop at a flush, else at the close)
        f0 = pc()
        try:
            return raw_feed(self)
        finally:
            fed[0] += pc() - f0

    if raw_feed is not None:
        check.RefitCheck._feed = feed
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def refit(kind: str) -> float:
        add, held = 0.0, []
        pre[0] = fed[0] = 0.0
        with refit_verify.refit(bench.llm, version=bench._next_version(), copy=a.trainer_copy) as chk:
            for n, t in items:
                a0 = pc()
                if kind == "append":
                    held.append((n, t, t._version))
                else:
                    chk.add(n, t)
                add += pc() - a0
                mark[0] = pc()
                model.load_weights([(n, t)])
            if kind == "append":
                for n, t in items:
                    chk.add(n, t)
        sync()
        return add

    def tight() -> float:
        s = StreamDigests(copy=a.trainer_copy, held_flush_bytes=float("inf"))
        t0 = pc()
        for n, t in items:
            s.add(n, t)
        return pc() - t0

    for _ in range(3):  # watched, learned, replayed
        refit("add")
    out: dict[str, list[float]] = {k: [] for k in ROUNDS}
    for r in range(a.rounds):
        for kind in (("add", "append") if r % 2 else ("append", "add")):
            s = refit(kind)
            if kind == "add":
                out["r.add, in the loop"].append(s)
                out["taken adds fed to the stream"].append(fed[0])
                out["wrapper, in the loop"].append(pre[0])
            else:
                out["append, in the loop"].append(s)
        out["r.add, tight loop"].append(tight())
    print("RESULT " + json.dumps({"calls": len(items), "seconds": out, "torch": torch.__version__,
                                  "package": str(Path(refit_verify.__file__).resolve().parent)}), flush=True)
    os._exit(0)  # an in-process engine's threads would hold the exit


def _rev() -> str:
    """The tree measured: its commit, ``+ changes`` when the work tree differs from it."""
    git = ["git", "-C", str(HERE.parent)]
    rev = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    return rev + (" + changes" if dirty else "")


def main(argv: list[str] | None = None) -> int:
    a, device = parse(__doc__, argv, rounds=20, extra=_extra)
    if a.child is not None:
        child(a, device)
        return 0
    import bench_paths as bp

    from refit_verify.testing import models

    name = a.model or ("qwen3-0.6b-like" if device == "cuda" else "qwen3-shaped-small")
    cfg = {"qwen3-0.6b-like": models.QWEN3_0_6B_LIKE, "qwen3-shaped-small": models.QWEN3_0_6B_SHAPED_SMALL}[name]
    work = Path(tempfile.mkdtemp(prefix="bench-inloop-"))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    pa = argparse.Namespace(device=device, paths=["boundary-per-param"], no_replay=False, cuda_graphs=None, no_direct_launch=False,
                            landed_cpu=device == "cpu")  # what bench_paths.build_env reads
    env = bp.build_env(pa, work)["enforce/inproc"]
    t0 = time.time()
    proc = subprocess.run([sys.executable, __file__, "--device", device, "--rounds", str(a.rounds), "--child", str(work / "model")]
                          + (["--trainer-copy"] if a.trainer_copy else []),
                          env=env, capture_output=True, text=True, timeout=900)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        print(f"the engine's process gave no result (exit {proc.returncode})", file=sys.stderr)
        return 1
    res = json.loads(line[len("RESULT "):])
    n = res["calls"]
    per = {k: [s * 1e6 / n for s in v] for k, v in res["seconds"].items()}
    base = statistics.median(per["append, in the loop"])
    lines = [f"# Per-call host cost inside a refit ({name}, {device})", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; run took {time.time() - t0:.0f} s",
             f"- refit-verify: {_rev() if Path(res['package']) == HERE.parent / 'src' / 'refit_verify' else 'the package at ' + res['package']}; "
             f"torch {res['torch']}; Python {sys.version.split()[0]}",
             f"- one in-process engine, REFIT_VERIFY=enforce, refit(copy={a.trainer_copy}), {n} calls a refit (one r.add and one "
             f"load_weights([(name, t)]) per tensor), {a.rounds} rounds after 3 refits (watched, learned, replayed); "
             "the two in-loop kinds alternate which goes first", "",
             "| step | µs per call: median | p25–p75 | / append in the loop |", "|---|---|---|---|"]
    for k in ROUNDS:
        v = per[k]
        q = statistics.quantiles(v, n=4) if len(v) > 1 else [v[0], v[0], v[0]]
        lines.append(f"| {k} | {statistics.median(v):.2f} | {q[0]:.2f}–{q[2]:.2f} | {statistics.median(v) / base:.2f} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
