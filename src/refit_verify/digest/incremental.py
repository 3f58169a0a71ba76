"""Digests of tensors added one at a time: a trainer exporting its parameters, a loader pulling them.

:class:`CopyingBatch` copies each CUDA tensor as it is added (what it held then is what is
digested), :class:`HeldBatch` holds the tensors themselves and checks, before reading them, that
they did not change; :func:`digest_now` reads a list handed over right now. All of them launch in
batches (:class:`~refit_verify.digest.batch.DigestBatch`), never one kernel per tensor, and synchronise
once when the digests are read. The trainer's face of both batches,
:class:`~refit_verify.trainer.exports.StreamDigests` (``copy=True`` / ``copy=False`` /
``hold_parameters=True``), is in :mod:`refit_verify.trainer.exports`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest import kept as _held  # its store read at each use (tests replace it)
from refit_verify.digest.batch import DigestBatch, tensor_digest
from refit_verify.digest.kept import DigestSet, SetLaunch, _columns_or_none
from refit_verify.digest.tensors import (
    IS_META,
    PLAIN,
    PLAIN_SET,
    PLAIN_TYPES,
    VERSION,
    check_storage,
    check_tensor,
    logical_bytes,
    plain_tensor_ops,
    tensor_seed,
    version_of,
)
from refit_verify.errors import RefitError, RefitInputError

__all__ = ["CopyingBatch", "HeldBatch", "digest_now", "snapshot", "version_of"]


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
    copies on the device. A small CPU tensor (below the compiled batch's bound, 1 MiB) is copied
    (a memcpy) and read at the flush with the others in one compiled call (``Backend.digest_many``:
    one call per tensor costs about 15 µs of fixed host time on this project's CPU machine); a
    larger one is digested at once (no copy).

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
        """Digest ``t`` under ``name`` as it is now (a later add of the same name replaces it; one that
        raises leaves no digest under ``name``, an earlier add's included).

        Raises:
            RefitInputError: ``t`` cannot be digested (see :func:`logical_bytes`).
        """
        try:
            if not isinstance(t, torch.Tensor):
                raise RefitInputError(f"only torch tensors can be digested, got {type(t).__name__} for {name!r:.100}")
            if t.device.type not in _backends.KERNEL_DEVICE_TYPES:
                be = _backends._CPU[0] or _backends.cpu_backend()
                n = t.numel() * t.element_size()
                if not (type(t) in PLAIN_TYPES and t.is_cpu and be.digest_many is not None and n < be.many_max_bytes):
                    self._batch.add(name, t)  # large, a subclass, no compiled batch: digested at once, no copy
                    return
                check_tensor(t)
                self._batch._hold_cpu(name, t.clone(), be)  # small: a copy of its own, read at the flush with the others
                n += _HELD_COPY_OVERHEAD  # what a queued copy holds besides its bytes (an empty one too)
            else:
                u8 = logical_bytes(t)
                n = u8.numel()
                seeds = tensor_seed(t.dtype, t.shape, n)
                if n and _same_storage(u8, t):
                    u8 = u8.clone()  # a view of t's memory (a non-contiguous t was already copied by logical_bytes)
                self._batch._queue(name, u8, seeds)
        except BaseException:
            self._batch.drop(name)
            raise
        self._pending += n
        if self._pending >= self.flush_bytes:
            self.launch()

    def drop(self, name: str) -> None:
        """Forget ``name`` (:meth:`DigestBatch.drop <refit_verify.digest.batch.DigestBatch.drop>`)."""
        self._batch.drop(name)

    def launch(self) -> None:
        """Launch the digests of the pending copies now (the copies are freed after, in stream order).
        A launch that raises leaves them pending: the next add past ``flush_bytes`` tries again."""
        self._batch.launch()
        self._pending = 0

    def hexdigests(self) -> dict[str, str]:
        """``{name: 32-hex}`` in insertion order (launches what is pending; one synchronisation per device)."""
        self._pending = 0
        return self._batch.hexdigests()

    def __contains__(self, name: str) -> bool:
        return name in self._batch._order

    def __len__(self) -> int:
        return len(self._batch._order)


_HELD_COPY_OVERHEAD = 512
"""Bytes a :class:`CopyingBatch` counts per queued CPU copy besides its own (the tensor object, its
queue entry), so that ``flush_bytes`` bounds many small or empty copies too."""

_NOW = object()
"""Default of :meth:`HeldBatch.add`'s ``version``: read the version counter at the add."""


class HeldBatch:
    """Digests of tensors their owner leaves untouched until the digests are read: no copy at all.

    For a trainer that exports tensors it does not modify, free or reuse before the refit ends
    (its live parameters, outside PEFT merges and sharded gathers): :meth:`add` records the tensor
    (a reference, its address, storage size and version counter) and the digests are launched over
    the tensors themselves, every :attr:`flush_bytes` and at :meth:`hexdigests`.

    The same memory is exported at every refit, so each flush's list of names keeps a
    :class:`~refit_verify.digest.kept.DigestSet` built over it (process-wide, up to
    :data:`~refit_verify.digest.kept.KEPT_HELD_TENSORS` tensors over all of them, holding signatures and launch plans, never
    the tensors): a flush whose names and tensor signatures (address, shape, strides, dtype,
    storage) are those of the kept set launches its plan with one signature compare per tensor, no
    planning; on the CPU, so does a flush of the kept set's layout at other addresses (a relocatable
    set, :meth:`~refit_verify.digest.kept.DigestSet.moved`: a copy made at every refit). Anything
    else takes the general path and is remembered for the next refit: on the CPU (memory a set can
    follow) a set is built over the flush then and read at once
    (:func:`refit_verify.digest.kept.keep_held_now`), so the second refit costs what later ones do;
    elsewhere the flush is read by a :class:`~refit_verify.digest.batch.DigestBatch` and its
    signatures kept, its set built at the second sight (:func:`refit_verify.digest.kept._keep_held`).

    Before a held tensor is read it is checked: a tensor whose version counter moved (modified in
    place through it), whose address changed or whose storage no longer holds it (freed or resized,
    as FSDP1 does after a gather) is not read and is named in :attr:`changed` with the reason. A
    write through another alias of its memory (``param.data``, which has a version counter of its
    own) is not seen by the counter: the tensor is then digested as it is at the flush, which the
    engine's copy does not match (a false failure, never a false pass).

    Host cost: an ``add`` of a plain tensor with an address is a few attribute reads and an append
    (the other input checks run at its flush; see :meth:`add`); a flush over
    a kept set one :func:`~refit_verify.digest.kept.signature` per tensor and one launch per device
    (``benchmarks/bench_host_ops.py``).

    Args:
        flush_bytes: bytes held at which their digests are launched (default 256 MiB).
        space: what the kept sets of this batch are keyed under besides the names (``""``: a
            trainer's export): users of the same names over other memory in one process (a
            colocated trainer and its engine's check before loading) keep theirs apart.

    Attributes:
        changed: ``{name: why}`` of tensors not digested because they changed after their add.
    """

    def __init__(self, flush_bytes: int = 256 << 20, space: str = "") -> None:
        self.flush_bytes = flush_bytes
        self._space = (space,) if space else ()
        self._batch = DigestBatch(hold_cpu=True)  # the general path: checked unchanged right before the launch reads them
        # (name, tensor, version counter, data_ptr, storage bytes or None: not read, see add) at the add
        self._held: list[tuple[str, torch.Tensor, int | None, int, int | None]] = []
        self._pending = 0
        self._order: dict[str, int] = {}  # name -> number of its latest add, in first-insertion order
        self._adds = 0
        self._sets: list[tuple[tuple[str, ...], int, SetLaunch]] = []  # kept-set launches: (names, first add number, launch)
        self._done: dict[str, str] = {}
        self._checked = False  # digest_now: every add was checked in full just before, nothing ran since
        self.changed: dict[str, str] = {}
        self._failed: str | None = None  # why a launch or read of this batch raised: its digests are not known since

    def _check_usable(self) -> None:
        if self._failed is not None:
            raise RefitError(f"refit-verify: a digest launch or read of this batch failed earlier ({self._failed}); the "
                             "digests of what it held are not known: a new batch must digest them again")

    def add(self, name: str, t: torch.Tensor, version: int | None | object = _NOW) -> None:
        """Hold ``t`` under ``name`` until the next flush (a later add of the same name replaces it).

        ``version``: ``t``'s version counter as read when the caller took ``t`` (a deferred add,
        :meth:`StreamDigests.drain`: a write through ``t`` since then is then found); default: now.

        An add whose checks raise records ``name`` in :attr:`changed` (:meth:`note_changed`): no
        digest of an earlier add of it is returned.

        Host cost: a plain tensor or parameter whose storage has an address (not quantized, not
        nested) is taken with a few attribute reads (``data_ptr``, ``storage_offset``, ``itemsize``,
        ``_version``, ``nbytes``) and an append, no storage object made: an add runs between a
        loader's calls, where every step costs several times more than in a tight loop. The rest of :func:`logical_bytes`' checks
        (strided layout, at most 255 dimensions, a storage that holds every byte it spans) run at
        the launch, over the flush: a tensor failing them there is named in :attr:`changed` with why
        and never read. Anything else is checked in full here. The storage's size is not read at
        such an add, so a storage freed and allocated again at the same address before the flush is
        not named: its bytes are digested as they are then (a mismatch unless they are the bytes the
        engine loaded).

        Raises:
            RefitInputError: ``t`` is not a tensor, or is one that has no bytes to read (meta, zero
                tensor, a freed storage at any offset, sparse), a quantized or nested one, or one
                taking the full checks that fails them (:func:`logical_bytes`).
            RefitError: the flush this add starts finds that a launch or read of this batch raised
                earlier (see :meth:`launch`; an add below ``flush_bytes`` only holds ``t``).
        """
        # an add is the per-tensor host cost: the fewest checks that refuse what cannot be read at all (RefitCheck.add runs
        # these first checks inline for its taken adds, then take(): keep the two alike)
        try:
            held = None
            if type(t) in PLAIN_TYPES and not (t.is_quantized or t.is_nested):
                try:  # data_ptr: 0 for a meta or zero tensor, an empty one, a freed storage; its offset alone for a view of a
                    ptr = t.data_ptr()  # freed storage; raises with no storage (sparse), _version for an inference tensor
                    if ptr and ptr != t.storage_offset() * t.itemsize:  # the rest of check_tensor (layout, dims, a storage that
                        held = (name, t, t._version if version is _NOW else version, ptr, None)  # holds it all): at the launch
                        nbytes = t.nbytes
                except RuntimeError:
                    held = None
            if held is None:  # anything else: every check now
                with PLAIN():
                    check_tensor(t)
                    version = version_of(t) if version is _NOW else version  # None for an inference tensor: its address is checked
                    nbytes = t.numel() * t.element_size()
                    held = (name, t, version, t.data_ptr(), t.untyped_storage().nbytes() if nbytes else 0)
        except BaseException as e:
            self.note_changed(name, _why_failed(e))
            raise
        self.changed.pop(name, None)
        self._held.append(held)
        self._pending += nbytes
        if self._pending >= self.flush_bytes:
            self.launch()

    def take(self, items: list[tuple[str, torch.Tensor, int, int, int]]) -> None:
        """Hold tensors whose adds were made earlier, in order: ``(name, tensor, version counter,
        data_ptr, nbytes)`` as read at the add, after :meth:`add`'s own first checks passed then (a
        plain tensor or parameter, not quantized or nested, ``data_ptr`` nonzero and not just its
        offset). As :meth:`add` of each at that time: the rest of the checks, and whether it was
        written, freed or given other memory since, run at the launch (a failing one is named in
        :attr:`changed`); launches when the held bytes reach ``flush_bytes``.

        Raises:
            RefitError: the launch it starts finds that a launch or read of this batch raised earlier.
        """
        changed, held = self.changed, self._held
        n = 0
        for name, t, version, ptr, nbytes in items:
            changed.pop(name, None)
            held.append((name, t, version, ptr, None))
            n += nbytes
        self._pending += n
        if self._pending >= self.flush_bytes:
            self.launch()

    def note_changed(self, name: str, why: str) -> None:
        """Record that ``name``'s latest add is not digested, and why (a deferred add found changed, an
        add whose checks raised): it is named in :attr:`changed` and no digest of it is returned."""
        self._adds += 1
        self._order[name] = self._adds
        self._batch._order.pop(name, None)
        self.changed[name] = why

    @plain_tensor_ops
    def launch(self) -> None:
        """Check the held tensors and launch their digests now (no synchronisation).

        Raises:
            RefitError: a launch or read of this batch raised earlier: once one has, the batch refuses
                every later launch and read (:meth:`launch`, :meth:`hexdigests`) rather than answer
                with the names of the failed flush missing, or at an earlier add's digest.
            Exception: what this launch raised (a device error); the batch refuses every later launch and read.
        """
        self._check_usable()
        held, self._held, self._pending = self._held, [], 0
        if not held:
            return
        try:
            self._launch(held)
        except BaseException as e:
            self._failed = f"{type(e).__name__}: {e}"[:300]
            raise

    def _launch(self, held: list) -> None:
        names, ts, versions, ptrs, sizes = zip(*held)  # the adds as columns
        key = self._space + names if self._space else names
        cols = _columns_or_none(ts)  # one pass per field, for the kept set's checks (None: no storage to sign, the
        found = _held._kept_held(key, cols, ts)  # general path says why)
        if found is not None and _unchanged(ts, versions, ptrs, sizes, cols):  # type: ignore[arg-type]
            kept, moved = found
            first = self._adds + 1  # a kept set's names are unique: one add number each, in order
            self._adds += len(names)
            self._order.update(zip(names, range(first, self._adds + 1)))
            if self._batch._order:
                for name in names:
                    self._batch._order.pop(name, None)
            self._sets.append((names, first, kept.launch(check=False, tensors=ts, moved=moved)))
            return
        self._launch_general(held, key, list(zip(*cols)) if cols is not None else None)

    def _launch_general(self, held: list, key: tuple[str, ...], sigs: list[tuple] | None) -> None:
        """Check each held tensor and digest it; when every one is unchanged and the names are unique,
        through a set kept now where one can follow the tensors (:func:`~refit_verify.digest.kept.keep_held_now`),
        else through the :class:`DigestBatch`, remembering the flush's signatures (:func:`~refit_verify.digest.kept._keep_held`)."""
        latest = {h[0]: i for i, h in enumerate(held)}
        ok = sigs is not None and len(latest) == len(held)
        adds: list[tuple[str, torch.Tensor]] = []
        for i, (name, t, version, ptr, size) in enumerate(held):
            if latest[name] != i:
                continue  # added again later: the later add is what counts
            self._adds += 1
            self._order[name] = self._adds
            why = _changed(t, version, ptr, size)
            if why is None and size is None and not self._checked:  # added on the fast path: the checks it left for now
                try:
                    check_tensor(t)
                except RefitInputError as e:
                    why = _why_failed(e)
            if why is not None:
                self.changed[name] = why
                self._batch._order.pop(name, None)
                ok = False
                continue
            adds.append((name, t))  # checked (at its add, or just now), unchanged since its add
        if ok and adds:  # every add unchanged, names unique: CPU memory a set can follow is read through one kept now
            ts = [t for _, t in adds]
            kept = _held.keep_held_now(key, ts)
            if kept is not None:
                names = tuple(n for n, _ in adds)
                if self._batch._order:
                    for name in names:
                        self._batch._order.pop(name, None)
                self._sets.append((names, self._adds - len(names) + 1, kept.launch(check=False, tensors=ts)))
                return
        for name, t in adds:
            self._batch.add(name, t, checked=True)
        self._batch.launch()
        if ok:
            _held._keep_held(key, sigs, [h[1] for h in held])

    def hexdigests(self) -> dict[str, str]:
        """``{name: 32-hex}`` of what was held and did not change, in the order added (a name added twice in one
        flush: at its later add; across flushes: at its first), one synchronisation per device.

        Raises:
            RefitError: a launch or read of this batch raised earlier (see :meth:`launch`).
            Exception: what this launch or read raised (a device error); the batch refuses every later launch and read.
        """
        self.launch()
        try:
            return self._collect()
        except BaseException as e:  # a read that failed halfway: some launches read, some not
            self._failed = f"{type(e).__name__}: {e}"[:300]
            raise

    def _collect(self) -> dict[str, str]:
        done = self._done
        done.update(self._batch.hexdigests())
        order = self._order
        for names, first, launched in self._sets:
            hexes = DigestSet.collect(launched)
            if list(map(order.get, names)) == list(range(first, first + len(names))):  # none added again since
                done.update(zip(names, hexes))
                continue
            for k, (name, h) in enumerate(zip(names, hexes), first):
                if order.get(name) == k:
                    done[name] = h
        self._sets.clear()
        if not self.changed and list(done) == list(order):  # every add digested, in order
            return dict(done)
        return {n: done[n] for n in order if n in done and n not in self.changed}

    def __len__(self) -> int:
        return len(self._order.keys() | {h[0] for h in self._held})



def _unchanged(ts: Sequence[torch.Tensor], versions: Sequence[int | None], ptrs: Sequence[int], sizes: tuple[int | None, ...],
               columns: tuple[list, ...]) -> bool:
    """True iff no held tensor changed since its add, read column by column: its version counter
    (where one was read: not an inference tensor's), its address (``columns[0]``) and, for one
    whose storage size was read at its add, that size (``columns[5]``; 0 recorded: an empty tensor;
    None: not read, the kept set's signatures compare the storage as it is now)."""
    if list(ptrs) != columns[0]:
        return False
    if sizes.count(None) != len(sizes):  # some added through every check, their storage sizes read then
        if not all(s is None or s == 0 or s == g for s, g in zip(sizes, columns[5])):
            return False
    if None in versions:
        return all(v is None or t._version == v for t, v in zip(ts, versions))
    return list(map(VERSION, ts)) == list(versions)


@plain_tensor_ops
def digest_now(items: Iterable[tuple[str, torch.Tensor]], space: str = "", checked: bool = False) -> dict[str, str]:
    """``{name: 32-hex}`` of ``items`` as they are now, read in one batch (one synchronisation per device).

    For a caller that reads tensors right after handing them over, with no code of its user in
    between (a transport's digests ahead of the bytes, a receiver's check before loading): there is
    no held interval to guard, so none of :class:`HeldBatch`'s per-add checks runs. When the names
    (unique) and every tensor's :func:`~refit_verify.digest.kept.signature` are those of a kept set
    (the same memory as the last call of these names under ``space``), the kept launch plan is run
    after :meth:`DigestSet.valid` (the signature fields compared field by field, nothing else per
    tensor); CPU tensors of a kept set's layout at other addresses are read through it too
    (:meth:`DigestSet.moved`, a pointer per tensor made again), and so are, at their first call,
    names a caller expected under ``space`` with their layout (:func:`~refit_verify.digest.kept.expect_layouts`:
    a set planned ahead, read only where :meth:`DigestSet.moved` finds that layout); otherwise every pair is checked
    (:func:`~refit_verify.digest.tensors.logical_bytes`' checks, a pair replaced by a later one of its name
    too: nothing is read when one fails) and the call goes through a :class:`HeldBatch` (the set is
    kept for the next call, as a flush's is).

    Args:
        items: ``(name, tensor)`` pairs (any iterable, read once), tensors of any dtype, shape and
            device the digest reads; a later pair of the same name replaces an earlier one.
        space: as :class:`HeldBatch` (kept sets of other users of the same names stay apart).
        checked: the caller has just run :func:`~refit_verify.digest.tensors.check_tensor` on every
            tensor and nothing ran since (a first sight does not check them again).

    Returns:
        dict[str, str]: ``{name: 32 lowercase hex}`` (digest v1, ``docs/digest-spec.md``; equal to
        :func:`~refit_verify.digest.batch.tensor_digest` of each tensor), in the order given (a name given twice: at its later pair).

    Raises:
        RefitInputError: a tensor cannot be digested (see :func:`~refit_verify.digest.tensors.logical_bytes`),
            naming its pair; nothing was read.
    """
    items = list(items)  # an iterator is read once
    names = tuple(n for n, _ in items)
    ts = [t for _, t in items]
    key = (space, *names) if space else names
    kept = _held.kept_set(key)  # else the HeldBatch below signs them (once)
    if kept is None and space:  # first sight: a set planned from the layout expected here, if any (expect_layouts)
        kept = _held.expected_set(space, names)
    if isinstance(kept, DigestSet) and len(set(names)) == len(names) and set(map(type, ts)) <= PLAIN_SET \
            and not any(map(IS_META, ts)):
        cols = _columns_or_none(ts)  # every signature field read once, for both checks (None: the HeldBatch says why)
        if cols is not None and kept.valid(ts, cols):  # every signature the set's, compared field by field
            return dict(zip(names, kept.digest(check=False, tensors=ts)))
        if cols is not None and kept.moved(ts, cols):  # the same layout elsewhere (the CPU's clones of a staged buffer)
            if kept.ahead:  # as expected: kept for the next calls of these names, as a set built now would be
                _held._store_held(key, kept)
            return dict(zip(names, kept.digest(check=False, tensors=ts, moved=True)))
    for name, t in () if checked else items:  # every pair checked before any is read: a bad one raises, a pair given again too
        try:
            check_tensor(t)
        except RefitInputError as e:
            raise RefitInputError(f"{name!r:.100}: {e}") from None
    batch = HeldBatch(flush_bytes=1 << 62, space=space)
    batch._checked = True  # just checked (here or by the caller): its launch does not check them again
    for name, t in items:
        batch.add(name, t)
    out = batch.hexdigests()
    if batch.changed:  # unreachable after the checks above (nothing runs between them and the launch); never a silent gap
        name, why = next(iter(batch.changed.items()))
        raise RefitInputError(f"{name!r:.100}: {why}")
    return out



_WARM_SPACE = "refit-verify warm-up"


@_backends.warm_path
def _warm_first_sight(device: torch.device) -> None:
    """On the CPU and a kernel device (CUDA), the first use of :func:`digest_now`'s paths on
    throwaway tensors on ``device`` (a few small ones of each float dtype a refit pushes): a first
    sight (checked, planned, a set kept), a set expected ahead
    (:func:`~refit_verify.digest.kept.expect_layouts`), a kept set read where the tensors moved; and
    :func:`~refit_verify.digest.batch.tensor_digest` (a close's fill digests). Nothing of it is kept.
    Other devices: nothing."""
    if device.type != "cpu" and device.type not in _backends.KERNEL_DEVICE_TYPES:
        return
    specs = [(f"{i}.{j}", shape, dt) for i, dt in enumerate((torch.bfloat16, torch.float16, torch.float32))
             for j, shape in enumerate(((4, 8), (8,)))]
    try:
        made = lambda: [(n, torch.zeros(sh, dtype=dt, device=device)) for n, sh, dt in specs]  # noqa: E731 - fresh each time
        digest_now(made(), space=_WARM_SPACE)  # first sight
        digest_now(made(), space=_WARM_SPACE)  # moved
        _held.forget_space(_WARM_SPACE)
        _held.expect_layouts(_WARM_SPACE, specs)
        digest_now(made(), space=_WARM_SPACE)  # expected ahead
        tensor_digest(torch.zeros((0, 8), dtype=torch.bfloat16, device=device))
    finally:
        _held.forget_space(_WARM_SPACE)


def _why_failed(e: BaseException) -> str:
    """The ``changed`` reason of an add that raised ``e``."""
    if isinstance(e, RefitInputError):
        return f"it cannot be digested: {e}"
    return f"its add raised {type(e).__name__}: {e}"[:500]


def _changed(t: torch.Tensor, version: int | None, ptr: int, size: int | None) -> str | None:
    """Why held tensor ``t`` no longer holds what it held when it was added (None: it does): its
    version counter, address or storage size (``size`` bytes at the add; 0 for an empty tensor;
    None: not read at the add, so a storage that no longer holds ``t`` is what is told) moved."""
    if version is not None and t._version != version:
        return f"it was modified in place after it was added ({version} -> {t._version} writes through it)"
    if size and t.untyped_storage().nbytes() != size:
        return f"its storage was freed or resized after it was added ({size} -> {t.untyped_storage().nbytes()} bytes)"
    if t.data_ptr() != ptr:
        if size is None:
            try:
                check_storage(t)  # every element it spans still in its storage?
            except RefitInputError:
                return f"its storage was freed or resized after it was added (now {t.untyped_storage().nbytes()} bytes)"
        return "its memory was replaced after it was added"
    return None
