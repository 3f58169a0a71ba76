"""vLLM 0.26's static senders into an in-process ``LLM``: each send is checked once, at the close of
the update it fed, through whichever way that update closes (``LLM.finish_weight_update``,
``LLM.collective_rpc("finish_weight_update")``, the next ``start_weight_update``), against that
``LLM``'s workers only; 0.26's one-line finish and the manifests share one RPC once the workers have
said they answer it. Fakes in the shape of 0.26's classes (the real 0.26 flow runs on the GPU:
``tests/gpu/test_native_ipc_gpu.py``)."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

pytest.importorskip("vllm")

from refit_verify import RefitConfigError, RefitProtocolError, RefitVerificationError  # noqa: E402
from refit_verify.vllm_plugin import native_trainer as native, native_worker, shims  # noqa: E402
from tests.e2e.test_native_api import _FakeEngine, _static_ipc  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def _state(monkeypatch):
    """No wrapper state left between tests; vLLM reads as 0.26 (the one-line finish is recognised only there)."""
    monkeypatch.setattr(shims, "vllm_version", lambda: (0, 26))
    yield
    native._PENDING.clear()
    native._OPEN.clear()
    native._ACTIVE.clear()


class _Engine026:
    """``LLM.llm_engine``: its one worker keeps an update open from start to a real finish, and answers
    the plugin's methods (``announce``: whether its manifest says it answers the combined finish)."""

    def __init__(self, llm, announce=True):
        self.llm, self.announce, self.calls, self.open = llm, announce, [], False
        self.fail, self.fail_on = None, None  # raise ``fail`` from every RPC, or from ``fail_on``'s only

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(method)
        if self.fail is not None and self.fail_on in (None, method):
            raise self.fail
        if method == "start_weight_update":
            self.open = True
            return [None]
        if method in ("finish_weight_update", native.FINISH_METHOD):
            assert self.open, "finish_weight_update called without a matching start_weight_update."
            self.open = False
            if method == "finish_weight_update":
                return [None]
        assert method in (native.MANIFEST_METHOD, native.FINISH_METHOD), method
        (w,) = _FakeEngine.collective_rpc(self.llm, native.MANIFEST_METHOD)
        return [dict(w, active=self.open, finish_rpc=self.announce)]


class _LLM026(_FakeEngine):
    """An in-process LLM of 0.26: ``finish_weight_update`` is 0.26's one-liner, wrapped as the plugin does."""

    def __init__(self, corrupt=None, announce=True):
        super().__init__(corrupt)
        self.llm_engine = _Engine026(self, announce)

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return self.llm_engine.collective_rpc(method, timeout)

    def start_weight_update(self):
        self.llm_engine.collective_rpc("start_weight_update")

    def finish_weight_update(self):
        """Finish the current weight update."""
        self.llm_engine.collective_rpc("finish_weight_update")


_LLM026.start_weight_update = native._wrap_llm_start(_LLM026.start_weight_update)
_LLM026.finish_weight_update = native._wrap_llm_finish(_LLM026.finish_weight_update)
_LLM026.collective_rpc = native._wrap_llm_rpc(_LLM026.collective_rpc)

WEIGHTS = {f"w{i}": torch.randn(4, 8) for i in range(3)}


def _update(ipc, llm, weights=WEIGHTS):
    llm.start_weight_update()
    ipc.trainer_send_weights(iter(weights.items()), {"send_mode": llm.send})


def test_the_first_finish_fetches_apart_then_one_rpc_finishes_and_fetches(monkeypatch):
    """Update 1: vLLM's finish, then a fetch (the workers have not said they answer the combined
    finish yet); updates 2 and 3: one RPC. A bad byte is named at the finish either way."""
    ipc = _static_ipc(monkeypatch)
    llm = _LLM026()
    _update(ipc, llm)
    assert llm.llm_engine.calls == ["start_weight_update"]  # nothing fetched at the send
    llm.finish_weight_update()
    assert llm.llm_engine.calls[1:] == ["finish_weight_update", native.MANIFEST_METHOD]
    assert native.last_reports()[0].ok
    del llm.llm_engine.calls[:]
    _update(ipc, llm)
    llm.finish_weight_update()
    assert llm.llm_engine.calls == ["start_weight_update", native.FINISH_METHOD] and not llm.llm_engine.open
    (report,) = native.last_reports()
    assert report.ok and report.verified == 3
    llm.corrupt = "w0"
    _update(ipc, llm)
    with pytest.raises(RefitVerificationError) as ei:
        llm.finish_weight_update()
    assert ei.value.mismatched == ["w0"] and not llm.llm_engine.open


