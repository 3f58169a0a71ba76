"""Copy into a staging slot and digest: the copy alone, the digest alone, both separately, and fused.

    python benchmarks/bench_fused_copy.py [--rounds 7] [--device auto|cuda|cpu] [--sizes 64,1024] [--many 256x4] [--out FILE]

What a verifying sender does to each grouped tensor (``stream.pack.Packer``): copy its bytes into a
slot of the staging buffer and digest them. Per size (one bf16 tensor, a slot of ``round_up(n, 8)``;
on CPU also ``--many``: a group of N tensors of K KiB each in consecutive slots, one batch for the group):

* **copy**: ``slot.copy_(bytes)`` (one read, one write);
* **digest**: the digest alone (one read);
* **digest+copy**: both, separately, as the sender did before the fused op (two reads, one write);
* **fused**: ``DigestBatch.add_copy``'s op (CUDA: the Triton COPY leaf kernels, one read and one
  write; CPU, tensors below 1 MiB: the numba copy+digest, each level-0 block copied then folded from
  cache, one compiled call per batch; CPU, larger tensors: not fused, it copies then digests, so it
  should equal digest+copy).

CUDA: the kernel-level calls with kept plans (``kernels.launch.plan_views`` / ``run_plan``: graph replay
from the third run), each sample ``triton.testing.do_bench`` (median of its repetitions, L2 flushed),
the variants interleaved within each round. CPU: ``DigestBatch`` (numba) and ``torch`` copies,
``time.perf_counter`` over enough calls for about 2 ms per sample, interleaved. The table gives the median over ``--rounds`` rounds in
ms, GB/s of the tensor's bytes, the ratio to the copy, and the ratio to the floor: one read and one
write of the bytes at the run's copy roofline (the best copy bandwidth of any size in this run,
counting read + write bytes). Every fused result is checked against the separate digest and the
copied bytes first.
"""

from __future__ import annotations

import datetime
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402

MiB = 1 << 20


def _extra(ap) -> None:
    ap.add_argument("--sizes", default=None,
                    help="MiB per tensor, comma-separated, fractions allowed (CUDA default 64,1024; CPU 0.0625,0.5,4,64)")
    ap.add_argument("--many", default="256x4", help="CPU: a group of N tensors of K KiB, NxK ('' for none)")


def main(argv: list[str] | None = None) -> int:
    a, dev = parse(__doc__, argv, rounds=7, extra=_extra)
    sizes = [int(float(s) * MiB) for s in (a.sizes or ("64,1024" if dev == "cuda" else "0.0625,0.5,4,64")).split(",")]
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
    rows: dict[str, dict[str, list[float]]] = {}
    checks: list[str] = []
    cases = []
    groups = [(_label(n), [n]) for n in sizes]
    if not cuda and a.many:
        cnt, kib = (int(x) for x in a.many.lower().split("x"))
        groups.append((f"{cnt} x {kib} KiB", [kib * 1024] * cnt))
    for label, ns in groups:
        ts = [torch.randn(n // 2, dtype=torch.bfloat16, device=dev) for n in ns]
        us = [logical_bytes(t) for t in ts]
        offs = [sum((m + 7) // 8 * 8 for m in ns[:i]) for i in range(len(ns))]
        buf = torch.empty(offs[-1] + (ns[-1] + 7) // 8 * 8, dtype=torch.uint8, device=dev)
        slots = [buf[o : o + (n + 7) // 8 * 8] for o, n in zip(offs, ns)]
        n = sum(ns)
        if cuda:
            t, u, slot = ts[0], us[0], slots[0]
            sd = ref.seed(dtype_name(t.dtype), tuple(t.shape), n)
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
            def copy(slots=slots, us=us):
                for slot, u in zip(slots, us):
                    slot[: u.numel()].copy_(u)

            def digest(ts=ts):
                b = DigestBatch()
                for i, t in enumerate(ts):
                    b.add(f"t{i}", t)
                return b.hexdigests()

            def both(ts=ts, slots=slots, us=us):
                b = DigestBatch()
                for i, (t, slot, u) in enumerate(zip(ts, slots, us)):
                    b.add(f"t{i}", t)
                    slot[: u.numel()].copy_(u)
                return b.hexdigests()

            def fused(ts=ts, slots=slots):
                b = DigestBatch()
                for i, (t, slot) in enumerate(zip(ts, slots)):
                    b.add_copy(f"t{i}", t, slot)
                return b.hexdigests()

            def sample(fn, calls=[1]):  # noqa: B006 - calls per sample, set once per case below
                t0 = time.perf_counter()
                for _ in range(calls[0]):
                    fn()
                return 1e3 * (time.perf_counter() - t0) / calls[0]

        # check: the fused op's digest is the separate one's, and the slot holds the bytes
        buf.fill_(0x5A)
        if cuda:
            ok = kd.to_hex(fused()) == kd.to_hex(digest()) and torch.equal(slots[0][:n], us[0])
        else:
            ok = fused() == digest() and all(torch.equal(sl[: u.numel()], u) for sl, u in zip(slots, us))
        checks.append(f"{label}: {'PASS' if ok else 'FAIL'} (fused {'one read' if fuses(ts[0]) else 'copy, then digest'})")
        fns = {"copy": copy, "digest": digest, "digest+copy": both, "fused": fused}
        for fn in fns.values():  # warm: compile, plans, graph capture
            for _ in range(3):
                fn()
        if not cuda:  # enough calls for about 2 ms per sample (the slowest variant)
            t0 = time.perf_counter()
            both()
            k = max(1, int(2e-3 / max(time.perf_counter() - t0, 1e-7)))
            sample = functools.partial(sample, calls=[k])
        cases.append((label, n, fns, sample))
        rows[label] = {k: [] for k in fns}
    for _ in range(a.rounds):  # interleaved: every variant of every size once per round
        for label, _n, fns, sample in cases:
            for k, fn in fns.items():
                rows[label][k].append(sample(fn))
    med = {label: {k: statistics.median(v) for k, v in r.items()} for label, r in rows.items()}
    nbytes = {label: n for label, n, _, _ in cases}
    roof = max(2 * nbytes[label] / m["copy"] / 1e6 for label, m in med.items())  # GB/s, read + write bytes
    lines = [f"# bench_fused_copy: copy vs digest+copy vs fused ({where})", "",
             f"{datetime.date.today()}, torch {torch.__version__}, {a.rounds} interleaved rounds, median; "
             f"copy roofline of this run {roof:.0f} GB/s (read + write)", "",
             "checks: " + "; ".join(checks), "",
             "| size | variant | ms | GB/s (tensor bytes) | / copy | / floor (1 read + 1 write at the copy roofline) |",
             "|---|---|---:|---:|---:|---:|"]
    for label, m in med.items():
        n = nbytes[label]
        floor = 2 * n / roof / 1e6  # ms
        for k, ms in m.items():
            lines.append(f"| {label} | {k} | {ms:.3f} | {n / ms / 1e6:.1f} | {ms / m['copy']:.2f} | {ms / floor:.2f} |")
    emit(lines, a.out)
    return 0 if all(c.split(": ")[1].startswith("PASS") for c in checks) else 1


def _label(n: int) -> str:
    return f"{n // MiB} MiB" if n % MiB == 0 else f"{n // 1024} KiB"


if __name__ == "__main__":
    sys.exit(main())
