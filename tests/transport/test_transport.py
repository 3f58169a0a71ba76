"""Transport: sender in this process, receiver in a spawned process (CPU shared memory), plus
in-process (thread) receivers for protocol edge cases."""

from __future__ import annotations

import logging
import re
import multiprocessing as mp
import os
import queue
import stat
import threading
import time

import msgspec
import pytest
import torch
import zmq

import refit_verify.digest.batch as digest_mod
from refit_verify import RefitConfig, logical_bytes
from refit_verify.digest.tensors import dtype_name
from refit_verify.errors import (RefitAbortedError, RefitConfigError, RefitInputError, RefitProtocolError, RefitReceiveError,
                                 RefitTimeoutError, RefitVerificationError)
from refit_verify.transport import RefitReceiver, RefitSender
from refit_verify.wire.staged import PROTOCOL_VERSION, Buffer, Hello, Reject, decode_reply
from refit_verify.wire.fields import encode

SPAWN = mp.get_context("spawn")
PROC_TIMEOUT_S = 60


# ---------------------------------------------------------------- receiver process (spawned)


def _count_digest_calls() -> dict:
    """Wrap DigestBatch.add / hexdigests with counters (in the calling process), leaving out the digest
    warm-up's threads (``refit-verify-warmup-*``: this spawned process imports refit_verify as a trainer
    does, and its warm-up's throwaway digests are no refit's)."""
    counts = {"add": 0, "hexdigests": 0}
    add, hexd = digest_mod.DigestBatch.add, digest_mod.DigestBatch.hexdigests

    def refit_thread() -> bool:
        return not threading.current_thread().name.startswith("refit-verify-warmup")

    def counted_add(self, name, t):
        counts["add"] += refit_thread()
        return add(self, name, t)

    def counted_hex(self):
        counts["hexdigests"] += refit_thread()
        return hexd(self)

    digest_mod.DigestBatch.add = counted_add
    digest_mod.DigestBatch.hexdigests = counted_hex
    return counts


def _receiver_main(endpoint: str, cfg: dict, n_refits: int, q, device: str | None = None) -> None:
    """Run ``n_refits`` receives; put one ``("ok", info)`` or ``("error", text)`` per refit."""
    counts = _count_digest_calls()
    try:
        with RefitReceiver(endpoint, config=RefitConfig.build(**cfg), device=device) as rx:
            for _ in range(n_refits):
                counts.update(add=0, hexdigests=0)
                got: dict[str, tuple[str, tuple[int, ...], bytes]] = {}

                def load(batch):
                    for name, t in batch:
                        assert device is None or t.device == torch.device(device), (name, t.device)
                        got[name] = (dtype_name(t.dtype), tuple(t.shape), logical_bytes(t).cpu().numpy().tobytes())

                res = rx.receive(load)
                q.put(("ok", {"result": {k: getattr(res, k) for k in ("manifest", "tensors", "bytes", "buffers", "error", "refit_id")},
                              "got": got, "counts": dict(counts)}))
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        q.put(("error", f"{type(e).__name__}: {e}"))


class ReceiverProcess:
    def __init__(self, endpoint: str, n_refits: int = 1, device: str | None = None, **cfg) -> None:
        cfg.setdefault("timeout_s", 30.0)
        cfg.setdefault("connect_timeout_s", 30.0)
        self.q = SPAWN.Queue()
        self.proc = SPAWN.Process(target=_receiver_main, args=(endpoint, cfg, n_refits, self.q, device), daemon=True)
        self.proc.start()

    def result(self) -> dict:
        try:
            kind, info = self.q.get(timeout=PROC_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"receiver process produced nothing (alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})") from None
        assert kind == "ok", info
        return info

    def close(self) -> None:
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def assert_received(got: dict, tensors: list[tuple[str, torch.Tensor]], *, except_name: str | None = None) -> None:
    assert list(got) == [n for n, _ in tensors]
    for name, t in tensors:
        dt, shape, data = got[name]
        assert (dt, shape) == (dtype_name(t.dtype), tuple(t.shape)), name
        same = torch.equal(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8),
                           logical_bytes(t).cpu())
        assert same is (name != except_name), name


# ---------------------------------------------------------------- tensors