def test_workers_that_do_not_announce_the_combined_finish_get_vllms_finish_every_time(monkeypatch):
    """Workers without refit_verify_native_finish (another refit-verify on a Ray node): vLLM's own
    finish, then a fetch, at every update; the finish always happens."""
    ipc = _static_ipc(monkeypatch)
    llm = _LLM026(announce=False)
    for _ in range(3):
        _update(ipc, llm)
        llm.finish_weight_update()
        assert not llm.llm_engine.open and native.last_reports()[0].ok
    assert llm.llm_engine.calls.count(native.FINISH_METHOD) == 0 and llm.llm_engine.calls.count("finish_weight_update") == 3


def test_a_failing_finish_raises_vllms_error_and_keeps_the_sends_for_the_retry(monkeypatch):
    ipc = _static_ipc(monkeypatch)
    llm = _LLM026()
    _update(ipc, llm)
    llm.finish_weight_update()  # the workers announce the combined finish
    _update(ipc, llm)
    llm.llm_engine.fail = RuntimeError("Call to collective_rpc method failed: Worker failed")
    with pytest.raises(RuntimeError, match="Worker failed"):  # vLLM's own error, unchanged
        llm.finish_weight_update()
    assert any(v._feeds(llm) for v in native._PENDING) and llm.llm_engine.open
    llm.llm_engine.fail = None
    llm.finish_weight_update()
    assert not native._PENDING and not llm.llm_engine.open
    assert native.last_reports()[0].ok


def test_the_worker_method_finishes_then_answers_and_never_raises_its_own_error():
    """refit_verify_native_finish itself: vLLM's finish first (its error propagates), then the
    manifest; a failure building the manifest comes back as an error entry, which the trainer's
    check turns into a failure (enforce raises, log warns)."""
    order = []

    class Worker:
        rank = 0
        weight_transfer_engine = None

        def finish_weight_update(self):
            order.append("finish")

    got = native_worker.refit_verify_native_finish(Worker())
    assert order == ["finish"] and got["verifying"] is False and got["finish_rpc"] is True

    class Broken(Worker):
        @property
        def weight_transfer_engine(self):
            raise ValueError("manifest bug")

    got = native_worker.refit_verify_native_finish(Broken())
    assert order == ["finish", "finish"] and got["error"] == "ValueError: manifest bug" and got["rank"] == 0

    class Failing(Worker):
        def finish_weight_update(self):
            raise RuntimeError("finish_weight_update called without a matching start_weight_update.")

    with pytest.raises(RuntimeError, match="without a matching start"):
        native_worker.refit_verify_native_finish(Failing())
    v = native.NativeSendVerifier(object(), mode="enforce")
    with pytest.raises(RefitProtocolError, match="worker rank 0 could not give its manifest .*manifest bug"):
        v.verify([got | {"error": "ValueError: manifest bug"}])


def _finish_two_rpcs(self):
    """Finish the current weight update."""
    self.llm_engine.collective_rpc("finish_weight_update")
    self.llm_engine.collective_rpc("reset_prefix_cache")


def _finish_kwargs(self):
    """Finish the current weight update."""
    self.llm_engine.collective_rpc("finish_weight_update", kwargs={"flush": True})


def _finish_returns(self):
    """Finish the current weight update."""
    return self.llm_engine.collective_rpc("finish_weight_update")


def _finish_version(self, weight_version=None):
    """Finish the weight update and set its version if provided."""
    self.llm_engine.collective_rpc("finish_weight_update")
    if weight_version is not None:
        self.llm_engine.set_weight_version(weight_version)


