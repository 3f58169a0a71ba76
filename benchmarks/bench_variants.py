"""Time the FAST-leaf variants of the digest kernels (``digest_variants.LEAF_VARIANTS``) on one CUDA GPU.

Usage: ``python benchmarks/bench_variants.py [--variants a,b,...] [--no-combos] [--out results.md]``

For every variant of the lab ``benchmarks/digest_variants.py`` (the FAST launch only; general
launch, upper and chain stages are production's), and for the production launch itself
(``kernels.digest.digest_views``, row ``production``):

1. runs it on a 1 GiB bf16 tensor, the 310-tensor model set (shapes from bench_digest.py) and a
   batch of awkward views (odd/8-but-not-16 offsets, partial superblocks, byte tails, two chunks),
   and compares every output word with the default kernel (``v1``): PASS/FAIL;
2. times ``digest_views`` on the 1 GiB tensor and on the model set (one batched call, plan
   memoised) with ``triton.testing.do_bench`` (median, L2 flushed), and prints GB/s and the ratio
   to a read-only xor-reduce roofline measured in the same run;
3. pass 2: builds up to 3 combinations from pass 1 (best variant + the best ``asm`` level + the
   single-knob changes that helped ``f256w8-full``), then re-times the top variants, the
   combinations, ``production`` and ``v1`` twice in alternating order with the roofline;
4. prints the ranking (best first, top 12 and any failure; the 1 GiB figure is the median of all
   its timings), the FAST-leaf-only time of the best variant and of v1 (the rest of the call is
   general leaf + upper + chain + gaps), and what adopting the best would take.

The whole script stays under ~3 minutes on an H200 (a budget guard skips what does not fit).
Without CUDA it prints a message and exits 0; ``--smoke`` runs tiny sizes on CPU under the Triton
interpreter (checks the script; timings meaningless). Exit status 1 if ``v1`` disagrees with the
torch path on the awkward batch.

Source: docs/digest-spec.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # must precede the triton import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import digest_variants as dv  # noqa: E402
from bench_digest import _xor_roofline_kernel, model_shapes  # noqa: E402

MiB = 1 << 20
KNOBS = ("mode", "cols", "warps", "unroll", "prefetch", "vec", "full", "ilv", "asm", "maxnreg", "stages")
DEFAULTS = dict(cols=256, warps=8, unroll=1, prefetch=False, vec=False, full=False, ilv=False, asm=0, maxnreg=None,
                stages=None)


def _norm(lf: dict) -> dict:
    """Variant dict with defaults filled in (for comparisons)."""
    d = dict(DEFAULTS, **lf)
    return {k: d.get(k) for k in KNOBS}


def _knob_str(lf: dict) -> str:
    n = _norm(lf)
    if n["mode"] == "v1":
        return "v1 kernel"
    return " ".join(f"{k}={v}" for k, v in n.items() if k != "mode" and v != DEFAULTS[k]) + f" mode={n['mode']}"


def _dict_literal(lf: dict) -> str:
    return "dict(" + ", ".join(f"{k}={v!r}" for k, v in lf.items()) + ")"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", default="", help="comma-separated subset of LEAF_VARIANTS (v1 always runs)")
    ap.add_argument("--no-combos", action="store_true", help="skip the pass-2 combinations")
    ap.add_argument("--budget-s", type=float, default=140.0, help="stop starting new work after this many seconds")
    ap.add_argument("--out", type=Path, help="also write the final table here (markdown)")
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny sizes: checks the script only")
    args = ap.parse_args()
    smoke = args.smoke
    t_start = time.perf_counter()
    if not smoke and not torch.cuda.is_available():
        print("bench_variants: no CUDA device available; the Triton kernels need a GPU. Nothing to do.")
        return 0

    from triton.testing import do_bench

    from refit_verify.digest import _torch as td
    from refit_verify.digest import reference as ref
    from refit_verify.digest.tensors import dtype_name, logical_bytes
    from refit_verify.digest.kernels import launch as kd

    def elapsed() -> float:
        return time.perf_counter() - t_start

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    if smoke:
        dev, dev_name = torch.device("cpu"), "CPU (smoke, interpreter)"
        big_bytes, big_name = (65536 + 4097) * 8, "544 KiB (smoke)"
        shapes = [tuple(max(1, d // 64) for d in s) for s in model_shapes()[:4]]
        sb = 65536 * 8
    else:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        dev_name = f"{props.name} ({props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs)"
        big_bytes, big_name = 1024 * MiB, "1 GiB"
        shapes = model_shapes()
        sb = 65536 * 8
    print(f"device: {dev_name}; torch {torch.__version__}; triton {triton.__version__}")

    names = list(dv.LEAF_VARIANTS)
    if args.variants:
        want = [n.strip() for n in args.variants.split(",") if n.strip()]
        unknown = [n for n in want if n not in dv.LEAF_VARIANTS]
        if unknown:
            print(f"unknown variants: {unknown}; known: {names}")
            return 2
        names = ["v1"] + [n for n in want if n != "v1"]
    variants = {n: dict(dv.LEAF_VARIANTS[n]) for n in names}

    # Inputs. -----------------------------------------------------------------------------------
    torch.manual_seed(0)
    big_t = torch.randn(big_bytes // 2, dtype=torch.bfloat16, device=dev)
    big = [logical_bytes(big_t)]
    big_seeds = [ref.seed(dtype_name(big_t.dtype), tuple(big_t.shape), big_bytes)]
    model_t = [torch.randn(s, dtype=torch.bfloat16, device=dev) for s in shapes]
    model = [logical_bytes(t) for t in model_t]
    model_seeds = [ref.seed(dtype_name(t.dtype), tuple(t.shape), u.numel()) for t, u in zip(model_t, model)]
    model_bytes = sum(u.numel() for u in model)
    two_chunks = (ref.CHUNK_LANES + 65536 + 4097) * 8 if not smoke else 0
    buf = torch.randint(0, 256, (max(two_chunks, 3 * sb) + 4096,), dtype=torch.uint8, device=dev)
    awkward = [
        buf[: 2 * sb],  # full superblocks, 16-aligned
        buf[8 : 8 + sb + 4097 * 8],  # 8- but not 16-aligned; partial superblock with zero blocks
        buf[16 : 16 + sb + 61441 * 8],  # partial superblock, 16-aligned
        buf[3 : 3 + sb + 13],  # odd offset, byte tail
        buf[32 : 32 + 2 * sb + 5],  # byte tail in the last superblock
        buf[:0],
        buf[5:300],
    ]
    if two_chunks:
        awkward.append(buf[:two_chunks])  # two chunks, the second with a partial superblock
    if smoke:
        awkward = awkward[1:3] + awkward[5:]
    awk_seeds = [ref.seed("uint8", (u.numel(),), u.numel()) for u in awkward]

    def roofline(u8: torch.Tensor) -> torch.Tensor:
        x = u8.view(torch.int64)
        grid = (triton.cdiv(x.numel(), 4096 * 16),)
        out = torch.empty(grid[0], dtype=torch.int64, device=x.device)
        _xor_roofline_kernel[grid](x, out, x.numel(), BLOCK=4096, ITERS=16, num_warps=8)
        return out

    def bench(fn, rep: int = 100) -> float:
        if smoke:  # the script check only: one call, wall time
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)
        return do_bench(fn, warmup=25, rep=rep, return_mode="median")

    cat = torch.cat(model) if not smoke else None  # contiguous copy: model-set roofline
    roof_big: list[float] = []
    roof_model: list[float] = []

    def measure_roofline() -> None:
        roof_big.append(bench(lambda: roofline(big[0])))
        if cat is not None:
            roof_model.append(bench(lambda: roofline(cat)))

    # Reference outputs from the default kernel (v1) + a torch-path check of v1. -------------
    v1 = variants["v1"]
    ref_big = dv.digest_views(big, big_seeds, v1).clone()
    ref_model = dv.digest_views(model, model_seeds, v1).clone()
    ref_awk = dv.digest_views(awkward, awk_seeds, v1).clone()
    torch_awk = [td.digest_u8(u, "uint8", (u.numel(),)) for u in awkward]
    base_ok = kd.to_hex(ref_awk) == torch_awk
    print(f"v1 vs torch path on {len(awkward)} awkward views: {'PASS' if base_ok else 'FAIL'}")
    measure_roofline()
    print(f"roofline (xor-reduce): {big_name} {big_bytes / roof_big[-1] / 1e6:.0f} GB/s"
          + (f", model set {model_bytes / roof_model[-1] / 1e6:.0f} GB/s" if roof_model else "")
          + f"  [{elapsed():.0f} s]")

    res: dict[str, dict] = {}

    def run_variant(name: str, lf: dict, rep: int = 100) -> None:
        """Compile + verify (first visit) and time ``lf`` (``production``: the production launch);
        results accumulate in res[name]."""
        r = res.setdefault(name, dict(lf=lf, big=[], model=[], check="-", err="", regs="-", spills="-", compile_s=0.0))
        if r["err"]:
            return
        digest = kd.digest_views if name == "production" else (lambda views, seeds: dv.digest_views(views, seeds, lf))
        try:
            if r["check"] == "-":
                t0 = time.perf_counter()
                o_big = digest(big, big_seeds)
                o_model = digest(model, model_seeds)
                o_awk = digest(awkward, awk_seeds)
                sync()
                r["compile_s"] = time.perf_counter() - t0
                ok = torch.equal(o_big, ref_big) and torch.equal(o_model, ref_model) and torch.equal(o_awk, ref_awk)
                r["check"] = "PASS" if ok else "FAIL"
                try:  # registers / spills of the FAST kernel(s), from one direct launch
                    if smoke:
                        raise RuntimeError("interpreter: no compiled kernels")
                    plan, work, C, F = dv.device_plan(dev, big[0], big_seeds, lf)
                    ks = (kd._launch_fast(plan, work, 1, C, 8, F) if name == "production"
                          else dv.launch(lf, plan, work, 1, C, 8, F))
                    r["regs"] = "/".join(str(getattr(k, "n_regs", "?")) for k in ks)
                    r["spills"] = "/".join(str(getattr(k, "n_spills", "?")) for k in ks)
                except Exception:  # noqa: BLE001 - diagnostics only
                    pass
            r["big"].append(bench(lambda: digest(big, big_seeds), rep))
            r["model"].append(bench(lambda: digest(model, model_seeds), rep))
        except Exception as e:  # noqa: BLE001 - a variant that fails to compile/launch is reported, not fatal
            r["err"] = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
            r["check"] = "ERROR"

    def line(name: str) -> str:
        r = res[name]
        if r["err"]:
            return f"{name:>22} {r['check']:>5}  {r['err']}"
        rb = statistics.median(roof_big)
        mb = statistics.median(r["big"])
        mm = statistics.median(r["model"])
        s = (f"{name:>22} {r['check']:>5} {mb:8.4f} ms {big_bytes / mb / 1e6:6.0f} GB/s ratio {rb / mb:5.3f}"
             f" | model {mm:7.4f} ms {model_bytes / mm / 1e6:6.0f} GB/s")
        if roof_model:
            s += f" ratio {statistics.median(roof_model) / mm:5.3f}"
        return s + f" | regs {r['regs']:>5} spills {r['spills']:>3} | {r['compile_s']:4.1f} s | {_knob_str(r['lf'])}"

    def run_pass(items: dict, budget_fraction: float) -> None:
        """Run and print every variant of ``items`` while the time budget's fraction lasts."""
        for name, lf in items.items():
            if elapsed() > args.budget_s * budget_fraction and not smoke:
                print(f"{name:>22} SKIPPED (time budget)")
                continue
            run_variant(name, lf)
            print(line(name) + f"  [{elapsed():.0f} s]", flush=True)

    # Pass 1. -----------------------------------------------------------------------------------
    print(f"\npass 1: {len(variants)} variants ({big_name} bf16 and the {len(model)}-tensor model set; "
          "median of do_bench, L2 flushed; check = every output word vs v1):")
    run_pass(dict(variants, production=dict(dv.LEAF_VARIANTS[dv.PRODUCTION])), 0.7)
    measure_roofline()

    def good(n: str) -> bool:
        return n in res and res[n]["check"] == "PASS" and bool(res[n]["big"])

    def t_big(n: str) -> float:
        return statistics.median(res[n]["big"])

    # Pass 2: combinations + re-timing. ---------------------------------------------------------
    combos: dict[str, dict] = {}
    ranked = sorted([n for n in res if good(n)], key=t_big)
    if ranked and not args.no_combos:
        base = "f256w8-full"
        helps: dict[str, object] = {}  # single-knob changes that beat `base`
        best_asm = None
        if good(base):
            nb = _norm(res[base]["lf"])
            for n in ranked:
                d = {k: v for k, v in _norm(res[n]["lf"]).items() if v != nb[k]}
                if n == base or not d or t_big(n) > 0.99 * t_big(base):
                    continue
                if set(d) <= {"asm", "maxnreg"} and "asm" in d:
                    if best_asm is None:
                        best_asm = d  # ranked: the fastest asm level comes first
                elif len(d) == 1:
                    helps.update(d)
        top = _norm(res[ranked[0]]["lf"])

        def add_asm(v: dict) -> dict:
            if best_asm is None or v["asm"]:
                return v
            v = dict(v, asm=best_asm["asm"])
            one_lane = v["cols"] == 32 * v["warps"] and not v["prefetch"] and v["unroll"] == 1
            if v["maxnreg"] is None and one_lane:
                v["maxnreg"] = best_asm.get("maxnreg", 64)
            return v

        cands = []
        if top["mode"] != "v1":
            cands.append(add_asm(dict(top)))
            cands.append(add_asm(dict(top, **{k: v for k, v in helps.items() if k != "maxnreg" or not top["asm"]})))
        if good(base):
            cands.append(add_asm(dict(_norm(res[base]["lf"]), **helps)))
        seen = [_norm(res[n]["lf"]) for n in res]
        for c in cands:
            if c not in seen and len(combos) < 3:
                seen.append(c)
                lf = {k: v for k, v in c.items() if k == "mode" or v != DEFAULTS.get(k)}
                combos[f"combo{len(combos) + 1}"] = lf
        if combos:
            print(f"\npass 2: combinations (single-knob gains over {base}: {helps or 'none'}; best asm: {best_asm}):")
            run_pass(combos, 0.85)
    retime = [n for n in sorted([n for n in res if good(n)], key=t_big)[:5]]
    retime += [n for n in combos if good(n) and n not in retime]
    retime += [n for n in ("production", "v1") if good(n) and n not in retime]
    if len(retime) > 1:
        rounds = 1 if smoke else 2
        print(f"\npass 2: re-timing {len(retime)} variants {rounds}x, alternating order, with the roofline")
        for rnd in range(rounds):
            if elapsed() > args.budget_s and not smoke:
                print("  (time budget reached)")
                break
            measure_roofline()
            for n in retime if rnd == 0 else list(reversed(retime)):
                if elapsed() > args.budget_s and not smoke:
                    break
                run_variant(n, res[n]["lf"], rep=150)
        measure_roofline()

    # Ranking. ------------------------------------------------------------------------------------
    order = sorted([n for n in res if good(n)], key=t_big) + [n for n in res if not good(n)]
    rb = statistics.median(roof_big)
    print(f"\nranking, best first ({big_name}: median of all timings of a variant; roofline median "
          f"{big_bytes / rb / 1e6:.0f} GB/s over {len(roof_big)} runs, range "
          f"{big_bytes / max(roof_big) / 1e6:.0f}-{big_bytes / min(roof_big) / 1e6:.0f}):")
    shown = order[:12] + [n for n in order[12:] if not good(n)]
    for n in shown:
        print(line(n))
    if len(shown) < len(order):
        print(f"{'':>22} ({len(order) - len(shown)} slower variants: see pass 1)")
    n_fail = sum(res[n]["check"] in ("FAIL", "ERROR") for n in res)
    print(f"\nchecks: {sum(res[n]['check'] == 'PASS' for n in res)} PASS, {n_fail} FAIL/ERROR"
          f"; v1 vs torch path: {'PASS' if base_ok else 'FAIL'}")

    if order and good(order[0]):
        best = order[0]
        lf = res[best]["lf"]
        # Leaf-only share: FAST launch alone vs the whole digest_views call, best and v1.
        for n in dict.fromkeys([best, "v1"]):
            if not good(n) or smoke:
                continue
            lfn = res[n]["lf"]
            plan, work, C, F = dv.device_plan(dev, big[0], big_seeds, lfn)
            ms_leaf = bench(lambda: dv.launch(lfn, plan, work, 1, C, 8, F))
            ms_all = t_big(n)
            print(f"{n}: FAST leaf launch alone {ms_leaf:.4f} ms ({big_bytes / ms_leaf / 1e6:.0f} GB/s, "
                  f"ratio {rb / ms_leaf:.3f}); rest of the call (general leaf, upper, chain, host) "
                  f"{ms_all - ms_leaf:.4f} ms")
        gbs = big_bytes / t_big(best) / 1e6
        print(f"\nbest: {best} — {gbs:.0f} GB/s, ratio {rb / t_big(best):.3f} on {big_name}"
              f" (target >= 3500 GB/s and >= 0.75: {'MET' if gbs >= 3500 and rb / t_big(best) >= 0.75 else 'not met'})")
        if best in ("production", dv.PRODUCTION):
            print(f"the production FAST launch ({dv.PRODUCTION}) is the best")
        else:
            print(f"production FAST launch: {dv.PRODUCTION} (src/refit_verify/digest/kernels/_leaf.py, FAST_LEAF); to adopt "
                  f"{best} = {_dict_literal(lf)}, specialise _leaf_fast_kernel to its knobs, then check the "
                  "interpreter tests and benchmarks/kernel_asm.py")
    print(f"total {elapsed():.0f} s")

    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows = ["| variant | check | 1 GiB ms | GB/s | ratio | model ms | regs | spills | knobs |", "|---" * 9 + "|"]
        for n in order:
            r = res[n]
            if r["err"] or not r["big"]:
                rows.append(f"| {n} | {r['check']} | - | - | - | - | - | - | {r['err']} |")
                continue
            mb, mm = statistics.median(r["big"]), statistics.median(r["model"])
            rows.append(f"| {n} | {r['check']} | {mb:.4f} | {big_bytes / mb / 1e6:.0f} | {rb / mb:.3f} | {mm:.4f} "
                        f"| {r['regs']} | {r['spills']} | {_knob_str(r['lf'])} |")
        args.out.write_text(f"device: {dev_name}; torch {torch.__version__}; triton {triton.__version__}; "
                            f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n\n" + "\n".join(rows) + "\n")
        print(f"wrote {args.out}")
    return 0 if base_ok else 1


if __name__ == "__main__":
    sys.exit(main())