def mixed_tensors(device: str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """bf16/fp16/fp32/int8/bool/fp8/int64, two oversized (one non-contiguous), 0-element, 0-dim,
    transposed, storage-offset (also odd bf16 offset), and 40 small ones (~30 KiB in all), on
    ``device`` (views are taken there)."""
    g = torch.Generator().manual_seed(0)

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(device)

    base = on(torch.randn(100, generator=g))
    bf_base = on(torch.randn(64, generator=g).to(torch.bfloat16))
    ts = [
        ("w.bf16", on(torch.randn(16, 40, generator=g).to(torch.bfloat16))),
        ("w.fp16", on(torch.randn(7, 13, generator=g).to(torch.float16))),
        ("w.fp32", on(torch.randn(3, 5, 7, generator=g))),
        ("w.int8", on(torch.randint(-128, 128, (77,), generator=g, dtype=torch.int8))),
        ("w.bool", on(torch.rand(50, generator=g) > 0.5)),
        ("w.fp8", on(torch.randn(33, generator=g).to(torch.float8_e4m3fn))),
        ("w.int64", on(torch.randint(-(2**62), 2**62, (5,), generator=g))),
        ("oversized", on(torch.randn(3000, generator=g))),  # 12000 B > half of 16 KiB
        ("empty", on(torch.empty(3, 0))),
        ("scalar", on(torch.tensor(2.5))),
        ("scalar.bf16", on(torch.tensor(-1.25, dtype=torch.bfloat16))),
        ("transposed", on(torch.randn(9, 17, generator=g)).t()),
        ("offset", base[13:57]),
        ("offset.bf16.odd", bf_base[3:20]),
    ]
    ts += [(f"layers.{i}.small", on(torch.randn(25 + 37 * i, generator=g))) for i in range(40)]
    ts.append(("tail.oversized.bf16", on(torch.randn(80, 80, generator=g).to(torch.bfloat16)).t()))  # 12800 B, non-contiguous
    return ts


SMALL_BUDGET = dict(buffer_bytes=16384)


# ---------------------------------------------------------------- two-process tests


def test_two_process_round_trip_enforce():
    tensors = mixed_tensors()
    assert not tensors[11][1].is_contiguous() and tensors[12][1].storage_offset() == 13
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL_BUDGET)
    sent_names: set[str] = set()

    class Recording(RefitSender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Buffer):
                sent_names.add(msg.handle.name)
            return super()._exchange(msg, staging)

    with Recording(config=cfg) as tx:
        rx = ReceiverProcess(tx.endpoint, n_refits=2, **SMALL_BUDGET)
        try:
            for _ in range(2):  # the channel is reusable
                report = tx.send(tensors)
                info = rx.result()
                assert report is not None and report.ok, report.describe()
                assert report.verified == len(tensors)
                assert_received(info["got"], tensors)
                st = tx.last_stats
                assert st["tensors"] == len(tensors) == info["result"]["tensors"]
                assert st["bytes"] == sum(logical_bytes(t).numel() for _, t in tensors) == info["result"]["bytes"]
                assert st["buffers"] == info["result"]["buffers"] >= 6  # several switches + 2 dedicated
                assert st["digest_s"] > 0 and st["wall_s"] >= st["digest_s"] and st["receiver_digest_s"] > 0
                assert info["result"]["error"] is None and info["result"]["refit_id"] == st["refit_id"]
                assert set(info["result"]["manifest"]) == {n for n, _ in tensors}
                assert info["counts"]["add"] == len(tensors)
        finally:
            rx.close()
    assert sent_names and not [f for f in os.listdir("/dev/shm") if f in sent_names]


def test_two_process_mode_off_computes_no_digest(monkeypatch):
    counts = {"n": 0}

    def forbidden(*a, **k):
        counts["n"] += 1
        raise AssertionError("digest code ran in off mode")

    for attr in ("__init__", "add", "hexdigests"):
        monkeypatch.setattr(digest_mod.DigestBatch, attr, forbidden)
    tensors = mixed_tensors()
    cfg = RefitConfig.build(mode="off", timeout_s=30.0, **SMALL_BUDGET)
    with RefitSender(config=cfg) as tx:
        # The receiver's own config says enforce: it must follow the sender's Hello.
        rx = ReceiverProcess(tx.endpoint, mode="enforce", **SMALL_BUDGET)
        try:
            assert tx.send(tensors) is None
            info = rx.result()
        finally:
            rx.close()
    assert counts["n"] == 0
    assert tx.last_stats["digest_s"] == 0.0 and tx.last_stats["receiver_digest_s"] == 0.0
    assert info["result"]["manifest"] is None and info["result"]["error"] is None
    assert info["counts"] == {"add": 0, "hexdigests": 0}
    assert_received(info["got"], tensors)


class CorruptingSender(RefitSender):
    """Flips one byte in the staging slot of ``target`` after packing, before the message leaves."""

    target = "layers.17.small"

    def _exchange(self, msg, staging=None):
        if isinstance(msg, Buffer):
            for e in msg.entries:
                if e.name == self.target:
                    i = e.offset + e.nbytes // 2
                    staging[i] = staging[i] ^ 0x10
        return super()._exchange(msg, staging)


