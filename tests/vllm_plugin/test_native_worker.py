"""The weight version of vLLM's native updates: the trainer names it
(``native_trainer.next_update_version``), each worker's next ``start_weight_update`` opens its session
with it, and the worker's order check names an older one. A worker-side weight-transfer engine
stand-in around the toy model (tests/support/toy_model.py); no vLLM needed."""

from __future__ import annotations

import types

import pytest

from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitConfigError
from refit_verify.manifest import from_wire
from refit_verify.vllm_plugin import native_trainer, native_worker
from tests.support.toy_model import ToyModel, toy_weights


class _TransferEngine:
    """vLLM's worker-side weight-transfer engine, reduced to its update calls."""

    def __init__(self, model) -> None:
        self.model = model

    def start_weight_update(self):
        pass

    def update_weights(self, weights):
        self.model.load_weights(weights)

    def finish_weight_update(self):
        pass


class _Engine:
    """A trainer's engine handle whose ``collective_rpc`` runs the plugin's worker methods on ``workers``."""

    def __init__(self, *workers) -> None:
        self.workers, self.calls = list(workers), []

    def collective_rpc(self, method, args=(), timeout=None):
        self.calls.append(method)
        return [getattr(native_worker, method)(w, *args) for w in self.workers]


@pytest.fixture
def worker(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    eng = _TransferEngine(ToyModel())
    native_worker.instrument_engine(eng, "ipc")
    return types.SimpleNamespace(rank=0, weight_transfer_engine=eng)


def _update(worker, seed):
    w = toy_weights(seed)
    eng = worker.weight_transfer_engine
    eng.start_weight_update()
    eng.update_weights(list(w.items()))
    eng.finish_weight_update()
    out = native_worker.refit_verify_native_manifest(worker)
    return compare_session({"model": digest_tensors(w.items())}, from_wire(out["session_manifest"]))


def test_the_version_the_trainer_names_opens_the_next_update_and_an_older_one_is_named(worker):
    engine = _Engine(worker)
    assert native_trainer.next_update_version(engine, 5) == [{"rank": 0, "verifying": True, "version": 5}]
    first = _update(worker, 1)
    assert first.ok and first.version == 5
    second = _update(worker, 2)  # no version named: unversioned, taken once
    assert second.ok and second.version is None
    native_trainer.next_update_version(engine, 3)
    late = _update(worker, 3)
    assert late.version == 3 and not late.ok
    assert late.problems == ("stale refit: version 3 is older than version 5 already closed on this worker",)
    native_trainer.next_update_version(engine, 6)
    assert _update(worker, 4).ok


@pytest.mark.parametrize("bad", [-1, 2.5, "4", True])
def test_a_version_that_is_not_an_int_from_0_is_refused_on_both_sides(worker, bad):
    engine = _Engine(worker)
    with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
        native_trainer.next_update_version(engine, bad)
    assert engine.calls == []
    with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
        native_worker.refit_verify_native_version(worker, bad)


def test_a_worker_without_a_weight_transfer_engine_fails_in_enforce_and_nothing_is_called_when_off(monkeypatch):
    engine = _Engine(types.SimpleNamespace(rank=2))
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    with pytest.raises(RefitConfigError, match=r"version 4 does not reach vLLM worker rank 2 \(no weight-transfer engine"):
        native_trainer.next_update_version(engine, 4)
    monkeypatch.setenv("REFIT_VERIFY", "log")
    assert native_trainer.next_update_version(engine, 4)[0]["verifying"] is False
    monkeypatch.setenv("REFIT_VERIFY", "off")
    engine.calls.clear()
    assert native_trainer.next_update_version(engine, 4) == [] and engine.calls == []
