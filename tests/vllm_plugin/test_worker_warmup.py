"""The worker's digest warm-up: started once the worker's device is set when it verifies, never
with ``REFIT_VERIFY=off``; vLLM's graph capture waits for it. Fake workers, no engine (the demo's
test reads the warm-up's record in a real worker's log: ``tests/e2e/test_demo.py``)."""

from __future__ import annotations

import re
import sys
import threading

import pytest
import torch

from refit_verify.config import VerifyMode
from refit_verify.digest import backends
from refit_verify.vllm_plugin import patches, worker_warmup
from tests.support.warmups import forget_warmups


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    forget_warmups(monkeypatch)


class _Worker:
    """``init_device`` sets ``device``, as vLLM's ``Worker`` / ``CPUWorker`` do."""

    def __init__(self, device: str) -> None:
        self._device, self.device, self.captured = torch.device(device), None, threading.Event()

    def init_device(self):
        self.device = self._device
        return "ready"

    def compile_or_warm_up_model(self):
        self.captured.set()
        return "captured"


@pytest.mark.parametrize("mode", ["enforce", "log", "off"])
def test_a_worker_warms_its_digests_once_its_device_is_set_when_it_verifies(monkeypatch, mode):
    monkeypatch.setenv("REFIT_VERIFY", mode)
    w = _Worker("cpu")
    assert worker_warmup.wrap_init_device(_Worker.init_device)(w) == "ready"
    warm = backends._WARMUPS.get("cpu")
    if mode == "off":
        assert warm is None and backends._WARMING == {}
        return
    assert warm is not None and warm.done.wait(120)
    assert (warm.error, warm.backend) == (None, "numba")
    assert set(worker_warmup.REFIT_MODULES) <= sys.modules.keys()  # imported by the warm-up, not the first refit


def test_the_warmup_patches_are_applied_only_when_verifying(monkeypatch):
    applied = []
    monkeypatch.setattr(patches, "_DONE", set())
    monkeypatch.setattr(patches, "_APPLY", {name: lambda mode, name=name: applied.append(name)
                                            for name in ("digest-warmup", "warmup-before-capture", "cpu-heap-freeze")})
    patches.apply(VerifyMode.OFF)
    assert applied == []
    patches.apply(VerifyMode.ENFORCE)
    assert applied == ["digest-warmup", "warmup-before-capture", "cpu-heap-freeze"]


