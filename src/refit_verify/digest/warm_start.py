"""The trainer's digest warm-up, started ahead of its first refit.

A trainer's first verified refit would otherwise start the warm-up itself (``refit``, ``push``) and
wait for it: numba loading (or compiling) the CPU digests, Triton loading and launching each CUDA
kernel for the first time in the process; hundreds of milliseconds on a CPU host, tens on CUDA.
:func:`install` (run by ``import refit_verify`` and by ``refit_verify.trainer``) arranges two starts
of :func:`~refit_verify.digest.backends.start_warmup`, each in a thread of its own, while the trainer
builds its model and starts its engine:

* the CPU's, :data:`CPU_SETTLE_S` after the import (every trainer digests host tensors on the CPU);
* the current CUDA device's, as the process initialises CUDA (``torch.cuda._lazy_call``; at once
  when it already is).

Nothing starts when torch is not imported yet (the next ``install``, or the first refit, starts it),
in a vLLM process (the plugin's ``register()`` sets :data:`engine_process`; its workers warm
themselves), with :data:`at_import` false, or with ``REFIT_VERIFY=off`` or ``REFIT_VERIFY_WARMUP=0``
in the trainer's environment. Never raises: a failure is logged.
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
"""Seconds the CUDA starter waits after CUDA's initialisation before reading the current device:
``torch.cuda.set_device(d)`` initialises CUDA first, then selects ``d``."""

CPU_SETTLE_S = 1.0
"""Seconds between ``import refit_verify`` and the start of the CPU's warm-up. A vLLM process imports
the package through its plugin entry point and calls the plugin's ``register()`` (which sets
:data:`engine_process`) right after loading its plugins, well within this; a first refit sooner than
this starts the warm-up itself and waits for it, as without the start at import."""

_installed = False
_cpu_starter: threading.Thread | None = None  # the thread that starts the CPU's warm-up (it ends after CPU_SETTLE_S)
engine_process = False
"""Set by the vLLM plugin's ``register()``: this process is vLLM's (its workers warm themselves)."""

at_import = True
"""False: nothing starts from :func:`install` (the test session sets it: its processes warm the CPU
digests in its own order, ``tests/conftest.py``)."""


def install() -> bool:
    """Arrange the trainer's digest warm-up (module docstring); once per process.

    Returns:
        bool: True iff a start was arranged by this call (torch imported; the CPU's starter thread
        started, or the CUDA start queued with torch).
    """
    global _installed, _cpu_starter
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    arranged = False
    if _cpu_starter is None:
        try:
            th = threading.Thread(target=_start, args=(CPU_SETTLE_S, False), name="refit-verify-warmup-start", daemon=True)
            th.start()
            _cpu_starter, arranged = th, True
        except Exception:  # noqa: BLE001 - never in the way of import: the first refit warms up instead
            logger.debug("refit-verify: could not start the CPU digest warm-up's starter", exc_info=True)
    lazy = getattr(getattr(torch, "cuda", None), "_lazy_call", None)
    if not _installed and lazy is not None:
        try:
            lazy(_cuda_started)
            _installed = arranged = True
        except Exception:  # noqa: BLE001 - never in the way of import: the first refit warms up instead
            logger.debug("refit-verify: could not queue the digest warm-up with torch.cuda", exc_info=True)
    return arranged


def _wanted() -> bool:
    """Whether a start arranged here goes ahead: not in a vLLM process, not switched off (:data:`at_import`),
    and ``REFIT_VERIFY`` not ``off`` (a trainer may pass its mode to ``refit`` instead of setting it)."""
    return at_import and not engine_process and os.environ.get("REFIT_VERIFY", "").strip().lower() != "off"


def _start(settle_s: float, cuda: bool) -> None:
    """After ``settle_s`` seconds, start the warm-up of the CPU or of the current CUDA device, if wanted."""
    time.sleep(settle_s)
    if not _wanted():
        return
    try:
        import torch

        from refit_verify.digest import backends

        backends.start_warmup(torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    except Exception:  # noqa: BLE001 - logged; the first refit starts the warm-up itself
        logger.warning("refit-verify: the trainer's %s digest warm-up could not start", "CUDA" if cuda else "CPU", exc_info=True)


def _cuda_started() -> None:
    """Called inside torch's CUDA initialisation (its lock held): only starts a thread, never raises."""
    try:
        threading.Thread(target=_start, args=(SETTLE_S, True), name="refit-verify-warmup-start", daemon=True).start()
    except Exception:  # noqa: BLE001 - an exception here would fail the trainer's CUDA initialisation
        pass