def test_two_process_corrupted_staging_enforce_and_log(caplog):
    tensors = mixed_tensors()
    target = CorruptingSender.target
    enforce = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL_BUDGET)
    log = RefitConfig.build(mode="log", timeout_s=30.0, **SMALL_BUDGET)
    with CorruptingSender(config=enforce) as tx:
        rx = ReceiverProcess(tx.endpoint, n_refits=2, **SMALL_BUDGET)
        try:
            with pytest.raises(RefitVerificationError) as ei:
                tx.send(tensors)
            assert ei.value.mismatched == [target] and not ei.value.missing and not ei.value.unexpected
            assert list(ei.value.rejected) == [target] and "differs from the sender's" in ei.value.rejected[target]
            rep = ei.value.report
            assert list(rep.kept) == [target] and rep.kept[target].startswith("not loaded: its digest")
            assert rep.landed == tuple(n for n, _ in tensors if n != target)
            assert target in str(ei.value) and "1 parameters keep the previous version" in str(ei.value)
            info = rx.result()
            # enforce: checked before load, the corrupted tensor never reached load; every other one did, intact
            assert_received(info["got"], [(n, t) for n, t in tensors if n != target])

            tx.config = log
            with caplog.at_level(logging.WARNING, logger="refit_verify"):
                report = tx.send(tensors)
            assert not report.ok and report.mismatched == (target,) and report.verified == len(tensors) - 1
            assert not report.rejected and not report.kept and len(report.landed) == len(tensors)
            assert any(target in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
            info = rx.result()
            assert_received(info["got"], tensors, except_name=target)  # log: loaded, and the verdict names it
        finally:
            rx.close()


# ---------------------------------------------------------------- timeouts


def test_sender_times_out_when_receiver_never_connects():
    cfg = RefitConfig.build(mode="enforce", timeout_s=1.0)
    with RefitSender(config=cfg) as tx:
        t0 = time.monotonic()
        with pytest.raises(RefitTimeoutError) as ei:
            tx.send([("a", torch.randn(4))])
        elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 3.0
    p = ei.value.progress
    assert p["reason"] == "receiver never connected" and p["silent"] == "receiver"
    assert p["buffers_acked"] == 0 and p["tensors_sent"] == 0
    assert "receiver never connected" in str(ei.value) and "VLLM_PLUGINS" in str(ei.value)


def _thread_receiver(endpoint: str, load, cfg: RefitConfig, out: dict, digests=None) -> threading.Thread:
    """A receiver thread running one refit into ``load`` (``digests``: where its digests are taken,
    e.g. a :class:`~refit_verify.boundary.worker.SessionDigests` at a worker's boundary)."""
    def run():
        try:
            with RefitReceiver(endpoint, config=cfg) as rx:
                out["result"] = rx.receive(load, digests=digests)
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_sender_times_out_when_receiver_goes_silent_mid_refit():
    cfg = RefitConfig.build(mode="enforce", timeout_s=1.0, connect_timeout_s=5.0, buffer_bytes=4096)
    out: dict = {}
    with RefitSender(config=cfg) as tx:
        th = _thread_receiver(tx.endpoint, lambda batch: time.sleep(2.0), cfg, out)
        t0 = time.monotonic()
        with pytest.raises(RefitTimeoutError) as ei:
            tx.send([(f"t{i}", torch.randn(200)) for i in range(8)])
        assert time.monotonic() - t0 < 4.0
        th.join(timeout=10)
    p = ei.value.progress
    assert p["buffers_sent"] >= 1 and p["buffers_acked"] < p["buffers_sent"] and p["last_name"].startswith("t")
    assert p["waiting_for"].startswith("Ack")
    # the sender's Abort is waiting when the slow receiver comes back: it stops at once
    assert isinstance(out.get("error"), RefitAbortedError) and "RefitTimeoutError" in out["error"].reason
    assert out["error"].progress["reason"] == "sender aborted"


def test_receiver_times_out_without_hello(tmp_path):
    cfg = RefitConfig.build(connect_timeout_s=0.3)
    with RefitReceiver(f"ipc://{tmp_path}/nobody.sock", config=cfg) as rx:
        t0 = time.monotonic()
        with pytest.raises(RefitTimeoutError) as ei:
            rx.receive(lambda b: None)
        assert time.monotonic() - t0 < 2.0
    assert ei.value.progress["stage"] == "waiting for Hello"


# ---------------------------------------------------------------- protocol edge cases (threads)


@pytest.mark.parametrize(
    "payload",
    [
        b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00\x8c\x05posix\x94\x8c\x06system\x94\x93\x94.",
        b"garbage",
        encode(Reject(reason="a reply is not a request")),
        encode(msgspec.structs.replace(Hello(protocol=PROTOCOL_VERSION, refit_id="x", mode="off", alignment=512), mode="ON")),
        encode(Hello(protocol=999, refit_id="x", mode="off", alignment=512)),
        encode(Hello(protocol=PROTOCOL_VERSION, refit_id="x", mode="off", alignment=48)),
        msgspec.msgpack.encode(["hello", 1, "x", "off"]),  # a protocol-1 Hello
    ],
    ids=["pickle", "garbage", "reply-as-request", "bad-mode", "bad-version", "bad-alignment", "v1-hello"],
)
def test_receiver_rejects_bad_first_message(tmp_path, payload):
    endpoint = f"ipc://{tmp_path}/s.sock"
    ctx = zmq.Context()
    req = ctx.socket(zmq.REQ)
    req.setsockopt(zmq.LINGER, 0)
    req.setsockopt(zmq.RCVTIMEO, 5000)
    req.bind(endpoint)
    out: dict = {}
    try:
        th = _thread_receiver(endpoint, lambda b: None, RefitConfig.build(connect_timeout_s=5.0), out)
        req.send(payload)
        reply = decode_reply(req.recv())
        th.join(timeout=5)
    finally:
        req.close()
        ctx.term()
    assert isinstance(reply, Reject)
    assert isinstance(out.get("error"), RefitProtocolError)


class RewritingSender(RefitSender):
    """Applies ``rewrite(msg) -> msg`` to every request."""

    rewrite = staticmethod(lambda msg: msg)

    def _exchange(self, msg, staging=None):
        return super()._exchange(self.rewrite(msg), staging)


def _run_pair(sender: RefitSender, tensors, load=lambda b: None, **cfg):
    out: dict = {}
    th = _thread_receiver(sender.endpoint, load, RefitConfig.build(connect_timeout_s=5.0, timeout_s=5.0, **cfg), out)
    try:
        return sender.send(tensors), out
    finally:
        th.join(timeout=10)


def test_protocol_version_mismatch_is_rejected():
    tx = RewritingSender(config=RefitConfig.build(mode="enforce", timeout_s=5.0))
    tx.rewrite = lambda m: msgspec.structs.replace(m, protocol=2) if isinstance(m, Hello) else m  # a protocol-2 sender
    with tx, pytest.raises(RefitProtocolError, match="protocol 2 not supported"):
        _run_pair(tx, [("a", torch.randn(3))])


@pytest.mark.parametrize("field", ["used_bytes", "offset", "nbytes", "dtype"])
def test_layout_tampering_rejects_exactly_the_bad_entries(field):
    """A bad entry is refused alone (named in Done.rejected, not loaded); the rest of its buffer and
    every other buffer load; enforce names exactly the refused entries. A used_bytes past the end of
    the buffer makes the whole buffer unreadable: all its entries are refused."""
    def tamper(m):
        if not isinstance(m, Buffer) or m.seq != 1:
            return m
        if field == "used_bytes":
            return msgspec.structs.replace(m, used_bytes=m.used_bytes + 512)
        e = m.entries[-1]
        changed = {"offset": e.offset + 512, "nbytes": e.nbytes + 4, "dtype": "float16"}[field]
        e = msgspec.structs.replace(e, **{field: changed})
        return msgspec.structs.replace(m, entries=[*m.entries[:-1], e])

    loaded: list[str] = []
    tx = RewritingSender(config=RefitConfig.build(mode="enforce", timeout_s=5.0, buffer_bytes=4096))
    tx.rewrite = tamper
    tensors = [(f"t{i}", torch.randn(100)) for i in range(12)]  # 4 per 2 KiB buffer: buffer 1 = t4..t7
    with tx, pytest.raises(RefitVerificationError) as ei:
        _run_pair(tx, tensors, load=lambda b: loaded.extend(n for n, _ in b), buffer_bytes=4096)
    bad = ["t4", "t5", "t6", "t7"] if field == "used_bytes" else ["t7"]
    assert list(ei.value.affected) == bad and ei.value.missing == bad and not ei.value.mismatched
    assert set(ei.value.rejected) == set(bad)
    assert loaded == [n for n, _ in tensors if n not in bad]
    assert tx.last_stats["tensors"] == len(tensors)
    needle = {"used_bytes": "buffer size", "offset": "used_bytes", "nbytes": "nbytes", "dtype": "nbytes"}[field]
    assert needle in ei.value.rejected["t7"] and needle in str(ei.value)


def test_same_size_dtype_relabel_is_caught_by_digest():
    """A relabel that keeps the byte count (float32 → int32) passes every layout check; the
    digest, which covers the dtype each side believes, names the tensor."""
    tx = RewritingSender(config=RefitConfig.build(mode="enforce", timeout_s=5.0))
    tx.rewrite = lambda m: msgspec.structs.replace(
        m, entries=[msgspec.structs.replace(e, dtype="int32") if e.name == "b" else e for e in m.entries]) if isinstance(m, Buffer) else m
    with tx, pytest.raises(RefitVerificationError) as ei:
        _run_pair(tx, [("a", torch.randn(5)), ("b", torch.randn(6)), ("c", torch.randn(7))])
    assert ei.value.mismatched == ["b"]


def test_load_error_is_deferred_to_done():
    def load(batch):
        if any(n == "bad" for n, _ in batch):
            raise RuntimeError("cannot load bad")

    with RefitSender(config=RefitConfig.build(mode="log", timeout_s=5.0)) as tx:
        with pytest.raises(RefitReceiveError, match="cannot load bad"):
            _run_pair(tx, [("good", torch.ones(3)), ("bad", torch.zeros(2))], load=load)


def test_private_directory_and_cleanup():
    tx = RefitSender(config=RefitConfig.build(mode="off"))
    path = tx.endpoint.removeprefix("ipc://")
    d = os.path.dirname(path)
    assert path.endswith("/refit.sock") and stat.S_IMODE(os.stat(d).st_mode) == 0o700
    with tx:
        report, out = _run_pair(tx, [])
    assert report is None and out["result"].tensors == 0 and out["result"].buffers == 0
    assert not os.path.exists(d)
    tx.close()  # idempotent


def test_demo_one_byte_flip_sender_is_caught():
    """The demo's fault injector (an ``_exchange`` override) works against this transport."""
    demo = pytest.importorskip("refit_verify.cli.demo")
    tensors = [(f"p{i}", torch.randn(64)) for i in range(6)]
    with demo.OneByteFlipSender(config=RefitConfig.build(mode="enforce", timeout_s=5.0, buffer_bytes=1024), target="p3", byte_index=5) as tx:
        with pytest.raises(RefitVerificationError) as ei:
            _run_pair(tx, tensors, buffer_bytes=1024)
    assert tx.flipped and ei.value.mismatched == ["p3"]


# ---------------------------------------------------------------- CUDA IPC (skipped without a GPU)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["enforce", "off"])
def test_two_process_round_trip_cuda_ipc(mode):
    tensors = mixed_tensors("cuda:0")
    cfg = RefitConfig.build(mode=mode, timeout_s=60.0, **SMALL_BUDGET)
    with RefitSender(config=cfg, device="cuda:0") as tx:
        rx = ReceiverProcess(tx.endpoint, n_refits=2, device="cuda:0", timeout_s=60.0, connect_timeout_s=60.0, **SMALL_BUDGET)
        try:
            for _ in range(2):
                report = tx.send(tensors)
                info = rx.result()
                assert (report is None) if mode == "off" else report.ok, report
                assert_received(info["got"], tensors)
                assert info["result"]["error"] is None
                assert tx.last_stats["buffers"] == info["result"]["buffers"] >= 6
        finally:
            rx.close()


@pytest.mark.gpu
@needs_cuda
def test_two_process_corrupted_cuda_staging_named():
    tensors = mixed_tensors("cuda:0")
    with CorruptingSender(config=RefitConfig.build(mode="enforce", timeout_s=60.0, **SMALL_BUDGET), device="cuda:0") as tx:
        rx = ReceiverProcess(tx.endpoint, device="cuda:0", timeout_s=60.0, connect_timeout_s=60.0, **SMALL_BUDGET)
        try:
            with pytest.raises(RefitVerificationError) as ei:
                tx.send(tensors)
            assert ei.value.mismatched == [CorruptingSender.target]
            rx.result()
        finally:
            rx.close()


@pytest.mark.gpu
@needs_cuda
def test_same_process_cuda_receiver():
    """Receiver thread in the sender's process: buffers exported here are used directly."""
    tensors = mixed_tensors("cuda:0")
    got: dict = {}

    def load(batch):
        for n, t in batch:
            got[n] = (dtype_name(t.dtype), tuple(t.shape), logical_bytes(t).cpu().numpy().tobytes())

    with RefitSender(config=RefitConfig.build(mode="off", timeout_s=30.0, **SMALL_BUDGET), device="cuda:0") as tx:
        for _ in range(2):
            got.clear()
            report, out = _run_pair(tx, tensors, load=load, **SMALL_BUDGET)
            assert report is None and out["result"].error is None, out
            assert_received(got, tensors)


# ---------------------------------------------------------------- mode agreement (handshake)


def _receiver_thread(endpoint, out, **kw):
    def run():
        try:
            with RefitReceiver(endpoint, config=RefitConfig.build(timeout_s=10.0, connect_timeout_s=10.0), **kw) as rx:
                out["result"] = rx.receive(lambda b: out.setdefault("loaded", []).extend(n for n, _ in b))
        except BaseException as e:  # noqa: BLE001
            out["error"] = e

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


def test_enforce_sender_vs_receiver_that_cannot_verify_fails_at_handshake(monkeypatch):
    """Never a silent unverified refit: the handshake fails, saying why, before any buffer moves (the
    first group was staged and digested while the receiver answered Hello: only it); the receiver
    is told (Abort) and stops; nothing is loaded."""
    digested: list[str] = []
    for attr in ("add", "add_copy"):
        orig = getattr(digest_mod.DigestBatch, attr)
        monkeypatch.setattr(digest_mod.DigestBatch, attr, lambda self, name, *a, _o=orig, **k: (digested.append(name), _o(self, name, *a, **k))[1])
    from refit_verify.transport import send_state

    staged: list[str] = []
    allocate = send_state._staging.allocate
    monkeypatch.setattr(send_state._staging, "allocate", lambda *a, **k: (b := allocate(*a, **k), staged.append(b._name))[0])
    out: dict = {}
    tensors = [(f"t{i}", torch.randn(100)) for i in range(12)]  # 4 per 2 KiB buffer: 3 groups
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0, buffer_bytes=4096)) as tx:
        th = _receiver_thread(tx.endpoint, out, verify=False)
        with pytest.raises(RefitProtocolError) as ei:
            tx.send(tensors)
        th.join(10)
        assert tx._progress.buffers_sent == 0
    msg = str(ei.value)
    assert "mode agreement failed" in msg and "enforce" in msg and "cannot verify" in msg and "verify=False" in msg
    assert digested == ["t0", "t1", "t2", "t3"] and "loaded" not in out
    assert isinstance(out["error"], RefitAbortedError) and "cannot verify" in out["error"].reason
    assert len(staged) == 1 and not set(staged) & set(os.listdir("/dev/shm"))  # the one staged buffer was freed