def test_no_warmup_without_a_device_or_with_the_switch_off(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    assert worker_warmup.start(_Worker("cpu")) is None  # init_device has not run: no device yet
    monkeypatch.setenv("REFIT_VERIFY_WARMUP", "off")
    w = _Worker("cpu")
    w.init_device()
    assert worker_warmup.start(w) is None and backends._WARMUPS == {}


def test_the_graph_capture_waits_for_the_warmup(monkeypatch):
    """A warm-up of the worker's device type in progress holds ``compile_or_warm_up_model`` (where vLLM
    captures its CUDA graphs) until it ends."""
    held = backends.Warmup(torch.device("cuda", 0))
    held.thread = threading.Thread(target=lambda: None)  # not the capturing thread
    backends._WARMING["cuda:0"] = held
    waiting = threading.Event()
    real_wait = backends.wait_for_warmup
    monkeypatch.setattr(backends, "wait_for_warmup", lambda t, s=None: (waiting.set(), real_wait(t, s)))
    w = _Worker("cuda:0")
    w.init_device()
    out = []
    th = threading.Thread(target=lambda: out.append(worker_warmup.wrap_compile_or_warm_up_model(_Worker.compile_or_warm_up_model)(w)))
    th.start()
    assert waiting.wait(30)
    assert th.is_alive() and not w.captured.is_set()
    backends._WARMING.pop("cuda:0")
    held.done.set()
    th.join(30)
    assert out == ["captured"]


def test_after_the_model_loads_a_cpu_worker_prepares_its_first_session_in_the_background(monkeypatch):
    from tests.support.toy_model import toy_worker

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    worker, wb, _ = toy_worker()
    worker.device = torch.device("cpu")
    th = worker_warmup.after_load(worker, wb)
    assert th is not None
    th.join(120)
    assert not th.is_alive()
    idx = wb.modules["model"]._index
    assert idx is not None and idx.kept["set"][0] is not None and idx.kept["set"][0].valid()
    assert wb.last is None and wb.baseline is None
    assert set(worker_warmup.REFIT_MODULES) <= sys.modules.keys()


def test_load_hooks_run_on_each_watched_model_in_the_loading_thread_and_a_failing_one_stops_nothing(monkeypatch):
    from tests.support.toy_model import toy_worker

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    worker, wb, _ = toy_worker()
    worker.device = torch.device("cpu")
    seen, built = [], []

    def broken(boundary, specs):
        raise RuntimeError("a kernel refused")

    def hook(boundary, specs):
        seen.append((boundary, threading.get_ident()))
        built.append(specs())

    monkeypatch.setattr(worker_warmup, "checkpoint_specs", lambda w: {"w": ((2, 3), "float32")})
    monkeypatch.setattr(worker_warmup, "LOAD_HOOKS", [broken, hook, lambda boundary, specs: built.append(specs())])
    handed = []
    monkeypatch.setattr(worker_warmup, "prepare", lambda *a: handed.append(a[3]))
    th = worker_warmup.after_load(worker, wb)
    assert seen == [(wb.modules["model"], threading.get_ident())]  # before after_load returned, in this thread
    assert th is not None
    th.join(120)
    assert built == [{"w": ((2, 3), "float32")}] * 2 and built[0] is built[1]  # built once
    assert handed == [built[0]]  # and handed on to the prepare


def test_a_cuda_worker_prepares_in_compile_or_warm_up_model_before_vllms_capture(monkeypatch):
    from tests.support.toy_model import toy_worker

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    worker, wb, _ = toy_worker()  # its tensors stay on the CPU: only the worker's device is named cuda here
    worker.device = torch.device("cuda", 0)
    assert worker_warmup.after_load(worker, wb) is None  # not in the background: vLLM profiles memory next
    assert wb.modules["model"]._index is None or wb.modules["model"]._index.kept.get("set") is None
    seen = []

    def compile_or_warm_up_model(self):
        seen.append(wb.modules["model"]._index.kept["set"][0])
        return "captured"

    assert worker_warmup.wrap_compile_or_warm_up_model(compile_or_warm_up_model)(worker) == "captured"
    assert len(seen) == 1 and seen[0] is not None  # prepared before the capture ran
    assert not hasattr(worker, worker_warmup._PENDING)


def test_no_preparing_with_the_warmup_off(monkeypatch):
    from tests.support.toy_model import toy_worker

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setenv("REFIT_VERIFY_WARMUP", "0")
    worker, wb, _ = toy_worker()
    worker.device = torch.device("cpu")
    assert worker_warmup.after_load(worker, wb) is None
    assert wb.modules["model"]._index is None or wb.modules["model"]._index.kept.get("set") is None


@pytest.fixture
def _unfrozen():
    """The test's process heap is unfrozen again afterwards (``gc.freeze`` is process-wide)."""
    import gc

    yield
    gc.unfreeze()


def test_a_cpu_worker_freezes_its_heap_after_vllms_warm_up_and_its_first_sessions_prepare(monkeypatch, caplog, _unfrozen):
    """As vLLM's GPU ``Worker`` does at the end of ``compile_or_warm_up_model``: after vLLM's own method
    returned and the prepare thread ended (its objects are frozen too); logged with the count."""
    import gc
    import logging

    from tests.support.toy_model import toy_worker

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    worker, wb, _ = toy_worker()
    worker.device = torch.device("cpu")
    release, kept = threading.Event(), []
    real_prepare = worker_warmup.prepare

    def slow_prepare(*a):
        release.wait(60)
        kept.append(object.__new__(type("Late", (), {})))  # an object the prepare made late: frozen as well
        return real_prepare(*a)

    monkeypatch.setattr(worker_warmup, "prepare", slow_prepare)
    order = []

    def compile_or_warm_up_model(self):
        order.append(("vllm", gc.get_freeze_count()))
        release.set()
        return "warmed"

    gc.unfreeze()
    th = worker_warmup.after_load(worker, wb)
    caplog.set_level(logging.INFO, logger="refit_verify")
    assert worker_warmup.wrap_cpu_compile_or_warm_up_model(compile_or_warm_up_model)(worker) == "warmed"
    assert order == [("vllm", 0)] and not th.is_alive()  # frozen after vLLM's method, once the prepare ended
    assert gc.get_freeze_count() > 1000
    assert kept[0] not in gc.get_objects(0) + gc.get_objects(1) + gc.get_objects(2)  # in the permanent generation
    assert wb.modules["model"]._index.kept["set"][0] is not None  # the prepare ran to its end
    msg = [r.getMessage() for r in caplog.records if "heap frozen" in r.getMessage()]
    assert len(msg) == 1
    m = re.fullmatch(r"refit-verify: worker heap frozen after the warm-up, as vLLM's GPU worker does: (\d+) objects "
                     r"\(waited (\d+\.\d{3}) s for the first session's prepare, froze in \d+\.\d{3} s\)", msg[0])
    assert m and int(m[1]) > 1000  # the heap of this test process


def test_no_heap_freeze_with_the_warmup_off_and_a_prepare_past_its_bound_is_left_running(monkeypatch, _unfrozen):
    import gc

    gc.unfreeze()
    monkeypatch.setenv("REFIT_VERIFY_WARMUP", "0")
    w = _Worker("cpu")
    assert worker_warmup.freeze_heap(w) is None and gc.get_freeze_count() == 0
    monkeypatch.delenv("REFIT_VERIFY_WARMUP")
    stuck = threading.Event()
    th = threading.Thread(target=stuck.wait, args=(60,), daemon=True)
    th.start()
    setattr(w, worker_warmup._THREAD, th)
    try:
        n = worker_warmup.freeze_heap(w, timeout_s=0.2)  # the bound holds: the freeze goes on without the prepare
        assert n == gc.get_freeze_count() > 1000 and th.is_alive()
    finally:
        stuck.set()
        th.join(10)


def test_checkpoint_specs_are_the_hf_tensors_of_the_engines_config_in_its_dtype():
    """What the prepare learns placements for: the transformers model of the worker's config, built on
    the meta device, its floating-point tensors in the engine's dtype; nothing for a config it cannot build."""
    import types

    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=40, tie_word_embeddings=False)
    worker = types.SimpleNamespace(model_config=types.SimpleNamespace(hf_config=cfg, dtype=torch.bfloat16))
    specs = worker_warmup.checkpoint_specs(worker)
    assert specs["model.embed_tokens.weight"] == ((40, 16), "bfloat16")
    assert specs["model.layers.0.self_attn.k_proj.weight"] == ((8, 16), "bfloat16")
    assert specs["lm_head.weight"] == ((40, 16), "bfloat16") and len(specs) == 12
    worker.model_config.hf_config = types.SimpleNamespace(model_type="no-such-architecture")
    assert worker_warmup.checkpoint_specs(worker) == {}
