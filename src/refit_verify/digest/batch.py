"""Public digest API: 128-bit digest v1 of tensors, on the tensor's own device.

Which implementation digests a device type's tensors is chosen once, in
:mod:`refit_verify.digest.backends` (:func:`backend_for`): the Triton kernels for CUDA tensors, numba for
CPU tensors, the torch path where neither can run (with one WARNING). All are bit-identical to
:mod:`refit_verify.digest.reference`. Batches of tensors added one at a time while their memory may change
(a trainer's export, a loader's pulls) are in :mod:`refit_verify.digest.incremental`.

Source: ``docs/digest-spec.md``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest import reference as _ref
from refit_verify.digest.tensors import check_storage, check_tensor, fits_many, logical_bytes, plain_tensor_ops, tensor_seed
from refit_verify.errors import RefitInputError

__all__ = ["tensor_digest", "digest_tensors", "DigestBatch", "fuses"]




_PLANNED: OrderedDict[tuple, Any] = OrderedDict()
_PLANNED_LOCK = threading.Lock()
_PLANNED_MAX = 32
"""Launch plans kept per set of tensors (device, addresses, shapes, strides, dtypes): a refit digests
the same memory every time (an engine's parameters, a trainer's, their regions), so its plan is built once."""



def _memo_plan(sig: tuple, planned: Any = None) -> Any:
    """:data:`_PLANNED` under its lock: with ``planned``, keep it for ``sig`` (the least recently used
    plan dropped beyond :data:`_PLANNED_MAX`); without, the plan kept for ``sig`` (marked recently
    used) or None."""
    with _PLANNED_LOCK:
        if planned is None:
            planned = _PLANNED.get(sig)
            if planned is not None:
                _PLANNED.move_to_end(sig)
            return planned
        _PLANNED[sig] = planned
        if len(_PLANNED) > _PLANNED_MAX:
            _PLANNED.popitem(last=False)
        return planned


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
        # (device index, backend) -> queued copies (name, logical bytes, seeds, destination, add number, own memory)
        self._copies: dict[Any, list[tuple[str, torch.Tensor, tuple[int, int], torch.Tensor, int, bool]]] = {}

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
                check_tensor(t)
            dtype = "cuda" if t.is_cuda else t.device.type
            if dtype in _backends.KERNEL_DEVICE_TYPES and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
                backend = _backends.backend_for(dtype)
                if backend.digest_views is not None:
                    self._adds += 1
                    self._order[name] = self._adds
                    self._queued.setdefault((t.get_device(), backend), []).append((name, t, None, self._adds))
                    return
            elif self.hold_cpu and dtype == "cpu" and t.is_contiguous():  # the rest is checked at the launch
                backend = _backends._CPU[0] or _backends.cpu_backend()
                if backend.digest_many is not None:
                    self._hold_cpu(name, t, backend)
                    return
            u8 = logical_bytes(t)
            self._queue(name, u8, tensor_seed(t.dtype, t.shape, u8.numel()))
        except BaseException:
            self.drop(name)
            raise

    @plain_tensor_ops
    def add_copy(self, name: str, t: torch.Tensor, dst: torch.Tensor, checked: bool = False) -> None:
        """Copy ``t``'s logical bytes into ``dst`` and digest them under ``name``, from one read of ``t``
        where a fused op runs (:func:`fuses`: the Triton backend on CUDA; numba on CPU for tensors
        below its ``many_max_bytes``).

        Fused: queued like :meth:`add` and run at :meth:`launch` / :meth:`hexdigests` (the copy too:
        ``dst`` holds the bytes only once the launch ran, in stream order on CUDA). CUDA: the leaf
        kernels store every lane they load into ``dst`` (``kernels.launch.plan_views`` ``dsts``). CPU:
        one compiled call for all of the launch's copies (``Backend.copy_many``) copies each level-0
        block of ``t`` into ``dst`` and folds it from there while it is in cache. Either way the digest
        is of exactly the bytes written. ``t`` and ``dst`` must stay alive and unchanged until the
        launch. A non-contiguous ``t`` is copied to its logical bytes here (that copy is what the launch
        reads). Elsewhere (larger CPU tensors, whose digest runs in a parallel region; the torch
        fallback) the bytes are copied now and ``t`` is digested as :meth:`add` does: two reads of ``t``.

        Args:
            name: as :meth:`add` (a later add of the same name replaces it).
            t: a tensor :meth:`add` accepts.
            checked: as :meth:`add`'s (the caller just ran ``t`` through the input checks).
            dst: 1-D contiguous uint8 tensor on ``t``'s device, 8-byte aligned address, at least
                ``round_up(nbytes, 8)`` bytes (``nbytes = t.numel() * t.element_size()``), not
                overlapping ``t``'s memory nor any other queued destination. Receives the bytes in
                ``[0, nbytes)`` and zeros in ``[nbytes, round_up(nbytes, 8))`` (the last lane's
                padding); bytes past that are untouched.

        Raises:
            RefitInputError: ``t`` cannot be digested, or ``dst`` is not such a tensor (other dtype,
                shape or device, misaligned, too short, overlapping ``t``); at the launch, two
                queued destinations (or a destination and another queued tensor) overlap, or (CPU) a
                queued source's or destination's storage was freed or shrunk since. Nothing is
                queued or copied for a call that raises, and no digest stays under ``name``.
        """
        try:
            if not checked:
                check_tensor(t)
            n = t.numel() * t.element_size()
            _check_dst(t, dst, n)
            if fuses(t):
                backend = _backends.backend_for("cuda" if t.is_cuda else t.device.type)
                # the CPU op reads a contiguous tensor's own memory (its logical bytes): no view to make
                u8 = t if backend.copy_many is not None and t.is_contiguous() and not (t.is_conj() or t.is_neg()) \
                    else logical_bytes(t)
                self._adds += 1
                self._order[name] = self._adds
                self._copies.setdefault((t.get_device(), backend), []).append(
                    (name, u8, tensor_seed(t.dtype, t.shape, n), dst, self._adds, u8.data_ptr() == t.data_ptr()))
                return
            r = (n + 7) // 8 * 8
            if n:
                dst[:n].copy_(logical_bytes(t), non_blocking=dst.is_cuda)
                dst[n:r].zero_()
            self.add(name, t, checked=True)
        except BaseException:
            self.drop(name)
            raise

    def _launch_copies(self) -> None:
        """Launch every queued :meth:`add_copy` (one fused plan per device, kept in :data:`_PLANNED` for the
        same sources and destinations while every source is its tensor's own memory)."""
        while self._copies:
            (dev, backend), items = self._copies.popitem()  # taken off the queue: a launch that raises is not retried
            keys = [(n, k) for n, _, _, _, k, _ in items]
            if backend.copy_many is not None:
                self._launch_cpu_copies(backend, items, keys)
                continue
            sig = ("copy", dev, backend.name, *[(u.data_ptr(), u.numel(), s, d.data_ptr()) for _, u, s, d, _, _ in items])
            planned = _memo_plan(sig)
            if planned is None:
                try:
                    planned = backend.plan_views([u for _, u, _, _, _, _ in items], [s for _, _, s, _, _, _ in items],
                                                 dsts=[d for _, _, _, d, _, _ in items])
                except (TypeError, ValueError) as e:
                    for n, _ in keys:
                        self.drop(n)
                    raise RefitInputError(f"add_copy: {e}") from None
                if all(own for *_, own in items):
                    _memo_plan(sig, planned)
            self._launched.append((keys, backend.run_plan(planned)))

    def _launch_cpu_copies(self, backend: _backends.Backend, items: list, keys: list[tuple[str, int]]) -> None:
        """The CPU's queued copies in one ``Backend.copy_many`` call (every source's and destination's
        storage re-checked first: one freed since its add is never read or written)."""
        try:
            for _, u8, _, dst, _, _ in items:
                check_storage(u8)
                check_storage(dst)
            h0, h1 = backend.copy_many([(u.data_ptr(), d.data_ptr(), u.numel() * u.element_size(), s)
                                        for _, u, s, d, _, _ in items])
        except RefitInputError:
            for n, _ in keys:
                self.drop(n)
            raise
        hx = _backends.hexes_many(h0, h1)
        order, done = self._order, self._done
        for i, (n, k) in enumerate(keys):
            if order.get(n) == k:  # the latest add of n (a name dropped since has none)
                done[n] = hx[32 * i : 32 * i + 32]

    def _hold_cpu(self, name: str, t: torch.Tensor, backend: _backends.Backend) -> None:
        """Queue CPU tensor ``t`` (checked, unchanged until the launch: held with ``hold_cpu``, or a
        copy of the caller's own) for the launch's one ``digest_many`` call, whatever ``hold_cpu`` is."""
        self._adds += 1
        self._order[name] = self._adds
        self._queued.setdefault((-1, backend), []).append((name, t, None, self._adds))

    def discard_queued(self) -> None:
        """Forget every add and copy queued and not launched yet (their names get no digest, and no
        copy runs), releasing their tensors: for a caller that abandons the batch while memory a queued
        copy would write (a transport's staging buffer) is being freed."""
        for queue in (self._queued, self._copies):
            for items in queue.values():
                for name, *_rest in items:
                    self.drop(name)
            queue.clear()

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
        backend = _backends.backend_for(dtype)
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

        Raises:
            RefitInputError: queued :meth:`add_copy` destinations overlap each other or a source
                (those names are dropped; nothing of their launch ran).
        """
        if self._copies:
            self._launch_copies()
        for (dev, backend), items in self._queued.items():
            if backend.digest_many is not None:
                self._launch_cpu(backend, items)
                continue
            keys = [(n, k) for n, _, _, k in items]
            if backend.plan_views is not None and all(s is None for _, _, s, _ in items):
                sig = (dev, backend.name, *[(t.data_ptr(), t.shape, t.stride(), t.dtype, t.is_conj(), t.is_neg())
                                            for _, t, _, _ in items])
                planned = _memo_plan(sig)
                if planned is None:
                    views = [logical_bytes(t) for _, t, _, _ in items]
                    seeds = [tensor_seed(t.dtype, t.shape, u.numel()) for (_, t, _, _), u in zip(items, views)]
                    planned = backend.plan_views(views, seeds)
                    # kept only when every view is the tensor's own memory: a tensor made non-contiguous
                    # since its add was copied by logical_bytes, and that copy is freed after this launch
                    if all(u.data_ptr() == t.data_ptr() for (_, t, _, _), u in zip(items, views)):
                        _memo_plan(sig, planned)
                self._launched.append((keys, backend.run_plan(planned)))  # (a copy in views lives until launched)
                continue
            views, seeds = [], []
            for _, t, s, _ in items:
                if s is None:
                    u = logical_bytes(t)
                    views.append(u)
                    seeds.append(tensor_seed(t.dtype, t.shape, u.numel()))
                else:
                    views.append(t)
                    seeds.append(s)
            self._launched.append((keys, backend.digest_views(views, seeds)))
        self._queued.clear()

    def _launch_cpu(self, backend: _backends.Backend, items: list) -> None:
        """Digest queued CPU tensors now: one ``digest_many`` call for those still contiguous, aligned
        and small (each re-checked: a tensor changed since its add is read as it is now), the rest one by one."""
        order, done = self._order, self._done
        most = backend.many_max_bytes if len(items) >= MANY_MIN else 0  # a few: one call each is cheaper
        many, names = [], []
        for name, t, _, k in items:
            if order.get(name) != k:
                continue  # added again later: the later add is what counts
            check_storage(t)  # re-checked at the read: freed or resized since the add, it is never read
            if fits_many(t, most):
                nbytes = t.numel() * t.element_size()
                many.append((t.data_ptr(), nbytes, tensor_seed(t.dtype, t.shape, nbytes)))
                names.append(name)
            else:
                u8 = logical_bytes(t)
                done[name] = _ref.hexdigest(*backend.digest_words(u8, tensor_seed(t.dtype, t.shape, u8.numel())))
        if many:
            hx = _backends.hexes_many(*backend.digest_many(many))  # the tensors in items stay alive for the call
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
            hx = _backends.hexes(torch.cat([w for _, w in groups]))
            i = 0
            for keys, _ in groups:
                for n, k in keys:
                    if order.get(n) == k:  # the latest add of n (a name dropped since has none)
                        done[n] = hx[i : i + 32]
                    i += 32
        self._launched.clear()
        return {n: done[n] for n in order}


MANY_MIN = 4
"""Queued CPU tensors from which one ``digest_many`` call is cheaper than one call per tensor."""


def fuses(t: torch.Tensor) -> bool:
    """True iff :meth:`DigestBatch.add_copy` of ``t`` reads ``t`` once: the Triton backend of its device
    type (CUDA), or a CPU tensor of fewer than the numba backend's ``many_max_bytes`` bytes (a larger one's
    digest runs in a parallel region, faster on two or more idle cores than the serial fused op);
    elsewhere it copies, then digests (two reads)."""
    if t.is_cpu and "cpu" not in _backends.KERNEL_DEVICE_TYPES:
        b = _backends._CPU[0] or _backends.cpu_backend()
        return b.copy_many is not None and t.numel() * t.element_size() < b.many_max_bytes
    kind = "cuda" if t.is_cuda else t.device.type
    return kind in _backends.KERNEL_DEVICE_TYPES and _backends.backend_for(kind).plan_views is not None


def _check_dst(t: torch.Tensor, dst: torch.Tensor, n: int) -> None:
    """Raise :class:`RefitInputError` unless ``dst`` can take :meth:`DigestBatch.add_copy`'s copy of the
    ``n`` logical bytes of ``t`` (see there)."""
    if not isinstance(dst, torch.Tensor) or dst.dtype is not torch.uint8 or dst.dim() != 1 or not dst.is_contiguous():
        raise RefitInputError(f"add_copy: dst must be a 1-D contiguous uint8 tensor, got {type(dst).__name__} "
                              f"{getattr(dst, 'dtype', '')} shape {tuple(getattr(dst, 'shape', ()))}")
    if not (dst.is_cpu and t.is_cpu) and dst.device != t.device:  # (torch.device objects only where needed)
        raise RefitInputError(f"add_copy: dst is on {dst.device}, the tensor on {t.device}")
    r = (n + 7) // 8 * 8
    if dst.numel() < r:
        raise RefitInputError(f"add_copy: dst holds {dst.numel()} bytes; a {n}-byte tensor needs {r} (whole 8-byte lanes)")
    a = dst.data_ptr()
    if a % 8:
        raise RefitInputError(f"add_copy: dst address {a:#x} is not 8-byte aligned")
    if n:
        lo = t.data_ptr()
        span = t.numel() if t.is_contiguous() else 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        if a < lo + span * t.element_size() and lo < a + r:
            raise RefitInputError("add_copy: dst overlaps the tensor's own memory")




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