def test_a_receiver_that_does_not_verify_gives_its_own_reason_at_the_handshake():
    """``RefitReceiver(verify=False, why_not=...)`` (a vLLM worker that does not verify) answers the
    handshake with that reason; ``why_not`` without ``verify=False``, or empty, is refused."""
    out: dict = {}
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0)) as tx:
        th = _receiver_thread(tx.endpoint, out, verify=False, why_not="worker rank 0: REFIT_VERIFY=off in this vLLM worker")
        with pytest.raises(RefitProtocolError, match=re.escape("cannot verify (worker rank 0: REFIT_VERIFY=off in this vLLM "
                                                               "worker); refusing an unverified refit")):
            tx.send([("a", torch.randn(8))])
        th.join(10)
    assert "loaded" not in out
    for bad in ({"why_not": "off"}, {"verify": False, "why_not": ""}, {"verify": False, "why_not": 3}):
        with pytest.raises(RefitConfigError, match="why_not must be a non-empty string, and only with verify=False"):
            RefitReceiver("ipc:///tmp/never-bound", **bad)


def test_log_sender_vs_receiver_that_cannot_verify_runs_unverified_with_warning(caplog, monkeypatch):
    """The first group is digested while the receiver answers Hello (the sender does not know yet);
    once it answers off, nothing more is digested and the plain wire carries the rest."""
    out: dict = {}
    digested: list[str] = []
    for attr in ("add", "add_copy"):
        orig = getattr(digest_mod.DigestBatch, attr)
        monkeypatch.setattr(digest_mod.DigestBatch, attr, lambda self, name, *a, _o=orig, **k: (digested.append(name), _o(self, name, *a, **k))[1])
    tensors = [(f"t{i}", torch.randn(100)) for i in range(12)]  # 4 per 2 KiB buffer: 3 groups
    with RefitSender(config=RefitConfig.build(mode="log", timeout_s=10.0, buffer_bytes=4096)) as tx:
        th = _receiver_thread(tx.endpoint, out, verify=False)
        with caplog.at_level(logging.WARNING, logger="refit_verify"):
            report = tx.send(tensors)
        th.join(10)
    assert report is None and tx.last_stats["mode"] == "off"
    assert digested == ["t0", "t1", "t2", "t3"]  # the first group only
    assert any("UNVERIFIED" in r.getMessage() and "cannot verify" in r.getMessage() for r in caplog.records)
    assert out["result"].ok and out["result"].mode.value == "off" and out["result"].manifest is None
    assert out["loaded"] == [n for n, _ in tensors]


