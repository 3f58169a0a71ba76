"""Worker side of the digest warm-up: the digest kernels of a worker's device are compiled and run
once in a background thread from the moment the device is set, so the first refit compiles nothing.

* ``Worker.init_device`` / ``CPUWorker.init_device`` are wrapped (:func:`wrap_init_device`): when
  they return, :func:`refit_verify.digest.backends.start_warmup` starts on ``worker.device``, and
  imports, in the same thread, the modules a refit imports in the worker (:data:`REFIT_MODULES`).
  A digest that comes while it runs waits for it (bounded, ``backends.WARMUP_WAIT_S``).
* ``Worker.compile_or_warm_up_model`` is wrapped (:func:`wrap_compile_or_warm_up_model`): vLLM
  captures its CUDA graphs there, and a launch or allocation of the warm-up thread during a capture
  would break it, so it first waits for the warm-up (same bound).

Nothing starts with ``REFIT_VERIFY=off`` or ``REFIT_VERIFY_WARMUP=0``.
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

from refit_verify.config import mode_from_env
from refit_verify.digest import backends
from refit_verify.vllm_plugin import runner

logger = logging.getLogger("refit_verify")

REFIT_MODULES = ("refit_verify.transport.receiver", "refit_verify.collective.broadcast")
"""What the worker's refit methods import on their first call (our transport's receiver, our broadcast
path): tens of milliseconds on a CPU host, imported by the warm-up instead."""


def _import_refit_modules() -> None:
    for name in REFIT_MODULES:
        importlib.import_module(name)


def start(worker: Any) -> backends.Warmup | None:
    """Start the digest warm-up on ``worker.device`` when this process verifies; never raises.

    Returns:
        the device's :class:`~refit_verify.digest.backends.Warmup`, or None (not verifying, warm-up
        off, or the worker has no device yet).
    """
    try:
        device = runner.device(worker)
        if device is None or not mode_from_env().verifies:
            return None
        return backends.start_warmup(device, then=_import_refit_modules)
    except Exception:  # noqa: BLE001 - the worker starts regardless; its first refit compiles the digests
        logger.warning("refit-verify: the digest warm-up could not start", exc_info=True)
        return None


def wrap_init_device(raw):
    @functools.wraps(raw)
    def init_device(self, *args, **kwargs):
        out = raw(self, *args, **kwargs)
        start(self)
        return out

    return init_device


def wrap_compile_or_warm_up_model(raw):
    @functools.wraps(raw)
    def compile_or_warm_up_model(self, *args, **kwargs):
        device = runner.device(self)
        if device is not None:
            backends.wait_for_warmup(getattr(device, "type", str(device)))
        return raw(self, *args, **kwargs)

    return compile_or_warm_up_model
