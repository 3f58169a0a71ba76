"""The worker methods of adapter verification without an engine: arguments as a ``vllm serve``
sends them (JSON text), vLLM's own scaling rule, a worker without LoRA, layers not provable."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from refit_verify.trainer.adapters import AdapterManifest  # noqa: E402
from refit_verify.manifest import from_wire  # noqa: E402
from refit_verify.vllm_plugin import worker_adapters as wa  # noqa: E402

B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(autouse=True)
def enforce(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")


def _worker(manager=None):
    runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=manager) if manager is not None else None)
    return SimpleNamespace(rank=0, model_runner=runner, get_model=lambda: SimpleNamespace())


def test_layout_uses_vllms_scaling_and_reads_json_text_arguments():
    am = SimpleNamespace(lora_config=SimpleNamespace(lora_dtype=torch.bfloat16))
    got = wa.refit_verify_lora_layout(_worker(am), json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}), json.dumps([A, B]))
    assert got["lora_dtype"] == "bfloat16" and got["scalings"] == {A: 1.0, B: 2.0}
    got = wa.refit_verify_lora_layout(_worker(am), {"r": 4, "lora_alpha": 8, "target_modules": [], "use_rslora": True,
                                                    "alpha_pattern": {"q_proj": 6}}, [B])
    assert got["scalings"] == {B: 6 / math.sqrt(4)}


def test_a_worker_without_lora_says_so():
    w = _worker()
    assert wa.refit_verify_lora_layout(w, {"r": 4, "lora_alpha": 8, "target_modules": []}, [A])["enabled"] is False
    got = wa.refit_verify_lora_verify(w, "3", "null", json.dumps({A: ["0" * 32, [4, 16]]}))
    man = from_wire(got["adapter"], AdapterManifest)
    assert man.adapter_id == 3 and man.version is None and not man.loaded and "LoRA is not enabled" in man.problems[0]


def test_off_answers_not_verifying(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "off")
    assert wa.refit_verify_lora_verify(_worker(), 1, None, "{}")["verifying"] is False
    assert wa.refit_verify_lora_audit(_worker())["verifying"] is False


def test_fully_sharded_and_unknown_layers_are_not_provable():
    am = SimpleNamespace(lora_config=SimpleNamespace(fully_sharded_loras=False))
    stacked = (torch.zeros(2, 1, 8, 16),)
    assert wa._why_not_provable(am, SimpleNamespace(tp_size=2, lora_a_stacked=stacked)) is None  # mapped per rank (_rank_slice)
    assert wa._why_not_provable(am, SimpleNamespace(tp_size=1, lora_a_stacked=stacked)) is None
    assert "not mapped" in wa._why_not_provable(am, SimpleNamespace(tp_size=1, w13_lora_a_stacked=stacked))
    sharded = SimpleNamespace(lora_config=SimpleNamespace(fully_sharded_loras=True))
    assert "fully sharded" in wa._why_not_provable(sharded, SimpleNamespace(tp_size=1, lora_a_stacked=stacked))


# --------------------------------------------------------------------------- tensor parallelism: each rank's slice


def _lora_layer(cls, **attrs):
    """One of vLLM's LoRA layer classes, built without an engine: only what its slicing reads."""
    layer = cls.__new__(cls)
    torch.nn.Module.__init__(layer)
    for k, v in attrs.items():
        setattr(layer, k, v)
    return layer


def _stacked(n: int, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(2, 1, rows, cols, dtype=torch.bfloat16) for _ in range(n))


