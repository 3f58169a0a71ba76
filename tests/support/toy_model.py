"""A small torch model whose ``load_weights`` and weight loaders behave like vLLM's (no vLLM needed).

``ToyModel`` has the three loader shapes refit-verify must learn from: a fused ``qkv_proj`` written
block by block (``weight_loader(param, w, shard_id)`` narrowing rows, as ``QKVParallelLinear``), a
vocab embedding padded to a multiple of 8 rows (copy, then ``fill_(0)`` of the padding, as
``VocabParallelEmbedding``), and a plain norm (``default_weight_loader``). Unknown ``*.bias`` names
are skipped, as vLLM's Llama does. ``ToyModel.load_weights`` returns the loaded parameter names.

Fault switches (engine-side loader bugs the transport digest cannot see):
``swap_halves_after``: from the n-th load of ``qkv_proj`` on, the loader writes ``k`` into ``v``'s
rows and ``v`` into ``k``'s (a loader that misplaces blocks on a later load).
"""

from __future__ import annotations

import torch

HIDDEN, Q, KV, VOCAB = 8, 8, 4, 13


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    param.data.copy_(loaded_weight)


class ToyModel(torch.nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.qkv_proj = torch.nn.Parameter(torch.zeros(Q + 2 * KV, HIDDEN, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.qkv_proj.weight_loader = self._qkv_loader
        padded = (VOCAB + 7) // 8 * 8
        self.embed = torch.nn.Parameter(torch.zeros(padded, HIDDEN, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.embed.weight_loader = self._embed_loader
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.swap_halves_after: int | None = None
        self.qkv_loads = 0

    def _qkv_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str) -> None:
        self.qkv_loads += 1
        offsets = {"q": (0, Q), "k": (Q, KV), "v": (Q + KV, KV)}
        if self.swap_halves_after is not None and self.qkv_loads > self.swap_halves_after and shard_id in "kv":
            shard_id = "v" if shard_id == "k" else "k"
        off, size = offsets[shard_id]
        param.data.narrow(0, off, size).copy_(loaded_weight)

    def _embed_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(0)

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            shard = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(name)
            if shard is not None:
                p = params["qkv_proj"]
                p.weight_loader(p, w, shard)
                loaded.add("qkv_proj")
                continue
            if name.endswith(".bias") and name not in params:
                continue
            p = params[name]
            getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add(name)
        return loaded


def toy_weights(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Trainer-side weights of :class:`ToyModel` with HF-style names."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (Q, HIDDEN), "k_proj": (KV, HIDDEN), "v_proj": (KV, HIDDEN), "embed": (VOCAB, HIDDEN), "norm": (HIDDEN,)}
    return {n: torch.randn(s, generator=g).to(dtype=dtype, device=device) for n, s in shapes.items()}


def toy_worker(model: torch.nn.Module | None = None, loader=default_weight_loader):
    """A worker-like object holding a :class:`~refit_verify.boundary.worker.WorkerBoundary` around
    ``model`` (default a fresh :class:`ToyModel`), with read-back, engine-state snapshots and audits
    as the plugin wires them in a vLLM worker: the plugin's worker methods run on it.

    Returns:
        ``(worker, boundary, model)``.
    """
    import types

    from refit_verify.boundary.worker import WorkerBoundary, identity_of
    from refit_verify.engine.state import audit, read_back, snapshot
    from refit_verify.vllm_plugin import worker_sessions

    wb = WorkerBoundary(identity_of(0))
    wb.readback, wb.snapshotter, wb.auditor = read_back, snapshot, audit
    model = ToyModel() if model is None else model
    wb.attach("model", model, loader)
    worker = types.SimpleNamespace()
    setattr(worker, worker_sessions._ATTR, wb)
    return worker, wb, model


class ToyEngine:
    """An engine whose ``collective_rpc`` runs the plugin's session methods
    (:mod:`refit_verify.vllm_plugin.worker_sessions`) on each of ``workers`` (from :func:`toy_worker`),
    as vLLM runs them on its workers; ``answer`` (if given) replaces the answers of the methods it names.
    """

    def __init__(self, *workers, answer=None) -> None:
        self.workers, self.answer, self.calls = list(workers), dict(answer or {}), []

    def collective_rpc(self, method, args=(), timeout=None):
        from refit_verify.vllm_plugin import worker_sessions

        self.calls.append(method)
        if method in self.answer:
            got = self.answer[method]
            if isinstance(got, BaseException):
                raise got
            return got(*args) if callable(got) else got
        return [getattr(worker_sessions, method)(w, *args) for w in self.workers]
