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


class ShardedToyModel(torch.nn.Module):
    """:class:`ToyModel`'s layout on tensor-parallel rank ``rank`` of ``tp``, loaded as vLLM's parallel
    layers load (each loader narrows the full delivered tensor to this rank's shard, then copies):
    ``qkv_proj`` column-parallel (this rank's rows of q, k and v, fused), ``o_proj`` row-parallel (its
    columns), ``embed`` vocab-parallel (its rows of the vocabulary padded to 16, the rows past the
    vocabulary filled with 0) and a replicated ``norm``."""

    def __init__(self, rank: int, tp: int = 2) -> None:
        super().__init__()
        self.rank, self.tp = rank, tp
        q, kv = Q // tp, KV // tp
        self.sizes = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}
        self.qkv_proj = torch.nn.Parameter(torch.zeros(q + 2 * kv, HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.qkv_proj.weight_loader = self._qkv_loader
        self.o_proj = torch.nn.Parameter(torch.zeros(HIDDEN, Q // tp, dtype=torch.bfloat16), requires_grad=False)
        self.o_proj.weight_loader = self._row_loader
        self.rows = (VOCAB + 7) // 8 * 8 // tp
        self.embed = torch.nn.Parameter(torch.zeros(self.rows, HIDDEN, dtype=torch.bfloat16), requires_grad=False)
        self.embed.weight_loader = self._vocab_loader
        self.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)

    def _qkv_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor, shard_id: str) -> None:
        off, size = self.sizes[shard_id]
        param.data.narrow(0, off, size).copy_(loaded_weight.narrow(0, self.rank * size, size))

    def _row_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        size = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.rank * size, size))

    def _vocab_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        lo = self.rank * self.rows
        n = max(0, min(self.rows, loaded_weight.shape[0] - lo))
        param.data[:n].copy_(loaded_weight.narrow(0, lo, n))
        param.data[n:].fill_(0)

    def shard(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full tensor ``t`` of HF name ``name`` (what a direct write sends it)."""
        part = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(name)
        if part is not None:
            size = self.sizes[part][1]
            return t.narrow(0, self.rank * size, size)
        if name == "o_proj":
            size = Q // self.tp
            return t.narrow(1, self.rank * size, size)
        if name == "embed":
            lo = self.rank * self.rows
            return t[lo:lo + self.rows]
        return t

    def engine_slice(self, name: str) -> torch.Tensor:
        """The engine memory that holds this rank's shard of ``name`` (a view of its parameter)."""
        part = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(name)
        if part is not None:
            off, size = self.sizes[part]
            return self.qkv_proj.data[off:off + size]
        if name == "embed":
            return self.embed.data[: max(0, min(self.rows, VOCAB - self.rank * self.rows))]
        return getattr(self, name).data

    def load_weights(self, weights) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, w in weights:
            shard = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(name)
            p = params["qkv_proj" if shard else name]
            if shard is not None:
                p.weight_loader(p, w, shard)
            else:
                getattr(p, "weight_loader", default_weight_loader)(p, w)
            loaded.add("qkv_proj" if shard else name)
        return loaded


def sharded_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Trainer-side weights of :class:`ShardedToyModel` (``toy_weights`` and ``o_proj``)."""
    g = torch.Generator().manual_seed(seed + 1000)
    return {**toy_weights(seed), "o_proj": torch.randn(HIDDEN, Q, generator=g).to(torch.bfloat16)}


def toy_weights(seed: int = 0, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Trainer-side weights of :class:`ToyModel` with HF-style names."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (Q, HIDDEN), "k_proj": (KV, HIDDEN), "v_proj": (KV, HIDDEN), "embed": (VOCAB, HIDDEN), "norm": (HIDDEN,)}
    return {n: torch.randn(s, generator=g).to(dtype=dtype, device=device) for n, s in shapes.items()}


def toy_worker(model: torch.nn.Module | None = None, loader=default_weight_loader, rank: int = 0):
    """A worker-like object holding a :class:`~refit_verify.boundary.worker.WorkerBoundary` around
    ``model`` (default a fresh :class:`ToyModel`) as worker ``rank`` (its tensor-parallel rank too), with read-back, engine-state snapshots and audits
    as the plugin wires them in a vLLM worker: the plugin's worker methods run on it.

    Returns:
        ``(worker, boundary, model)``.
    """
    import types

    from refit_verify.boundary.worker import WorkerBoundary, identity_of
    from refit_verify.engine.state import audit, read_back, snapshot
    from refit_verify.vllm_plugin import worker_sessions

    wb = WorkerBoundary(identity_of(rank, tp=rank))
    wb.readback, wb.snapshotter, wb.auditor = read_back, snapshot, audit
    model = ToyModel() if model is None else model
    wb.attach("model", model, loader)
    wb.modules["model"].tap.callable_ahead = lambda f: True  # the toy's loaders stand in for vLLM's own
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


def untimed(man) -> dict:
    """A manifest's modules and engine state as plain data, without their seconds (``*_s``)."""
    from refit_verify.manifest import to_wire

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if not k.endswith("_s")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return strip({"modules": to_wire(man)["modules"], "engine": to_wire(man)["engine"]})
