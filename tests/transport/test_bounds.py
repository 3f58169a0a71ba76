"""Every wait of the staged transport ends within its bound under reuse, restarts and late peers.

Each test times the waits it provokes and asserts that each ends within its bound plus a small
slack (:data:`SLACK_S`: a loaded 2-core machine), and that a failure names its real cause and what
each side last saw. Patterns: one sender reused for many refits while the receiver is re-created
for each one (in a thread, and in a worker process, as vLLM's ``refit_verify_receive`` does), a
receiver process killed mid-refit and restarted, a receiver started before its sender and one
started long after, a sender restarted on the same endpoint, two receivers on one endpoint
(before a refit and mid-refit), a concurrent send on one sender, a refit id that is not the receiver's, and an ``Abort`` of an earlier refit
reaching a re-created receiver.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from refit_verify import RefitConfig
from refit_verify.errors import RefitProtocolError, RefitTimeoutError
from refit_verify.transport import RefitReceiver, RefitSender
from refit_verify.transport.sender import SECOND_PEER_GRACE_S
from refit_verify.wire.staged import PROTOCOL_VERSION, Abort, Ack, Hello, Reject, Welcome, decode_reply
from refit_verify.wire.fields import encode
from tests.support.zmq_peers import bound_req

SPAWN = mp.get_context("spawn")
SLACK_S = 1.5
TIMEOUT_S = 6.0  # the new user's setting
TENSORS = [(f"t{i}", torch.randn(100, generator=torch.Generator().manual_seed(i))) for i in range(12)]
SMALL = dict(buffer_bytes=4096)  # four 400-byte tensors per buffer: three buffers per refit


def sender(mode: str = "enforce", timeout_s: float = TIMEOUT_S, **kw) -> RefitSender:
    return RefitSender(config=RefitConfig.build(mode=mode, timeout_s=timeout_s, **SMALL), **kw)


def rx_config(timeout_s: float = TIMEOUT_S, connect_timeout_s: float = TIMEOUT_S) -> RefitConfig:
    return RefitConfig.build(timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)


class Timed:
    """Runs ``fn`` in a thread; ``.value`` / ``.error`` and ``.seconds`` once joined."""

    def __init__(self, fn, delay_s: float = 0.0) -> None:
        self.value = self.error = None
        self.seconds: float | None = None

        def run():
            if delay_s:
                time.sleep(delay_s)
            t0 = time.monotonic()
            try:
                self.value = fn()
            except BaseException as e:  # noqa: BLE001 - inspected by the test
                self.error = e
            self.seconds = time.monotonic() - t0

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self, bound_s: float) -> Timed:
        self.thread.join(bound_s + SLACK_S + 5.0)
        assert not self.thread.is_alive(), f"still waiting after {bound_s + SLACK_S + 5.0:g} s (bound {bound_s:g} s)"
        return self


def receive_once(endpoint: str, load=lambda b: None, **cfg):
    with RefitReceiver(endpoint, config=rx_config(**cfg)) as rx:
        return rx.receive(load)


def timed_send(tx: RefitSender, tensors=TENSORS):
    t0 = time.monotonic()
    try:
        return tx.send(tensors), None, time.monotonic() - t0
    except Exception as e:  # noqa: BLE001
        return None, e, time.monotonic() - t0


# ------------------------------------------------------------------ one sender, re-created receivers


def test_reused_sender_with_a_receiver_recreated_for_every_refit():
    """The new user's pattern: one sender, ``timeout_s=6``, a fresh receiver per refit that starts
    a little before or a little after the sender's Hello. Before the fix a receiver blocked in a
    read with no timeout (libzmq's REP reported a request it then discarded) and the sender said
    "receiver went silent" after 2-50 refits; now every refit verifies and no wait comes near 6 s."""
    rng = random.Random(int(os.environ.get("REFIT_FAULT_SEED") or 7))
    n, worst_send, worst_rx, hellos = 80, 0.0, 0.0, 0
    with sender() as tx:
        for i in range(n):
            early = rng.random() < 0.5
            rx = Timed(lambda: receive_once(tx.endpoint), delay_s=0.0 if early else rng.random() * 0.05)
            if early:
                time.sleep(rng.random() * 0.05)
            report, err, send_s = timed_send(tx)
            rx.join(TIMEOUT_S)
            assert err is None and rx.error is None, f"refit {i}: sender {err!r}; receiver {rx.error!r}"
            assert report.ok and report.verified == len(TENSORS) and rx.value.ok
            worst_send, worst_rx = max(worst_send, send_s), max(worst_rx, rx.seconds)
            hellos += tx.last_stats["hello_sent"] - 1
    print(f"\n{n} refits, one sender, a new receiver each: longest send {worst_send:.2f} s, longest receive "
          f"{worst_rx:.2f} s (timeout {TIMEOUT_S:g} s); Hello sent again {hellos} times")
    assert worst_send < TIMEOUT_S / 2 and worst_rx < TIMEOUT_S / 2


def _recreating_worker(endpoint: str, n: int, q) -> None:
    """A worker process that builds a new RefitReceiver for each of ``n`` refits (as vLLM's
    ``refit_verify_receive``), reporting how long each receive took."""
    from refit_verify.digest.batch import digest_tensors

    digest_tensors([("warm-up", torch.ones(4))])
    q.put(("ready", 0.0))
    for _ in range(n):
        t0 = time.monotonic()
        try:
            with RefitReceiver(endpoint, config=rx_config()) as rx:
                res = rx.receive(lambda b: None)
            q.put(("ok" if res.ok else f"not ok: {res.rejected} {res.error}", time.monotonic() - t0))
        except Exception as e:  # noqa: BLE001
            q.put((f"{type(e).__name__}: {e}", time.monotonic() - t0))


def test_reused_sender_with_a_worker_process_recreating_its_receiver():
    n = 25
    with sender() as tx:
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_recreating_worker, args=(tx.endpoint, n, q), daemon=True)
        proc.start()
        try:
            assert q.get(timeout=120)[0] == "ready"
            for i in range(n):
                report, err, send_s = timed_send(tx)
                what, rx_s = q.get(timeout=TIMEOUT_S + SLACK_S + 5)
                assert err is None and what == "ok", f"refit {i}: sender {err!r}; worker {what}"
                assert report.ok and send_s < TIMEOUT_S and rx_s < TIMEOUT_S + SLACK_S
        finally:
            proc.kill()
            proc.join(10)


def _dying_worker(endpoint: str, die_in_buffer: int, q) -> None:
    """A worker process whose receiver dies (os._exit) while loading buffer ``die_in_buffer``."""
    from refit_verify.digest.batch import digest_tensors

    digest_tensors([("warm-up", torch.ones(4))])
    seen = {"n": 0}

    def load(batch):
        seen["n"] += 1
        if seen["n"] == die_in_buffer:
            os._exit(3)

    with RefitReceiver(endpoint, config=rx_config()) as rx:
        q.put("ready")
        rx.receive(load)


def test_receiver_process_killed_mid_refit_then_restarted():
    """The receiver process dies in its 2nd buffer: the sender fails fast naming the disconnect
    (not "went silent"); a restarted receiver then serves the same sender's next refit."""
    with sender() as tx:
        q = SPAWN.Queue()
        proc = SPAWN.Process(target=_dying_worker, args=(tx.endpoint, 2, q), daemon=True)
        proc.start()
        assert q.get(timeout=120) == "ready"
        report, err, send_s = timed_send(tx)
        proc.join(10)
        assert isinstance(err, RefitTimeoutError) and err.progress["reason"] == "receiver disconnected", err
        assert err.progress["buffers_acked"] == 1 and err.progress["waiting_for"] == "Ack(seq=1)"
        assert f"pid {proc.pid} disconnected" in err.progress["connections"] and "last reply Ack(seq=0)" in str(err)
        assert send_s < 3.0  # far below timeout_s: the dropped connection ends the wait
        rx = Timed(lambda: receive_once(tx.endpoint))
        report, err, send_s = timed_send(tx)
        rx.join(TIMEOUT_S)
        assert err is None and report.ok and rx.error is None and send_s < TIMEOUT_S


# ------------------------------------------------------------------ early and late receivers


def test_receiver_started_before_its_sender(tmp_path):
    """The worker connects to an endpoint nobody has bound yet; the sender binds 1.5 s later: the
    receiver's wait for Hello ends with the refit, within its connect_timeout_s."""
    endpoint = f"ipc://{tmp_path}/refit.sock"
    rx = Timed(lambda: receive_once(endpoint, connect_timeout_s=TIMEOUT_S))
    time.sleep(1.5)
    with sender(endpoint=endpoint) as tx:
        report, err, _ = timed_send(tx)
    rx.join(TIMEOUT_S)
    assert err is None and report.ok and rx.error is None and rx.value.ok
    assert 1.5 <= rx.seconds < TIMEOUT_S


def test_sender_restarted_on_the_same_endpoint_while_a_receiver_waits(tmp_path):
    """The trainer's sender goes away between refits and a new one binds the same endpoint: a
    receiver already waiting for Hello reconnects by itself and serves the new sender's refit."""
    endpoint = f"ipc://{tmp_path}/refit.sock"
    with sender(endpoint=endpoint) as tx:
        rx = Timed(lambda: receive_once(endpoint))
        report, err, _ = timed_send(tx)
        rx.join(TIMEOUT_S)
        assert err is None and report.ok and rx.error is None
        rx = Timed(lambda: receive_once(endpoint))  # connects to the old sender, then waits for a Hello
        time.sleep(0.3)
    time.sleep(0.5)  # the old sender is gone; the receiver's socket retries every few ms
    with sender(endpoint=endpoint) as tx2:
        report, err, send_s = timed_send(tx2)
    rx.join(TIMEOUT_S)
    assert err is None and report.ok and rx.error is None and rx.value.ok and send_s < TIMEOUT_S
    assert rx.seconds < TIMEOUT_S


def test_receiver_started_long_after_its_sender():
    """No receiver within the sender's timeout: "receiver never connected" at timeout_s. A receiver
    that comes later finds the sender idle: it names that (not "went silent" mid-refit) at its
    connect_timeout_s, and the next refit of the same sender works."""
    with sender(timeout_s=2.0) as tx:
        report, err, send_s = timed_send(tx)
        assert isinstance(err, RefitTimeoutError) and err.progress["reason"] == "receiver never connected", err
        assert 2.0 * 0.95 <= send_s < 2.0 + SLACK_S
        rx = Timed(lambda: receive_once(tx.endpoint, connect_timeout_s=1.0)).join(1.0)
        assert isinstance(rx.error, RefitTimeoutError) and rx.seconds < 1.0 + SLACK_S
        assert rx.error.progress["reason"] == "sender went silent" and "connected but sent no Hello" in str(rx.error)
        rx = Timed(lambda: receive_once(tx.endpoint), delay_s=1.0)  # within the sender's 2 s
        report, err, send_s = timed_send(tx)
        rx.join(TIMEOUT_S)
        assert err is None and report.ok and rx.error is None and 1.0 <= send_s < 2.0 + SLACK_S


def test_receiver_with_no_sender_at_all_names_it(tmp_path):
    rx = Timed(lambda: receive_once(f"ipc://{tmp_path}/nobody.sock", connect_timeout_s=1.0)).join(1.0)
    assert isinstance(rx.error, RefitTimeoutError) and rx.error.progress["reason"] == "sender never connected"
    assert 0.95 <= rx.seconds < 1.0 + SLACK_S and "no sender is connected" in str(rx.error)


# ------------------------------------------------------------------ two receivers, concurrent sends, stray messages

_ZMQ_PEER = """
import sys, time, zmq
ctx = zmq.Context(); rep = ctx.socket(zmq.REP); rep.setsockopt(zmq.LINGER, 0); rep.connect(sys.argv[1])
print("connected", flush=True); time.sleep(float(sys.argv[2]))
"""


def _second_receiver(endpoint: str, hold_s: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _ZMQ_PEER, endpoint, str(hold_s)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "connected"
    return proc


def test_two_receivers_on_one_endpoint_are_named():
    """A thread receiver of this process and a second receiver process connect to one sender: the
    refit fails at once (after a short grace for a closing previous receiver) naming both pids,
    instead of dealing Buffers out to both; the receivers' own waits end at their bound."""
    with sender() as tx:
        rx = Timed(lambda: receive_once(tx.endpoint, connect_timeout_s=2.0))
        other = _second_receiver(tx.endpoint, 10)
        try:
            deadline = time.monotonic() + 10
            while len(tx._watch.established()) < 2 and time.monotonic() < deadline:
                tx._watch.mon.poll(50)
                tx._watch.drain()
            report, err, send_s = timed_send(tx)
        finally:
            other.kill()
            other.wait(10)
        rx.join(2.0)
    assert isinstance(err, RefitProtocolError) and err.progress["reason"] == "two receivers", err
    assert "2 receivers are connected" in str(err) and f"pid {os.getpid()}" in str(err) and f"pid {other.pid}" in str(err)
    assert send_s < SECOND_PEER_GRACE_S + SLACK_S
    assert isinstance(rx.error, RefitTimeoutError) and rx.seconds < 2.0 + SLACK_S and "sent no Hello" in str(rx.error)


def test_a_second_receiver_connecting_mid_refit_is_named():
    """A second receiver connects while the first is loading buffer 0: the sender's next request
    would go to it, so the refit fails naming both, within the grace; the first receiver sees the
    Abort at once."""
    with sender() as tx:
        holder: dict = {}

        def slow(batch):
            if "other" not in holder:
                holder["other"] = _second_receiver(tx.endpoint, 10)
                time.sleep(0.3)

        rx = Timed(lambda: receive_once(tx.endpoint, load=slow))
        try:
            report, err, send_s = timed_send(tx)
        finally:
            rx.join(TIMEOUT_S)
            if "other" in holder:
                holder["other"].kill()
                holder["other"].wait(10)
    assert isinstance(err, RefitProtocolError) and "during the refit" in str(err) and "2 receivers are connected" in str(err), err
    assert send_s < 0.3 + SLACK_S + 1.0
    assert rx.error is not None and rx.seconds < TIMEOUT_S + SLACK_S


def test_concurrent_send_on_one_sender_is_named_and_the_running_refit_completes():
    with sender() as tx:
        rx = Timed(lambda: receive_once(tx.endpoint, load=lambda b: time.sleep(0.3)))
        first = Timed(lambda: tx.send(TENSORS))
        deadline = time.monotonic() + 10
        while tx._progress.buffers_sent == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.monotonic()
        with pytest.raises(RefitProtocolError) as ei:
            tx.send(TENSORS)
        second_s = time.monotonic() - t0
        first.join(TIMEOUT_S)
        rx.join(TIMEOUT_S)
    assert second_s < 0.1
    running = tx.last_stats["refit_id"]
    assert f"concurrent send on one RefitSender ({tx.endpoint}): refit {running} is in progress" in str(ei.value)
    assert ei.value.progress["reason"] == "concurrent send"
    assert first.error is None and first.value.ok and rx.error is None and rx.value.ok


def test_refit_id_mismatch_is_named_by_the_receiver(tmp_path):
    """A Hello of another refit arrives mid-refit (the sender gave up on the first without an Abort
    reaching this receiver): the receiver rejects it naming both refit ids, and stops at once."""
    endpoint = f"ipc://{tmp_path}/s.sock"
    ctx, req = bound_req(endpoint)
    try:
        rx = Timed(lambda: receive_once(endpoint))
        req.send(encode(Hello(protocol=PROTOCOL_VERSION, refit_id="a" * 32, mode="enforce", alignment=512)))
        assert isinstance(decode_reply(req.recv()), Welcome)
        req.send(encode(Hello(protocol=PROTOCOL_VERSION, refit_id="b" * 32, mode="enforce", alignment=512)))
        reply = decode_reply(req.recv())
        rx.join(TIMEOUT_S)
    finally:
        req.close()
        ctx.term()
    assert isinstance(reply, Reject) and reply.reason.startswith(f"refit id mismatch: Hello of refit {'b' * 32} arrived during refit {'a' * 32}")
    assert isinstance(rx.error, RefitProtocolError) and "refit id mismatch" in str(rx.error) and rx.seconds < 1.0


def test_an_abort_of_an_earlier_refit_does_not_end_a_new_receivers_wait(tmp_path):
    """The tail of a failed refit (its Abort) reaches the next, re-created receiver: acknowledged
    and ignored; the receiver goes on waiting for its Hello and serves the refit."""
    endpoint = f"ipc://{tmp_path}/s.sock"
    ctx, req = bound_req(endpoint)
    try:
        rx = Timed(lambda: receive_once(endpoint))
        req.send(encode(Abort(reason="RefitTimeoutError: an earlier refit")))
        assert decode_reply(req.recv()) == Ack(seq=-2)
        req.send(encode(Hello(protocol=PROTOCOL_VERSION, refit_id="c" * 32, mode="off", alignment=512)))
        assert isinstance(decode_reply(req.recv()), Welcome)
        from refit_verify.wire.staged import Complete

        req.send(encode(Complete(n_tensors=0)))
        done = decode_reply(req.recv())
        rx.join(TIMEOUT_S)
    finally:
        req.close()
        ctx.term()
    assert rx.error is None and rx.value.refit_id == "c" * 32 and done.tensors == 0


def test_a_reused_sender_after_a_timed_out_refit_serves_the_next_receiver():
    """Refit 1's receiver hangs in load past the sender's timeout: the sender names it ("connected
    but did not answer"), within timeout_s; the hung receiver then sees the Abort; a fresh receiver
    serves the same sender's refit 2."""
    release = threading.Event()
    with sender(timeout_s=1.0) as tx:
        rx = Timed(lambda: receive_once(tx.endpoint, load=lambda b: release.wait(3)))
        report, err, send_s = timed_send(tx)
        assert isinstance(err, RefitTimeoutError) and err.progress["reason"] == "receiver went silent", err
        assert "is connected but did not answer (busy loading, or hung)" in str(err) and 0.95 <= send_s < 1.0 + SLACK_S
        release.set()
        rx.join(TIMEOUT_S)
        assert rx.error is not None and "aborted by the sender" in str(rx.error)
        rx2 = Timed(lambda: receive_once(tx.endpoint))
        report, err, send_s = timed_send(tx)
        rx2.join(TIMEOUT_S)
        assert err is None and report.ok and rx2.error is None


def test_push_whose_workers_fail_raises_the_senders_error_caused_by_the_workers():
    """push: the workers' receive fails at once (here: a channel that raises) and the sender then
    times out waiting for them. The raised error is the sender's, bounded by its timeout, and the
    workers' own error is its cause, never dropped."""
    import refit_verify

    class Broken:
        def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
            raise RuntimeError("worker exploded while mapping the staging memory")

    sender = RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=1, connect_timeout_s=1), device="cpu")
    t0 = time.perf_counter()
    try:
        with pytest.raises(RefitTimeoutError, match="could not send Hello within 1 s") as ei:
            refit_verify.push(Broken(), {"w": torch.zeros(4)}, sender=sender)
    finally:
        sender.close()
    assert time.perf_counter() - t0 < 1 + SLACK_S
    assert isinstance(ei.value.__cause__, RefitProtocolError) and "worker exploded" in str(ei.value.__cause__)


