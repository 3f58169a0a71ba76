"""Staging memory shared between a refit sender and its receiver.

One interface over two kinds of memory:

* **CPU**: a POSIX shared-memory object (``/dev/shm/<name>``, mode 0600, unpredictable name). The
  sender creates it (through :class:`multiprocessing.shared_memory.SharedMemory`, so Python's
  resource tracker unlinks it if the sender process dies) and unlinks it in :meth:`close`. Both
  sides map it with ``torch.from_file(..., shared=True)``, so the mapping lives exactly as long as
  the last tensor viewing it: no exported-buffer bookkeeping, and the receiver never registers the
  object with a resource tracker (which would unlink it or warn at exit).
* **CUDA**: ``torch.empty(nbytes, dtype=torch.uint8, device=cuda)`` exported with
  ``torch.multiprocessing.reductions.reduce_tensor``; the receiver rebuilds it with
  ``rebuild_cuda_tensor`` on *its own* device index.

Sender side: :func:`allocate` → :class:`StagingBuffer` (``.tensor``, ``.handle()``, ``.close()``).
Receiver side: :func:`open_handle` → 1-D uint8 tensor; :func:`release` when done reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import stat
import weakref
from multiprocessing import shared_memory

import torch

from refit_verify.errors import RefitProtocolError
from refit_verify.wire.staged import CudaIpcHandle, ShmHandle

__all__ = ["StagingBuffer", "allocate", "open_handle", "release", "synchronize", "SHM_DIR"]

logger = logging.getLogger("refit_verify")

SHM_DIR = "/dev/shm"
"""Where POSIX shared-memory objects appear as files (Linux)."""

# CUDA buffers exported by THIS process, by (IPC handle, storage offset): CUDA cannot open an IPC
# handle in the process that exported it, so a receiver in the sender's process uses the memory
# directly (threaded tests, an in-process engine).
_LOCAL_EXPORTS: weakref.WeakValueDictionary[tuple[bytes, int], CudaStagingBuffer] = weakref.WeakValueDictionary()


def _as_device(device: str | torch.device | int | None) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, int):
        return torch.device("cuda", device)
    d = torch.device(device)
    if d.type == "cuda" and d.index is None:
        d = torch.device("cuda", torch.cuda.current_device())
    return d


def synchronize(device: torch.device) -> None:
    """Block until all work queued on ``device``'s current stream has finished (no-op on CPU)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.current_stream(device).synchronize()