def test_receiver_whose_digest_code_is_unavailable_cannot_verify():
    """Verification unavailable in the receiver's process (here: the digest import fails) is
    reported at the handshake with the reason."""

    class Broken(RefitReceiver):
        def _can_verify(self):
            return False, "digest code unavailable in this process: ImportError: no numba"

    out: dict = {}
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0)) as tx:
        def run():
            try:
                with Broken(tx.endpoint, config=RefitConfig.build(timeout_s=10.0, connect_timeout_s=10.0)) as rx:
                    rx.receive(lambda b: None)
            except BaseException as e:  # noqa: BLE001
                out["error"] = e

        th = threading.Thread(target=run, daemon=True)
        th.start()
        with pytest.raises(RefitProtocolError, match="no numba"):
            tx.send([("a", torch.randn(4))])
        th.join(10)
    assert isinstance(out["error"], RefitAbortedError)


def test_older_receiver_fails_at_handshake_with_versions_named(tmp_path):
    """A protocol-1 receiver cannot decode a protocol-2 Hello and answers Reject; the sender's error
    names both versions instead of timing out or running unverified."""
    import msgspec as _ms

    class HelloV1(_ms.Struct, tag="hello", array_like=True, forbid_unknown_fields=True):
        protocol: int
        refit_id: str
        mode: str

    class RejectV1(_ms.Struct, tag="reject", array_like=True):
        reason: str

    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0)) as tx:
        ctx = zmq.Context()
        rep = ctx.socket(zmq.REP)
        rep.setsockopt(zmq.LINGER, 0)
        rep.connect(tx.endpoint)

        def old_receiver():
            data = rep.recv()
            try:
                _ms.msgpack.decode(data, type=HelloV1)
                reason = "?"
            except _ms.ValidationError as e:
                reason = f"undecodable request: {e}"
            rep.send(_ms.msgpack.encode(RejectV1(reason=reason)))

        th = threading.Thread(target=old_receiver, daemon=True)
        th.start()
        try:
            with pytest.raises(RefitProtocolError) as ei:
                tx.send([("a", torch.randn(4))])
        finally:
            th.join(10)
            rep.close()
            ctx.term()
    assert "undecodable request" in str(ei.value) and f"protocol {PROTOCOL_VERSION}" in str(ei.value) and "older refit-verify" in str(ei.value)


