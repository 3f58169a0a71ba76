"""A trainer process's digest warm-up starts as it initialises CUDA (``refit_verify.digest.warm_start``), so
its first refit finds the kernels loaded. Run in a fresh Python process (this one has CUDA initialised
already). Needs a CUDA GPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

_CHILD = r"""
import json, os, time
import torch
import refit_verify
from refit_verify.digest import backends
x = torch.randn(1 << 20, device="cuda")  # the trainer's first CUDA use: the warm-up starts on cuda:0
t0 = time.perf_counter()
while "cuda:0" not in backends._WARMUPS and time.perf_counter() - t0 < 10:
    time.sleep(0.01)
w = backends._WARMUPS.get("cuda:0")
ok = w is not None and w.done.wait(300)
print(json.dumps({"started": w is not None, "done": bool(ok), "backend": getattr(w, "backend", None),
                  "error": repr(getattr(w, "error", None))}))
"""


def test_a_trainer_process_warms_its_digests_when_it_initialises_cuda():
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("REFIT_VERIFY", "REFIT_VERIFY_WARMUP")}
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=400, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"started": True, "done": True, "backend": "triton", "error": "None"}, out.stderr[-3000:]


def test_after_the_warmup_plans_of_new_sizes_pin_no_host_memory():
    """Every plan goes to the device through a pinned block (``kernels.launch._device_plan``): after
    the warm-up's blocks (``backends._warm_pinned``), first plans of other sizes up to 1 MiB make no
    ``cudaHostAlloc`` (torch's caching host allocator reuses them, one list per power of two)."""
    from refit_verify.digest import backends
    from refit_verify.digest import reference as ref
    from refit_verify.digest.kernels import launch as kd

    backends._warm_pinned()
    before = torch.cuda.host_memory_stats()["num_host_alloc"]
    sizes = []
    for n in (3, 21, 300, 2000):
        views = [torch.full((1000 + i,), i % 251, dtype=torch.uint8, device="cuda") for i in range(n)]
        seeds = [ref.seed("uint8", (v.numel(),), v.numel()) for v in views]
        p = kd.plan_views(views, seeds)
        sizes.append(p.plan.numel() * 8)
        got = kd.to_hex(kd.run_plan(p))  # synchronises: the block is free again for the next plan
        assert got[2] == ref.digest_bytes(views[2].cpu().numpy().tobytes(), "uint8", (views[2].numel(),))
    assert torch.cuda.host_memory_stats()["num_host_alloc"] == before
    assert min(sizes) < 4096 and 65536 < max(sizes) <= 1 << 20  # the bins it went through
