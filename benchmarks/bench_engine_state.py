"""Engine-state digest (read-back / audit / snapshot) against a device-to-host copy + SHA-256 per parameter.

What refit-verify does at the end of every session (``refit_verify.engine.state.snapshot``: every
parameter digested on its device, one batched launch, one synchronisation) against what vLLM
0.32's ``Worker.compute_weight_checksums`` does (``model_executor/model_loader/weight_checksum.py``:
for each named parameter, copy to the host, make contiguous, SHA-256 the bytes), on the same
tensors, interleaved round by round. Prints a Markdown table (median, quartiles, ratio to the
baseline of the same run) and writes it to ``--out``.

Usage: ``python benchmarks/bench_engine_state.py [--model qwen3-0.6b-like|tiny] [--rounds 20] [--device auto|cuda|cpu]``.
The 310-tensor, 1.11 GiB Qwen3-0.6B-like set is the default on CUDA, the tiny Llama on CPU.
"""

from __future__ import annotations

import datetime
import hashlib
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from refit_verify.testing import models
from refit_verify.boundary.worker import identity_of
from refit_verify.digest.batch import DigestBatch
from refit_verify.engine.state import snapshot

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _baseline(params: dict[str, torch.Tensor]) -> dict[str, str]:
    """vLLM's checksum: per parameter, to host, contiguous, SHA-256 (compute_tensor_digests)."""
    out = {}
    for name, p in params.items():
        host = p.detach().to("cpu").contiguous()
        out[name] = hashlib.sha256(host.view(torch.uint8).numpy().tobytes()).hexdigest()
    return out


def _ours(module: torch.nn.Module, device: str):
    return snapshot({"model": module}, identity_of(0, device=device))


def _kernels_only(params: dict[str, torch.Tensor], device: str) -> None:
    b = DigestBatch()
    for n, p in params.items():
        b.add(n, p)
    b.hexdigests()


def _q(xs: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return qs[0], statistics.median(xs), qs[2]


def main(argv: list[str] | None = None) -> int:
    a, device = parse(__doc__, argv, rounds=20,
                      extra=lambda ap: ap.add_argument("--model", choices=("qwen3-0.6b-like", "tiny"), default=None))
    name = a.model or ("qwen3-0.6b-like" if device == "cuda" else "tiny")
    cfg = models.QWEN3_0_6B_LIKE if name == "qwen3-0.6b-like" else models.load_config(models.packaged_config_dir())
    sd = models.random_state_dict(cfg, seed=0, device=device)
    module = torch.nn.Module()
    for i, (n, t) in enumerate(sd.items()):
        module.register_parameter(f"p{i}", torch.nn.Parameter(t, requires_grad=False))
    params = dict(module.named_parameters())
    nbytes = sum(p.numel() * p.element_size() for p in params.values())
    print(f"{name}: {len(params)} tensors, {nbytes / 2**30:.3f} GiB on {device}", flush=True)
    # warm up (kernel compile, numba JIT) and check both see the same tensors
    assert len(_ours(module, device).params) == len(_baseline(params))
    _kernels_only(params, device)
    times: dict[str, list[float]] = {"refit-verify engine-state snapshot": [], "refit-verify digests only (DigestBatch)": [],
                                     "baseline: D2H copy + SHA-256 per parameter": []}
    fns = {"refit-verify engine-state snapshot": lambda: _ours(module, device),
           "refit-verify digests only (DigestBatch)": lambda: _kernels_only(params, device),
           "baseline: D2H copy + SHA-256 per parameter": lambda: _baseline(params)}
    order = list(fns)
    for r in range(a.rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            _sync(device)
            t0 = time.perf_counter()
            fns[k]()
            _sync(device)
            times[k].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["baseline: D2H copy + SHA-256 per parameter"])
    dev = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    lines = [f"# Engine-state digest vs D2H + SHA-256 ({datetime.date.today()}, {dev}, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]})", "",
             f"{name}: {len(params)} tensors, {nbytes / 2**30:.3f} GiB, {a.rounds} interleaved rounds", "",
             "| what | p25 ms | median ms | p75 ms | GB/s (median) | ratio to baseline |", "|---|---|---|---|---|---|"]
    for k, xs in times.items():
        p25, med, p75 = _q(xs)
        lines.append(f"| {k} | {p25:.3f} | {med:.3f} | {p75:.3f} | {nbytes / med / 1e6:.1f} | {med / base:.4f} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
