"""A trainer process's digest warm-up starts as it initialises CUDA (``refit_verify.digest.warm_on_cuda``), so
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