def test_a_large_done_is_not_dropped_by_the_receivers_close():
    """The receiver closes right after queueing its last reply. With no linger a large ``Done`` (a
    big model's manifest: here 1,500 names of 200 characters, about 0.4 MB) could be discarded
    before ZMQ's I/O thread wrote it, and the sender failed with "the receiver's connection closed
    while waiting for Done" although the refit had landed (before the fix: the first refit here). The
    close now gives queued messages LAST_WORDS_S to leave."""
    tensors = [(f"model.layers.{i}." + "x" * 180 + ".weight", torch.full((4,), float(i))) for i in range(1500)]
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S, buffer_bytes=1 << 20)) as tx:
        for i in range(16):
            rx = Timed(lambda: receive_once(tx.endpoint))
            report, err, _ = timed_send(tx, tensors)
            rx.join(TIMEOUT_S)
            assert err is None and rx.error is None, f"refit {i}: sender {err!r}; receiver {rx.error!r}"
            assert report.ok and report.verified == len(tensors)


def test_a_receiver_gone_after_its_welcome_is_named_at_once():
    """A receiver that answers Hello and closes before the first Buffer goes: the sender says
    "receiver disconnected" at once instead of waiting ``timeout_s`` for a peer to take the Buffer."""
    import zmq

    from refit_verify.wire.staged import Buffer, decode_request

    class Slow(RefitSender):  # the receiver's close is seen before the first Buffer leaves
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Buffer):
                time.sleep(0.5)
            return super()._exchange(msg, staging)

    tx = Slow(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S, **SMALL))

    def answer_then_close():
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        rep.connect(tx.endpoint)
        try:
            assert rep.poll(int(TIMEOUT_S * 1000)) and isinstance(decode_request(rep.recv()), Hello)
            rep.send(encode(Welcome(protocol=PROTOCOL_VERSION, mode="enforce", reason=None)))
        finally:
            rep.close()
            ctx.term()

    with tx:
        peer = threading.Thread(target=answer_then_close, daemon=True)
        peer.start()
        _report, err, secs = timed_send(tx)
        peer.join(5)
    assert isinstance(err, RefitTimeoutError) and err.progress["reason"] == "receiver disconnected", err
    assert "answered the last request disconnected" in str(err) and err.progress["buffers_sent"] == 0
    assert secs < 0.5 + SLACK_S < TIMEOUT_S