class StagingBuffer:
    """Staging memory owned by the sender.

    Attributes:
        tensor: 1-D ``torch.uint8`` tensor of ``nbytes`` elements on ``device``.
        nbytes: size in bytes.
        device: ``cpu`` or ``cuda:i``.
    """

    tensor: torch.Tensor
    nbytes: int
    device: torch.device

    def handle(self) -> ShmHandle | CudaIpcHandle:
        """Return the wire handle of this buffer (see the subclasses for call rules)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the memory. Idempotent."""
        raise NotImplementedError

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ShmStagingBuffer(StagingBuffer):
    """CPU staging in a POSIX shared-memory object the sender creates and unlinks."""

    def __init__(self, nbytes: int) -> None:
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"CPU staging needs POSIX shared memory visible under {SHM_DIR}")
        self.nbytes = int(nbytes)
        self.device = torch.device("cpu")
        # Created O_CREAT|O_EXCL with mode 0600; registered with the resource tracker so that a
        # crashed sender does not leak it. Python's own mapping is closed at once: torch maps it.
        self._shm = shared_memory.SharedMemory(name=f"rv_{secrets.token_hex(12)}", create=True, size=self.nbytes)
        self._name = self._shm.name.lstrip("/")
        try:
            self._shm.close()
            self.tensor = torch.from_file(os.path.join(SHM_DIR, self._name), shared=True, size=self.nbytes, dtype=torch.uint8)
        except BaseException:
            self._unlink()
            raise
        self._closed = False

    def handle(self) -> ShmHandle:
        """Return ``ShmHandle(name, nbytes)``; may be called any number of times."""
        return ShmHandle(name=self._name, nbytes=self.nbytes)

    def _unlink(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()

    def close(self) -> None:
        """Drop this object's view and unlink the name; the memory goes with the last mapping."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.tensor = torch.empty(0, dtype=torch.uint8)
        self._unlink()


class CudaStagingBuffer(StagingBuffer):
    """CUDA staging: one caching-allocator block exported through CUDA IPC."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.nbytes = int(nbytes)
        self.device = device
        self.tensor = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self._closed = False

    def handle(self) -> CudaIpcHandle:
        """Export the buffer: call once per message that references it.

        Each call goes through ``reduce_tensor`` (``storage._share_cuda_()``), which takes a fresh
        slot of torch's IPC reference counter; the receiver's :func:`open_handle` consumes exactly
        one slot per handle. Sending one exported handle twice, or exporting without sending,
        unbalances the counter (the block may then linger in torch's IPC limbo).
        The caller must have synchronised the packing stream (:func:`synchronize`).
        """
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(self.tensor)
        (_cls, size, stride, tensor_offset, _scls, dtype, device, handle, storage_size_bytes, storage_offset_bytes,
         _rg, ref_counter_handle, ref_counter_offset, event_handle, event_sync_required) = args
        h = CudaIpcHandle(
            handle=bytes(handle),
            storage_size_bytes=int(storage_size_bytes),
            storage_offset_bytes=int(storage_offset_bytes),
            dtype=str(dtype).removeprefix("torch."),
            size=[int(s) for s in size],
            stride=[int(s) for s in stride],
            tensor_offset=int(tensor_offset),
            ref_counter_handle=bytes(ref_counter_handle),
            ref_counter_offset=int(ref_counter_offset),
            event_handle=None if event_handle is None else bytes(event_handle),
            event_sync_required=bool(event_sync_required),
            device=int(device),
        )
        _LOCAL_EXPORTS[(h.handle, h.storage_offset_bytes)] = self
        return h

    def close(self) -> None:
        """Drop the tensor; the caching allocator (or torch's IPC limbo, while a receiver still
        holds the block) takes the memory back."""
        if self._closed:
            return
        self._closed = True
        self.tensor = torch.empty(0, dtype=torch.uint8)


def allocate(nbytes: int, device: str | torch.device | int | None) -> StagingBuffer:
    """Allocate ``nbytes`` (> 0) of staging memory on ``device`` (``None`` or ``cpu`` → shared memory).

    Returns:
        StagingBuffer: ``.tensor`` is a 1-D uint8 tensor of ``nbytes`` elements (CPU: zero-filled).

    Raises:
        ValueError: ``nbytes`` <= 0. RuntimeError: no ``/dev/shm`` (CPU) or CUDA error.
    """
    if nbytes <= 0:
        raise ValueError(f"staging size must be > 0 bytes, got {nbytes}")
    dev = _as_device(device)
    if dev.type == "cpu":
        return ShmStagingBuffer(nbytes)
    if dev.type == "cuda":
        return CudaStagingBuffer(nbytes, dev)
    raise ValueError(f"staging on {dev} is not supported (cpu or cuda only)")


def open_handle(handle: ShmHandle | CudaIpcHandle, device: str | torch.device | int | None = None) -> torch.Tensor:
    """Map the sender's staging buffer in this (receiver) process.

    Args:
        handle: a handle from a ``Buffer`` message.
        device: the receiver's device; for a CUDA handle its index is used to rebuild (default:
            the current CUDA device); ignored for shared memory.

    Returns:
        torch.Tensor: 1-D uint8 view of the whole buffer (``handle.nbytes`` / ``size[0]`` elements).
        Drop every view of it before acknowledging (see :func:`release`).

    Raises:
        RefitProtocolError: the handle is malformed or names no existing shared-memory object.
    """
    if isinstance(handle, ShmHandle):
        return _open_shm(handle)
    if isinstance(handle, CudaIpcHandle):
        return _open_cuda(handle, device)
    raise RefitProtocolError(f"unknown staging handle type {type(handle).__name__}")


def _open_shm(h: ShmHandle) -> torch.Tensor:
    if "/" in h.name or h.name in (".", ".."):
        raise RefitProtocolError(f"bad shared-memory name {h.name!r}")
    path = os.path.join(SHM_DIR, h.name)
    # Open without following links and check what was opened (not the path, which another process
    # could swap): a regular file owned by this user (or root), no group/other access, at least
    # ``nbytes`` long. from_file(shared=True) on a path would create (and grow) a missing file, so
    # the mapping goes through this very descriptor.
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RefitProtocolError(f"shared-memory object {h.name!r} does not exist") from None
    except OSError as e:
        raise RefitProtocolError(f"shared-memory object {h.name!r} cannot be opened: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise RefitProtocolError(f"shared-memory object {h.name!r} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o077:
            raise RefitProtocolError(f"shared-memory object {h.name!r} is owned by uid {st.st_uid} with mode "
                                     f"{stat.S_IMODE(st.st_mode):o}; only a private (0600) object of uid {os.geteuid()} is accepted")
        if st.st_size < h.nbytes:
            raise RefitProtocolError(f"shared-memory object {h.name!r} has {st.st_size} bytes, handle says {h.nbytes}")
        via = f"/proc/self/fd/{fd}"
        return torch.from_file(via if os.path.exists(via) else path, shared=True, size=h.nbytes, dtype=torch.uint8)
    finally:
        os.close(fd)


def _open_cuda(h: CudaIpcHandle, device: str | torch.device | int | None) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if h.dtype != "uint8" or len(h.size) != 1 or list(h.stride) != [1]:
        raise RefitProtocolError(f"CUDA staging handle must describe a 1-D contiguous uint8 tensor, got dtype={h.dtype} size={h.size} stride={h.stride}")
    if h.tensor_offset + h.size[0] > h.storage_size_bytes:
        raise RefitProtocolError(f"CUDA staging handle out of bounds: offset {h.tensor_offset} + {h.size[0]} > storage {h.storage_size_bytes} bytes")
    if device is None:
        index = torch.cuda.current_device()
    else:
        d = _as_device(device)
        if d.type != "cuda":
            raise RefitProtocolError(f"a CUDA IPC handle cannot be opened on {d}")
        index = d.index
    local = _LOCAL_EXPORTS.get((h.handle, h.storage_offset_bytes))
    if local is not None and not local._closed and local.tensor.numel() >= h.size[0]:
        # Exported by this very process: view the memory directly, and give back the IPC
        # reference-counter slot the export took (what rebuild_cuda_tensor does on a cache hit).
        torch.storage.TypedStorage._release_ipc_counter(h.ref_counter_handle, h.ref_counter_offset, device=local.device.index)
        return local.tensor[: h.size[0]]
    # Same argument order as reduce_tensor's CUDA branch; arg 6 is OUR device index.
    return rebuild_cuda_tensor(
        torch.Tensor,
        torch.Size(h.size),
        tuple(h.stride),
        h.tensor_offset,
        torch.storage.TypedStorage,
        torch.uint8,
        index,
        h.handle,
        h.storage_size_bytes,
        h.storage_offset_bytes,
        False,
        h.ref_counter_handle,
        h.ref_counter_offset,
        h.event_handle,
        h.event_sync_required,
    )


def release(buf: torch.Tensor) -> None:
    """Finish reading a buffer from :func:`open_handle`: wait until no queued GPU work can still
    read it (a whole-device ``torch.cuda.synchronize``, so work ``load`` queued on other streams is
    covered too; no-op on CPU).

    The caller then drops every reference (``del``); the shared-memory mapping or the CUDA IPC
    mapping (and torch's reference-counter slot) is released when the last view is gone.
    """
    if buf.is_cuda:
        torch.cuda.synchronize(buf.device)
