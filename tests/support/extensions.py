"""Worker extensions in the style of the RL frameworks that call ``model.load_weights`` themselves.

Loaded by vLLM in its worker process (``LLM(worker_extension_cls="tests.support.extensions.FrameworkSyncExtension")``;
the repository root must be on ``PYTHONPATH`` there). Each method emulates the *call shape* of one
framework's weight sync, driven by the trainer through ``collective_rpc``; the bytes travel through
files in ``/dev/shm`` (or a directory given by the trainer) that the worker maps, never through the
RPC itself. Nothing here calls refit-verify: the plugin's model boundary sees the loads.

* OpenRLHF (``WorkerWrap.update_weight``): one parameter per call,
  ``self.model_runner.model.load_weights(weights=[(name, weight)])`` (keyword form).
* verl (``vLLMColocateWorkerExtension.update_weights_from_ipc``): buckets received one after the
  other into one staging buffer, each handed to ``model.load_weights(bucket)`` (positional) as views of
  that buffer; optionally inside vLLM's layerwise reload (then a layer whose weights straddle two
  buckets is applied after its first bucket's bytes were overwritten: the vLLM #51258 class).
* SkyRL (``_LoadWeightsProxy`` / ``set_weight_update_target``): the update engine (made once, holding
  the model) has its model reference replaced by a proxy that overrides only ``load_weights`` and
  calls ``model.load_weights(weights=list)``. :meth:`FrameworkSyncExtension.fw_skyrl_stand_in` puts
  such a proxy in place of ``model_runner.model`` itself (what ``get_model()`` returns then).
* prime-rl (``update_weights_from_path``): a lazy iterator over a safetensors file inside
  ``initialize_layerwise_reload`` / ``load_weights(iter)`` / ``finalize_layerwise_reload``.
* A streaming receiver (:meth:`FrameworkSyncExtension.fw_stream_update_weights`): one
  ``load_weights(iterator)`` call whose iterator refills its receive buffer bucket after bucket.
* Drafter: the verl shape aimed at the speculative-decoding draft model (``module="drafter"``).

Method names carry the ``fw_`` prefix: ``worker_extension_cls`` must not clash with ``Worker`` methods.
Arguments and results are builtins (msgpack through ``collective_rpc``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["FrameworkSyncExtension", "LoadWeightsProxy", "TensorEntry", "map_file", "map_tensor"]

TensorEntry = tuple[str, str, list[int], int]
"""``(name, dtype name, shape, byte offset in its file)`` of one tensor the trainer wrote."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dt


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def write_file(path, pairs, align: int = 64) -> list[list]:
    """Write the tensors of ``pairs`` (``(name, tensor)``) into the file ``path``, each at a byte offset
    aligned to ``align``; return the entries ``[name, dtype, shape, byte offset]`` the worker maps them by
    (:func:`map_file`, :func:`map_tensor`)."""
    entries, chunks, off = [], [], 0
    for n, t in pairs:
        off = (off + align - 1) // align * align
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        entries.append([n, str(t.dtype).removeprefix("torch."), list(t.shape), off])
        chunks.append((off, raw))
        off += raw.numel()
    buf = torch.zeros(off, dtype=torch.uint8)
    for o, raw in chunks:
        buf[o:o + raw.numel()] = raw
    with open(path, "wb") as f:
        f.write(buf.numpy().tobytes())
    return entries


def map_file(path: str) -> torch.Tensor:
    """Map the whole file at ``path`` as a shared ``uint8`` tensor (writes by others are visible)."""
    import os

    return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)


def map_tensor(buf: torch.Tensor, dtype: str, shape: list[int], offset: int) -> torch.Tensor:
    """Return the tensor of ``dtype`` / ``shape`` at byte ``offset`` of the ``uint8`` buffer ``buf`` (a view)."""
    dt = _dtype(dtype)
    nbytes = _numel(shape) * torch.empty((), dtype=dt).element_size()
    if offset < 0 or offset + nbytes > buf.numel():
        raise ValueError(f"tensor of {nbytes} bytes at offset {offset} overruns a buffer of {buf.numel()} bytes")
    return buf[offset:offset + nbytes].view(dt).view([int(s) for s in shape])


