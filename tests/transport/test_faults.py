"""Fault-injection matrix, no-false-positive sweep and bounded waits over CPU shared memory.

In ``enforce`` the receiver checks every tensor against the digest that came in its Buffer before
``load`` (protocol 3): for the byte and layout faults the matrix also asserts that the corrupted
tensor never reached ``load`` and that the verdict's ``kept`` / ``landed`` say so.

The receiver is a spawned process (one per module, serving every refit of the matrix and of the
sweep); faults are injected by :class:`tests.support.faults.FaultySender` between the sender's digest and
the receiver's read. Every run draws a fresh seeded sample: ``REFIT_FAULT_SEED=<n>`` replays one
(the seed is in every assertion message and printed with ``-s``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time

import pytest
import torch

from refit_verify import RefitConfig
from refit_verify.errors import RefitAbortedError, RefitInputError, RefitReceiveError, RefitTimeoutError, RefitVerificationError
from refit_verify.transport import RefitReceiver, RefitSender
from refit_verify.wire.staged import Complete
from tests.support.faults import (
    CLASSES,
    SPAWN,
    AddUnexpected,
    Case,
    Drop,
    DuplicateName,
    FaultySender,
    ReceiverProcess,
    ShortenUsed,
    mapped_staging,
    random_budget,
    random_tensor_set,
    shm_leftovers,
    tensor_sha,
)

SEED = int(os.environ.get("REFIT_FAULT_SEED") or secrets.randbelow(1 << 30))
CI_SEEDS_PER_CLASS = 3
SLOW_SEEDS_PER_CLASS = 200
CI_CLEAN_REFITS = 50
SLOW_CLEAN_REFITS = 5000

MISMATCH_CLASSES = {"BitFlip", "LaneSwap", "TensorSwap", "StaleSlot", "DtypeRelabel", "Reshape"}


def setup_module(module):
    print(f"\nREFIT_FAULT_SEED={SEED}")


@pytest.fixture(scope="module")
def channel():
    """One sender (faults and config set per refit) and one receiver process for the module."""
    tx = FaultySender(config=RefitConfig.build(mode="enforce", timeout_s=30.0))
    rx = ReceiverProcess(tx.endpoint, timeout_s=30.0, connect_timeout_s=5.0)
    yield tx, rx
    rx.close()
    tx.close()


def refit(channel, tensors, mode, budget, faults=()):
    """One refit through the shared channel: ``(returned, raised, receiver result)``."""
    tx, rx = channel
    tx.faults = list(faults)
    tx.config = RefitConfig.build(mode=mode, timeout_s=30.0, **budget)
    out = err = None
    try:
        out = tx.send(tensors)
    except Exception as e:  # noqa: BLE001 - inspected by the caller
        err = e
    res = rx.result()
    assert "raised" not in res, res
    assert res["refit_id"] == tx.last_stats["refit_id"]
    return out, err, res


# ------------------------------------------------------------------------------ the matrix


def check_case(case: Case, mode: str, out, err, res, records) -> None:
    """The verdict names exactly ``fault.affected``, in the right categories; everything else
    arrived byte-exact; ``log`` logs and completes; ``off`` sees only metadata faults."""
    f = case.fault
    ctx = f"seed={SEED} {case!r} mode={mode}"
    assert f.fired, ctx
    aff = f.affected
    kind = case.cls.__name__
    sent = dict(case.tensors)
    # the receiver completed and every unaffected tensor arrived byte-exact
    for name, t in sent.items():
        if name not in aff:
            assert res["got"].get(name) == tensor_sha(t), f"{name} not delivered intact: {ctx}"
    if mode == "off":
        if not f.metadata:
            assert err is None and out is None, f"off mode cannot see {kind}: {ctx}"
            return
        assert isinstance(err, RefitReceiveError), f"{type(err).__name__}: {err} {ctx}"
        if kind == "ShortenUsed":
            assert f"{len(aff)} entries rejected" in str(err), ctx
            assert len(aff) > 20 or all(n in str(err) for n in aff), ctx  # rejected entries are named (the first 20)
        elif kind == "DuplicateName":
            assert f.dst in str(err), ctx  # the name sent twice; without manifests src is not seen
        else:
            assert "receiver got" in str(err), ctx  # a count mismatch, unnamed
        return
    if mode == "enforce":
        assert isinstance(err, RefitVerificationError), f"{type(err).__name__}: {err} {ctx}"
        rep = err.report
        if len(aff) <= 20:
            assert all(n in str(err) for n in aff), ctx
    else:
        assert err is None, f"{type(err).__name__}: {err} {ctx}"
        rep = out
        assert rep is not None and not rep.ok, ctx
        warned = " ".join(r.getMessage() for r in records if r.levelno == logging.WARNING and r.name == "refit_verify")
        assert all(n in warned for n in list(aff)[:20]) or len(aff) > 20, f"log mode did not log {aff}: {ctx}"
    assert set(rep.affected) == aff, f"named {rep.affected}, affected {aff}: {ctx}"
    cats = {"mismatched": set(rep.mismatched), "missing": set(rep.missing), "unexpected": set(rep.unexpected), "rejected": set(rep.rejected)}
    checked_first = mode == "enforce" and kind in MISMATCH_CLASSES | {"AddUnexpected"}
    if checked_first:
        # verify before load: the receiver compared each tensor with the digest that came with it and
        # never handed a corrupt (or undigested) one to load; the verdict says what the engine holds
        assert not aff & set(res["got"]), f"{aff & set(res['got'])} reached load: {ctx}"
        assert set(rep.kept) == aff and all(v.startswith("not loaded: ") for v in rep.kept.values()), f"{rep.kept} {ctx}"
        assert set(rep.landed) == set(res["got"]) == set(sent) - aff, ctx
    if kind in MISMATCH_CLASSES:
        want = {"mismatched": aff, "rejected": aff} if checked_first else {"mismatched": aff}
        if checked_first:
            assert all("differs from the sender's" in rep.rejected[n] for n in aff), ctx
    elif kind == "Drop":
        want = {"missing": aff}
    elif kind == "AddUnexpected":
        want = {"unexpected": aff, "rejected": aff} if checked_first else {"unexpected": aff}
        if checked_first:
            assert all("carries no sender digest" in rep.rejected[n] for n in aff), ctx
    elif kind == "DuplicateName":
        want = {"missing": aff, "rejected": {f.dst}}
        assert rep.rejected[f.dst] == "sent twice in one refit", ctx
    else:  # ShortenUsed
        want = {"missing": aff, "rejected": aff}
        assert all("used_bytes" in rep.rejected[n] for n in aff), ctx
    assert cats == {k: want.get(k, set()) for k in cats}, f"{cats} != {want}: {ctx}"
    assert rep.verified == len(sent) - len(aff & set(sent)), ctx


def run_class(channel, cls, mode, seeds, caplog):
    for seed in seeds:
        case = Case(cls, seed)
        if case.previous is not None:  # stale slot: the refit whose bytes go stale
            _, err, _ = refit(channel, case.previous, mode, case.budget, [case.fault])
            assert err is None, f"{err} seed={SEED} {case!r}"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="refit_verify"):
            out, err, res = refit(channel, case.tensors, mode, case.budget, [case.fault])
        check_case(case, mode, out, err, res, caplog.records)


@pytest.mark.parametrize("mode", ["enforce", "log", "off"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_fault_matrix_sample(channel, cls, mode, caplog):
    run_class(channel, cls, mode, [SEED + i for i in range(CI_SEEDS_PER_CLASS)], caplog)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["enforce", "log", "off"])
@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_fault_matrix_full(channel, cls, mode, caplog):
    run_class(channel, cls, mode, [SEED + 1000 + i for i in range(SLOW_SEEDS_PER_CLASS)], caplog)


def test_faults_at_chosen_positions(channel, caplog):
    """Deterministic placements: a bit far into a tensor, the last byte, lanes 0 and last, a drop
    and a shortened used_bytes at a buffer's end, a duplicate across buffers."""
    from tests.support.faults import BitFlip, DtypeRelabel, LaneSwap, Reshape

    g = torch.Generator().manual_seed(5)
    tensors = [(f"w{i}", torch.randn(300, generator=g)) for i in range(6)]
    tensors.append(("h.bf16", torch.randn(40, 3, generator=g).to(torch.bfloat16)))
    tensors.append(("q.int8", torch.randint(-128, 128, (64,), generator=g, dtype=torch.int8)))
    budget = {"buffer_bytes": 2 * 2560, "alignment": 512}  # two 1200-byte tensors per buffer
    cases = [
        ([BitFlip("w2", byte=1199, bit=7)], {"w2"}),
        ([BitFlip("w5", byte=777, bit=0)], {"w5"}),
        ([LaneSwap("w1", lanes=(0, 149))], {"w1"}),
        ([DtypeRelabel("h.bf16")], {"h.bf16"}),
        ([DtypeRelabel("q.int8")], {"q.int8"}),
        ([Reshape("h.bf16", shape=[120])], {"h.bf16"}),
        ([Drop("w3")], {"w3"}),
        ([DuplicateName("w4", "w0")], {"w4", "w0"}),
        ([ShortenUsed("w3", by=1)], {"w3"}),
        ([BitFlip("w0", byte=0, bit=0), Drop("w5"), AddUnexpected()], {"w0", "w5", "injected.unexpected.weight"}),
    ]
    for faults, want in cases:
        out, err, res = refit(channel, tensors, "enforce", budget, faults)
        assert isinstance(err, RefitVerificationError), (faults, err)
        assert set(err.affected) == want, (faults, err)
        assert set().union(*(f.affected for f in faults)) == want