def test_each_ranks_slice_is_the_one_vllms_own_slicing_takes():
    from vllm.lora.layers import (MergedColumnParallelLinearWithLoRA, MergedQKVParallelLinearWithLoRA, QKVParallelLinearWithLoRA,
                                  RowParallelLinearWithLoRA)

    # the tiny Llama at TP=2, rank 1: q of 2 heads of 64 split, the one KV head replicated (kv shard 0 on both ranks)
    qkv = _lora_layer(MergedQKVParallelLinearWithLoRA, tp_size=2, tp_rank=1, n_slices=3, output_slices=(64, 64, 64),
                      output_ids=(1, 0, 0), lora_a_stacked=_stacked(3, 8, 128))
    assert wa._rank_slice(qkv, 0, False, [128, 4]) == (0, [(64, 128)])
    assert wa._rank_slice(qkv, 1, False, [64, 4]) is None and wa._rank_slice(qkv, 2, False, [64, 4]) is None
    assert wa._rank_slice(qkv, 0, True, [4, 128]) is None  # lora_A whole on every rank
    gate_up = _lora_layer(MergedColumnParallelLinearWithLoRA, tp_size=2, tp_rank=0, n_slices=2, output_slices=(128, 128),
                          output_ids=(0, 0), lora_a_stacked=_stacked(2, 8, 128))
    assert wa._rank_slice(gate_up, 1, False, [256, 4]) == (0, [(0, 128)])
    down = _lora_layer(RowParallelLinearWithLoRA, tp_size=2, tp_rank=1, input_size=128, lora_a_stacked=_stacked(1, 8, 128))
    assert wa._rank_slice(down, 0, True, [4, 256]) == (1, [(128, 256)])
    assert wa._rank_slice(down, 0, False, [128, 4]) is None
    assert wa._rank_slice(_lora_layer(RowParallelLinearWithLoRA, tp_size=1, tp_rank=0, input_size=256), 0, True, [4, 256]) is None
    # one packed qkv module (chatglm-like): 4 heads of 32, 2 KV heads, rank 1 takes its q, k and v rows
    base = SimpleNamespace(num_kv_head_replicas=1)
    packed = _lora_layer(QKVParallelLinearWithLoRA, tp_size=2, tp_rank=1, base_layer=base, q_proj_total_size=128, q_proj_shard_size=64,
                         kv_proj_shard_size=32, kv_proj_total_size=64, lora_a_stacked=_stacked(1, 8, 128))
    assert wa._rank_slice(packed, 0, False, [256, 4]) == (0, [(64, 128), (160, 192), (224, 256)])


def test_whole_layers_at_tp2_and_what_cannot_be_mapped():
    from vllm.lora.layers import LogitsProcessorWithLoRA, RowParallelLinearWithLoRA, VocabParallelEmbeddingWithLoRA

    assert wa._rank_slice(_lora_layer(LogitsProcessorWithLoRA, tp_size=2, tp_rank=1), 0, False, [512, 4]) is None
    assert wa._rank_slice(_lora_layer(VocabParallelEmbeddingWithLoRA, tp_size=2), 0, True, [4, 512]) is None
    no_slicing = SimpleNamespace(tp_size=2, lora_a_stacked=_stacked(1, 8, 16))
    assert "has no slice_lora_b: not mapped" in wa._rank_slice(no_slicing, 0, False, [16, 4])
    short = _lora_layer(RowParallelLinearWithLoRA, tp_size=2, tp_rank=1, input_size=128, lora_a_stacked=_stacked(1, 8, 128))
    assert "empty" in wa._rank_slice(short, 0, True, [4, 100])  # columns 128:256 of a tensor of 100: nothing


def _tp_worker(rank: int, layer) -> SimpleNamespace:
    am = SimpleNamespace(lora_config=SimpleNamespace(lora_dtype=torch.bfloat16, fully_sharded_loras=False), model=SimpleNamespace(),
                         packed_modules={}, modules={"model.layers.0.self_attn.o_proj": layer}, lora_index_to_id=[7, None],
                         list_adapters=lambda: {7: object()})
    w = _worker(am)
    w.rank = rank
    return w