class _OrderedSender(RefitSender):
    """A sender that records its requests (message type) and its waits for replies, with how many
    tensors were packed by then, in ``order``."""

    def __init__(self, order: list[str], **kw) -> None:
        super().__init__(**kw)
        self.order = order

    def _exchange(self, msg, staging=None):
        self.order.append(type(msg).__name__)
        return super()._exchange(msg, staging)

    def _take_reply(self, expect, seq=None):
        self.order.append(f"wait {expect.__name__} (packed {self._progress.tensors_packed})")
        return super()._take_reply(expect, seq)


def test_off_sender_with_verifying_receiver_stays_unverified_and_lazy(monkeypatch):
    """Receiver able to verify, sender off: no digest anywhere, and no extra round trip — the
    Welcome is collected only after the first group is packed (as the Ack of Hello used to be)."""
    for attr in ("add", "hexdigests"):
        monkeypatch.setattr(digest_mod.DigestBatch, attr, lambda *a, **k: (_ for _ in ()).throw(AssertionError("digest in off mode")))
    order: list[str] = []
    out: dict = {}
    tensors = [(f"t{i}", torch.randn(100)) for i in range(6)]
    with _OrderedSender(order, config=RefitConfig.build(mode="off", timeout_s=10.0, buffer_bytes=4096)) as tx:
        th = _receiver_thread(tx.endpoint, out)  # verify=True: it could verify
        assert tx.send(tensors) is None
        th.join(10)
    assert out["result"].ok and out["result"].mode.value == "off" and out["loaded"] == [n for n, _ in tensors]
    assert order[0] == "Hello" and order[1].startswith("wait Welcome (packed 4)")
    assert order.count("Hello") == 1 and sum(o.startswith("wait") for o in order) == 1 + 2 + 1  # Welcome, 2 Acks, Done


def test_one_element_strided_views_are_sent():
    """A one-element view with a non-unit stride (``x[1::2][:1]``) counts as contiguous; the sender
    sends and digests it like its copy."""
    base = torch.arange(12, dtype=torch.int32)
    tensors = [("step1", base[1::2][:1]), ("col", base.reshape(3, 4)[:1, 1:2]), ("bf", base.to(torch.bfloat16)[3::4][:1])]
    assert all(t.numel() == 1 and t.reshape(-1).stride(0) != 1 for _, t in tensors[:1])
    got: dict = {}
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0)) as tx:
        report, out = _run_pair(tx, tensors, load=lambda b: got.update({n: t.clone() for n, t in b}))
    assert report.ok and report.verified == 3
    assert all(torch.equal(got[n], t) and got[n].shape == t.shape for n, t in tensors)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda:0", marks=[pytest.mark.gpu, needs_cuda])])
