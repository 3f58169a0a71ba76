"""One fixed list of live tensors, digested again and again: its checks and launch plans made once.

A verified refit digests the same memory at every close: the engine-state snapshot reads every
parameter and persistent buffer of the model, and a replayed session's read-back the same regions
of the same parameters (:mod:`refit_verify.boundary.plan`). :class:`~refit_verify.digest.batch.DigestBatch`
re-checks and re-plans each tensor at every call (a few µs of Python per tensor);
:class:`DigestSet` does that once, when it is built, and per call only compares one cheap
signature per tensor with the one it was built on: data pointer, shape, strides, dtype, storage
bytes, conjugate / negative bits (:func:`signature`). A tensor whose signature moved (``.data``
reassigned, storage freed or resized, re-viewed) makes :meth:`DigestSet.digest` return ``None``
and the caller takes the general path, which checks everything again and builds a new set. A set
over CPU tensors digested by the compiled batch (no region, none large) is *relocatable*: new
tensors of its exact layout at other addresses (the clones vLLM's layerwise reload is handed at
every refit) are read through it where they are (:meth:`DigestSet.moved`), its plan being one
address per tensor.

The bytes are read at every call: the kernels (Triton on CUDA, one launch plan per device) and the
CPU's compiled batch (numba, ``Backend.digest_many``) read the memory the tensors hold then. The
digests are those of :func:`~refit_verify.digest.batch.tensor_digest` (digest v1, ``docs/digest-spec.md``),
bit for bit; ``tests/digest/test_kept.py`` compares them on every backend this machine has.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from itertools import repeat
from operator import and_, attrgetter, sub

import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest import reference as _ref
from refit_verify.digest.tensors import as_view, check_tensor, fits_many, logical_bytes, plain_tensor_ops, tensor_seed

__all__ = ["DigestSet", "SetLaunch", "could_relocate", "expect_layouts", "same_layout", "signature", "KEPT_HELD_TENSORS",
           "kept_set"]

DERIVE_REGIONS = True
"""False: a set with ``regions`` reads every entry itself on the kernel path too (``DigestSet.saved``
0; benchmarks compare the two in one process)."""


def signature(t: torch.Tensor) -> tuple:
    """What must not change for a built :class:`DigestSet` to read ``t`` correctly: ``(data_ptr,
    shape, strides, dtype, storage data_ptr, storage bytes, is_conj, is_neg)``. The caller runs on
    plain tensor ops."""
    s = t.untyped_storage()
    return (t.data_ptr(), t.shape, t.stride(), t.dtype, s.data_ptr(), s.nbytes(), t.is_conj(), t.is_neg())


def _layout(columns: Sequence[list]) -> tuple[list, ...]:
    """What :func:`signature` fields say of tensors' layout wherever they are, from
    :func:`_signature_columns`' columns: shape, strides, dtype, storage bytes, conjugate / negative
    bits, and offset into the storage (data pointer minus storage pointer), one list each."""
    return (columns[1], columns[2], columns[3], columns[5], columns[6], columns[7], list(map(sub, columns[0], columns[4])))


def same_layout(a: Sequence[tuple], b: Sequence[tuple]) -> bool:
    """True iff signatures ``a`` and ``b`` (:func:`signature`, in order) describe tensors of one
    layout, wherever each is: every field but the two addresses equal, and the same offset into the
    storage (:meth:`DigestSet.moved`'s rule)."""
    return len(a) == len(b) and (not a or _layout(list(map(list, zip(*a)))) == _layout(list(map(list, zip(*b)))))


_T = torch.Tensor
_SHAPE, _DTYPE, _DEVICE, _IS_COMPLEX = attrgetter("shape"), attrgetter("dtype"), attrgetter("device"), attrgetter("is_complex")
_CPU = {torch.device("cpu")}
_NBYTES, _STORAGE_PTR = torch.UntypedStorage.nbytes, torch.UntypedStorage.data_ptr


def _signature_columns(ts: Sequence[torch.Tensor]) -> tuple[list, ...]:
    """The fields of :func:`signature` of every tensor of ``ts``, one list per field, in its order:
    read field by field (one C-level pass per field, not a Python call per tensor). Only a complex
    tensor can carry the conjugate bit (torch asserts it), so with no complex dtype among them that
    field is not read: all False. The caller runs on plain tensor ops."""
    storages = list(map(_T.untyped_storage, ts))
    dtypes = list(map(_DTYPE, ts))
    conj = list(map(_T.is_conj, ts)) if any(map(_IS_COMPLEX, set(dtypes))) else [False] * len(dtypes)
    return (list(map(_T.data_ptr, ts)), list(map(_SHAPE, ts)), list(map(_T.stride, ts)), dtypes,
            list(map(_STORAGE_PTR, storages)), list(map(_NBYTES, storages)), conj, list(map(_T.is_neg, ts)))


def _columns_or_none(ts: Sequence[torch.Tensor]) -> tuple[list, ...] | None:
    """:func:`_signature_columns` of ``ts``, or None when one has no storage to sign (a caller's
    general path then says why). The caller runs on plain tensor ops."""
    try:
        return _signature_columns(ts)
    except (RuntimeError, NotImplementedError):
        return None


def could_relocate(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a :class:`DigestSet` over ``tensors`` would be :attr:`~DigestSet.relocatable`, read
    from the tensors alone (no set built): every one a contiguous CPU tensor at an 8-byte aligned
    address, below the compiled batch's length bound, on a CPU without kernels. For a caller that
    would otherwise build a set only to find it cannot follow moving memory. The caller runs on
    plain tensor ops."""
    if "cpu" in _backends.KERNEL_DEVICE_TYPES or not set(map(_DEVICE, tensors)) <= _CPU:
        return False
    backend = _backends.backend_for("cpu")
    if backend.plan_many is None:
        return False
    most = backend.many_max_bytes
    return all(fits_many(t, most) for t in tensors)


class DigestSet:
    """The digests of ``tensors``, re-read at every :meth:`digest` with no per-tensor planning.

    Args:
        tensors: the live tensors, in output order (contiguous, on CUDA, or on the CPU; anything
            :func:`~refit_verify.digest.tensors.logical_bytes` accepts). The set holds them (``hold``).
        regions: per tensor, a region ``(element offset, shape, strides)`` of it to read instead
            (:func:`~refit_verify.digest.tensors.as_view`; each must be contiguous): the set then holds
            the tensors (e.g. parameters) and their signatures, never a view of their storage.
        hold: keep the tensors (default). False: keep only their signatures and the launch plans,
            and be handed tensors with the same signatures at each call (a trainer's held tensors:
            new tensor objects over the same memory at every refit, and no memory kept alive).
        checked: the caller has just run :func:`~refit_verify.digest.tensors.check_tensor` on every
            tensor (no ``regions``) and nothing ran since: not checked again here.
    Attributes:
        tensors: the tensors given, in order (None with ``hold=False``).
        signatures: their :func:`signature` when the set was built, in order (index 4 of each: the
            storage's data pointer, what an engine-state snapshot records).
        saved: bytes a call does not read twice: with ``regions``, an entry lying inside another
            entry at a 512 KiB multiple (a region of a fused parameter beside the parameter) takes
            its full 512 KiB superblocks from that entry's read in the same launch (kernel plans
            only, ``kernels.launch.plan_views(derive=True)``; the CPU's compiled batch reads every
            entry, as do sets without regions). A call reads ``sum(entry bytes) - saved`` bytes.
        relocatable: the set can read tensors of its layout at other addresses (:meth:`moved`):
            every tensor is a whole CPU tensor digested by the compiled batch (no kernel plan, no
            region), so its plan is one pointer per tensor, made again from the tensors given.
        ahead: the set was planned from a layout before any of its tensors existed (:meth:`of_layout`).

    Raises:
        RefitInputError: a tensor cannot be digested (:func:`~refit_verify.digest.tensors.logical_bytes`).
        ValueError: a tensor (region) is not contiguous, is a conjugate / negative view, or is on a
            device that has neither the kernels nor the CPU batch (use :class:`~refit_verify.digest.batch.DigestBatch`);
            ``regions`` and ``tensors`` differ in length.
        RuntimeError: a region lies outside its tensor's storage.

    Host cost of a call: the :func:`signature` fields of every tensor, read and compared field by
    field (eight C-level passes over the tensors), one launch per CUDA
    device (kept plan), one compiled call for the CPU's small tensors (one call each for the
    large ones), one device-to-host copy per device, one hex formatting of all the words.
    """

    @plain_tensor_ops
    def __init__(self, tensors: Sequence[torch.Tensor], regions: Sequence[tuple] | None = None, hold: bool = True,
                 checked: bool = False) -> None:
        self.tensors: list[torch.Tensor] | None = list(tensors)
        self.regions = list(regions) if regions is not None else None
        if self.regions is not None and len(self.regions) != len(self.tensors):
            raise ValueError(f"{len(self.tensors)} tensors but {len(self.regions)} regions")
        self._n = len(self.tensors)
        views = [self._view(i) for i in range(self._n)]  # transient: only addresses are kept
        if not checked or self.regions is not None:
            for u in views:
                check_tensor(u)
        self._columns = _signature_columns(self.tensors)  # what valid() compares
        self.signatures = list(zip(*self._columns))
        self._layout: tuple[list, ...] | None = None  # what moved() compares (made at its first call)
        self.saved = 0
        # per group: (positions in the output, kept kernel plan or the CPU's kept plan_many (its list without one), backend,
        # large CPU items (position, seeds))
        self._groups: list[tuple[list[int], object, object, list[tuple[int, tuple[int, int]]]]] = []
        by: dict[tuple, list[int]] = {}
        for i, t in enumerate(views):
            if not t.is_contiguous() or t.is_conj() or t.is_neg():
                raise ValueError("a DigestSet reads tensors in place: contiguous ones, without conjugate or negative bits")
            dtype = "cuda" if t.is_cuda else t.device.type
            if dtype in _backends.KERNEL_DEVICE_TYPES:
                backend = _backends.backend_for(dtype)
                if backend.plan_views is None:
                    raise ValueError(f"no kept launch plans for {dtype} tensors (backend {backend.name})")
                by.setdefault((t.get_device(), True, backend), []).append(i)
            elif dtype == "cpu":
                backend = _backends.backend_for("cpu")
                if backend.digest_many is None:
                    raise ValueError(f"no batched CPU digests (backend {backend.name})")
                by.setdefault((-1, False, backend), []).append(i)
            else:
                raise ValueError(f"no batched digests of {dtype} tensors")
        for (_dev, kernel, backend), pos in by.items():
            if kernel:
                u8 = [logical_bytes(views[i]) for i in pos]
                seeds = [tensor_seed(views[i].dtype, views[i].shape, u.numel()) for i, u in zip(pos, u8)]
                planned = backend.plan_views(u8, seeds, derive=DERIVE_REGIONS and self.regions is not None)
                self.saved += getattr(planned, "saved", 0)
                self._groups.append((pos, planned, backend, []))
                continue
            most = backend.many_max_bytes
            many, mpos, large = [], [], []
            for i in pos:
                t = views[i]
                nbytes = t.numel() * t.element_size()
                seeds = tensor_seed(t.dtype, t.shape, nbytes)
                if fits_many(t, most):
                    many.append((t.data_ptr(), nbytes, seeds))
                    mpos.append(i)
                else:
                    large.append((i, seeds))
            # the compiled batch's arguments checked once (no Python step per tensor per call), or its list
            self._groups.append((mpos, backend.plan_many(many) if backend.plan_many is not None else many, backend, large))
        if not hold:
            self.tensors = None
        # a set over CPU memory only, whole tensors, each digested through a kept plan of the compiled batch: it can
        # read tensors of the same layout elsewhere (moved(), launch(moved=True)): an address per tensor is all it holds
        self.relocatable = regions is None and all(b.digest_many is not None and not isinstance(kept, list) and not large
                                                   for _, kept, b, large in self._groups)
        self.ahead = False

    @classmethod
    def of_layout(cls, shapes: Sequence[torch.Size], strides: Sequence[tuple[int, ...]], dtypes: Sequence[torch.dtype],
                  nbytes: Sequence[int], plan: object, backend: object) -> DigestSet:
        """A relocatable set planned from a layout alone, before any tensor of it exists
        (:func:`expect_layouts`): whole contiguous CPU tensors of these shapes, strides and dtypes,
        each at offset 0 of a storage of exactly its bytes, read through the compiled batch's kept
        ``plan`` (``backend.plan_many`` of ``(0, nbytes, seeds)`` per tensor; ``nbytes``: each one's
        bytes). It reads only tensors
        :meth:`moved` finds of that layout (its addresses are none a tensor has: :meth:`valid` is
        never true); :attr:`ahead` is True."""
        ds = cls.__new__(cls)
        n = len(shapes)
        ds.tensors, ds.regions, ds._n, ds.saved, ds._layout = None, None, n, 0, None
        ds._columns = ([-1] * n, list(shapes), list(strides), list(dtypes), [-1] * n, list(nbytes), [False] * n, [False] * n)
        ds.signatures = list(zip(*ds._columns))
        ds._groups = [(list(range(n)), plan, backend, [])]
        ds.relocatable, ds.ahead = True, True
        return ds

    def _view(self, i: int, tensors: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
        """Entry ``i``: the tensor, or its region (made now: the set keeps no view, so no memory a
        parameter left stays alive through it)."""
        t = (self.tensors if tensors is None else tensors)[i]
        if self.regions is None:
            return t
        return as_view(t.detach(), self.regions[i])

    def __len__(self) -> int:
        return self._n

    @plain_tensor_ops
    def valid(self, tensors: Sequence[torch.Tensor] | None = None, columns: tuple[list, ...] | None = None) -> bool:
        """True iff every tensor (``tensors``: these, in the set's order, for a set that holds none)
        still has the signature the set was built on. ``columns``: ``tensors``' signature fields as
        columns (:func:`_signature_columns`), when the caller read them just now."""
        ts = self.tensors if tensors is None else tensors
        if ts is None or len(ts) != self._n:
            return False
        cols = _columns_or_none(ts) if columns is None else columns  # None: given memory with no storage to sign
        return cols is not None and cols == self._columns

    @plain_tensor_ops
    def moved(self, tensors: Sequence[torch.Tensor], columns: tuple[list, ...] | None = None) -> bool:
        """True iff the set is :attr:`relocatable` and ``tensors`` (in the set's order) are laid out
        as the tensors it was built on, wherever they are now: the same shape, strides, dtype,
        storage bytes, offset into their storage and conjugate / negative bits, and 8-byte aligned
        addresses (the compiled batch's requirement). New tensors of a buffer's layout at another
        address (clones made at every refit on the CPU) then need no new plan: :meth:`launch` with
        ``moved=True`` reads them where they are. ``columns``: ``tensors``' signature fields as
        columns, when the caller read them just now (they are not read again)."""
        if not self.relocatable or len(tensors) != self._n or not set(map(_DEVICE, tensors)) <= _CPU:  # meta: not CPU
            return False
        cols = _columns_or_none(tensors) if columns is None else columns
        if cols is None:
            return False
        if self._layout is None:
            self._layout = _layout(self._columns)
        return _layout(cols) == self._layout and not any(map(and_, cols[0], repeat(7)))

    @plain_tensor_ops
    def launch(self, check: bool = True, tensors: Sequence[torch.Tensor] | None = None, moved: bool = False) -> SetLaunch | None:
        """Start reading every tensor as it is now, without synchronising (the kernels run in
        stream order; the CPU's digests are taken now): a :class:`SetLaunch` to :meth:`collect`,
        or None when a tensor's signature moved since the set was built (nothing is read then).

        ``check=False``: the caller has just checked :meth:`valid` (or a set over the same
        tensors) in this step. ``tensors``: the tensors to read, for a set built with
        ``hold=False`` (they must have the set's signatures: checked unless ``check=False``).
        ``moved``: ``tensors`` have the set's layout somewhere else (:meth:`moved`: checked unless
        ``check=False``); they are read where they are now.
        """
        if moved:  # relocatable: CPU groups of whole tensors through kept plans, no large item, no kernel plan
            if not self.relocatable or tensors is None or (check and not self.moved(tensors)):
                return None
        elif check and not self.valid(tensors):
            return None
        out: list[str | None] = [None] * self._n
        words: list[tuple[list[int], torch.Tensor]] = []
        for pos, kept, backend, large in self._groups:
            if backend.digest_many is not None:  # the CPU: small tensors in one compiled call, the large one by one
                if pos:
                    if moved:  # read where the given tensors are now
                        got = backend.run_many(kept, map(_T.data_ptr, map(tensors.__getitem__, pos)))  # type: ignore[union-attr]
                    else:
                        got = backend.digest_many(kept) if isinstance(kept, list) else backend.run_many(kept)
                    hx = _backends.hexes_many(*got)
                    for j, i in enumerate(pos):
                        out[i] = hx[32 * j : 32 * j + 32]
                for i, seeds in large:
                    out[i] = _ref.hexdigest(*backend.digest_words(logical_bytes(self._view(i, tensors)), seeds))
                continue
            words.append((pos, backend.run_plan(kept)))
        return SetLaunch(out, words)

    @staticmethod
    def collect(launched: SetLaunch) -> list[str]:
        """``[32-hex]`` of a :meth:`launch`, in the set's order (one device-to-host copy per device)."""
        out = launched.hexes
        by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for pos, w in launched.words:
            by_device.setdefault(w.device, []).append((pos, w))
        for groups in by_device.values():
            hx = _backends.hexes(torch.cat([w for _, w in groups]) if len(groups) > 1 else groups[0][1])
            j = 0
            for pos, _ in groups:
                for i in pos:
                    out[i] = hx[j : j + 32]
                    j += 32
        launched.words = []
        return out  # type: ignore[return-value]

    def digest(self, check: bool = True, tensors: Sequence[torch.Tensor] | None = None, moved: bool = False) -> list[str] | None:
        """Digest every tensor as it is now: ``[32-hex]`` in the order given, or None when a
        tensor's signature moved since the set was built (nothing is read then). Arguments as
        :meth:`launch`."""
        launched = self.launch(check, tensors, moved)
        return None if launched is None else self.collect(launched)


class SetLaunch:
    """The digests a :meth:`DigestSet.launch` started: CPU ones done (``hexes``), device words pending."""

    __slots__ = ("hexes", "words")

    def __init__(self, hexes: list[str | None], words: list[tuple[list[int], torch.Tensor]]) -> None:
        self.hexes, self.words = hexes, words


# -- the kept sets of held flushes, process-wide ---------------------------------------------------
# The kept sets of held flushes: one :class:`~refit_verify.digest.kept.DigestSet` per list of names, process-wide.
#
# A trainer exports the same memory at every refit, and a receiver checks the same staging slots (or
# the CPU's clones of them, laid out alike) before loading: :class:`~refit_verify.digest.incremental.HeldBatch`
# and :func:`~refit_verify.digest.incremental.digest_now` look each flush's names up here and, when its
# tensors still have the kept set's signatures (or, on the CPU, its layout elsewhere), launch that
# set's plan instead of checking and planning every tensor again. A flush that went the general way
# is remembered: where a set can follow its tensors wherever they are (CPU memory), a set built then
# and read at once (:func:`keep_held_now`); elsewhere its signatures the first time, a set built over
# its tensors when the same names come again alike (:func:`_keep_held`). Entries hold signatures and
# launch plans, never tensors.

KEPT_HELD_TENSORS = 1 << 17
"""Tensors over all the flush signatures and sets :class:`~refit_verify.digest.incremental.HeldBatch` keeps (one entry per flush of a
trainer's export, least recently used dropped beyond this): an entry holds no tensor, only signatures
and a launch plan, so a whole large model's flushes fit (a 7B model in bf16 is about 56 flushes of
256 MiB; a bound by entries would drop each flush's entry just before it comes again)."""
_HELD_SETS: OrderedDict[tuple[str, ...], DigestSet | list[tuple]] = OrderedDict()
_HELD_TENSORS = 0  # tensors over the entries of _HELD_SETS
_HELD_LOCK = threading.Lock()


def _kept_held(names: tuple[str, ...], columns: tuple[list, ...] | None,
               tensors: Sequence[torch.Tensor]) -> tuple[DigestSet, bool] | None:
    """The kept set of a flush of ``names`` whose ``tensors`` have the signature fields ``columns``
    (:func:`~refit_verify.digest.kept._signature_columns`), and whether they moved (a relocatable set
    of their layout elsewhere, :meth:`DigestSet.moved`), or None."""
    ds = kept_set(names) if columns is not None else None
    if ds is None:
        return None
    if ds.valid(tensors, columns):
        return ds, False
    return (ds, True) if ds.moved(tensors, columns) else None


def kept_set(names: tuple[str, ...]) -> DigestSet | None:
    """The kept set of ``names`` (marked most recently used), or None when there is none (or only the
    signatures of one flush so far)."""
    with _HELD_LOCK:
        ds = _HELD_SETS.get(names)
        if not isinstance(ds, DigestSet):
            return None
        _HELD_SETS.move_to_end(names)
        return ds


def _keep_held(names: tuple[str, ...], sigs: list[tuple], tensors: list[torch.Tensor]) -> None:
    """Remember a flush that went the general way: its signatures the first time; a set over its
    tensors (no tensors held) when the same names come again with the same signatures, or with the
    same layout elsewhere when a set can follow it (:func:`~refit_verify.digest.kept.could_relocate`:
    CPU clones made at every refit). Memory that moves at every refit where no set can follow it
    (a sharded gather's on a GPU, a large CPU tensor's) is never planned for nothing."""
    with _HELD_LOCK:
        prev = _HELD_SETS.get(names)
    entry: DigestSet | list[tuple] = sigs
    before = None if prev is None else prev if isinstance(prev, list) else prev.signatures
    same = before == sigs
    # memory that moves at every refit gets a set only where one can follow it (the CPU's compiled batch):
    # a sharded gather's on a GPU, or a large CPU tensor's, is never planned for nothing
    if same or (before is not None and same_layout(before, sigs) and could_relocate(tensors)):
        try:
            entry = DigestSet(tensors, hold=False)
        except (RuntimeError, ValueError):  # not contiguous, not on a device with kept plans: the general path each time
            entry = sigs
    _store_held(names, entry)


def _store_held(names: tuple[str, ...], entry: DigestSet | list[tuple]) -> None:
    """Keep ``entry`` for the flush of ``names`` (most recently used), the least recently used dropped
    beyond :data:`KEPT_HELD_TENSORS` tensors."""
    with _HELD_LOCK:
        global _HELD_TENSORS
        old = _HELD_SETS.pop(names, None)
        _HELD_TENSORS -= len(names) if old is not None else 0
        _HELD_SETS[names] = entry
        _HELD_TENSORS += len(names)
        while _HELD_TENSORS > KEPT_HELD_TENSORS and len(_HELD_SETS) > 1:
            dropped, _ = _HELD_SETS.popitem(last=False)
            _HELD_TENSORS -= len(dropped)


class _Expected:
    """One sequence of tensors expected ahead (:func:`expect_layouts`): per position its name, shape
    (``torch.Size``), contiguous strides, dtype and the compiled batch's plan item ``(0, nbytes,
    seeds)``, or None where such a tensor could not be read through a relocatable set (a large one);
    and ``plans``: the compiled batch's plan of a run (``(start, stop)``), made from its items."""

    __slots__ = ("names", "at", "shapes", "strides", "dtypes", "items", "plans")

    def __init__(self, specs: Sequence[tuple[str, Sequence[int], torch.dtype]], most: int) -> None:
        self.names = tuple(n for n, _, _ in specs)
        self.at = {n: i for i, n in reversed(list(enumerate(self.names)))}  # a name's first position
        self.shapes = [torch.Size(sh) for _, sh, _ in specs]
        self.dtypes = [dt for _, _, dt in specs]
        self.strides: list[tuple[int, ...]] = []
        self.items: list[tuple[int, int, tuple[int, int]] | None] = []
        for sh, dt in zip(self.shapes, self.dtypes):
            self.strides.append(torch.empty(sh, dtype=dt, device="meta").stride())
            nbytes = math.prod(sh) * dt.itemsize
            self.items.append((0, nbytes, tensor_seed(dt, sh, nbytes)) if nbytes < most else None)
        self.plans: dict[tuple[int, int], object] = {}

    def run(self, names: tuple[str, ...]) -> slice | None:
        """The positions of ``names`` when they are a run of this sequence, in its order; else None."""
        i = self.at.get(names[0]) if names else None
        if i is None or self.names[i : i + len(names)] != names:
            return None
        return slice(i, i + len(names))


_EXPECTED: dict[str, list[_Expected]] = {}  # space -> the sequences expected there, most recent first
_EXPECTED_MAX = 4


def expect_layouts(space: str, specs: Sequence[tuple[str, Sequence[int], torch.dtype]]) -> int:
    """Expect, under ``space`` (as :func:`~refit_verify.digest.incremental.digest_now`'s), tensors
    ``specs`` (``[(name, shape, dtype)]`` in the order they are expected) as fresh whole CPU tensors
    (a clone each: contiguous, at offset 0 of a storage of exactly its bytes), in one or several
    calls, each a run of ``specs`` in that order. The first such call then reads through a set
    planned from this layout (:meth:`DigestSet.of_layout`) instead of checking and planning each
    tensor: only once :meth:`DigestSet.moved` found every tensor of that layout (shape, strides,
    dtype, storage bytes, offset, no conjugate / negative bit, 8-byte aligned), the check a kept
    set's relocated read makes at every call; anything else (other names, order, shapes, dtypes,
    views, large tensors) takes the general path as without it. Nothing is read here; the compiled
    batch's plan of the whole sequence as one call is made here (a shorter run's at its call). The
    last :data:`_EXPECTED_MAX` sequences per space are kept. Returns how many of ``specs`` a set can
    take (0: none, e.g. a CPU with kernels or without the compiled batch).

    Raises:
        ValueError: an empty ``space`` (the trainer's own flushes are never expected ahead).
    """
    if not space:
        raise ValueError("expect_layouts takes a named space")
    if "cpu" in _backends.KERNEL_DEVICE_TYPES:
        return 0
    backend = _backends.backend_for("cpu")
    if backend.plan_many is None:
        return 0
    seq = _Expected(specs, backend.many_max_bytes)
    if seq.items and None not in seq.items:  # the whole sequence in one call (one staging buffer): planned now, not at it
        seq.plans[(0, len(seq.items))] = backend.plan_many(seq.items)
    with _HELD_LOCK:
        got = _EXPECTED.setdefault(space, [])
        got.insert(0, seq)
        del got[_EXPECTED_MAX:]
    return sum(it is not None for it in seq.items)


def expected_set(space: str, names: tuple[str, ...]) -> DigestSet | None:
    """A set planned ahead for a call of ``names`` under ``space`` (:func:`expect_layouts`), or None
    when they are no run of an expected sequence (or one of them is not expected as a small tensor).
    The caller reads through it only after :meth:`DigestSet.moved` of the tensors it was handed."""
    with _HELD_LOCK:
        seqs = list(_EXPECTED.get(space, ()))
    for seq in seqs:
        r = seq.run(names)
        if r is None:
            continue
        items = seq.items[r]
        if None in items:
            return None
        backend = _backends.backend_for("cpu")
        plan = seq.plans.get((r.start, r.stop))  # planned ahead from the same items, or now
        return DigestSet.of_layout(seq.shapes[r], seq.strides[r], seq.dtypes[r], [it[1] for it in items],  # type: ignore[index]
                                   backend.plan_many(items) if plan is None else plan, backend)
    return None


def forget_space(space: str) -> None:
    """Drop what is kept and expected under ``space`` (a warm-up's throwaway sets)."""
    with _HELD_LOCK:
        global _HELD_TENSORS
        _EXPECTED.pop(space, None)
        for key in [k for k in _HELD_SETS if k and k[0] == space]:
            del _HELD_SETS[key]
            _HELD_TENSORS -= len(key)


def keep_held_now(names: tuple[str, ...], tensors: list[torch.Tensor]) -> DigestSet | None:
    """A set over a flush that takes the general way (its first sight, or its layout changed), built
    now, kept for the next flushes of ``names`` and for the caller to read this flush through, when a
    set can follow its tensors wherever they are (:func:`could_relocate`: CPU memory the compiled batch
    reads, e.g. the clones vLLM's layerwise reload makes at every refit). Building it checks and plans
    each tensor once, as the general path would: the second flush of these names then costs what the
    later ones do. None (nothing kept): no set can follow them; the caller takes the general path
    and :func:`_keep_held` (signatures first, a set at the second sight of the same memory).
    The caller checked every tensor (:func:`~refit_verify.digest.tensors.check_tensor`) unchanged since
    its add, just now, and the names unique."""
    if not could_relocate(tensors):
        return None
    try:
        ds = DigestSet(tensors, hold=False, checked=True)
    except (RuntimeError, ValueError):  # not readable as a set: the general path
        return None
    _store_held(names, ds)
    return ds
