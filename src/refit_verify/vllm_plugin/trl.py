"""TRL colocate mode: every ``VLLMGeneration.sync_weights`` becomes a verified refit session.

TRL (``vllm_mode="colocate"``) runs vLLM in the trainer's process (``external_launcher``) and pushes
each parameter with ``model_runner.model.load_weights([(name, param)])``. With ``REFIT_VERIFY`` set
to ``log`` or ``enforce``, the plugin wraps ``VLLMGeneration.sync_weights`` (patch
``trl-sync-weights``): each sync runs inside :func:`refit_verify.refit` on ``self.llm``, every
``(name, param)`` TRL's ``_iter_named_params`` yields is digested as the trainer's side before TRL
pushes it, and the model boundary digests what ``load_weights`` receives. At the end of the sync
the manifests are compared (a plain model's parameters are digested at the end of the sync, with no
copy: TRL leaves them untouched until then; under PEFT, FSDP or ZeRO-3 each is copied as it is
pushed, see :func:`_holds`): ``enforce`` raises :class:`~refit_verify.errors.RefitVerificationError`
out of ``sync_weights`` (and so out of the training step); ``log`` warns.

The weight version is the trainer's ``state.global_step``: the trainer is the caller of
``sync_weights`` whose ``vllm_generation`` is this one (or the one given to :func:`attach`); with no
such trainer, a per-engine sync count.

After each sync, ``VLLMGeneration.refit_verify_reports`` holds that sync's reports (one
:class:`~refit_verify.report.VerificationReport` per worker) and ``refit_verify_history`` the last
:data:`MAX_HISTORY` syncs as ``(version, reports)``, oldest first; a failed verification is recorded
before it is raised. TRL's server mode (``vllm_mode="server"``) pushes through vLLM's native NCCL
API from TRL's own client: it is not hooked here.

Nothing here imports TRL or vLLM at import time.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any

from refit_verify.config import mode_from_env

logger = logging.getLogger("refit_verify")

__all__ = ["MAX_HISTORY", "attach", "patch_module"]

_STEP_ATTR = "_refit_verify_step"
MAX_HISTORY = 64
"""Syncs kept in ``VLLMGeneration.refit_verify_history`` (the oldest are dropped)."""


def attach(trainer: Any) -> None:
    """Use ``trainer.state.global_step`` as the weight version of ``trainer.vllm_generation``'s syncs.

    Args:
        trainer: a TRL trainer with ``vllm_generation`` (``GRPOTrainer``, ``RLOOTrainer``, ...).
    """
    gen = getattr(trainer, "vllm_generation", None)
    if gen is not None:
        setattr(gen, _STEP_ATTR, lambda: int(trainer.state.global_step))


def _find_trainer(gen: Any) -> None:
    """Attach the trainer among the callers of ``sync_weights`` whose ``vllm_generation`` is ``gen``."""
    f = sys._getframe(3)
    for _ in range(8):
        if f is None:
            return
        obj = f.f_locals.get("self")
        if obj is not None and getattr(obj, "vllm_generation", None) is gen and hasattr(obj, "state"):
            attach(obj)
            return
        f = f.f_back


def _version(gen: Any) -> int:
    if getattr(gen, _STEP_ATTR, None) is None:
        _find_trainer(gen)
    step = getattr(gen, _STEP_ATTR, None)
    if callable(step):
        try:
            return step()
        except Exception:  # noqa: BLE001 - a trainer without state yet
            pass
    n = getattr(gen, "_refit_verify_syncs", 0) + 1
    gen._refit_verify_syncs = n
    return n


def _holds(gen: Any) -> bool:
    """True iff TRL pushes the trainer's live parameters and leaves them untouched until the sync
    ends: no PEFT (merged before, unmerged after the walk), no FSDP (freed after each gather), no
    DeepSpeed ZeRO-3 (repartitioned after each gather). Then the trainer's digests are taken from
    the parameters themselves at the end of the sync, without a copy (``refit(copy=False)``);
    anything unknown copies."""
    dist = getattr(gen, "_dist", None)
    if dist is None or getattr(dist, "is_fsdp", True) or getattr(dist, "is_zero3", True):
        return False
    is_peft = getattr(sys.modules.get(type(gen).__module__), "is_peft_model", None)
    model = getattr(gen, "model", None)
    if not callable(is_peft) or model is None:
        return False
    try:
        return not is_peft(model)
    except Exception:  # noqa: BLE001 - unknown: copy
        return False


def _wrap_sync(raw):
    @functools.wraps(raw)
    def sync_weights(self, *args, **kwargs):
        mode = mode_from_env()
        if not mode.verifies or getattr(self, "mode", None) != "colocate" or getattr(self, "llm", None) is None:
            return raw(self, *args, **kwargs)
        from refit_verify.trainer.refit import refit

        version = _version(self)
        check = refit(self.llm, version=version, mode=mode, copy=not _holds(self))
        inner = self._iter_named_params
        self._iter_named_params = lambda: check.wrap(inner())
        try:
            with check:
                out = raw(self, *args, **kwargs)
        finally:
            vars(self).pop("_iter_named_params", None)
            self.refit_verify_reports = check.reports
            if check.reports:
                history = vars(self).setdefault("refit_verify_history", [])
                history.append((version, list(check.reports)))
                del history[:-MAX_HISTORY]
        return out

    return sync_weights


def patch_module(module: Any) -> None:
    """Wrap ``module.VLLMGeneration.sync_weights`` (``trl.generation.vllm_generation``); idempotent."""
    from refit_verify.vllm_plugin import shims

    cls = getattr(module, "VLLMGeneration", None)
    if cls is not None:
        shims.patch(cls, "sync_weights", _wrap_sync)
