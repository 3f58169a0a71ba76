"""Host cost of ``DigestBatch.add`` + ``hexdigests``: this tree against a baseline revision.

    python benchmarks/bench_host.py [--baseline REV] [--rounds 15] [--reps 10] [--scale 64]
                                    [--device cpu] [--no-numba] [--out FILE]

The tensor set is the 310-tensor Qwen3-0.6B-like layout (``refit_verify.testing.models.QWEN3_0_6B_LIKE``,
names and order of ``param_shapes``) with every dimension divided by ``--scale`` (default 64:
the same tensor count, 286 KiB of bf16 in all), so the time is host overhead, not hashing. One
sample is one batch: a fresh ``DigestBatch``, 310 ``add`` calls, one ``hexdigests``, timed
separately and divided by the tensor count.

Two worker processes, one importing ``refit_verify`` from ``git archive REV`` (the baseline) and
one from this tree's ``src``, build the same tensors, warm up, and then run rounds on request,
alternating which goes first; each round is ``--reps`` batches. Both must return the same digests
(checked once). The table gives the median and quartiles in microseconds per tensor and the ratio
of the medians to the baseline's, all from the same run. ``--no-numba`` makes ``numba``
unimportable in both workers (the torch fallback; use a larger ``--scale``, it is slow).

Messages between the processes: msgspec JSON lines over the workers' stdin/stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[1]


class Round(msgspec.Struct):
    """A worker's answer to one round: per-tensor microseconds of each batch, and a digest check."""

    add_us: list[float]
    hex_us: list[float]
    digests_sha256: str
    backend: str


def _tensors(scale: int, device: str):
    import torch

    from refit_verify.testing import models

    g = torch.Generator().manual_seed(0)
    out = []
    for name, shape in models.param_shapes(models.QWEN3_0_6B_LIKE).items():
        small = tuple(max(1, d // scale) for d in shape)
        out.append((name, torch.randn(small, generator=g).to(torch.bfloat16).to(device)))
    return out


def _worker(args: argparse.Namespace) -> int:
    if args.no_numba:
        sys.modules["numba"] = None  # import numba now fails: the torch fallback
    import torch

    from refit_verify.digest.batch import DigestBatch

    tensors = _tensors(args.scale, args.device)
    n = len(tensors)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)

    def batch() -> tuple[float, float, dict[str, str]]:
        b = DigestBatch()
        t0 = time.perf_counter()
        for name, t in tensors:
            b.add(name, t)
        t1 = time.perf_counter()
        got = b.hexdigests()
        t2 = time.perf_counter()
        return (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6, got

    got = batch()[2]  # warm-up: JIT or cache load, seeds
    sync()
    check = hashlib.sha256("".join(f"{k}={v};" for k, v in got.items()).encode()).hexdigest()
    try:
        from refit_verify.digest.backends import backend_for

        backend = backend_for(torch.device(args.device).type).name
    except ImportError:  # a baseline without refit_verify.digest.backends
        backend = "(baseline)"
    enc = msgspec.json.Encoder()
    for line in sys.stdin:
        if line.strip() != "round":
            break
        adds, hexes = [], []
        for _ in range(args.reps):
            a, h, _ = batch()
            adds.append(a)
            hexes.append(h)
        sys.stdout.buffer.write(enc.encode(Round(adds, hexes, check, backend)) + b"\n")
        sys.stdout.flush()
    return 0


def _quart(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", default="HEAD", help="git revision of the baseline (default HEAD)")
    ap.add_argument("--rounds", type=int, default=15, help="rounds per version (default 15)")
    ap.add_argument("--reps", type=int, default=10, help="batches per round (default 10)")
    ap.add_argument("--scale", type=int, default=64, help="divide every dimension by this (default 64)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--no-numba", action="store_true", help="make numba unimportable in both workers")
    ap.add_argument("--out", help="also write the table (markdown) here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)

    wargs = ["--worker", "--reps", str(args.reps), "--scale", str(args.scale), "--device", args.device]
    wargs += ["--no-numba"] if args.no_numba else []
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.baseline], check=True,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "src"], capture_output=True,
                           text=True).stdout.strip()
    here = f"this tree ({subprocess.run(['git', '-C', str(REPO), 'rev-parse', '--short', 'HEAD'], capture_output=True, text=True).stdout.strip()}{' + changes' if dirty else ''})"
    with tempfile.TemporaryDirectory(prefix="bench_host_") as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        roots = {f"baseline {rev}": Path(tmp) / "src", here: REPO / "src"}
        procs = {}
        for label, src in roots.items():
            env = dict(os.environ, PYTHONPATH=str(src))
            procs[label] = subprocess.Popen([sys.executable, __file__, *wargs], stdin=subprocess.PIPE,
                                            stdout=subprocess.PIPE, env=env)
        dec = msgspec.json.Decoder(Round)
        samples: dict[str, dict[str, list[float]]] = {k: {"add": [], "hex": [], "total": []} for k in roots}
        checks, backends = {}, {}
        try:
            labels = list(roots)
            for r in range(args.rounds):
                for label in labels if r % 2 == 0 else labels[::-1]:
                    p = procs[label]
                    p.stdin.write(b"round\n")
                    p.stdin.flush()
                    line = p.stdout.readline()
                    if not line:
                        raise RuntimeError(f"worker {label} ended early (exit {p.wait(timeout=30)})")
                    res = dec.decode(line)
                    checks[label], backends[label] = res.digests_sha256, res.backend
                    s = samples[label]
                    s["add"] += res.add_us
                    s["hex"] += res.hex_us
                    s["total"] += [a + h for a, h in zip(res.add_us, res.hex_us)]
                print(f"  round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        finally:
            for p in procs.values():
                p.stdin.close()
                p.wait(timeout=60)
    same = len(set(checks.values())) == 1
    base = labels[0]
    load = os.getloadavg()
    lines = [
        f"# DigestBatch host cost: {len(_shapes_count())} tensors (Qwen3-0.6B-like, dims / {args.scale}), "
        f"device {args.device}{', numba made unimportable' if args.no_numba else ''}",
        "",
        f"- {args.rounds} interleaved rounds x {args.reps} batches per version; {platform.platform()}, "
        f"Python {platform.python_version()}, {os.cpu_count()} CPUs, load average {load[0]:.2f} at the end",
        f"- digests identical in both versions: {'yes' if same else 'NO'}",
        "",
        "| version | backend | step | q1 us/tensor | median us/tensor | q3 us/tensor | median / baseline |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for label in labels:
        for step, key in (("add", "add"), ("hexdigests", "hex"), ("add + hexdigests", "total")):
            q1, med, q3 = _quart(samples[label][key])
            ratio = med / statistics.median(samples[base][key])
            lines.append(f"| {label} | {backends[label]} | {step} | {q1:.2f} | {med:.2f} | {q3:.2f} | {ratio:.3f} |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        Path(args.out).write_text(report)
    return 0 if same else 1


def _shapes_count() -> list:
    sys.path.insert(0, str(REPO / "src"))
    from refit_verify.testing import models

    return list(models.param_shapes(models.QWEN3_0_6B_LIKE))


if __name__ == "__main__":
    raise SystemExit(main())
