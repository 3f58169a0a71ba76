"""What proving a linear weight through its layer's forward costs (refit_verify.engine.forward), on this CPU.

For each shape (``[N, K]`` bf16): the rebuild of ``W`` from the GEMM on blocks of the identity and the
digests of it, i.e. what the close adds per repacked linear. Two kernels: a float32 oneDNN handler of the
weight (vLLM's onednn_mm; what tests/support/plugins.pack_linear builds where this CPU's oneDNN has no
bf16 matmul) and plain ``F.linear`` (torch's bf16 GEMM). Prints min and median ms of ``--repeat`` runs (on a
shared 2-core machine the median carries other processes' scheduling).

    .venv/bin/python benchmarks/bench_forward_proof.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from refit_verify.engine import forward

# the demo's tiny Llama (hidden 128, intermediate 256, 2 heads, 1 kv head, 2 layers): qkv, o, gate_up, down per layer
TINY = [(256, 128), (128, 128), (512, 128), (128, 256)] * 2


class _Layer(torch.nn.Module):
    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(w, requires_grad=False)


def _kernels(w: torch.Tensor):
    out = {"F.linear": lambda x: torch.nn.functional.linear(x, w)}
    try:
        from vllm import _custom_ops as ops

        h = ops.create_onednn_mm(w.float().t(), 32)
        out["onednn fp32"] = lambda x: ops.onednn_mm(h, x.float(), None).to(x.dtype)
    except Exception as e:  # noqa: BLE001 - a CPU or build without it
        print(f"no oneDNN kernel: {type(e).__name__}: {e}"[:200])
    return out


def _time(fn, repeat: int) -> tuple[float, float]:
    """(min, median) ms of ``repeat`` runs after one warm-up run."""
    fn()
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"torch threads {torch.get_num_threads()}")
    for label, shapes in (("demo tiny Llama, 8 linears", TINY), ("one 6144x2048 bf16", [(6144, 2048)])):
        ws = [torch.randn(s).bfloat16() for s in shapes]
        for kname in _kernels(ws[0]):
            ks = [_kernels(w)[kname] for w in ws]

            def run(ks=ks, ws=ws):
                for k, w in zip(ks, ws):
                    got = forward.rebuild(k, tuple(w.shape), w.dtype)
                    forward._digests(got, [])
                    assert torch.equal(got, w)

            lo, med = _time(run, a.repeat)
            print(f"{label}: {kname}: min {lo:.1f} ms, median {med:.1f} ms (rebuild + digest)")


if __name__ == "__main__":
    main()
