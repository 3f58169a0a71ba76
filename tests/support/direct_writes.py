"""A worker extension that writes parameters directly, never calling ``load_weights``.

The shape of SkyRL's / NeMo-RL's / prime-rl's direct weight updates (and of NCCL or NIXL writes into
parameter storage): the worker maps each HF name to its engine parameter and slice itself (q / k / v
into the fused ``qkv_proj``, gate / up into ``gate_up_proj``) and copies with ``param.data[rows].copy_(t)``.
Loaded by vLLM in its worker process (``worker_extension_cls="tests.support.direct_writes.DirectWriteExtension"``);
driven by the trainer through ``collective_rpc``, the bytes travel through files in ``/dev/shm``
(:func:`tests.support.extensions.map_file`). Nothing here calls refit-verify.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.support.extensions import FrameworkSyncExtension, map_file, map_tensor

__all__ = ["DirectWriteExtension", "TPDirectWriteExtension"]


class DirectWriteExtension(FrameworkSyncExtension):
    """Mixed into vLLM's worker class: direct parameter writes (``dw_`` methods) besides the framework syncs."""

    def _dw_slice(self, name: str) -> torch.Tensor:
        """The engine's memory for HF tensor ``name`` (a view of its parameter: a slice of a fused one)."""
        hf = self.model_runner.model_config.hf_config
        params = dict(self.model_runner.model.named_parameters())
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # Qwen3 sets head_dim
        q, kv = hf.num_attention_heads * head, hf.num_key_value_heads * head
        for part, (lo, n) in {"q_proj": (0, q), "k_proj": (q, kv), "v_proj": (q + kv, kv)}.items():
            if name.endswith(f".self_attn.{part}.weight"):
                return params[name.replace(f"{part}.weight", "qkv_proj.weight")].data[lo:lo + n]
        for part, lo in {"gate_proj": 0, "up_proj": hf.intermediate_size}.items():
            if name.endswith(f".mlp.{part}.weight"):
                return params[name.replace(f"{part}.weight", "gate_up_proj.weight")].data[lo:lo + hf.intermediate_size]
        p = params[name].data
        return p[: hf.vocab_size] if name.endswith(("embed_tokens.weight", "lm_head.weight")) else p

    def dw_write(self, path: str, entries: list[list[Any]], skip: list[str] | None = None, flip: str | None = None) -> int:
        """Copy each tensor of the trainer's file into its engine slice (``param.data[rows].copy_``);
        leave out ``skip``; ``flip``: then flip one bit of the middle byte of that tensor's slice (a
        corrupted write). Returns the tensors written."""
        buf = map_file(path)
        n = 0
        for name, dtype, shape, off in entries:
            if name in (skip or ()):
                continue
            self._dw_slice(name).copy_(map_tensor(buf, dtype, shape, off))
            n += 1
        if flip is not None:
            raw = self._dw_slice(flip).view(torch.uint8).view(-1)
            raw[raw.numel() // 2] ^= 1
        return n

    def dw_sparse(self, patches: list[list[Any]]) -> int:
        """A sparse delta: ``[[name, flat element indices, values], ...]`` written in place into each
        tensor's engine slice (values as Python floats, exact for bf16). Returns the elements written."""
        n = 0
        for name, idx, values in patches:
            flat = self._dw_slice(name).view(-1)
            flat[torch.tensor(idx, dtype=torch.long)] = torch.tensor(values, dtype=flat.dtype)
            n += len(idx)
        return n


class TPDirectWriteExtension(DirectWriteExtension):
    """:class:`DirectWriteExtension` on a tensor-parallel worker: each rank writes its own shard of every
    HF tensor, as vLLM's parallel layers hold them (rows of q / k / v in ``qkv_proj`` and of gate / up in
    ``gate_up_proj``, a replicated kv head whole; columns of the row-parallel ``o_proj`` / ``down_proj``;
    its rows of the vocab-parallel embeddings; norms whole)."""

    def _dwtp_shard(self, name: str, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(engine memory holding this rank's shard of name, that shard of the full tensor t)``."""
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        r, tp = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        hf = self.model_runner.model_config.hf_config
        params = dict(self.model_runner.model.named_parameters())
        head = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        q = hf.num_attention_heads * head // tp
        kv_heads = max(1, hf.num_key_value_heads // tp)
        kv, kv_rank = kv_heads * head, r // max(1, tp // hf.num_key_value_heads)
        for part, (lo, n, at) in {"q_proj": (0, q, r), "k_proj": (q, kv, kv_rank), "v_proj": (q + kv, kv, kv_rank)}.items():
            if name.endswith(f".self_attn.{part}.weight"):
                return params[name.replace(f"{part}.weight", "qkv_proj.weight")].data[lo:lo + n], t.narrow(0, at * n, n)
        inter = hf.intermediate_size // tp
        for part, lo in {"gate_proj": 0, "up_proj": inter}.items():
            if name.endswith(f".mlp.{part}.weight"):
                return params[name.replace(f"{part}.weight", "gate_up_proj.weight")].data[lo:lo + inter], t.narrow(0, r * inter, inter)
        p = params[name].data
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            return p, t.narrow(1, r * p.shape[1], p.shape[1])
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            lo = r * p.shape[0]
            n = max(0, min(p.shape[0], hf.vocab_size - lo))
            return p[:n], t.narrow(0, lo, n)
        return p, t

    def dwtp_write(self, path: str, entries: list[list[Any]], skip: list[str] | None = None, flip: str | None = None,
                   flip_rank: int | None = None) -> int:
        """Copy this rank's shard of each tensor of the trainer's file into its engine memory; leave out
        ``skip``; ``flip``: then flip one bit of the middle byte of that tensor's shard here, on rank
        ``flip_rank`` only. Returns the tensors written."""
        from vllm.distributed import get_tensor_model_parallel_rank

        buf = map_file(path)
        n = 0
        for name, dtype, shape, off in entries:
            if name in (skip or ()):
                continue
            dest, src = self._dwtp_shard(name, map_tensor(buf, dtype, shape, off))
            dest.copy_(src)
            n += 1
        if flip is not None and flip_rank == get_tensor_model_parallel_rank():
            dest, _src = self._dwtp_shard(flip, _full_like(entries, buf, flip))
            raw = dest.view(torch.uint8).view(-1)
            raw[raw.numel() // 2] ^= 1
        return n

    def dwtp_param_bytes(self) -> int:
        """Bytes of this worker's model parameters (what every byte proven must add up to)."""
        return sum(p.numel() * p.element_size() for p in self.model_runner.model.parameters())


def _full_like(entries: list[list[Any]], buf: torch.Tensor, name: str) -> torch.Tensor:
    """The trainer's tensor ``name`` in the file (a view)."""
    (entry,) = [e for e in entries if e[0] == name]
    return map_tensor(buf, entry[1], entry[2], entry[3])
