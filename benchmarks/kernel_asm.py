"""Compile every digest kernel launch for a CUDA target, without a GPU, and write its PTX and SASS.

    python benchmarks/kernel_asm.py OUT_DIR [--only a,b] [--arch 90]

One file pair per launch (``OUT_DIR/<launch>.ptx`` and ``.sass``): the production launches
(``leaf_general``, ``leaf_v1fast``, ``upper``, ``chain``, ``fast`` = the production FAST leaf; with the
COPY leaf variants, ``fast_copy`` and ``leaf_general_copy``, the others compiled with COPY=False) and
every variant of ``benchmarks/digest_variants.py`` (``var_<name>``, ``l0`` variants as ``_l0`` and
``_l1``). Kernel names, ``.loc``/``.file`` lines, debug sections and ``$L__tmp`` labels are
stripped, so two trees give equal files exactly when ptxas would run the same code: to check that
a refactor of the kernels changes nothing, run each tree's own copy of this script
(``PYTHONPATH=<tree>/src python <tree>/benchmarks/kernel_asm.py``) and ``diff -r`` the two
directories. This copy reads the ``refit_verify.digest.kernels`` layout; for a tree from before
the production/lab split (``kernels.digest`` holding ``LEAF_VARIANTS``, no copy of its own) use
this script as of commit 9b4c8f9, which reads both.

Needs Triton's bundled ``ptxas``/``cuobjdump`` (the CUDA Triton wheel); no CUDA device or driver.
Pointer arguments are compiled with Triton's 16-byte divisibility hint, as torch allocations launch.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
P = "*i64"
_LEAF = {"tab_ptr": P, "work_ptr": P, "V": "i64", "C": "i64", "LO": "i64", "FAST": "constexpr"}
_FAST = {"tab_ptr": P, "work_ptr": P, "V": "i64", "C": "i64", "LO": "i64", "KM0": "i32", "KM1": "i32"}
_L0 = {"tab_ptr": P, "work_ptr": P, "l0_ptr": P, "V": "i64", "C": "i64", "LO": "i64", "F": "i64", "KM0": "i32",
       "KM1": "i32"}
_FUSED_KNOBS = ("COLS", "UNROLL", "LOGU", "PREFETCH", "VEC", "FULL", "ILV", "ASM")


def _sig(base: dict, constexprs) -> dict:
    return dict(base, **{k: "constexpr" for k in constexprs})


def _variant_specs(variants: dict, fused, l0, l1) -> dict:
    """``{launch name: (kernel, signature, constexprs, options)}`` of every non-v1 variant."""
    out = {}
    for name, lf in variants.items():
        if lf["mode"] == "v1":
            continue
        opts = {"num_warps": lf.get("warps", 8)}
        if lf.get("maxnreg") is not None:
            opts["maxnreg"] = lf["maxnreg"]
        cols, asm, vec, ilv = lf.get("cols", 256), lf.get("asm", 0), bool(lf.get("vec")), bool(lf.get("ilv"))
        if lf["mode"] == "fused":
            u = lf.get("unroll", 1)
            ce = dict(COLS=cols, UNROLL=u, LOGU=u.bit_length() - 1, PREFETCH=bool(lf.get("prefetch")), VEC=vec,
                      FULL=bool(lf.get("full")), ILV=ilv, ASM=asm)
            out[f"var_{name}"] = (fused, _sig(_FAST, _FUSED_KNOBS), ce, opts)
        else:
            out[f"var_{name}_l0"] = (l0, _sig(_L0, ("COLS", "VEC", "ILV", "ASM")), dict(COLS=cols, VEC=vec, ILV=ilv, ASM=asm), opts)
            out[f"var_{name}_l1"] = (l1, _sig(_L0, ("COLS", "ASM")), dict(COLS=cols, ASM=asm), {"num_warps": lf.get("warps", 8)})
    return out


def specs() -> dict:
    """Every launch of the tree on ``sys.path`` (``refit_verify.digest.kernels`` layout)."""
    from refit_verify.digest.kernels import _leaf, _upper, launch as kd

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import digest_variants as dv

    upper = {"tab_ptr": P, "work_ptr": P, "V": "i64", "C": "i64", "CV": "i64"}
    chain = {"tab_ptr": P, "work_ptr": P, "out_ptr": P, "V": "i64", "C": "i64", "RB": "constexpr"}
    out = _variant_specs(dict(dv.LEAF_VARIANTS, **dv.EXTRA_VARIANTS), dv._leaf_fused_kernel,
                         dv._leaf_l0_kernel, dv._leaf_l1_kernel)
    fl = _leaf.FAST_LEAF
    fast, leaf, up, ch = _leaf._leaf_fast_kernel, _leaf._digest_leaf_kernel, _upper._digest_upper_kernel, _upper._digest_chain_kernel
    fast_opts = {"num_warps": fl["warps"], "maxnreg": fl["maxnreg"]}
    out["fast"] = (fast, _sig(_FAST, ("COLS", "ASM")), dict(COLS=fl["cols"], ASM=fl["asm"]), fast_opts)
    out["leaf_general"] = (leaf, _LEAF, {"FAST": False}, {"num_warps": kd.LEAF_WARPS})
    out["leaf_v1fast"] = (leaf, _LEAF, {"FAST": True}, {"num_warps": kd.LEAF_WARPS})
    if "COPY" in leaf.arg_names:  # the copy variants (a tree since the fused copy+digest): COPY=False is the launch above
        for k in ("fast", "leaf_general", "leaf_v1fast"):
            fn, sig, ce, opts = out[k]
            out[k] = (fn, _sig(sig, ("COPY",)), dict(ce, COPY=False), opts)
        out["fast_copy"] = (fast, _sig(_FAST, ("COLS", "ASM", "COPY")), dict(COLS=fl["cols"], ASM=fl["asm"], COPY=True),
                            dict(fast_opts, maxnreg=fl.get("copy_maxnreg", fl["maxnreg"])))
        out["leaf_general_copy"] = (leaf, _sig(_LEAF, ("COPY",)), {"FAST": False, "COPY": True}, {"num_warps": kd.LEAF_WARPS})
    out["upper"] = (up, upper, {}, {"num_warps": 4})
    out["chain"] = (ch, chain, {"RB": 16}, {"num_warps": 1})
    return out


def compile_one(fn, sig: dict, constexprs: dict, opts: dict, arch: int, out: Path) -> tuple[float, str]:
    """Compile one launch for sm_<arch>; write normalised ``out.ptx`` / ``out.sass``; (seconds, resources)."""
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    t0 = time.perf_counter()
    k = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", arch, 32), options=opts)
    dt = time.perf_counter() - t0
    name = k.metadata.name
    ptx = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", k.asm["ptx"], flags=re.S)
    keep = [ln for ln in ptx.splitlines() if not ln.lstrip().startswith((".loc", ".file", "//", "$L__tmp"))]
    out.with_suffix(".ptx").write_text("\n".join(keep).replace(name, "KERNEL") + "\n")
    cubin = out.with_suffix(".cubin")
    cubin.write_bytes(k.asm["cubin"])
    sass = subprocess.run([_BIN / "cuobjdump", "-sass", cubin], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([_BIN / "cuobjdump", "-res-usage", cubin], capture_output=True, text=True).stdout
    cubin.unlink()
    keep = [ln for ln in sass.splitlines() if not any(w in ln for w in ("Fatbin", "code for", "Function :"))]
    out.with_suffix(".sass").write_text("\n".join(keep).replace(name, "KERNEL") + "\n")
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", res)
    return dt, f"regs {m.group(1)} stack {m.group(2)}" if m else "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="directory for <launch>.ptx and <launch>.sass")
    ap.add_argument("--only", default="", help="comma-separated launch names (default: all)")
    ap.add_argument("--arch", type=int, default=90, help="SM version (default 90, H100/H200)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    todo = specs()
    if args.only:
        todo = {k: v for k, v in todo.items() if k in args.only.split(",")}
    for name, (fn, sig, ce, opts) in todo.items():
        dt, res = compile_one(fn, sig, ce, opts, args.arch, args.out / name)
        print(f"{name:32s} {dt:6.1f} s  {res}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
