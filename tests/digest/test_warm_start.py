"""The trainer's digest warm-up starts ahead of its first refit (``refit_verify.digest.warm_start``):
the CPU's shortly after ``import refit_verify``, the CUDA device's as the process initialises CUDA.

No GPU here: torch's CUDA queue is replaced by a recorder (tests/gpu/test_trainer_warmup_gpu.py runs
the real thing on CUDA); the CPU's start runs for real in a fresh trainer process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from refit_verify.digest import warm_start


@pytest.fixture
def queued(monkeypatch):
    calls, started = [], []
    done = threading.Event()
    if warm_start._cpu_starter is not None:  # the starter of this process's import ends before anything is patched
        warm_start._cpu_starter.join(10)
    monkeypatch.setattr(warm_start, "_installed", False)
    monkeypatch.setattr(warm_start, "_cpu_starter", threading.current_thread())  # no CPU start: tested on its own below
    monkeypatch.setattr(warm_start, "engine_process", False)
    monkeypatch.setattr(warm_start, "at_import", True)
    monkeypatch.setattr(warm_start, "SETTLE_S", 0.0)
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn, **kw: calls.append(fn))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    from refit_verify.digest import backends

    def start(device=None, then=None):
        started.append(device)
        done.set()

    monkeypatch.setattr(backends, "start_warmup", start)
    return calls, started, done


def test_the_warm_up_starts_on_the_current_device_when_cuda_initialises(queued, monkeypatch):
    calls, started, done = queued
    monkeypatch.delenv("REFIT_VERIFY", raising=False)  # a trainer may pass its mode to refit() instead
    assert warm_start.install() and not warm_start.install()  # queued once per process
    assert calls == [warm_start._cuda_started] and started == []
    calls[0]()  # torch initialises CUDA
    assert done.wait(10) and started == [torch.device("cuda", 3)]


@pytest.mark.parametrize("engine, env, at_import", [(True, "enforce", True), (False, "off", True), (False, " OFF ", True),
                                                    (False, "log", False)])
def test_no_warm_up_in_a_vllm_process_with_verification_off_or_switched_off(queued, monkeypatch, engine, env, at_import):
    calls, started, done = queued
    monkeypatch.setattr(warm_start, "engine_process", engine)
    monkeypatch.setattr(warm_start, "at_import", at_import)
    if env is None:
        monkeypatch.delenv("REFIT_VERIFY", raising=False)
    else:
        monkeypatch.setenv("REFIT_VERIFY", env)
    assert warm_start.install()
    calls[0]()
    assert not done.wait(0.5) and started == []


def test_a_torch_without_the_queue_still_starts_the_cpu_warm_up(queued, monkeypatch):
    calls, started, done = queued
    monkeypatch.setenv("REFIT_VERIFY", "log")
    monkeypatch.setattr(warm_start, "_cpu_starter", None)
    monkeypatch.setattr(warm_start, "CPU_SETTLE_S", 0.0)
    monkeypatch.delattr(torch.cuda, "_lazy_call")
    assert warm_start.install() and not warm_start.install()
    assert done.wait(10) and started == ["cpu"] and calls == []


def test_nothing_before_torch_is_imported(monkeypatch):
    monkeypatch.setattr(warm_start, "_installed", False)
    monkeypatch.setattr(warm_start, "_cpu_starter", None)
    monkeypatch.delitem(sys.modules, "torch")
    assert not warm_start.install() and warm_start._cpu_starter is None and not warm_start._installed


_TRAINER = """
import json, sys, time
import torch
import refit_verify
from refit_verify.digest import backends, warm_start
t0 = time.perf_counter()
while "cpu" not in backends._WARMUPS and time.perf_counter() - t0 < 30:
    time.sleep(0.02)
w = backends._WARMUPS.get("cpu")
ok = w is not None and w.done.wait(120)
print(json.dumps({"started_s": time.perf_counter() - t0, "backend": w and w.backend, "done": ok,
                  "error": repr(w and w.error), "thread": w and w.thread and w.thread.name,
                  "settle": warm_start.CPU_SETTLE_S}))
"""


@pytest.mark.parametrize("env", [{"REFIT_VERIFY": "enforce"}, {}, {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "0"},
                                 {"REFIT_VERIFY": "off"}])
def test_the_cpu_warm_up_starts_in_a_fresh_trainer_process_after_import(env):
    full = {k: v for k, v in os.environ.items() if k not in ("REFIT_VERIFY", "REFIT_VERIFY_WARMUP")} | env
    starts = env in ({"REFIT_VERIFY": "enforce"}, {})
    script = _TRAINER.replace("< 30", "< 30" if starts else "< 3")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180, env=full)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if not starts:
        assert got["backend"] is None and not got["done"]  # nothing started within 3 s
    else:
        assert got["done"] and got["backend"] == "numba" and got["error"] == "None"
        assert got["settle"] - 0.2 <= got["started_s"] < 20
