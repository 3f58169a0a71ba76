"""Host cost per tensor of the operations one verified refit repeats per tensor, on CUDA (or CPU).

    python benchmarks/bench_host_ops.py [--rounds 5] [--device auto|cuda|cpu] [--out FILE]

For each of the 310 tensors of the Qwen3-0.6B-like set: tensor attribute reads, the views
``logical_bytes`` makes, a device copy (``clone``), the cached §3 seed, and the batches built from
them (``DigestBatch`` without copies, ``CopyingBatch`` / ``StreamDigests`` with one copy per
tensor, ``engine_state.snapshot`` of a module holding the set, ``digest_now`` of the whole set and
of 40 tensors at a time, as the transport's two sides read it; kept sets read with JIT and with
direct launches, ``refit_verify.digest.kernels.direct``). One sample times the host side
of one pass over the set (``time.perf_counter``, a CUDA synchronisation before the pass, none
inside it unless the row says so); the table gives the median and quartiles over ``--rounds``
samples in microseconds per tensor, and each row's ratio to the same run's ``t.view(-1)`` row.
This is where host time per tensor goes; ``bench_paths.py`` measures what a whole refit costs.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from refit_verify.testing import models
from refit_verify.boundary.worker import identity_of
from refit_verify.config import DIRECT_LAUNCH_ENV_VAR
from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.tensors import tensor_seed, logical_bytes
from refit_verify.digest.kept import DigestSet
from refit_verify.digest.incremental import CopyingBatch, _same_storage, digest_now
from refit_verify.trainer.exports import StreamDigests
from refit_verify.engine.state import snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    a, dev = parse(__doc__, argv, rounds=5)
    sd = models.random_state_dict(models.QWEN3_0_6B_LIKE, seed=1, device=dev)
    ts = list(sd.items())
    u8s = [logical_bytes(t) for _, t in ts]
    module = torch.nn.Module()
    for n, t in ts:
        module.register_parameter(n.replace(".", "_"), torch.nn.Parameter(t.clone(), requires_grad=False))
    who = identity_of(0, device=dev)

    def sync() -> None:
        if dev == "cuda":
            torch.cuda.synchronize()

    def filled(make, finish: str):
        """Add every tensor to ``make()``, then call its ``finish`` method."""
        def run() -> None:
            b = make()
            for n, t in ts:
                b.add(n, t)
            getattr(b, finish)()
        return run

    copying = filled(CopyingBatch, "launch")
    stream = filled(StreamDigests, "digests")
    held = filled(lambda: StreamDigests(copy=False), "digests")
    plain = filled(DigestBatch, "hexdigests")

    whole = DigestSet([t for _, t in ts])
    forties = [DigestSet([t for _, t in ts[i:i + 40]]) for i in range(0, len(ts), 40)]

    def kept(sets, jit: bool, collect: bool):
        """Read kept sets (no signature check): launches only, or launches and the device-to-host read."""
        def run() -> None:
            if jit:
                os.environ[DIRECT_LAUNCH_ENV_VAR] = "0"
            try:
                for k in sets:
                    got = k.launch(check=False)
                    if collect:
                        DigestSet.collect(got)
            finally:
                os.environ.pop(DIRECT_LAUNCH_ENV_VAR, None)
        return run

    rows = [
        ("t.view(-1)", lambda: [t.view(-1) for _, t in ts]),
        ("t.dtype, t.shape, t.numel()", lambda: [(t.dtype, t.shape, t.numel()) for _, t in ts]),
        ("t.untyped_storage().data_ptr()", lambda: [t.untyped_storage().data_ptr() for _, t in ts]),
        ("t.reshape(-1).view(torch.uint8)", lambda: [t.reshape(-1).view(torch.uint8) for _, t in ts]),
        ("logical_bytes(t) (checks + views)", lambda: [logical_bytes(t) for _, t in ts]),
        ("cached seed", lambda: [tensor_seed(t.dtype, t.shape, u.numel()) for u, (_, t) in zip(u8s, ts)]),
        ("same-storage test", lambda: [_same_storage(u, t) for u, (_, t) in zip(u8s, ts)]),
        ("u8.clone() (one device copy)", lambda: [u.clone() for u in u8s]),
        ("DigestBatch: add + hexdigests (incl. sync)", plain),
        ("CopyingBatch: add + launch", copying),
        ("StreamDigests: add + digests (incl. sync)", stream),
        ("StreamDigests(copy=False): add + digests (incl. sync)", held),
        ("engine_state.snapshot of the module (incl. sync)", lambda: snapshot({"model": module}, who)),
        ("digest_now of the set, kept (incl. sync): the transport sender's digests ahead", lambda: digest_now(ts, space="bench")),
        ("digest_now, 40 tensors at a time (incl. syncs): the worker's check before loading",
         lambda: [digest_now(ts[i:i + 40], space="bench-40") for i in range(0, len(ts), 40)]),
        ("kept set of the 310, launch only: JIT launches", kept([whole], True, False)),
        ("kept set of the 310, launch only: direct launches", kept([whole], False, False)),
        ("kept set of the 310, launch + read (incl. sync): JIT launches", kept([whole], True, True)),
        ("kept set of the 310, launch + read (incl. sync): direct launches", kept([whole], False, True)),
        ("8 kept sets of 40, launch + read each (incl. syncs): JIT launches", kept(forties, True, True)),
        ("8 kept sets of 40, launch + read each (incl. syncs): direct launches", kept(forties, False, True)),
    ]
    samples: dict[str, list[float]] = {label: [] for label, _ in rows}
    for r in range(a.rounds + 1):
        for label, fn in rows:  # interleaved: every row once per round
            sync()
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            sync()
            if r:  # round 0 warms up (kernel compile, caches)
                samples[label].append(dt * 1e6 / len(ts))
    base = statistics.median(samples[rows[0][0]])
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    lines = [f"# Host cost per tensor ({datetime.date.today()}, {name}, torch {torch.__version__})", "",
             f"{len(ts)} tensors, {a.rounds} interleaved rounds; µs per tensor (host time of one pass over the set)", "",
             "| operation | p25 | median | p75 | / t.view(-1) |", "|---|---|---|---|---|"]
    for label, _ in rows:
        xs = samples[label]
        q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
        med = statistics.median(xs)
        lines.append(f"| {label} | {q[0]:.2f} | {med:.2f} | {q[2]:.2f} | {med / base:.1f} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
