"""The benchmarks' Qwen3 layouts (Qwen3-1.7B, -4B, -8B configs) and weights drawn on the device."""

from __future__ import annotations

import pytest
import torch

from refit_verify.testing import models


def _bytes(h: int, inter: int, layers: int, nq: int, nkv: int, tied: bool, hd: int = 128, vocab: int = 151936) -> int:
    """bf16 bytes of a Qwen3 decoder, counted from its config (q/k norms per head, two norms per layer)."""
    per_layer = h * nq * hd * 2 + 2 * h * nkv * hd + 3 * h * inter + 2 * hd + 2 * h
    return 2 * (vocab * h * (1 if tied else 2) + layers * per_layer + h)


@pytest.mark.parametrize(("name", "h", "inter", "layers", "nq", "tied", "tensors"), [
    ("qwen3-0.6b-like", 1024, 3072, 28, 16, True, 310),
    ("qwen3-1.7b-like", 2048, 6144, 28, 16, True, 310),
    ("qwen3-4b-like", 2560, 9728, 36, 32, True, 398),
    ("qwen3-8b-like", 4096, 12288, 36, 32, False, 399),
])
def test_bench_layouts_are_the_qwen3_configs(name, h, inter, layers, nq, tied, tensors):
    cfg = models.BENCH_LAYOUTS[name]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]) == (h, inter, layers, nq)
    assert (cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"], cfg["tie_word_embeddings"]) == (8, 128, 151936, tied)
    shapes = models.param_shapes(cfg)
    assert len(shapes) == tensors
    assert ("lm_head.weight" in shapes) is not tied
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (nq * 128, h)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (8 * 128, h)
    assert models.state_bytes(cfg) == _bytes(h, inter, layers, nq, 8, tied)


def test_bench_layout_sizes_in_gb():
    got = {n: round(models.state_bytes(c) / 1e9, 2) for n, c in models.BENCH_LAYOUTS.items()}
    assert got == {"qwen3-shaped-small": 0.0, "qwen3-0.6b-like": 1.19, "qwen3-1.7b-like": 3.44, "qwen3-4b-like": 8.04,
                   "qwen3-8b-like": 16.38}
    sizes = list(got.values())
    assert sizes == sorted(sizes)  # smallest first


def test_device_state_dict_same_seed_same_values_and_the_layout():
    cfg = models.QWEN3_0_6B_SHAPED_SMALL
    a, b, c = (models.device_state_dict(cfg, seed=s) for s in (5, 5, 6))
    shapes = models.param_shapes(cfg)
    assert list(a) == list(shapes)
    assert all(a[n].shape == shapes[n] and a[n].dtype == torch.bfloat16 for n in a)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert sum(t.numel() * t.element_size() for t in a.values()) == models.state_bytes(cfg)
    emb, norm = a["model.embed_tokens.weight"].float(), a["model.norm.weight"].float()
    assert abs(emb.mean().item()) < 0.002 and 0.018 < emb.std().item() < 0.022
    assert abs(norm.mean().item() - 1.0) < 0.01


def test_tiny_qwen3_moe_layout_per_expert_names_deterministic_by_seed():
    """The packaged Qwen3-MoE: per layer a router and 4 experts of gate / up / down; the same seed, the same bytes."""
    cfg = models.load_config(models.packaged_config_dir(models.TINY_QWEN3_MOE))
    assert (cfg["model_type"], cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == ("qwen3_moe", 4, 2, 2)
    shapes = models.param_shapes(cfg)
    assert len(shapes) == 45 and not any(".mlp.gate_proj" in n or ".mlp.down_proj" in n for n in shapes)
    assert shapes["model.layers.1.mlp.gate.weight"] == (4, 64)
    assert shapes["model.layers.1.mlp.experts.3.gate_proj.weight"] == (64, 64) == shapes["model.layers.0.mlp.experts.0.down_proj.weight"]
    assert shapes["model.layers.0.self_attn.q_norm.weight"] == (32,)
    a, b, c = (models.random_state_dict(cfg, seed=s) for s in (5, 5, 6))
    assert list(a) == list(shapes) and all(torch.equal(a[n], b[n]) for n in a) and not torch.equal(a["lm_head.weight"], c["lm_head.weight"])


def test_stacked_experts_are_the_per_expert_tensors_in_fused_checkpoint_names():
    cfg = models.load_config(models.packaged_config_dir(models.TINY_QWEN3_MOE))
    w = models.random_state_dict(cfg, seed=1)
    s = models.stacked_experts(w, cfg)
    assert len(s) == 45 - 2 * 12 + 2 * 2 and not any(".experts.0." in n for n in s)
    gate_up, down = s["model.layers.1.mlp.experts.gate_up_proj"], s["model.layers.1.mlp.experts.down_proj"]
    assert gate_up.shape == (4, 128, 64) and down.shape == (4, 64, 64)
    assert torch.equal(gate_up[2, :64], w["model.layers.1.mlp.experts.2.gate_proj.weight"])
    assert torch.equal(gate_up[2, 64:], w["model.layers.1.mlp.experts.2.up_proj.weight"])
    assert torch.equal(down[3], w["model.layers.1.mlp.experts.3.down_proj.weight"])
    assert models.stacked_experts(models.random_state_dict(models.load_config(models.packaged_config_dir()), seed=1), cfg).keys() \
        == models.param_shapes(models.load_config(models.packaged_config_dir())).keys()  # no experts: unchanged