# ------------------------------------------------------------------------------ no false positives


def clean_sweep(channel, seeds) -> int:
    n = 0
    for seed in seeds:
        tensors = random_tensor_set(seed)
        budget = random_budget(seed, tensors)
        mode = "log" if seed % 5 == 0 else "enforce"
        out, err, res = refit(channel, tensors, mode, budget)
        ctx = f"seed={seed} budget={budget} ({len(tensors)} tensors)"
        assert err is None, f"{type(err).__name__}: {err} {ctx}"
        assert out is not None and out.ok and out.verified == len(tensors), ctx
        assert res["got"] == {n_: tensor_sha(t) for n_, t in tensors}, ctx  # byte-exact, digest-independent
        assert res["error"] is None and not res["rejected"], ctx
        n += 1
    return n


def test_no_false_positives_sample(channel):
    n = clean_sweep(channel, [SEED * 3 + i for i in range(CI_CLEAN_REFITS)])
    assert n == CI_CLEAN_REFITS


@pytest.mark.slow
def test_no_false_positives_full(channel):
    t0 = time.monotonic()
    n = clean_sweep(channel, [SEED * 7 + 100_000 + i for i in range(SLOW_CLEAN_REFITS)])
    print(f"\n{n} clean refits verified equal in {time.monotonic() - t0:.1f} s (seed {SEED})")
    assert n >= 1000


