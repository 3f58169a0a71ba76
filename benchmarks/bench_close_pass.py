"""A close's one pass over a fused engine layout: the state with the regions of its fused parameters,
their superblocks derived from the parameters' read (``DigestSet.saved``) or read again.

A Qwen3-like model as vLLM holds it (per layer a fused ``qkv_proj`` = q, k, v rows and a fused
``gate_up_proj`` = gate, up rows, ``o_proj``, ``down_proj``, the norms; the embedding) and the pass a
close makes (``refit_verify.engine.state._extra_launch``): one kept :class:`~refit_verify.digest.kept.DigestSet`
over every state tensor whole, then the q / k / v / gate / up regions. Timed, interleaved round by
round: the state alone (one read of the engine's bytes), the pass with derived regions (the default),
and the pass with every region read again (``kept.DERIVE_REGIONS = False``, as before). Prints a
Markdown table (median, quartiles, bytes read, ratio to the state alone) and writes it to ``--out``.
On the CPU the compiled batch reads every region in both passes (derived views are a kernel-path
feature): the two rows measure the same work there.

Usage: ``python benchmarks/bench_close_pass.py [--model qwen3-4b-like|...] [--rounds 20] [--device auto|cuda|cpu]``.
Default layout: ``qwen3-4b-like`` on CUDA, ``qwen3-shaped-small`` on the CPU.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from refit_verify.digest import kept
from refit_verify.digest.batch import tensor_digest
from refit_verify.digest.kept import DigestSet
from refit_verify.testing import models

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _tables import emit, parse  # noqa: E402


def fused_layout(cfg: dict, device: str) -> tuple[list[torch.Tensor], list[tuple[int, tuple]]]:
    """The engine's state tensors of ``cfg`` with q/k/v and gate/up fused (bf16, random), and the
    regions a close reads beside them: ``(state, [(index into state, (offset, shape, strides))])``."""
    sd = models.device_state_dict(cfg, device=device)
    state: list[torch.Tensor] = []
    regions: list[tuple[int, tuple]] = []

    def fused(parts: list[torch.Tensor]) -> None:
        t = torch.cat(parts)
        state.append(t)
        row = 0
        for p in parts:
            regions.append((len(state) - 1, (row * t.shape[1], tuple(p.shape), t.stride())))
            row += p.shape[0]

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        fused([sd.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
        fused([sd.pop(p + f"mlp.{x}_proj.weight") for x in ("gate", "up")])
    state += list(sd.values())
    return state, regions


def _q(xs: list[float]) -> tuple[float, float, float]:
    qs = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return qs[0], statistics.median(xs), qs[2]


def main(argv: list[str] | None = None) -> int:
    a, device = parse(__doc__, argv, rounds=20,
                      extra=lambda ap: ap.add_argument("--model", choices=tuple(models.BENCH_LAYOUTS), default=None))
    name = a.model or ("qwen3-4b-like" if device == "cuda" else "qwen3-shaped-small")
    state, regions = fused_layout(models.BENCH_LAYOUTS[name], device)
    whole = [(0, tuple(t.shape), t.stride()) for t in state]
    tensors = state + [state[i] for i, _ in regions]
    geoms = whole + [g for _, g in regions]
    sb = sum(t.numel() * t.element_size() for t in state)
    rb = sum(state[i].element_size() * g[1][0] * g[1][1] for i, g in regions)
    sets = {"state alone (one read)": DigestSet(state)}
    kept.DERIVE_REGIONS = False
    sets["state + regions, regions read again"] = DigestSet(tensors, geoms)
    kept.DERIVE_REGIONS = True
    sets["state + regions, derived (the close's pass)"] = DigestSet(tensors, geoms)
    print(f"{name}: {len(state)} state tensors, {sb / 2**30:.3f} GiB, {len(regions)} regions, {rb / 2**30:.3f} GiB, on {device}",
          flush=True)
    got = {k: s.digest() for k, s in sets.items()}  # warm up (compile, check) and agree
    assert got["state + regions, regions read again"] == got["state + regions, derived (the close's pass)"]
    assert got["state alone (one read)"] == got["state + regions, derived (the close's pass)"][: len(state)]
    assert got["state + regions, derived (the close's pass)"][len(state)] == tensor_digest(
        state[regions[0][0]][: regions[0][1][1][0]])
    times: dict[str, list[float]] = {k: [] for k in sets}
    order = list(sets)
    for r in range(a.rounds):
        for k in (order if r % 2 == 0 else order[::-1]):
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sets[k].digest()
            if device == "cuda":
                torch.cuda.synchronize()
            times[k].append((time.perf_counter() - t0) * 1e3)
    base = statistics.median(times["state alone (one read)"])
    dev = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    lines = [f"# A close's pass over a fused layout ({datetime.date.today()}, {dev}, torch {torch.__version__}, "
             f"Python {sys.version.split()[0]})", "",
             f"{name}: {len(state)} state tensors ({sb / 2**30:.3f} GiB), {len(regions)} q/k/v/gate/up regions "
             f"({rb / 2**30:.3f} GiB), {a.rounds} interleaved rounds", "",
             "| what | p25 ms | median ms | p75 ms | GiB read | read / state | ms / state alone |", "|---|---|---|---|---|---|---|"]
    for k, xs in times.items():
        p25, med, p75 = _q(xs)
        nb = (sb if k.startswith("state alone") else sb + rb) - sets[k].saved
        lines.append(f"| {k} | {p25:.3f} | {med:.3f} | {p75:.3f} | {nb / 2**30:.3f} | {nb / sb:.3f} | {med / base:.3f} |")
    emit(lines, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
