"""Copy into a staging slot and digest: the copy alone, the digest alone, both separately, and fused.

    python benchmarks/bench_fused_copy.py [--rounds 7] [--device auto|cuda|cpu] [--sizes 64,1024] [--out FILE]

What a verifying sender does to each grouped tensor (``stream.pack.Packer``): copy its bytes into a
slot of the staging buffer and digest them. Per size (one bf16 tensor, a slot of ``round_up(n, 8)``):

* **copy**: ``slot.copy_(bytes)`` (one read, one write);
* **digest**: the digest alone (one read);
* **digest+copy**: both, separately, as the sender did before the fused op (two reads, one write);
* **fused**: ``DigestBatch.add_copy``'s op (CUDA: the Triton COPY leaf kernels, one read and one
  write; CPU: no fused op exists, it copies then digests, so it should equal digest+copy).

CUDA: the kernel-level calls with kept plans (``kernels.launch.plan_views`` / ``run_plan``: graph replay
from the third run), each sample ``triton.testing.do_bench`` (median of its repetitions, L2 flushed),
the variants interleaved within each round. CPU: ``DigestBatch`` (numba) and ``torch`` copies,
``time.perf_counter`` per call, interleaved. The table gives the median over ``--rounds`` rounds in
ms, GB/s of the tensor's bytes, the ratio to the copy, and the ratio to the floor: one read and one
write of the bytes at the run's copy roofline (the best copy bandwidth of any size in this run,
counting read + write bytes). Every fused result is checked against the separate digest and the
copied bytes first.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402

MiB = 1 << 20


def _extra(ap) -> None:
    ap.add_argument("--sizes", default=None, help="MiB per tensor, comma-separated (CUDA default 64,1024; CPU 4,64)")


def main(argv: list[str] | None = None) -> int:
    a, dev = parse(__doc__, argv, rounds=7, extra=_extra)
    sizes = [int(s) * MiB for s in (a.sizes or ("64,1024" if dev == "cuda" else "4,64")).split(",")]
    from refit_verify.digest import reference as ref
    from refit_verify.digest.batch import DigestBatch, fuses
    from refit_verify.digest.tensors import dtype_name, logical_bytes

    cuda = dev == "cuda"
    if cuda:
        from triton.testing import do_bench

        from refit_verify.digest.kernels import launch as kd

        props = torch.cuda.get_device_properties(0)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        import os

        where = f"CPU ({os.cpu_count()} cores)"
    rows: dict[int, dict[str, list[float]]] = {}
    checks: list[str] = []
    cases = []
    for n in sizes:
        t = torch.randn(n // 2, dtype=torch.bfloat16, device=dev)
        u = logical_bytes(t)
        slot = torch.empty((n + 7) // 8 * 8, dtype=torch.uint8, device=dev)
        sd = ref.seed(dtype_name(t.dtype), tuple(t.shape), n)
        if cuda:
            plain = kd.plan_views([u], [sd])
            fused_p = kd.plan_views([u], [sd], dsts=[slot])

            def copy(slot=slot, u=u):
                slot[: u.numel()].copy_(u)

            def digest(plain=plain):
                return kd.run_plan(plain)

            def both(plain=plain, slot=slot, u=u):
                w = kd.run_plan(plain)
                slot[: u.numel()].copy_(u)
                return w

            def fused(fused_p=fused_p):
                return kd.run_plan(fused_p)

            def sample(fn):
                return do_bench(fn, warmup=10, rep=100, return_mode="median")
        else:
            def copy(slot=slot, u=u):
                slot[: u.numel()].copy_(u)

            def digest(t=t):
                b = DigestBatch()
                b.add("t", t)
                return b.hexdigests()

            def both(t=t, slot=slot, u=u):
                b = DigestBatch()
                b.add("t", t)
                slot[: u.numel()].copy_(u)
                return b.hexdigests()

            def fused(t=t, slot=slot):
                b = DigestBatch()
                b.add_copy("t", t, slot)
                return b.hexdigests()

            def sample(fn):
                t0 = time.perf_counter()
                fn()
                return 1e3 * (time.perf_counter() - t0)

        # check: the fused op's digest is the separate one's, and the slot holds the bytes
        slot.fill_(0x5A)
        if cuda:
            ok = kd.to_hex(fused()) == kd.to_hex(digest()) and torch.equal(slot[:n], u)
        else:
            ok = fused() == digest() and torch.equal(slot[:n], u)
        checks.append(f"{n // MiB} MiB: {'PASS' if ok else 'FAIL'} (fused {'one read' if fuses(t) else 'copy, then digest'})")
        for fn in (copy, digest, both, fused):  # warm: compile, plans, graph capture
            for _ in range(3):
                fn()
        cases.append((n, {"copy": copy, "digest": digest, "digest+copy": both, "fused": fused}, sample))
        rows[n] = {k: [] for k in ("copy", "digest", "digest+copy", "fused")}
    for _ in range(a.rounds):  # interleaved: every variant of every size once per round
        for n, fns, sample in cases:
            for k, fn in fns.items():
                rows[n][k].append(sample(fn))
    med = {n: {k: statistics.median(v) for k, v in r.items()} for n, r in rows.items()}
    roof = max(2 * n / m["copy"] / 1e6 for n, m in med.items())  # GB/s, read + write bytes
    lines = [f"# bench_fused_copy: copy vs digest+copy vs fused ({where})", "",
             f"{datetime.date.today()}, torch {torch.__version__}, {a.rounds} interleaved rounds, median; "
             f"copy roofline of this run {roof:.0f} GB/s (read + write)", "",
             "checks: " + "; ".join(checks), "",
             "| size | variant | ms | GB/s (tensor bytes) | / copy | / floor (1 read + 1 write at the copy roofline) |",
             "|---|---|---:|---:|---:|---:|"]
    for n, m in med.items():
        floor = 2 * n / roof / 1e6  # ms
        for k, ms in m.items():
            lines.append(f"| {n // MiB} MiB | {k} | {ms:.3f} | {n / ms / 1e6:.1f} | {ms / m['copy']:.2f} | {ms / floor:.2f} |")
    emit(lines, a.out)
    return 0 if all(c.split(": ")[1].startswith("PASS") for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