def test_rest_of_the_list_is_digested_while_the_receiver_reads_an_oversized_first_tensor(monkeypatch, device):
    """A refit list whose first tensor is larger than a staging half (a model's embedding) goes
    alone in a buffer of its own: the sender digests the rest of the list once that Buffer is sent
    and before it waits for its Ack (while the receiver checks and loads it), counts those seconds
    in ``digest_shadow_s``, and the refit verifies. A rest that fails to digest there aborts the refit
    with the Buffer in flight: the receiver stops, nothing after it is loaded. (The digest-ahead path
    of tensors the fused copy+digest does not take: CPU ones; on CUDA fusing is switched off here, its
    own tests are ``tests/gpu/test_fused_copy_gpu.py``.)"""
    from refit_verify.stream.pack import Packer

    monkeypatch.setattr(Packer, "_fuses", lambda self, t, aligned: False)
    order: list[str] = []
    raw = Packer._digest_known

    def digest_known(self, items, **kw):
        order.append(f"digest {','.join(n for n, _ in items)}")
        return raw(self, items, **kw)

    monkeypatch.setattr(Packer, "_digest_known", digest_known)

    tensors = [(n, t.to(device)) for n, t in (("embed", torch.randn(1024)), ("a", torch.randn(100)), ("b", torch.randn(100)))]
    out: dict = {}  # the embedding's 4096 bytes > a 2048-byte staging half
    with _OrderedSender(order, config=RefitConfig.build(mode="enforce", timeout_s=10.0, buffer_bytes=4096), device=device) as tx:
        th = _receiver_thread(tx.endpoint, out)
        report = tx.send(tensors)
        th.join(10)
        stats = tx.last_stats
    assert report.ok and report.verified == 3 and out["loaded"] == ["embed", "a", "b"]
    # the first tensor is digested while the receiver answers Hello; its Buffer goes once the Welcome is taken
    assert order[:7] == ["Hello", "digest embed", "wait Welcome (packed 0)", "DigestBuffer", "digest a,b", "wait Ack (packed 0)",
                         "DigestBuffer"]
    assert 0.0 < stats["digest_shadow_s"] < stats["digest_s"]

    def failing(self, items, **kw):  # the rest's storage freed under it after the list was checked
        if len(items) > 1:
            raise RefitInputError("storage freed under 'a'")
        return raw(self, items, **kw)

    monkeypatch.setattr(Packer, "_digest_known", failing)
    out = {}
    with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=10.0, buffer_bytes=4096), device=device) as tx:
        th = _receiver_thread(tx.endpoint, out)
        with pytest.raises(RefitInputError, match="storage freed"):
            tx.send(tensors)
        th.join(10)
    assert not th.is_alive() and isinstance(out.get("error"), RefitAbortedError)
    assert out.get("loaded", []) in ([], ["embed"])  # the embedding was sent before the failure; nothing after it


def test_the_sender_carries_its_version_and_an_older_one_after_a_newer_one_fails_in_enforce():
    from refit_verify.boundary.worker import SessionDigests
    from tests.support.toy_model import toy_weights, toy_worker

    _, wb, model = toy_worker()
    w = list(toy_weights(4).items())
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, connect_timeout_s=30.0)
    with RefitSender(config=cfg) as tx:
        def one(**kw):
            out: dict = {}
            th = _thread_receiver(tx.endpoint, model.load_weights, cfg, out, SessionDigests(wb, "transport"))
            try:
                return tx.send(w, **kw)
            finally:
                th.join(timeout=30)

        assert one(version=7).ok and wb.last.version == 7
        assert one().ok and wb.last.version is None  # unversioned: no order
        assert one(version=7).ok and wb.last.version == 7 and wb.last.stale is None  # a repeat (a retried sync) is in order
        assert one(version=8).ok and wb.last.stale is None
        with pytest.raises(RefitVerificationError) as ei:
            one(version=6)
        assert wb.last.version == 6 and ei.value.report.problems == (
            "stale refit: version 6 is older than version 8 already closed on this worker",)
        with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
            tx.send(w, version=-1)  # before anything is sent


def test_a_hello_without_a_version_decodes_as_unversioned():
    legacy = msgspec.msgpack.encode(["hello", PROTOCOL_VERSION, "r1", "enforce", 64, 0, "cpu"])
    from refit_verify.wire.staged import decode_request

    hello = decode_request(legacy)
    assert isinstance(hello, Hello) and (hello.producer_rank, hello.version) == (0, None)
    assert decode_request(encode(Hello(protocol=PROTOCOL_VERSION, refit_id="r1", mode="log", alignment=64, version=12))).version == 12


def test_a_worker_fed_by_another_producer_than_its_own_names_it_and_fails_in_enforce():
    from refit_verify.boundary.worker import SessionDigests
    from tests.support.toy_model import toy_weights, toy_worker

    _, wb, model = toy_worker()
    w = list(toy_weights(5).items())
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, connect_timeout_s=30.0)

    def one(expect):
        th = _thread_receiver(tx.endpoint, model.load_weights, cfg, {}, SessionDigests(wb, "transport", expect_producer=expect))
        try:
            return tx.send(w)
        finally:
            th.join(timeout=30)

    with RefitSender(config=cfg, rank=1) as tx:
        assert one(1).ok and one(None).ok
        with pytest.raises(RefitVerificationError) as ei:
            one(0)
    assert ei.value.report.problems == ("misrouted payload: worker rank 0 (tp 0, pp 0) received the payload of producer "
                                        "rank 1 (cpu); it must be fed by producer rank 0",)


