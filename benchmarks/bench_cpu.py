"""CPU throughput of digest v1 against common hashes and a read roofline.

    python benchmarks/bench_cpu.py [--out FILE] [--mib 256] [--runs 7]

On one buffer of ``--mib`` MiB of random bytes (default 256 MiB), each method runs once to warm
up (the numba JIT compile or cache load is not counted) and then ``--runs`` times; the table gives
the median time, the median and best throughput (GB = 1e9 bytes) and the median throughput as a
fraction of the read roofline (the faster of a numpy ``sum`` over a ``uint64`` view and a numba
``prange`` sum on all threads).

Bench-only dependencies: ``blake3`` and ``xxhash`` (``pip install blake3 xxhash``); a method whose
package is missing is listed as skipped.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from importlib import metadata

import numpy as np
import torch


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _time(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm-up
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="also write the report (markdown) to this file")
    ap.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    ap.add_argument("--runs", type=int, default=7, help="timed runs per method, after one warm-up (>= 5)")
    ap.add_argument("--skip-torch", action="store_true", help="skip the (slow) torch digest path")
    args = ap.parse_args(argv)
    runs = max(5, args.runs)
    nbytes = args.mib << 20

    from refit_verify.digest import _torch as _torch_digest
    from refit_verify.digest import batch as _digest

    try:
        from refit_verify.digest import _numba as nd
        from refit_verify.digest import backends
    except Exception as e:  # noqa: BLE001
        nd = None
        print(f"numba path unavailable: {e!r}", file=sys.stderr)

    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, nbytes, dtype=np.uint8)
    u8 = torch.from_numpy(arr)
    lanes = arr.view(np.uint64)
    shape = (nbytes,)

    rows: list[tuple[str, str, list[float]]] = []  # (method, threads, times)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    def bench(name: str, threads: str, fn: Callable[[], object]) -> None:
        print(f"  {name} ({threads}) ...", file=sys.stderr, flush=True)
        rows.append((name, threads, _time(fn, runs)))

    # Read roofline.
    bench("read roofline: numpy uint64 sum", "1", lambda: lanes.sum())
    numba_threads = "-"
    if nd is not None:
        import numba

        @numba.njit(parallel=True, nogil=True, cache=False)
        def _psum(a):  # noqa: ANN001, ANN202
            s = np.uint64(0)
            for i in numba.prange(a.shape[0]):
                s += a[i]
            return s

        numba_threads = str(numba.get_num_threads())
        bench("read roofline: numba prange uint64 sum", numba_threads, lambda: _psum(lanes))

        # Ours.
        t0 = time.perf_counter()
        backends.warmup_cpu()
        warm_s = time.perf_counter() - t0
        bench("**refit-verify digest v1, numba** (`digest._numba.digest_u8`)", numba_threads,
              lambda: nd.digest_u8(u8, "uint8", shape))  # fmt: skip
        bench("refit-verify digest v1, numba, public API (`tensor_digest`)", numba_threads,
              lambda: _digest.tensor_digest(u8))  # fmt: skip
        saved = nd.PARALLEL_MIN_LANES
        nd.PARALLEL_MIN_LANES = 1 << 62
        try:
            bench("refit-verify digest v1, numba, serial", "1", lambda: nd.digest_u8(u8, "uint8", shape))
        finally:
            nd.PARALLEL_MIN_LANES = saved
    else:
        warm_s = float("nan")
    if not args.skip_torch:
        bench("refit-verify digest v1, torch (`_torch_digest.digest_u8`)", str(torch.get_num_threads()),
              lambda: _torch_digest.digest_u8(u8, "uint8", shape))  # fmt: skip

    # Other hashes (all zero-copy on the same buffer).
    bench("hashlib sha256", "1", lambda: hashlib.sha256(arr).digest())
    try:
        import blake3

        bench("blake3", "1", lambda: blake3.blake3(arr).digest())
        bench("blake3 (max_threads=AUTO)", str(ncpu), lambda: blake3.blake3(arr, max_threads=blake3.blake3.AUTO).digest())
    except ImportError:
        rows.append(("blake3 (skipped: not installed)", "-", []))
    try:
        import xxhash

        bench("xxhash xxh3_128", "1", lambda: xxhash.xxh3_128(arr).digest())
    except ImportError:
        rows.append(("xxhash xxh3_128 (skipped: not installed)", "-", []))

    # Report.
    def gbps(t: float) -> float:
        return nbytes / t / 1e9

    roof = max(gbps(statistics.median(ts)) for name, _, ts in rows if ts and name.startswith("read roofline"))
    try:
        threading_layer = numba.threading_layer() if nd is not None else "-"
    except Exception:  # noqa: BLE001
        threading_layer = "?"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    lines = [
        f"# CPU digest benchmark: {args.mib} MiB buffer, median of {runs} runs after one warm-up",
        "",
        f"- CPU: {_cpu_model()}; {ncpu} usable cores (os.cpu_count() = {os.cpu_count()})",
        f"- {platform.platform()}; Python {platform.python_version()}",
        f"- torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}, "
        f"numba {_version('numba')} (llvmlite {_version('llvmlite')}, {numba_threads} threads, "
        f"threading layer {threading_layer}), blake3 {_version('blake3')}, xxhash {_version('xxhash')}",
        f"- numba warm-up (compile or cache load, not counted): {warm_s:.2f} s",
        f"- load average at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
        "(other processes on the machine make the numbers noisy)",
        "",
        "| method | threads | median time (ms) | median GB/s | best GB/s | median / read roofline |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, threads, ts in rows:
        if not ts:
            lines.append(f"| {name} | {threads} | - | - | - | - |")
            continue
        med = statistics.median(ts)
        lines.append(
            f"| {name} | {threads} | {med * 1e3:.1f} | {gbps(med):.2f} | {gbps(min(ts)):.2f} | "
            f"{gbps(med) / roof:.2f} |"
        )
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
