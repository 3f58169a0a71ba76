"""HF parameter layouts of small decoder models, for the demo, tests and benchmarks.

Builds trainer-side state dicts whose names and shapes match what vLLM's ``load_weights`` expects
for Llama-, Qwen3- and Qwen3-MoE-style configs (``config.json`` fields).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

TINY_LLAMA = "tiny-llama"
TINY_QWEN3_MOE = "tiny-qwen3-moe"
"""A Qwen3-MoE layout (hidden 64, 4 experts of which 2 routed per token, 2 layers, vocab 512): experts tests."""


def packaged_config_dir(name: str = TINY_LLAMA) -> Path:
    """Return the directory of a model config shipped in the package (``data/<name>/config.json``)."""
    return Path(str(resources.files("refit_verify") / "data" / name))


def load_config(model_dir: str | Path) -> dict:
    """Read ``config.json`` from ``model_dir``."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def param_shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Return ``{HF name: shape}`` of a Llama/Qwen3 decoder, in checkpoint order.

    Args:
        cfg: ``config.json`` fields: hidden_size, intermediate_size, num_attention_heads,
            num_key_value_heads, num_hidden_layers, vocab_size, optional head_dim,
            tie_word_embeddings, model_type (``qwen3`` adds per-head q/k norms; ``qwen3_moe``
            too, and each layer's MLP is a router ``mlp.gate`` ``(num_experts, hidden)`` and
            per-expert ``mlp.experts.<e>.{gate,up,down}_proj`` of ``moe_intermediate_size``).
    """
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or h // nh
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if cfg.get("model_type") in ("qwen3", "qwen3_moe"):
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        if _sparse(cfg, i):
            mi = cfg["moe_intermediate_size"]
            out[p + "mlp.gate.weight"] = (cfg["num_experts"], h)
            for e in range(cfg["num_experts"]):
                out[p + f"mlp.experts.{e}.gate_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{e}.up_proj.weight"] = (mi, h)
                out[p + f"mlp.experts.{e}.down_proj.weight"] = (h, mi)
        else:
            out[p + "mlp.gate_proj.weight"] = (inter, h)
            out[p + "mlp.up_proj.weight"] = (inter, h)
            out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
    return out


def _sparse(cfg: dict, layer: int) -> bool:
    """Whether decoder ``layer`` has experts (Qwen3-MoE: ``num_experts`` > 0, not in
    ``mlp_only_layers``, every ``decoder_sparse_step``-th layer)."""
    if cfg.get("model_type") != "qwen3_moe" or not cfg.get("num_experts"):
        return False
    return layer not in cfg.get("mlp_only_layers", []) and (layer + 1) % cfg.get("decoder_sparse_step", 1) == 0


def stacked_experts(weights: dict[str, torch.Tensor], cfg: dict) -> dict[str, torch.Tensor]:
    """Return ``weights`` with each sparse layer's per-expert tensors stacked as fused checkpoints
    (transformers v5) name them: ``mlp.experts.gate_up_proj`` ``(num_experts, 2 * moe_intermediate,
    hidden)`` (each expert's gate rows then its up rows) and ``mlp.experts.down_proj``
    ``(num_experts, hidden, moe_intermediate)``, in place of the first expert's names; other names
    and the order of the rest are kept. Same dtype and device; the stacks are new tensors."""
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            out[name] = t
            continue
        if not tail.startswith("0.gate_proj."):
            continue
        n = cfg["num_experts"]
        e = [f"{head}.mlp.experts.{i}." for i in range(n)]
        out[f"{head}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[x + "gate_proj.weight"], weights[x + "up_proj.weight"]]) for x in e])
        out[f"{head}.mlp.experts.down_proj"] = torch.stack([weights[x + "down_proj.weight"] for x in e])
    return out


def random_state_dict(cfg: dict, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Return fresh random weights (normal, std 0.02; norms near 1) with HF names and shapes."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=torch.float32) * 0.02
        if name.endswith("norm.weight"):
            t += 1.0
        out[name] = t.to(dtype=dtype, device=device)
    return out


QWEN3_0_6B_LIKE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "vocab_size": 151936,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""The 310-tensor, 1.11 GiB Qwen3-0.6B-like layout of the benchmarks (dummy weights only)."""

QWEN3_0_6B_SHAPED_SMALL = {
    **QWEN3_0_6B_LIKE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 256,
}
"""The same 310 tensors (names, kinds, fused blocks) as :data:`QWEN3_0_6B_LIKE` with 2 MiB of weights:
per-tensor host cost on a CPU, where digesting 1.11 GiB would hide it (benchmarks only)."""

QWEN3_1_7B_LIKE = {**QWEN3_0_6B_LIKE, "hidden_size": 2048, "intermediate_size": 6144}
"""Qwen3-1.7B's layout (hidden 2048, intermediate 6144, 28 layers, 16 q / 8 kv heads of 128, vocab 151936,
tied embeddings): 310 tensors, 3.44 GB bf16 (benchmarks; dummy weights only)."""

QWEN3_4B_LIKE = {**QWEN3_0_6B_LIKE, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32}
"""Qwen3-4B's layout (hidden 2560, intermediate 9728, 36 layers, 32 q / 8 kv heads of 128, vocab 151936,
tied embeddings): 398 tensors, 8.04 GB bf16 (benchmarks; dummy weights only)."""

QWEN3_8B_LIKE = {**QWEN3_0_6B_LIKE, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False}
"""Qwen3-8B's layout (hidden 4096, intermediate 12288, 36 layers, 32 q / 8 kv heads of 128, vocab 151936,
an untied ``lm_head``): 399 tensors, 16.38 GB bf16 (benchmarks; dummy weights only)."""

BENCH_LAYOUTS = {"qwen3-shaped-small": QWEN3_0_6B_SHAPED_SMALL, "qwen3-0.6b-like": QWEN3_0_6B_LIKE,
                 "qwen3-1.7b-like": QWEN3_1_7B_LIKE, "qwen3-4b-like": QWEN3_4B_LIKE, "qwen3-8b-like": QWEN3_8B_LIKE}
"""The benchmarks' layouts by ``--model`` name, smallest first (``tiny`` is the packaged tiny Llama)."""


def state_bytes(cfg: dict, element_size: int = 2) -> int:
    """Bytes of the state dict :func:`param_shapes` lays out, at ``element_size`` bytes per element (bf16: 2)."""
    total = 0
    for shape in param_shapes(cfg).values():
        n = 1
        for s in shape:
            n *= s
        total += n * element_size
    return total


def device_state_dict(cfg: dict, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                      device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Fresh random weights as :func:`random_state_dict` lays them out (normal, std 0.02; norms near 1),
    drawn on ``device`` in ``dtype`` by a generator of that device: seconds for GB-sized sets where the
    CPU draw takes minutes. The same ``seed``, device type, dtype and torch give the same values; they
    differ from :func:`random_state_dict`'s."""
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for name, shape in param_shapes(cfg).items():
        t = torch.randn(shape, generator=g, dtype=dtype, device=device).mul_(0.02)
        if name.endswith("norm.weight"):
            t.add_(1.0)
        out[name] = t
    return out