def test_only_0_26s_one_line_finish_is_replaced(monkeypatch):
    def finish_026(self):
        """Finish the current weight update."""
        self.llm_engine.collective_rpc("finish_weight_update")

    assert native._is_026_finish(finish_026)
    # vLLM 0.26's llm.py has no `from __future__ import annotations` (this module has): the same function
    plain = compile('def finish_weight_update(self):\n    """Finish the current weight update."""\n'
                    '    self.llm_engine.collective_rpc("finish_weight_update")\n', "vllm/entrypoints/llm.py", "exec", dont_inherit=True)
    ns: dict = {}
    exec(plain, ns)
    assert not ns["finish_weight_update"].__code__.co_flags & 0x1000000 and finish_026.__code__.co_flags & 0x1000000
    assert native._is_026_finish(ns["finish_weight_update"])
    # the same instructions over its constants in another order: collective_rpc(None), then return the name
    ns = {}
    exec(compile('def finish_weight_update(self):\n    """Something else."""\n    self.llm_engine.collective_rpc(None)\n'
                 '    return "finish_weight_update"\n', "vllm/entrypoints/llm.py", "exec", dont_inherit=True), ns)
    assert ns["finish_weight_update"].__code__.co_code == finish_026.__code__.co_code
    assert not native._is_026_finish(ns["finish_weight_update"])
    for other in (_finish_two_rpcs, _finish_kwargs, _finish_returns, _finish_version):
        assert not native._is_026_finish(other), other.__name__
    monkeypatch.setattr(shims, "vllm_version", lambda: (0, 27))
    assert not native._is_026_finish(finish_026)


def test_a_finish_through_collective_rpc_checks_the_pending_sends(monkeypatch):
    """``llm.collective_rpc("finish_weight_update")`` closes the update as LLM.finish_weight_update does:
    the sends pending on it are checked there."""
    ipc = _static_ipc(monkeypatch)
    llm = _LLM026(corrupt="w1")
    _update(ipc, llm)
    with pytest.raises(RefitVerificationError) as ei:
        llm.collective_rpc("finish_weight_update")
    assert ei.value.mismatched == ["w1"] and not native._PENDING and not llm.llm_engine.open
    assert native.MANIFEST_METHOD in llm.llm_engine.calls