def test_sweep_covers_buffer_switches_and_oversized(channel):
    """The random budgets really do force many buffers and dedicated (oversized) buffers."""
    tx, _ = channel
    many = oversized = single_strided = 0
    for seed in range(SEED, SEED + 30):
        tensors = random_tensor_set(seed)
        budget = random_budget(seed, tensors)
        refit(channel, tensors, "enforce", budget)
        half = budget["buffer_bytes"] // 2
        a = budget["alignment"]
        oversized += any(-(-t.numel() * t.element_size() // a) * a > half for _, t in tensors)
        single_strided += any(t.numel() == 1 and t.dim() and t.reshape(-1).stride(0) != 1 for _, t in tensors)
        many += tx.last_stats["buffers"] >= 4
    assert many >= 6 and oversized >= 6, (many, oversized)  # each ~55 % of seeds


# ------------------------------------------------------------------------------ bounded waits

TENSORS = [(f"t{i}", torch.randn(100, generator=torch.Generator().manual_seed(i))) for i in range(12)]
SMALL = dict(buffer_bytes=4096)  # four 400-byte tensors (512-byte slots) per 2 KiB buffer


def _die_after(endpoint: str, k: int, mode: str, ready) -> None:
    """Receiver process that exits (no cleanup) while loading its k-th buffer, or hangs (mode 'hang')."""
    n = {"buffers": 0}

    def load(batch):
        n["buffers"] += 1
        if n["buffers"] == k:
            if mode == "die":
                os._exit(3)
            time.sleep(3600)

    from refit_verify.digest.batch import digest_tensors

    digest_tensors([("warm-up", torch.ones(4))])  # load the digest code first: the first Ack must not wait for it
    with RefitReceiver(endpoint, config=RefitConfig.build(timeout_s=60.0, connect_timeout_s=30.0)) as rx:
        ready.put(True)
        rx.receive(load)


@pytest.mark.parametrize("how", ["die", "hang"])
def test_receiver_dies_after_kth_buffer(how):
    k = 1 + SEED % 3
    timeout = 10.0 if how == "die" else 1.0
    cfg = RefitConfig.build(mode="enforce", timeout_s=timeout, **SMALL)
    with FaultySender(config=cfg) as tx:
        ready = SPAWN.Queue()
        proc = SPAWN.Process(target=_die_after, args=(tx.endpoint, k, how, ready), daemon=True)
        proc.start()
        try:
            ready.get(timeout=60)  # the receiver process needs a few seconds to import torch
            with pytest.raises(RefitTimeoutError) as ei:
                t0 = time.monotonic()
                tx.send(TENSORS)
            elapsed = time.monotonic() - t0
        finally:
            proc.kill()
            proc.join(10)
    p = ei.value.progress
    print(f"\nreceiver {how}s in buffer {k}: sender raised after {elapsed:.2f} s (timeout {timeout:g} s): {ei.value}")
    assert p["silent"] == "receiver" and p["side"] == "sender"
    assert p["reason"] == ("receiver disconnected" if how == "die" else "receiver went silent")
    assert p["buffers_acked"] == k - 1 and p["buffers_sent"] == k
    assert p["tensors_acked"] == 4 * (k - 1) and p["last_acked_name"] == (f"t{4 * (k - 1) - 1}" if k > 1 else None)
    assert p["waiting_for"] == f"Ack(seq={k - 1})"
    assert elapsed < (3.0 if how == "die" else timeout + 2.0)  # die: far below the 10 s timeout
    if how == "hang":
        assert elapsed >= timeout * 0.95
    assert "staging memory released" in str(ei.value)
    assert len(tx.staging_names) == k and not shm_leftovers(tx.staging_names)


_DYING_SENDER = """
import os, sys, torch
from refit_verify import RefitConfig
from refit_verify.transport import RefitSender
from refit_verify.wire.staged import Buffer
k = int(sys.argv[1])

class Dying(RefitSender):
    def _exchange(self, msg, staging=None):
        if isinstance(msg, Buffer) and msg.seq == k:
            os._exit(4)  # no cleanup, no Abort: the process is simply gone
        return super()._exchange(msg, staging)

tensors = [(f"t{i}", torch.randn(100, generator=torch.Generator().manual_seed(i))) for i in range(12)]
with Dying(config=RefitConfig.build(mode="enforce", timeout_s=60.0, buffer_bytes=4096)) as tx:
    print(tx.endpoint, flush=True)
    tx.send(tensors)
"""


class RecordingReceiver(RefitReceiver):
    """Records the shared-memory staging objects named by the Buffers it handled."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.staging_names: list[str] = []

    def _handle_buffer(self, msg, state, load):
        self.staging_names.append(msg.handle.name)
        return super()._handle_buffer(msg, state, load)


def test_sender_process_dies_mid_stream():
    """The sender process dies (os._exit) before its (k+1)-th buffer: the receiver notices the
    dropped connection at once, raises with its progress, and maps no staging memory; the dead
    sender's own resource tracker unlinks the staging objects."""
    import subprocess
    import sys

    k = 1 + SEED % 2
    # stderr: the dead sender's resource tracker warns about the staging objects it unlinks
    proc = subprocess.Popen([sys.executable, "-c", _DYING_SENDER, str(k)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        endpoint = proc.stdout.readline().strip()
        with RecordingReceiver(endpoint, config=RefitConfig.build(timeout_s=10.0, connect_timeout_s=30.0)) as rx:
            last = {"t": None}

            def load(batch):
                last["t"] = time.monotonic()

            with pytest.raises(RefitTimeoutError) as ei:
                rx.receive(load)
            elapsed = time.monotonic() - last["t"]
        assert proc.wait(10) == 4
    finally:
        proc.kill()
        proc.wait(10)
    p = ei.value.progress
    print(f"\nsender died before buffer {k + 1}: receiver raised {elapsed:.2f} s after its last buffer (timeout 10 s): {ei.value}")
    assert p["reason"] == "sender disconnected" and p["silent"] == "sender" and p["side"] == "receiver"
    assert p["buffers"] == k and p["tensors"] == 4 * k and p["last_name"] == f"t{4 * k - 1}"
    assert p["stage"] == f"waiting for Buffer {k} or Complete"
    assert elapsed < 3.0  # far below the 10 s timeout
    assert not mapped_staging()  # the receiver holds no staging memory
    assert len(rx.staging_names) == k
    deadline = time.monotonic() + 10
    while shm_leftovers(rx.staging_names) and time.monotonic() < deadline:  # the dead sender's resource tracker unlinks
        time.sleep(0.1)
    assert not shm_leftovers(rx.staging_names)


def test_sender_exception_aborts_receiver_at_once():
    """A sender-side exception (here: a bad item from the iterator) sends Abort; the receiver
    raises at once, not after its timeout."""
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL)
    out: dict = {}
    with FaultySender(config=cfg) as tx:
        def receive():
            try:
                with RefitReceiver(tx.endpoint, config=RefitConfig.build(timeout_s=30.0, connect_timeout_s=10.0)) as rx:
                    rx.receive(lambda b: None)
            except BaseException as e:  # noqa: BLE001
                out["error"], out["t"] = e, time.monotonic()

        th = threading.Thread(target=receive, daemon=True)
        th.start()

        def items():
            yield from TENSORS[:9]
            yield ("bad", [1, 2, 3])

        with pytest.raises(TypeError, match="expected a torch.Tensor"):
            tx.send(items())
        t_raise = time.monotonic()
        th.join(10)
    e = out["error"]
    print(f"\nsender raised TypeError; receiver raised {type(e).__name__} {out['t'] - t_raise:+.3f} s later: {e}")
    assert isinstance(e, RefitAbortedError) and "RefitInputError" in e.reason and "expected a torch.Tensor" in str(e)
    assert e.progress["buffers"] == 2 and e.progress["tensors"] == 8 and e.progress["last_name"] == "t7"
    assert out["t"] - t_raise < 1.0
    assert len(tx.staging_names) == 2 and not shm_leftovers(tx.staging_names) and not mapped_staging()


def test_a_bad_item_late_in_a_list_is_refused_before_any_buffer_goes():
    """A refit given as a list digests the tensors of its first buffer before sending it and the
    rest right after it (``Packer.digest_first``), but validates every item first: a bad item late in
    the list raises on the sender before any buffer went, the receiver is aborted at once and loads
    nothing (the engine keeps its previous weights whole), and the sender's staging is gone."""
    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL)
    for bad in (("bad", [1, 2, 3]), ("t1", TENSORS[0][1]), ("m", torch.empty(4, device="meta"))):
        out: dict = {"loaded": []}
        with FaultySender(config=cfg) as tx:  # no fault set: it records its staging names
            def receive():
                try:
                    with RefitReceiver(tx.endpoint, config=RefitConfig.build(timeout_s=30.0, connect_timeout_s=10.0)) as rx:
                        rx.receive(lambda b: out["loaded"].extend(n for n, _ in b))
                except BaseException as e:  # noqa: BLE001
                    out["error"], out["t"] = e, time.monotonic()

            th = threading.Thread(target=receive, daemon=True)
            th.start()
            with pytest.raises((TypeError, ValueError, RefitInputError)) as raised:
                tx.send(list(TENSORS[:9]) + [bad])
            t_raise = time.monotonic()
            th.join(10)
        e = out["error"]
        assert isinstance(e, RefitAbortedError) and type(raised.value).__name__ in e.reason
        assert e.progress["buffers"] == 0 and out["loaded"] == []
        assert out["t"] - t_raise < 1.0
        assert not shm_leftovers(tx.staging_names) and not mapped_staging()


def test_receiver_never_connects():
    cfg = RefitConfig.build(mode="enforce", timeout_s=1.0)
    with RefitSender(config=cfg) as tx:
        t0 = time.monotonic()
        with pytest.raises(RefitTimeoutError) as ei:
            tx.send(TENSORS)
        elapsed = time.monotonic() - t0
    print(f"\nno receiver: sender raised after {elapsed:.2f} s (timeout 1 s): {ei.value}")
    assert 0.95 <= elapsed < 3.0
    p = ei.value.progress
    assert p["reason"] == "receiver never connected" and p["silent"] == "receiver" and p["buffers_sent"] == 0
    assert "VLLM_PLUGINS" in str(ei.value)


def test_complete_never_comes():
    """The sender hangs after its last buffer: the receiver raises after timeout_s with the full
    progress (every buffer and tensor received, the last name) and holds no staging memory."""
    release = threading.Event()

    class Hanging(FaultySender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Complete):
                release.wait(30)
                raise RuntimeError("sender hung before Complete")
            return super()._exchange(msg, staging)

    cfg = RefitConfig.build(mode="enforce", timeout_s=30.0, **SMALL)
    with Hanging(config=cfg) as tx:
        errors: dict = {}
        th = threading.Thread(target=lambda: errors.setdefault("sender", pytest.raises(RuntimeError, tx.send, TENSORS)), daemon=True)
        th.start()
        with RefitReceiver(tx.endpoint, config=RefitConfig.build(timeout_s=1.0, connect_timeout_s=10.0)) as rx:
            seen = {"t": None}

            def load(batch):
                seen["t"] = time.monotonic()

            with pytest.raises(RefitTimeoutError) as ei:
                rx.receive(load)
            elapsed = time.monotonic() - seen["t"]
            assert not mapped_staging()
        release.set()
        th.join(10)
    p = ei.value.progress
    print(f"\nComplete never came: receiver raised {elapsed:.2f} s after the last buffer (timeout 1 s): {ei.value}")
    assert 0.95 <= elapsed < 3.0
    assert p["reason"] == "sender went silent" and p["silent"] == "sender"
    assert p["buffers"] == 3 and p["tensors"] == 12 and p["last_name"] == "t11"
    assert p["stage"] == "waiting for Buffer 3 or Complete"
    assert len(tx.staging_names) == 3 and not shm_leftovers(tx.staging_names)