class LoadWeightsProxy:
    """Stands in for a model, overriding only ``load_weights`` (SkyRL's ``_LoadWeightsProxy`` shape)."""

    def __init__(self, model: Any, load_weights: Any) -> None:
        self._model = model
        self.load_weights = load_weights

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class _UpdateEngine:
    """A weight-update engine holding the model it loads into (``set_weight_update_target`` swaps it)."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def set_weight_update_target(self, model: Any) -> None:
        self.model = model

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> Any:
        return self.model.load_weights(weights=weights)


class FrameworkSyncExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``): framework-style weight syncs.

    Every ``fw_*`` method runs in the worker; ``self`` is the vLLM worker (``model_runner``,
    ``get_model``, ``vllm_config`` come from it).
    """

    # -- helpers -------------------------------------------------------------------------------

    def _fw_target(self, module: str) -> Any:
        if module == "model":
            return self.model_runner.model
        if module == "drafter":
            drafter = getattr(self.model_runner, "drafter", None)
            model = getattr(drafter, "model", None)
            if model is None:
                raise RuntimeError("this engine has no draft model")
            return model
        raise ValueError(f"module must be 'model' or 'drafter', got {module!r}")

    def fw_sleep(self, seconds: float) -> float:
        """Keep this worker busy (a long generation or another RPC ahead of refit-verify's calls)."""
        import time

        time.sleep(float(seconds))
        return float(seconds)

    def fw_info(self) -> dict[str, Any]:
        """Return ``pid`` and the parameter names of the main model (``params``) and drafter (``drafter_params``, or None)."""
        import os

        out: dict[str, Any] = {"pid": os.getpid(), "params": [n for n, _ in self.model_runner.model.named_parameters()]}
        try:
            out["drafter_params"] = [n for n, _ in self._fw_target("drafter").named_parameters()]
        except RuntimeError:
            out["drafter_params"] = None
        return out

    def fw_param_sha256(self, module: str = "model") -> dict[str, str]:
        """Return ``{parameter name: SHA-256 hex of its bytes}`` of every parameter of ``module`` as the
        engine holds it (row-major bytes; independent of refit-verify's digest)."""
        import hashlib

        out = {}
        for n, p in self._fw_target(module).named_parameters():
            raw = p.detach().contiguous().reshape(-1).view(torch.uint8)
            out[n] = hashlib.sha256(raw.numpy().tobytes()).hexdigest()
        return out

    # -- OpenRLHF ------------------------------------------------------------------------------

    def fw_openrlhf_update_weight(self, name: str, dtype: str, shape: list[int], path: str, offset: int = 0) -> None:
        """Load one parameter from the trainer's file: ``model.load_weights(weights=[(name, weight)])``."""
        weight = map_tensor(map_file(path), dtype, shape, offset)
        self.model_runner.model.load_weights(weights=[(name, weight)])

    # -- verl ----------------------------------------------------------------------------------

    def fw_verl_update_weights(self, buckets: list[dict[str, Any]], layerwise: bool = False, module: str = "model") -> int:
        """Receive ``buckets`` one after the other into one staging buffer; ``load_weights(bucket)`` each.

        Args:
            buckets: ``[{"path": str, "entries": [TensorEntry, ...]}]``, in send order; offsets are
                within the bucket.
            layerwise: wrap the whole update in vLLM's layerwise reload (initialize / finalize).
            module: ``"model"`` or ``"drafter"``.

        Returns:
            int: buckets loaded.
        """
        model = self._fw_target(module)
        sizes = [map_file(b["path"]).numel() for b in buckets]
        staging = torch.empty(max(sizes, default=0), dtype=torch.uint8)  # reused for every bucket
        if layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
        for b, size in zip(buckets, sizes):
            staging[:size].copy_(map_file(b["path"]))  # the next bucket overwrites the previous one
            weights = [(n, map_tensor(staging, dt, shape, off)) for n, dt, shape, off in b["entries"]]
            model.load_weights(weights)
        if layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.model_runner.model_config)
        return len(buckets)

    def fw_stream_update_weights(self, buckets: list[dict[str, Any]], layerwise: bool = True, module: str = "model") -> int:
        """Like :meth:`fw_verl_update_weights`, but one ``load_weights(iterator)`` call for all buckets.

        The iterator refills the staging buffer with the next bucket when the loader pulls past the
        last tensor of the previous one (a streaming receiver yielding views of its receive buffer).

        Returns:
            int: buckets received.
        """
        model = self._fw_target(module)
        sizes = [map_file(b["path"]).numel() for b in buckets]
        staging = torch.empty(max(sizes, default=0), dtype=torch.uint8)
        received = 0

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal received
            for b, size in zip(buckets, sizes):
                staging[:size].copy_(map_file(b["path"]))
                received += 1
                for n, dt, shape, off in b["entries"]:
                    yield n, map_tensor(staging, dt, shape, off)

        if layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(model)
        model.load_weights(stream())
        if layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(model, self.model_runner.model_config)
        return received

    # -- SkyRL ---------------------------------------------------------------------------------

    def _fw_skyrl_engine(self) -> _UpdateEngine:
        """The update engine, made once with the model it loads into (as vLLM makes its weight-transfer
        engine at ``init_weight_transfer_engine``): it keeps that reference whatever stands in later."""
        engine = getattr(self, "_fw_update_engine", None)
        if engine is None:
            model = self.model_runner.model
            if isinstance(model, LoadWeightsProxy):
                model = model._model
            engine = self._fw_update_engine = _UpdateEngine(model)
        return engine

    def fw_skyrl_stand_in(self, on: bool) -> bool:
        """Install (``on``) or remove a :class:`LoadWeightsProxy` as ``model_runner.model`` itself.

        While it stands in, ``get_model()`` returns the proxy: what a session opened meanwhile sees.
        Returns whether a proxy stands in now.
        """
        self._fw_skyrl_engine()
        current = self.model_runner.model
        if on and not isinstance(current, LoadWeightsProxy):
            self.model_runner.model = LoadWeightsProxy(current, self._fw_skyrl_loader(current))
        elif not on and isinstance(current, LoadWeightsProxy):
            self.model_runner.model = current._model
        return isinstance(self.model_runner.model, LoadWeightsProxy)

    @staticmethod
    def _fw_skyrl_loader(model: Any):
        def load_weights(weights, **kwargs):
            ordinary = [(n, t) for n, t in weights if not n.startswith("skyrl.")]  # SkyRL splits such wire tensors off
            return model.load_weights(weights=ordinary, **kwargs) if ordinary else set()

        return load_weights

    def fw_skyrl_update_weights(self, path: str, entries: list[TensorEntry], chunk: int = 4) -> int:
        """Load ``entries`` in chunks of ``chunk``: ``engine.model.load_weights(weights=chunk)`` where the
        update engine's model reference was replaced by a :class:`LoadWeightsProxy` of the model
        (``set_weight_update_target``) for this update, and restored after it.

        Returns:
            int: chunks loaded.
        """
        engine = self._fw_skyrl_engine()
        model = engine.model
        engine.set_weight_update_target(LoadWeightsProxy(model, self._fw_skyrl_loader(model)))
        try:
            buf = map_file(path)
            pairs = [(n, map_tensor(buf, dt, shape, off)) for n, dt, shape, off in entries]
            for i in range(0, len(pairs), chunk):
                engine.load(pairs[i:i + chunk])
        finally:
            engine.set_weight_update_target(model)
        return (len(pairs) + chunk - 1) // chunk

    # -- prime-rl ------------------------------------------------------------------------------

    def fw_primerl_update_weights_from_path(self, weight_path: str, module: str = "model") -> None:
        """Reload from a safetensors file: layerwise reload around ``load_weights(lazy iterator)``."""
        from safetensors import safe_open
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model = self._fw_target(module)

        def weights_iter() -> Iterator[tuple[str, torch.Tensor]]:
            with safe_open(weight_path, framework="pt", device="cpu") as f:
                for key in f.keys():  # noqa: SIM118 - a safe_open handle is not iterable
                    yield key, f.get_tensor(key)

        initialize_layerwise_reload(model)
        try:
            model.load_weights(weights_iter())
        finally:
            finalize_layerwise_reload(model, self.model_runner.model_config)