def test_a_rank_compares_its_slice_with_the_trainers_digest_of_it():
    from vllm.lora.layers import RowParallelLinearWithLoRA

    from refit_verify.trainer.adapters import expected_slices

    oa, ob = A.replace("q_proj", "o_proj"), B.replace("q_proj", "o_proj")
    a, b = torch.randn(4, 128), torch.randn(128, 4)
    layer = _lora_layer(RowParallelLinearWithLoRA, tp_size=2, tp_rank=1, input_size=64, lora_a_stacked=_stacked(1, 8, 64),
                        lora_b_stacked=_stacked(1, 128, 8))
    layer.lora_a_stacked[0][0, 0, :4, :64] = a[:, 64:].to(torch.bfloat16)  # what set_lora copies in on rank 1
    layer.lora_b_stacked[0][0, 0, :128, :4] = (b.to(torch.bfloat16) * 2)
    w = _tp_worker(1, layer)
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": ["o_proj"]}
    lay = wa.refit_verify_lora_layout(w, cfg, [oa, ob], [[4, 128], [128, 4]])
    assert lay["slices"] == {oa: [1, [[64, 128]]]}  # lora_B of a row-parallel layer is whole
    whole, by_rank = expected_slices({oa: a, ob: b}, torch.bfloat16, lay["scalings"], {1: {oa: (1, [(64, 128)])}})
    text = json.dumps({n: [d, s] for n, (d, s) in whole.items()})
    sl = json.dumps({str(r): {n: [d, s, [sp[0], [list(x) for x in sp[1]]]] for n, (d, s, sp) in v.items()} for r, v in by_rank.items()})
    man = from_wire(wa.refit_verify_lora_verify(w, 7, 1, text, sl)["adapter"], AdapterManifest)
    assert man.ok and man.digests == {oa: by_rank[1][oa][0], ob: whole[ob][0]} and man.not_proven == {}
    assert man.where[oa] == "model.layers.0.self_attn.o_proj.lora_a, slot 0, worker rank 1's slice dim 1 [64:128]"
    assert man.proven_bytes == (4 * 64 + 128 * 4) * 2
    layer.lora_a_stacked[0][0, 0, 1, 3] += 1  # one element of rank 1's columns
    man = from_wire(wa.refit_verify_lora_verify(w, 7, 2, text, sl)["adapter"], AdapterManifest)
    assert not man.ok and man.digests[oa] != by_rank[1][oa][0] and man.digests[ob] == whole[ob][0]
    # no digest of this rank's slice sent (a trainer that did not ask for the layout's slices): named, never compared whole
    man = from_wire(wa.refit_verify_lora_verify(w, 7, 3, text)["adapter"], AdapterManifest)
    assert not man.ok and oa not in man.digests and "for which the trainer sent no digest" in man.where[oa]


def test_fully_sharded_lora_at_tp2_is_not_proven_with_its_reason():
    """fully_sharded_loras=True is an engine flag of its own (no engine of the suite runs it): named, never compared."""
    from vllm.lora.layers import RowParallelLinearWithShardedLoRA

    oa, ob = A.replace("q_proj", "o_proj"), B.replace("q_proj", "o_proj")
    layer = _lora_layer(RowParallelLinearWithShardedLoRA, tp_size=2, tp_rank=0, input_size=64, lora_a_stacked=_stacked(1, 8, 64),
                        lora_b_stacked=_stacked(1, 64, 8))
    w = _tp_worker(0, layer)
    w.model_runner.lora_manager._adapter_manager.lora_config.fully_sharded_loras = True
    assert wa.refit_verify_lora_layout(w, {"r": 4, "lora_alpha": 8, "target_modules": []}, [oa, ob], [[4, 128], [128, 4]])["slices"] == {}
    man = from_wire(wa.refit_verify_lora_verify(w, 7, 1, json.dumps({oa: ["0" * 32, [4, 128]], ob: ["0" * 32, [128, 4]]}))["adapter"],
                    AdapterManifest)
    assert set(man.not_proven) == {oa, ob} and all("fully sharded LoRA" in why for why in man.not_proven.values())
    assert not man.ok and man.digests == {} and man.proven_bytes == 0
