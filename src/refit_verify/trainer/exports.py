"""The trainer's digests of a refit: tensors exported one at a time, copied or held.

:class:`StreamDigests` is the trainer's face of :mod:`refit_verify.digest.incremental`'s batches
(:class:`~refit_verify.digest.incremental.CopyingBatch`, :class:`~refit_verify.digest.incremental.HeldBatch`):
``copy=True`` / ``copy=False`` / ``hold_parameters=True``, deferred held adds drained in the shadow
of a blocked call (:mod:`refit_verify.trainer.overlap`), and the report lines for held tensors that changed
(:func:`changed_problems`). Used by the trainer API (:func:`refit_verify.refit`), vLLM's native
weight-transfer hooks (:mod:`refit_verify.vllm_plugin.native_sender`) and checkpoints.
"""

from __future__ import annotations

import threading
import time
from time import perf_counter as _perf_counter

import torch

from refit_verify.digest import incremental as _ds  # its _changed read at each use (tests replace it)
from refit_verify.digest.incremental import CopyingBatch, HeldBatch, _why_failed
from refit_verify.digest.tensors import version_of
from refit_verify.errors import RefitConfigError, RefitInputError, RefitProtocolError

__all__ = ["MAX_NAMED_CHANGED", "YIELD_EVERY", "StreamDigests", "changed_problems"]


YIELD_EVERY = 32
"""Tensors a drain in the shadow of a blocked call handles between two ``time.sleep(0)`` (GIL hand-overs)."""

MAX_NAMED_CHANGED = 20
"""Held tensors named one by one in a report before the rest are counted."""


def changed_problems(changed: dict[str, str], *, verb: str, hint: str, more: str, label=lambda n: n) -> list[str]:
    """Report lines for held tensors that changed before their digests were taken (``changed``:
    ``{name: why}``, from :attr:`StreamDigests.changed`): one per tensor for the first
    :data:`MAX_NAMED_CHANGED` (``the trainer's {label(name)} could not be digested as {verb}: {why}
    ({hint})``), then ``… and N {more}``."""
    out = [f"the trainer's {label(name)} could not be digested as {verb}: {why} ({hint})"
           for name, why in list(changed.items())[:MAX_NAMED_CHANGED]]
    if len(changed) > MAX_NAMED_CHANGED:
        out.append(f"… and {len(changed) - MAX_NAMED_CHANGED} {more}")
    return out


