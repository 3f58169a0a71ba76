"""HF parameter layouts of small decoder models, for the demo, tests and benchmarks.

Builds trainer-side state dicts whose names and shapes match what vLLM's ``load_weights`` expects
for Llama- and Qwen3-style configs (``config.json`` fields).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import torch

TINY_LLAMA = "tiny-llama"


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
            tie_word_embeddings, model_type (``qwen3`` adds per-head q/k norms).
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
        if cfg.get("model_type") == "qwen3":
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
    out["model.norm.weight"] = (h,)
    if not cfg.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (v, h)
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
