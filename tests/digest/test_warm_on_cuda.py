"""The trainer's digest warm-up is queued with torch's CUDA initialisation (``refit_verify.digest.warm_on_cuda``).

No GPU here: torch's queue and the warm-up are replaced by recorders; tests/gpu/test_trainer_warmup_gpu.py
runs the real thing on CUDA.
"""

from __future__ import annotations

import threading

import pytest
import torch

from refit_verify.digest import warm_on_cuda as _cuda_warm


@pytest.fixture
def queued(monkeypatch):
    calls, started = [], []
    done = threading.Event()
    monkeypatch.setattr(_cuda_warm, "_installed", False)
    monkeypatch.setattr(_cuda_warm, "engine_process", False)
    monkeypatch.setattr(_cuda_warm, "SETTLE_S", 0.0)
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
    monkeypatch.delenv("REFIT_VERIFY", raising=False)
    assert _cuda_warm.install() and not _cuda_warm.install()  # queued once per process
    assert calls == [_cuda_warm._cuda_started] and started == []
    calls[0]()  # torch initialises CUDA
    assert done.wait(10) and started == [torch.device("cuda", 3)]


@pytest.mark.parametrize("engine, env", [(True, None), (False, "off")])
def test_no_warm_up_in_a_vllm_process_or_with_verification_off(queued, monkeypatch, engine, env):
    calls, started, done = queued
    monkeypatch.setattr(_cuda_warm, "engine_process", engine)
    if env is None:
        monkeypatch.delenv("REFIT_VERIFY", raising=False)
    else:
        monkeypatch.setenv("REFIT_VERIFY", env)
    assert _cuda_warm.install()
    calls[0]()
    assert not done.wait(0.5) and started == []


def test_a_torch_without_the_queue_is_left_alone(monkeypatch):
    monkeypatch.setattr(_cuda_warm, "_installed", False)
    monkeypatch.delattr(torch.cuda, "_lazy_call")
    assert not _cuda_warm.install()
