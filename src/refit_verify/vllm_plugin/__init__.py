"""vLLM plugin: the only part of refit-verify that imports vllm.

Installed through the ``vllm.general_plugins`` entry point, so vLLM calls :func:`register` in every
process it starts (front end, engine core, each worker, and the trainer's own process when it builds
an in-process ``LLM``). ``register`` validates ``REFIT_VERIFY`` (a typo aborts start-up in that
process) and applies the patches listed, with why and when to remove each, in
:data:`refit_verify.vllm_plugin.patches.PATCHES`. It is idempotent and touches no CUDA.

Layout, by side:

* worker: :mod:`.worker_sessions` (the model boundary of each worker and the session methods),
  :mod:`.worker_methods` (receivers of our transport and broadcast path), :mod:`.worker_copies` (the
  layerwise reload's copies and their pools), :mod:`.native_worker` (vLLM's
  native weight-transfer updates as sessions), :mod:`.worker_adapters` (LoRA adapters in vLLM's slots),
  :mod:`.worker_warmup` (the digest kernels compiled
  in the background once the worker's device is set);
* trainer: :mod:`.native_trainer` and :mod:`.native_sender` (native API senders), :mod:`.broadcast_trainer` (:func:`broadcast_group`);
* versions: :mod:`.shims` (detection, patch machinery, per-version accessors), :mod:`.patches`;
  :mod:`.rpc_names` (the worker methods' names both sides use).
"""

from __future__ import annotations

SUPPORTED = ((0, 24), (0, 34))
"""[low, high) vLLM releases the model boundary supports (the native API hooks need 0.26)."""

from refit_verify._lazy import face  # noqa: E402

_EXPORTS = {"DEFAULT_GROUP_TIMEOUT_S": "refit_verify.vllm_plugin.broadcast_trainer",
            "broadcast_group": "refit_verify.vllm_plugin.broadcast_trainer"}
__all__ = ["DEFAULT_GROUP_TIMEOUT_S", "SUPPORTED", "broadcast_group", "register"]
__getattr__, __dir__ = face(__name__, _EXPORTS)


def register() -> None:
    """Validate ``REFIT_VERIFY`` and apply refit-verify's patches to this process's vLLM; idempotent.

    Raises:
        RefitConfigError: ``REFIT_VERIFY`` holds a value other than ``off``, ``log``, ``enforce``, or
            ``REFIT_VERIFY_REPLAY`` one other than ``0``, ``1``, or ``REFIT_VERIFY_CUDA_GRAPHS`` one that
            is neither on, ``force`` nor off, or ``REFIT_VERIFY_DIRECT_LAUNCH`` or ``REFIT_VERIFY_WARMUP``
            one neither on nor off (checked here, as the engine starts, so a bad value never reaches a
            session open inside vLLM's own weight update).
        RuntimeError: verification is requested and this vLLM has no v1 ``WorkerBase`` (older than
            the supported range).
    """
    from refit_verify.boundary.plan import replay_from_env
    from refit_verify.config import check_cuda_graphs_env, check_direct_launch_env, check_warmup_env, mode_from_env
    from refit_verify.digest import warm_start
    from refit_verify.vllm_plugin import patches, shims

    warm_start.engine_process = True  # the workers warm themselves (worker_warmup), not as a trainer
    mode = mode_from_env()
    replay_from_env()
    check_cuda_graphs_env()
    check_direct_launch_env()
    check_warmup_env()
    try:
        import vllm.v1.worker.worker_base  # noqa: F401
    except ImportError as e:  # pragma: no cover - depends on the installed vLLM
        if mode.verifies:
            raise RuntimeError(f"refit-verify: REFIT_VERIFY={mode.value} but vLLM {shims.vllm_version()} has no v1 WorkerBase "
                               f"({e}); supported: vLLM {SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}.{SUPPORTED[1][1] - 1}") from e
        return
    patches.apply(mode)
