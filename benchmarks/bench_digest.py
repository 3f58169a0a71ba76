"""Benchmark the Triton digest kernels against a read-only roofline kernel on one CUDA GPU.

Usage: ``python benchmarks/bench_digest.py [--out results.md] [--leaf-warps 4,8]``

Prints (and with ``--out`` writes as markdown plus a sibling ``.csv``):

1. a correctness check, kernels vs the torch path (``_torch_digest``) on CUDA: PASS/FAIL;
2. bf16 tensors of 1 MiB .. 4 GiB: median time (``triton.testing.do_bench``, L2 flushed), GB/s,
   ratio to a read-only roofline kernel (xor-reduce of uint64 lanes) measured in the same run, and
   the pure-PyTorch path (sizes <= 256 MiB, else '-');
3. the 310-tensor model set (Qwen3-0.6B-like shapes, bf16): one batched ``digest_views`` call
   (plan memoised / cold), ``digest_tensors`` end to end (seeds + sync + hex), and 310 separate calls.

Without CUDA it prints a message and exits 0 (``--smoke`` instead runs the whole script on CPU
under the Triton interpreter with tiny sizes, to check the script itself; timings meaningless).
Exit status 1 if the correctness check fails.

Source: docs/digest-spec.md
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from pathlib import Path

import torch

if "--smoke" in sys.argv:  # must precede the triton import
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

MiB = 1 << 20
SIZES = [("1 MiB", MiB), ("16 MiB", 16 * MiB), ("256 MiB", 256 * MiB), ("1 GiB", 1024 * MiB), ("4 GiB", 4096 * MiB)]
TORCH_CAP = 256 * MiB  # the torch path is only timed up to this size


@triton.jit
def _xor_roofline_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """Read-only roofline: xor-reduce ITERS*BLOCK uint64 lanes per program."""
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ITERS)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int64)
    for i in range(ITERS):
        o = base + i * BLOCK + offs
        acc ^= tl.load(x_ptr + o, mask=o < n, other=0, eviction_policy="evict_first")
    tl.store(out_ptr + tl.program_id(0), tl.xor_sum(acc, axis=0))


def model_shapes() -> list[tuple[int, ...]]:
    """310 tensors: embedding, 28 x (7 matrices + 4 norms), final norm."""
    layer = [(2048, 1024), (1024, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (3072, 1024), (1024, 3072),
             (1024,), (1024,), (128,), (128,)]
    return [(151936, 1024)] + layer * 28 + [(1024,)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="write the tables here (markdown) and next to it as .csv")
    ap.add_argument("--leaf-warps", default="", help="also time 1 GiB and the model set with these leaf num_warps, e.g. 4,8")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny sizes: checks the script only")
    args = ap.parse_args()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("bench_digest: no CUDA device available; the Triton kernels need a GPU. Nothing to do.")
        return 0

    from triton.testing import do_bench

    from refit_verify.digest import _torch as td
    from refit_verify.digest import reference as ref
    from refit_verify.digest.batch import digest_tensors
    from refit_verify.digest.tensors import dtype_name, logical_bytes
    from refit_verify.digest.kernels import launch as kd

    def roofline(u8: torch.Tensor) -> torch.Tensor:
        x = u8.view(torch.int64)
        per = 4096 * 16
        grid = (triton.cdiv(x.numel(), per),)
        out = torch.empty(grid[0], dtype=torch.int64, device=x.device)
        _xor_roofline_kernel[grid](x, out, x.numel(), BLOCK=4096, ITERS=16, num_warps=8)
        return out

    sizes, mib, cap, shapes = SIZES, MiB, TORCH_CAP, model_shapes()
    if smoke:  # everything ~1/1024 (model set: dims / 256)
        dev, dev_name, mib, cap = torch.device("cpu"), "CPU (smoke, interpreter)", 1024, 1 << 20
        sizes = [(n.replace("MiB", "KiB").replace("GiB", "MiB"), b // 1024) for n, b in SIZES[:3]]
        shapes = [tuple(max(1, d // 256) for d in s) for s in shapes]
    else:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        dev_name = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    print(f"device: {dev_name}, torch {torch.__version__}, triton {triton.__version__}")

    # 1. correctness: kernels vs torch path on CUDA.
    torch.manual_seed(0)
    buf = torch.randint(0, 256, (16 * mib + 65536,), dtype=torch.uint8, device=dev)
    checks = [buf[:0], buf[:13], buf[3 : 3 + 4096 * 8 + 5], buf[5 : 5 + mib + 3], buf[: 16 * mib]]
    big = None
    if not smoke:
        big = torch.randint(0, 256, ((ref.CHUNK_LANES + 4097) * 8 + 3,), dtype=torch.uint8, device=dev)
        checks.append(big)
    seeds = [ref.seed("uint8", (u.numel(),), u.numel()) for u in checks]
    got = kd.to_hex(kd.digest_views(checks, seeds))
    want = [td.digest_u8(u, "uint8", (u.numel(),)) for u in checks]
    ok = got == want
    print(f"correctness (kernels vs torch path, {len(checks)} views incl. odd offsets, 2 chunks): {'PASS' if ok else 'FAIL'}")
    del buf, big, checks

    rows: list[dict[str, str]] = []

    def add(name: str, nbytes: int, ms: float, roof_ms: float | None, torch_ms: float | None, note: str = "") -> None:
        r = {
            "case": name,
            "bytes": str(nbytes),
            "triton_ms": f"{ms:.4f}",
            "GB/s": f"{nbytes / ms / 1e6:.0f}",
            "roofline_GB/s": f"{nbytes / roof_ms / 1e6:.0f}" if roof_ms else "-",
            "ratio_to_roofline": f"{roof_ms / ms:.3f}" if roof_ms else "-",
            "torch_ms": f"{torch_ms:.3f}" if torch_ms else "-",
            "note": note,
        }
        rows.append(r)
        print(f"{r['case']:>24} {r['triton_ms']:>10} ms {r['GB/s']:>6} GB/s  roofline {r['roofline_GB/s']:>6} GB/s"
              f"  ratio {r['ratio_to_roofline']:>6}  torch {r['torch_ms']:>9} ms  {note}")

    def bench(fn) -> float:
        if smoke:
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        return do_bench(fn, warmup=25, rep=200, return_mode="median")

    # 2. single bf16 tensors.
    print("\nsingle bf16 tensors (median of do_bench, L2 flushed):")
    roof_gbs = {}
    for name, nbytes in sizes:
        t = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=dev)
        u = logical_bytes(t)
        sd = [ref.seed(dtype_name(t.dtype), tuple(t.shape), nbytes)]
        ms = bench(lambda: kd.digest_views([u], sd))
        roof_ms = bench(lambda: roofline(u))
        roof_gbs[name] = nbytes / roof_ms / 1e6
        torch_ms = bench(lambda: td.digest_u8(u, "bfloat16", tuple(t.shape))) if nbytes <= cap else None
        add(f"bf16 {name}", nbytes, ms, roof_ms, torch_ms)
        del t, u
        if not smoke:
            torch.cuda.empty_cache()

    # 3. model set.
    print("\n310-tensor model set (bf16):")
    tensors = {f"t{i}": torch.randn(s, dtype=torch.bfloat16, device=dev) for i, s in enumerate(shapes)}
    views = [logical_bytes(t) for t in tensors.values()]
    seeds = [ref.seed(dtype_name(t.dtype), tuple(t.shape), u.numel()) for t, u in zip(tensors.values(), views)]
    total = sum(u.numel() for u in views)
    cat = torch.cat([u for u in views])  # contiguous copy: roofline for the same byte count
    roof_ms = bench(lambda: roofline(cat))
    del cat
    ms = bench(lambda: kd.digest_views(views, seeds))
    add(f"model set x{len(views)}", total, ms, roof_ms, None, f"batched, plan memoised; {1e3 * ms / len(views):.2f} us/tensor")

    def cold():
        kd._PLANS.clear()
        return kd.digest_views(views, seeds)

    ms = bench(cold)
    add(f"model set x{len(views)}", total, ms, roof_ms, None, "batched, cold plan (host plan + H2D each call)")
    ms = bench(lambda: digest_tensors(tensors))
    add(f"model set x{len(views)}", total, ms, roof_ms, None, "digest_tensors end to end (seeds, sync, hex)")
    ms = bench(lambda: [kd.digest_views([u], [s]) for u, s in zip(views, seeds)])
    add(f"model set x{len(views)}", total, ms, roof_ms, None, f"{len(views)} separate calls; {1e3 * ms / len(views):.2f} us/tensor")

    # Optional: leaf num_warps sweep.
    for w in [int(x) for x in args.leaf_warps.split(",") if x.strip()]:
        old, kd.LEAF_WARPS = kd.LEAF_WARPS, w
        try:
            t = torch.randn(512 * mib, dtype=torch.bfloat16, device=dev)
            u = logical_bytes(t)
            sd = [ref.seed("bfloat16", tuple(t.shape), u.numel())]
            ms = bench(lambda: kd.digest_views([u], sd))
            rg = roof_gbs.get("1 GiB")
            add("bf16 1 GiB", u.numel(), ms, u.numel() / rg / 1e6 if rg else None, None, f"leaf num_warps={w}")
            del t, u
            ms = bench(lambda: kd.digest_views(views, seeds))
            add(f"model set x{len(views)}", total, ms, roof_ms, None, f"batched, leaf num_warps={w}")
        finally:
            kd.LEAF_WARPS = old

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        md = args.out if args.out.suffix != ".csv" else args.out.with_suffix(".md")
        keys = list(rows[0])
        lines = [f"device: {dev_name}; torch {torch.__version__}; triton {triton.__version__}; "
                 f"correctness: {'PASS' if ok else 'FAIL'}; {time.strftime('%Y-%m-%d %H:%M:%S')}", "",
                 "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
        md.write_text("\n".join(lines) + "\n")
        with md.with_suffix(".csv").open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(rows)
        print(f"\nwrote {md} and {md.with_suffix('.csv')}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