def test_two_engines_fed_at_once_are_each_checked_against_their_own_workers(monkeypatch):
    """Two open LLMs, two trainer threads sending at once (each send_mode a method of its LLM): A's
    corrupt byte fails A's finish; B's finish checks B; neither is checked against the other."""
    ipc = _static_ipc(monkeypatch)
    a, b = _LLM026(corrupt="w2"), _LLM026()
    a.start_weight_update()
    b.start_weight_update()
    gate = threading.Barrier(2)

    def send(llm):
        def items():
            gate.wait(5)
            yield from WEIGHTS.items()
        ipc.trainer_send_weights(items(), {"send_mode": llm.send})

    threads = [threading.Thread(target=send, args=(llm,)) for llm in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert sum(v._feeds(a) for v in native._PENDING) == 1 and sum(v._feeds(b) for v in native._PENDING) == 1
    with pytest.raises(RefitVerificationError) as ei:
        a.finish_weight_update()
    assert ei.value.mismatched == ["w2"] and native.MANIFEST_METHOD in a.llm_engine.calls
    assert native.MANIFEST_METHOD not in b.llm_engine.calls
    b.finish_weight_update()
    assert native.last_reports()[0].ok and not native._PENDING


def test_a_start_that_vllm_refuses_leaves_the_sends_to_the_recovery_finish(monkeypatch):
    """A second start before a finish (0.26 refuses it): the pending sends are checked by their delivered
    digests, stay pending, and the finish that closes the update checks its whole session."""
    ipc = _static_ipc(monkeypatch)
    llm = _LLM026()
    _update(ipc, llm)
    llm.llm_engine.fail, llm.llm_engine.fail_on = RuntimeError("weight update already active"), "start_weight_update"
    with pytest.raises(RuntimeError, match="already active"):
        llm.start_weight_update()
    assert native.MANIFEST_METHOD in llm.llm_engine.calls  # checked by delivered digests before the start
    assert any(v._feeds(llm) for v in native._PENDING)
    llm.llm_engine.fail = None
    llm.finish_weight_update()
    assert llm.llm_engine.calls[-2:] == ["finish_weight_update", native.MANIFEST_METHOD]  # checked again after the close
    assert not native._PENDING and native.last_reports()[0].ok


def test_lambda_sends_into_two_open_engines_are_refused_as_ambiguous(monkeypatch):
    """A send whose send_mode names no engine, while two LLMs have open updates and both received
    update_weights during it: not left to either finish; checked at once, and refused as ambiguous."""
    monkeypatch.setenv("REFIT_VERIFY", "enforce")

    class IPCWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            for name, tensor in iterator:
                trainer_args["send_mode"]((name, tensor))

    send = native._wrap_static_sender(IPCWeightTransferEngine.__dict__["trainer_send_weights"])
    a, b = _LLM026(), _LLM026()
    a.start_weight_update()
    b.start_weight_update()
    update = native._wrap_llm_update(lambda self, item: self.send(*item))

    def mode(item):
        update(a, item)
        update(b, item)

    with pytest.raises(RefitConfigError, match="cannot tell which of 2"):
        send.__func__(iter(WEIGHTS.items()), {"send_mode": mode})
    assert not native._PENDING


def test_the_deferral_budget_follows_the_send_mode_and_packing():
    """Unpacked: the one update_weights follows every export, no budget; packed: two buffers (one
    update_weights per buffer at least); a send with no callable send_mode (nccl) is never deferred."""
    import math
    from types import SimpleNamespace

    assert native._defer_budget({"send_mode": print}) == math.inf
    assert native._defer_budget({"send_mode": print, "packed": True, "packed_buffer_size_bytes": 1000}) == 2000
    assert native._defer_budget(SimpleNamespace(send_mode=print, packed=True)) == 2 << 30  # 0.26's args object, default buffer
    v = native.NativeSendVerifier(None, mode="enforce")
    assert native._shadow_target(v, {"group": object()}) is None  # nccl: the update runs in another thread
    assert native._shadow_target(v, {"send_mode": "http", "url": "http://x"}) is None


def test_a_pending_send_does_not_keep_a_dropped_engine_alive(monkeypatch, caplog):
    """A send waits in the pending list for its update's finish; an engine the user drops before
    that finish (a failed update never finished, the engine rebuilt) is freed with its workers, and
    the send leaves the list with a warning that it was never verified. A send into the next engine
    is checked as usual."""
    import gc
    import logging
    import weakref

    ipc = _static_ipc(monkeypatch)
    llm = _LLM026()
    _update(ipc, llm)
    assert any(v._feeds(llm) for v in native._PENDING)
    gone = weakref.ref(llm)
    del llm
    gc.collect()
    assert gone() is None  # the pending list held it weakly
    assert len(native._PENDING) == 1 and not any(v._feeds(None) for v in native._PENDING)
    fresh = _LLM026()
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        _update(ipc, fresh)
    assert "1 weight send(s) into an in-process vLLM engine that was garbage-collected" in caplog.text
    assert len(native._PENDING) == 1 and native._PENDING[0]._feeds(fresh)
    fresh.finish_weight_update()
    assert native.last_reports()[0].ok and not native._PENDING


def test_a_pending_send_with_no_target_leaves_the_list_when_the_engine_it_fed_is_gone(caplog):
    """An nccl send names no engine: it finds the one it fed by tracking (held weakly). Once that
    engine is garbage-collected the send is pruned with the same warning, never matched to another."""
    import gc
    import logging

    llm, other = _LLM026(), _LLM026()
    v = native.NativeSendVerifier(mode="enforce")
    v._saw_engine(llm)
    native._pend(v)
    assert v._feeds(llm) and not v._feeds(other) and not v._target_gone()
    del llm
    gc.collect()
    assert v._target_gone() and not v._feeds(other) and not v._feeds(None)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        with native._LOCK:
            native._prune_gone()
    assert not native._PENDING and "were never verified" in caplog.text


def test_the_native_verdict_on_a_session_passes_only_where_every_worker_passed():
    """``native_sender.record_verdicts``: a closed session compared on several workers is recorded as
    passed only when every worker's report passed, whatever their order; a report without a session
    (an update still open) records nothing."""
    from refit_verify import verdicts
    from refit_verify.compare import compare_manifests
    from refit_verify.vllm_plugin.native_sender import record_verdicts

    good = dataclasses.replace(compare_manifests({"a": "0" * 32}, {"a": "0" * 32}), session="native-s1")
    bad = dataclasses.replace(compare_manifests({"a": "0" * 32}, {"a": "1" * 32}), session="native-s1")
    assert good.ok and not bad.ok
    for order in ([good, bad], [bad, good]):
        verdicts.record("native-s1", True)
        record_verdicts(order)
        assert not verdicts.passed("native-s1") and verdicts.failed("native-s1") == "its refit failed verification"
    record_verdicts([good, dataclasses.replace(good, session="native-s2")])
    assert verdicts.passed("native-s1") and verdicts.passed("native-s2")
    open_update = compare_manifests({"a": "0" * 32}, {"a": "1" * 32})
    record_verdicts([open_update])
    assert open_update.session is None and verdicts.failed(None) is None