def test_fused_copy_and_digest_round_trip_verifies_and_a_corrupted_staged_byte_is_caught(monkeypatch):
    """The sender's fused path (grouped tensors copied into staging and digested from one read,
    ``DigestBatch.add_copy``; the Triton kernels, interpreted on CPU tensors here, as on CUDA): a refit
    of mixed tensors verifies and every tensor lands intact; a byte flipped in a staged slot after
    packing is named and not loaded (the digest is of the tensor read, not of the slot)."""
    from refit_verify.digest.kernels import launch as kd

    if not kd._INTERPRETED:
        pytest.skip("compiled kernels: the CUDA transport tests (tests/gpu, test_two_process_*_cuda_*) run this path")
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    fused: list[str] = []
    real = digest_mod.DigestBatch.add_copy

    def spy(self, name, t, dst, **kw):
        fused.append(name)
        return real(self, name, t, dst, **kw)

    monkeypatch.setattr(digest_mod.DigestBatch, "add_copy", spy)
    keep = {f"layers.{i}.small" for i in range(15, 20)}  # (fewer small ones: the interpreter is slow)
    tensors = [(n, t) for n, t in mixed_tensors() if not n.startswith("layers.") or n in keep]
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL_BUDGET)
    with CorruptingSender(config=cfg) as tx:  # (the receiver in a process of its own: the interpreter is not thread-safe)
        rx = ReceiverProcess(tx.endpoint, n_refits=2, **SMALL_BUDGET)
        try:
            tx.target = None  # first refit: nothing corrupted
            report = tx.send(tensors)
            assert report.ok and report.verified == len(tensors), report
            assert_received(rx.result()["got"], tensors)
            alone = {"oversized", "tail.oversized.bf16"}
            assert sorted(fused) == sorted(n for n, _ in tensors if n not in alone)
            tx.target = target = CorruptingSender.target
            with pytest.raises(RefitVerificationError) as ei:
                tx.send(tensors)
            assert ei.value.mismatched == [target] and list(ei.value.rejected) == [target]
            assert_received(rx.result()["got"], [(n, t) for n, t in tensors if n != target])
        finally:
            rx.close()


# ---------------------------------------------------------------- staging ahead of the first group


def _shm_bytes_allocated(buf) -> int:
    """Bytes tmpfs holds for a CPU staging buffer's shared-memory file (pages touched so far)."""
    return os.stat(os.path.join("/dev/shm", buf._name)).st_blocks * 512


def test_stage_ahead_touches_exactly_the_first_groups_pages():
    from refit_verify.transport.send_state import SendState

    st = SendState(send=None, settle=None, requested=None, mode=None, progress=None, capacity=1 << 20, device=None)
    items = [("a", torch.zeros(40_000, dtype=torch.uint8)), ("b", torch.zeros(10_000, dtype=torch.float32)),
             ("c", torch.zeros(300_000, dtype=torch.float32)), ("d", torch.zeros(8))]  # c (1.2 MB) does not fit: stop there
    try:
        staged = st.stage_ahead(items, 512)
        assert staged == 40_448 + 40_448  # a and b, each rounded up to 512
        assert st.stage_s > 0 and st.pool[1] is None
        held = _shm_bytes_allocated(st.pool[0])
        assert 80_896 <= held <= 80_896 + 2 * 4096 and held < st.capacity // 8  # the first group's pages, not the buffer's
        assert st.stage_ahead(items, 512) == 0  # the buffer is there already: nothing more
    finally:
        st.free_pool()


@pytest.mark.parametrize("items", [[], [("big", torch.zeros(2 << 20, dtype=torch.uint8))], ["junk", ("a", torch.zeros(4))],
                                   [("m", torch.empty(4, device="meta"))]],
                         ids=["empty", "first-too-large", "not-a-pair", "meta"])
def test_stage_ahead_does_nothing_for_what_it_cannot_stage(items):
    from refit_verify.transport.send_state import SendState

    st = SendState(send=None, settle=None, requested=None, mode=None, progress=None, capacity=1 << 20, device=None)
    assert st.stage_ahead(items, 512) == 0  # never raises: the packer reports bad items
    assert st.pool == [None, None] and st.stage_s == 0.0


@pytest.mark.parametrize("mode", ["enforce", "off"])
def test_sender_stages_the_first_group_while_waiting_for_welcome(mode):
    tensors = [(f"t{i}", torch.randn(1000 + i)) for i in range(6)]
    got: dict = {}
    with RefitSender(config=RefitConfig.build(mode=mode, timeout_s=5.0)) as tx:
        report, _ = _run_pair(tx, tensors, load=lambda b: got.update((n, t.clone()) for n, t in b))
    st = tx.last_stats
    if mode == "enforce":
        assert report.ok and 0 < st["stage_s"] <= st["welcome_s"] and 0 <= st["digest_before_welcome_s"] <= st["digest_s"]
    else:  # nothing staged ahead, nothing digested
        assert report is None and st["stage_s"] == 0.0 == st["digest_before_welcome_s"] == st["digest_s"] and st["welcome_s"] > 0
    assert list(got) == [n for n, _ in tensors] and all(torch.equal(got[n], t) for n, t in tensors)


def test_a_finished_sender_is_freed_by_reference_counting_and_keeps_its_counts():
    """After a verified refit the sender's progress keeps the packing counts, not the packer (which refers
    back to the sender): dropping the sender frees it, its sockets and digest buffers at once, with the
    cyclic collector off."""
    import gc
    import weakref

    tx = RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=5.0))
    with tx:
        report, out = _run_pair(tx, [("a", torch.randn(5)), ("b", torch.randn(6))])
    assert report is not None and report.ok and out.get("error") is None
    assert (tx._progress.tensors_packed, tx._progress.last_name) == (2, "b")
    assert tx.last_stats["tensors"] == 2 and tx.last_stats["digest_s"] > 0
    gone = weakref.ref(tx)
    gc.disable()
    try:
        del tx
        assert gone() is None
    finally:
        gc.enable()
