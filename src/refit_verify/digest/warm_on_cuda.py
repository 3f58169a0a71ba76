"""The trainer's digest warm-up, started when its process initialises CUDA.

A trainer's first verified refit would otherwise start the warm-up itself (``refit``, ``push``) and
wait for it: Triton loading and launching each digest kernel for the first time in the process, tens
of milliseconds, inside the refit. :func:`install` (run by ``import refit_verify``) asks torch to
call :func:`_cuda_started` as CUDA initialises (``torch.cuda._lazy_call``; at once when it already
is), which starts :func:`~refit_verify.digest.backends.start_warmup` in a thread of its own: it runs
while the trainer trains, long before the first refit. Nothing happens when torch is not imported
yet (the refit starts the warm-up, as before), in a vLLM process (the plugin warms its workers), or
with ``REFIT_VERIFY=off`` or ``REFIT_VERIFY_WARMUP=0``. Never raises: a failure is logged.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

__all__ = ["install"]

logger = logging.getLogger("refit_verify")

SETTLE_S = 0.05
"""Seconds the starter waits after CUDA's initialisation before reading the current device:
``torch.cuda.set_device(d)`` initialises CUDA first, then selects ``d``."""

_installed = False
engine_process = False
"""Set by the vLLM plugin's ``register()``: this process is vLLM's (its workers warm themselves)."""


def install() -> bool:
    """Have the digest warm-up start when this process initialises CUDA; once per process.

    Returns:
        bool: True iff the call was queued with torch (torch imported, with ``torch.cuda._lazy_call``).
    """
    global _installed
    torch = sys.modules.get("torch")
    lazy = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    if _installed or lazy is None:
        return False
    try:
        lazy(_cuda_started)
    except Exception:  # noqa: BLE001 - never in the way of import: the first refit warms up instead
        logger.debug("refit-verify: could not queue the digest warm-up with torch.cuda", exc_info=True)
        return False
    _installed = True
    return True


def _cuda_started() -> None:
    """Called inside torch's CUDA initialisation (its lock held): only starts a thread, never raises."""
    try:
        threading.Thread(target=_start, name="refit-verify-warmup-start", daemon=True).start()
    except Exception:  # noqa: BLE001 - an exception here would fail the trainer's CUDA initialisation
        pass


def _start() -> None:
    time.sleep(SETTLE_S)
    if engine_process or os.environ.get("REFIT_VERIFY", "").strip().lower() == "off":
        return
    try:
        import torch

        from refit_verify.digest import backends

        backends.start_warmup(torch.device("cuda", torch.cuda.current_device()))
    except Exception:  # noqa: BLE001 - logged; the first refit starts the warm-up itself
        logger.warning("refit-verify: the trainer's digest warm-up could not start", exc_info=True)
