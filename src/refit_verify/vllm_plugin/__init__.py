"""vLLM plugin: the only part of refit-verify that imports vllm.

Installed through the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register` in
every process it starts (front end, engine core, each worker). ``register`` validates
``REFIT_VERIFY`` (a typo aborts start-up in that process) and adds the ``refit_verify_*`` worker
methods to vLLM's ``WorkerBase``, so ``llm.collective_rpc("refit_verify_receive", ...)`` works
without ``worker_extension_cls``. With ``log`` or ``enforce`` it also wraps vLLM's native
weight-transfer path (:mod:`refit_verify.vllm_plugin.native`). It is idempotent and touches no CUDA.
"""

from __future__ import annotations

_REGISTERED = False
SUPPORTED = ((0, 26), (0, 34))  # [low, high) vLLM release range


def register() -> None:
    """Validate ``REFIT_VERIFY`` and make the ``refit_verify_*`` methods available on vLLM workers.

    Raises:
        RefitConfigError: ``REFIT_VERIFY`` holds a value other than ``off``, ``log``, ``enforce``.
        RuntimeError: verification is requested and the installed vLLM has no ``WorkerBase`` to
            extend or no hookable native weight-transfer path (outside the supported range).
    """
    global _REGISTERED
    from refit_verify.config import mode_from_env

    mode = mode_from_env()
    if _REGISTERED:
        _native_install(mode)
        return
    try:
        from vllm.v1.worker.worker_base import WorkerBase
    except ImportError as e:  # pragma: no cover - depends on the installed vLLM
        if mode.verifies:
            raise RuntimeError(f"refit-verify: REFIT_VERIFY={mode.value} but this vLLM has no v1 WorkerBase ({e})") from e
        return
    from refit_verify.vllm_plugin import native, worker

    for mod in (worker, native):
        for name in mod.METHODS:
            if not hasattr(WorkerBase, name):
                setattr(WorkerBase, name, getattr(mod, name))
    _REGISTERED = True
    _native_install(mode)


def _native_install(mode) -> None:
    """Wrap vLLM's native weight-transfer path when ``mode`` verifies (patches nothing when off)."""
    if mode.verifies:
        from refit_verify.vllm_plugin import native

        native.install(mode)