class StreamDigests:
    """Digests of tensors exported one at a time (a trainer's send), with no per-tensor launch or sync.

    By default each tensor is recorded as it is at :meth:`add` (a device copy on CUDA, see
    :class:`~refit_verify.digest.incremental.CopyingBatch`, digested in batches of :data:`FLUSH_BYTES`;
    a small CPU tensor is copied and read with the others, a large one digested at once). With ``copy=False`` the tensors are held, not copied
    (:class:`~refit_verify.digest.incremental.HeldBatch`, launched every :data:`HELD_FLUSH_BYTES`): the
    caller leaves them untouched until :meth:`digests`, and any that changed are in :attr:`changed`. With
    ``hold_parameters=True`` (and ``copy=True``) a tensor that is a ``torch.nn.Parameter`` is held
    and any other tensor copied: a parameter is the model's own memory, not a temporary of the
    export (a gathered, cast or merged tensor) that holding would keep alive. One synchronisation
    when :meth:`digests` is read.

    With :attr:`defer_held` set, an add of a held parameter only records it, its version counter,
    address and storage size (an append); its checks, signature and launch run at the next
    :meth:`drain` (or :meth:`launch` / :meth:`digests`): a caller that knows when it will be
    blocked (a trainer waiting for the engine's ``update_weights`` RPC, :mod:`refit_verify.trainer.overlap`)
    does that work there. A parameter written in place, freed, resized or given other memory
    between its add and the drain is named in :attr:`changed` (as an inline add would have found
    it at the flush), and one that cannot be digested at all is named there too (an inline add
    raises at once); neither is digested. Past :attr:`defer_bytes` of deferred bytes with no drain,
    an add drains at once (no shadow came: the digests launch as they would inline).

    Args:
        copy: copy every tensor at :meth:`add` (True) or hold every tensor (False).
        hold_parameters: with ``copy=True``, hold ``torch.nn.Parameter`` tensors instead.
        held_flush_bytes: bytes held at which the held tensors' digests launch (default
            :data:`HELD_FLUSH_BYTES`, 1 GiB; ``math.inf``: only when the digests are read; copies
            launch every :data:`FLUSH_BYTES`, 256 MiB).

    Raises:
        RefitConfigError: ``held_flush_bytes`` is not a number > 0.

    Attributes:
        digest_s: host seconds spent digesting (drains included, wherever they ran).
        drain_s: of those, seconds spent in :meth:`drain` calls made with ``shadow=True`` (while the
            caller's own thread was blocked elsewhere).
        changed: ``{name: why}`` of held tensors that changed before their digests were taken
            (not in :meth:`digests`; see :class:`HeldBatch`).
        defer_held: defer held parameters' adds to :meth:`drain` (default False; ``hold_parameters`` only).
        defer_bytes: deferred bytes at which an add drains at once (default :data:`DEFER_BYTES`;
            ``math.inf``: never, the caller drains).
    """

    FLUSH_BYTES = 256 << 20
    """Bytes of copies at which a copying batch launches (bounds the copies the device holds at once)."""
    HELD_FLUSH_BYTES = 1 << 30
    """Bytes held at which a held batch launches: a held tensor costs no memory of ours, so a held
    batch launches less often than a copying one (each launch is a fixed host cost, about 0.45 ms on
    an H100/H200 host); bounded so one launch's work area stays small (about 1 % of the bytes read)."""
    DEFER_BYTES = 1 << 30
    """Deferred bytes at which an add drains at once (:attr:`defer_held`)."""

    def __init__(self, copy: bool = True, hold_parameters: bool = False, held_flush_bytes: float | None = None) -> None:
        self.copy = copy
        self.hold_parameters = hold_parameters and copy
        if held_flush_bytes is not None and (isinstance(held_flush_bytes, bool) or not isinstance(held_flush_bytes, (int, float))
                                             or not held_flush_bytes > 0):
            raise RefitConfigError(f"held_flush_bytes must be a number > 0 (bytes; math.inf: launch only when read), "
                                   f"got {held_flush_bytes!r}")
        self.held_flush_bytes: float = self.HELD_FLUSH_BYTES if held_flush_bytes is None else held_flush_bytes
        self._batch = self._new()
        self._held = HeldBatch(self.held_flush_bytes) if self.hold_parameters else None
        self._last: dict[str, bool] = {}  # name -> held (True) or copied, of its latest add (hold_parameters only)
        self._done: dict[str, str] = {}
        self.changed: dict[str, str] = {}
        self.digest_s = 0.0
        self.drain_s = 0.0
        self.defer_held = False
        self.defer_bytes: float = self.DEFER_BYTES
        # held adds not drained yet: (name, tensor, version, data_ptr, storage bytes) as at the add
        self._deferred: list[tuple[str, torch.Tensor, int | None, int, int]] = []
        self._deferred_bytes = 0
        self._uncollected = 0  # adds since the digests were last read
        self._draining = threading.Lock()  # held by the drain running now (one at a time: see _lock_drain)

    def _new(self) -> CopyingBatch | HeldBatch:
        return CopyingBatch(self.FLUSH_BYTES) if self.copy else HeldBatch(self.held_flush_bytes)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Digest ``tensor`` under ``name`` (a later add of the same name replaces it).

        An add that raises names ``name`` in :attr:`changed` (why: it cannot be digested) until a later
        add of it succeeds: no digest of an earlier add of it is returned, as for a deferred add
        found undigestible at the drain.

        Raises:
            TypeError: ``name`` is not a str, or ``tensor`` cannot be digested (see :func:`tensor_digest`).
        """
        if not isinstance(name, str):
            raise RefitInputError(f"tensor names must be str, got {name!r:.100}")
        t0 = _perf_counter()
        self._uncollected += 1
        try:
            if self._held is None:  # one batch: copies (copy=True) or held tensors (copy=False)
                self._batch.add(name, tensor)
            else:
                held = self._last[name] = isinstance(tensor, torch.nn.Parameter)
                if not (held and self.defer_held and self._defer(name, tensor)):
                    if held and self._deferred:  # deferred adds first, in order (defer_held turned off since)
                        self._drain_locked()
                    (self._held if held else self._batch).add(name, tensor)
        except BaseException as e:
            why = _why_failed(e)
            self._done.pop(name, None)  # collected from an earlier add
            for batch in (self._batch, self._held):  # pending from an earlier add (the failed batch forgot it already)
                if isinstance(batch, HeldBatch):
                    batch.note_changed(name, why)
                elif batch is not None:
                    batch.drop(name)
            if self._deferred:  # an earlier deferred add of it: never drained after this one
                kept = [d for d in self._deferred if d[0] != name]
                if len(kept) != len(self._deferred):
                    self._deferred, self._deferred_bytes = kept, sum(d[4] for d in kept)
            self.changed[name] = why
            self.digest_s += _perf_counter() - t0
            raise
        self.digest_s += _perf_counter() - t0

    def add_taken(self, items: list[tuple[str, torch.Tensor, int, int, int]]) -> None:
        """Add held tensors taken earlier, in order: ``(name, tensor, version counter, data_ptr, nbytes)``
        as read when taken, after :meth:`HeldBatch.add <refit_verify.digest.incremental.HeldBatch.add>`'s
        own first checks passed then (:meth:`HeldBatch.take <refit_verify.digest.incremental.HeldBatch.take>`).

        For a caller that only recorded its adds where they were made (:meth:`RefitCheck.add
        <refit_verify.trainer.refit.RefitCheck.add>`) and hands them over here at once. Each counts as an
        add made when it was taken: a tensor written, freed or given other memory since is named in
        :attr:`changed` at the launch, as is one failing the checks left to it.
        A stream of held tensors only (``copy=False``, no ``hold_parameters``).

        Raises:
            RefitConfigError: this stream copies its tensors, or sorts parameters apart.
            RefitError: the launch it starts finds that a launch or read of its batch raised earlier.
        """
        if self.copy or self._held is not None:
            raise RefitConfigError("add_taken adds held tensors: a StreamDigests(copy=False) without hold_parameters")
        t0 = _perf_counter()
        self._uncollected += len(items)
        try:
            self._batch.take(items)
        finally:
            self.digest_s += _perf_counter() - t0

    def _defer(self, name: str, t: torch.Tensor) -> bool:
        """Record held parameter ``t`` for the next drain; False when it has no storage to record (added inline)."""
        try:
            ptr, size = t.data_ptr(), t.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            return False
        self._deferred.append((name, t, version_of(t), ptr, size))
        self._deferred_bytes += size
        if self._deferred_bytes >= self.defer_bytes:
            self._drain_locked()
        return True

    def _drain_locked(self) -> None:
        """:meth:`_drain` under the drain lock (an add's: the budget reached, or deferred adds before an inline one)."""
        self._lock_drain()
        try:
            self._drain()
        finally:
            self._draining.release()

    def _lock_drain(self) -> None:
        """Take the drain lock, or raise: a drain still runs in another thread (shadow work whose call
        returned and that timed out, :func:`~refit_verify.trainer.overlap.run_in_shadow`, still holds these digests)."""
        if not self._draining.acquire(blocking=False):
            raise RefitProtocolError("refit-verify: a drain of these digests is still running in another thread (shadow work "
                             "that did not end in time?): what it has not digested yet is not known, so these digests "
                             "cannot be read or added to until it ends")

    @property
    def deferred(self) -> int:
        """Held adds waiting for :meth:`drain`."""
        return len(self._deferred)

    @property
    def uncollected(self) -> int:
        """Adds since the digests were last read (:meth:`digests`, or :meth:`drain` with ``collect``)."""
        return self._uncollected

    def drain(self, *, collect: bool = False, shadow: bool = False) -> None:
        """Run the deferred adds (checks, signatures) and launch every digest added so far; with
        ``collect``, also wait for them and take their hex digests (what :meth:`digests` does).
        ``shadow``: the caller's own thread is blocked meanwhile: count the seconds in
        :attr:`drain_s` too, and let other threads run every :data:`YIELD_EVERY` tensors
        (the blocked call's own Python, e.g. its reply's decoding, waits less for the GIL).

        A deferred tensor that changed since its add or cannot be digested is named in
        :attr:`changed` (from :meth:`digests`), never raised.

        Raises:
            RefitProtocolError: a drain of these digests still runs in another thread (one that timed out
                in the shadow of a call): the names it has not reached are neither digested nor changed yet.
        """
        t0 = time.perf_counter()
        self._lock_drain()
        try:
            self._drain(YIELD_EVERY if shadow else 0)
            self._batch.launch()
            if self._held is not None:
                self._held.launch()
            if collect:
                self._take()
        finally:
            self._draining.release()
            dt = time.perf_counter() - t0
            self.digest_s += dt
            if shadow:
                self.drain_s += dt

    def _drain(self, yield_every: int = 0) -> None:
        deferred, self._deferred, self._deferred_bytes = self._deferred, [], 0
        held = self._held
        i = 0
        try:
            for i, (name, t, version, ptr, size) in enumerate(deferred):
                if yield_every and i % yield_every == yield_every - 1:
                    time.sleep(0)
                why = _ds._changed(t, version, ptr, size)
                if why is None:
                    try:
                        held.add(name, t, version)
                    except RefitInputError:
                        pass  # named in held.changed by the add
                    continue
                held.note_changed(name, why)
        except BaseException as e:  # anything else (a device error): the adds not reached stay deferred, none lost
            if deferred:  # the add it stopped at is named changed (HeldBatch.add already did, unless _changed raised)
                held.note_changed(deferred[i][0], _why_failed(e))
            rest = deferred[i + 1 :]
            self._deferred = rest + self._deferred
            self._deferred_bytes = sum(d[4] for d in self._deferred)
            raise

    def _collect(self, batch: CopyingBatch | HeldBatch, held: bool | None) -> None:
        """Take ``batch``'s digests into :attr:`_done` (``held``: keep only names whose latest add went
        to this batch, True for the held one; None: every name)."""
        got = batch.hexdigests()
        for name, h in got.items():
            if held is None or self._last.get(name) is held:
                self.changed.pop(name, None)
                self._done[name] = h
        for name, why in getattr(batch, "changed", {}).items():
            if held is None or self._last.get(name) is held:
                self._done.pop(name, None)
                self.changed[name] = why

    def launch(self) -> None:
        """Launch the digests of everything added and not launched yet (no synchronisation; deferred
        adds drained first): a caller with other work before :meth:`digests` lets the device digest meanwhile."""
        self.drain()

    def digests(self) -> dict[str, str]:
        """Return ``{name: 32-hex}`` of everything added so far (drains deferred adds, collects the launched kernels first).

        Raises:
            RefitProtocolError: a drain still runs in another thread (see :meth:`drain`).
        """
        self.drain(collect=True)
        return dict(self._done)

    def _take(self) -> None:
        """Collect both batches into :attr:`_done` (one synchronisation per device) and start new ones."""
        self._uncollected = 0
        mixed = self._held is not None
        if len(self._batch):
            self._collect(self._batch, False if mixed else None)
            self._batch = self._new()
        if mixed and len(self._held):
            self._collect(self._held, True)
            self._held = HeldBatch(self.held_flush_bytes)

    def __len__(self) -> int:
        pending = len(self._batch) + (len(self._held) if self._held is not None else 0)
        return len(self._done) + pending + len(self._deferred)
