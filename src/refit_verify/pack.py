"""The sender's half of the stream layer: :class:`Packer` cuts a refit into groups of aligned slots.

Both transports pack through it (the staged ZMQ transport, :mod:`refit_verify.transport`, into a
shared staging buffer; the broadcast path, :mod:`refit_verify.broadcast`, into a bucket): digest
**before** packing, the slot layout ``offset = used; used += round_up(nbytes, alignment)``, a group
cut when the next slot or the entry list does not fit, and the oversized path (a tensor whose
aligned size exceeds a group travels alone). A :class:`PackSink` per transport provides buffers and
sends groups. The receiver's half and what both share are in :mod:`refit_verify.stream`.

Source: ``docs/protocol.md`` (sender steps, invariants).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Protocol

import torch

from refit_verify.digest import DigestBatch, dtype_name, logical_bytes
from refit_verify.digest_stream import digest_now
from refit_verify.stream import checked_item, entry_cost, round_up
from refit_verify.wire import MAX_ENTRIES_BYTES, DigestEntry, Entry

__all__ = ["PackSink", "Packer"]


class PackSink(Protocol):
    """What a transport gives the :class:`Packer`: memory for a group, and the way to send one."""

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """Return the current group's 1-D uint8 buffer (of at least the packer's capacity), allocated
        on first use; ``like`` is the first tensor's bytes (a transport may take its device)."""

    def post(self, entries: list[Entry], used: int) -> None:
        """Send the current group: ``entries`` at their offsets in the buffer, ``used`` aligned bytes."""

    def post_alone(self, u8: torch.Tensor, entry: Entry, aligned: int) -> None:
        """Send one oversized tensor alone: its logical bytes ``u8``, its entry (offset 0) and its
        aligned size in bytes."""


class Packer:
    """Packs a refit's tensors into groups of aligned slots (the sender's half of the stream layer).

    Args:
        sink: the transport's :class:`PackSink`.
        capacity: bytes of one group (``buffer_bytes // 2``); a tensor whose aligned size exceeds
            it is sent alone (:meth:`PackSink.post_alone`), never split.
        alignment: byte alignment of every slot (a power of two).
        digests: where the sender's digests go (``None``: the refit does not verify, no digest code runs).
        sync_digests: finish a group's CUDA digests with a synchronisation before it is sent
            (``True``) or only launch them (``False``: the transport orders its stream before the
            bytes leave).
        max_entries_bytes: estimated encoded size of a group's entry list at which it is cut.
        digests_ahead: give every entry its digest (:class:`~refit_verify.wire.DigestEntry`), so
            the receiver can check each tensor before loading it: each group's digests are
            finished (one synchronisation per group on CUDA) before the group is sent. Needs
            ``digests``.

    Attributes:
        tensors (int): tensors packed. bytes (int): their exact bytes. digest_s (float): seconds
        in digest code. last_name (str | None): the last name taken from the stream.
    """

    def __init__(self, sink: PackSink, *, capacity: int, alignment: int, digests: DigestBatch | None,
                 sync_digests: bool = False, max_entries_bytes: int = MAX_ENTRIES_BYTES, digests_ahead: bool = False) -> None:
        self.sink, self.capacity, self.alignment = sink, capacity, alignment
        self.digests, self.sync_digests, self.max_entries_bytes = digests, sync_digests, max_entries_bytes
        self.ahead = digests_ahead and digests is not None
        self._hex: dict[str, str] = {}  # digests of finished groups (digests_ahead), and all of digest_first's
        self._known: dict[str, str] = {}  # digest_first's
        self.names: set[str] = set()
        self.entries: list[Entry] = []
        self.used = 0
        self._est = 0
        self._cuda_pending = False
        self.tensors = 0
        self.bytes = 0
        self.digest_s = 0.0
        self.last_name: str | None = None

    def add(self, item: tuple[str, torch.Tensor]) -> None:
        """Digest one ``(name, tensor)`` (if verifying), then pack it; may send groups.

        Raises:
            TypeError / ValueError: as :func:`checked_item`; what the digest raises for a tensor it
            cannot read (sparse, meta); what the sink raises.
        """
        name, t = checked_item(item, self.names)
        self.last_name = name
        if self.digests is not None and name not in self._known:
            t0 = time.perf_counter()
            self.digests.add(name, t)  # before packing: covers the pack, the transport and the slicing
            self.digest_s += time.perf_counter() - t0
            self._cuda_pending |= t.is_cuda
        u8 = logical_bytes(t)
        n = u8.numel()
        a = round_up(n, self.alignment)
        dt, shape = dtype_name(t.dtype), list(t.shape)
        if a > self.capacity:
            self.flush()
            self.finish_digests()
            if self.ahead:
                entry: Entry = DigestEntry(name=name, dtype=dt, shape=shape, offset=0, nbytes=n, digest=self._group_hex()[name])
            else:
                entry = Entry(name=name, dtype=dt, shape=shape, offset=0, nbytes=n)
            self.sink.post_alone(u8, entry, a)
        else:
            cost = entry_cost(name, dt, t.dim())
            if self.used + a > self.capacity or self._est + cost > self.max_entries_bytes:
                self.flush()
            buf = self.sink.buffer(u8)
            if n:
                dst = buf[self.used : self.used + n]
                dst.copy_(u8, non_blocking=dst.is_cuda)
                del dst
            self.entries.append(Entry(name=name, dtype=dt, shape=shape, offset=self.used, nbytes=n))
            self.used += a
            self._est += cost
        del u8
        self.tensors += 1
        self.bytes += n

    def digest_first(self, items: Sequence[tuple[str, torch.Tensor]]) -> None:
        """When verifying: digest a whole refit given as a sequence before any of it is packed, at
        once through :func:`~refit_verify.digest_stream.digest_now` (kept sets: the trainer's memory
        at every refit; no per-tensor check besides one signature): one synchronisation per device
        for the refit instead of one per group, and no digest work per :meth:`add`. The tensors are
        the trainer's, unchanged while it sends them; one changed in between differs from its digest
        where the receiver reads it (refused before loading with ``digests_ahead``, a mismatch in
        the verdict without): a failure, never a pass.

        Digesting only the first group's tensors ahead and the rest after the first group was sent
        (while the receiver loads it) was tried and measured slower on one H200, about 17 ms per
        refit more (``docs/performance.md``, the fourteenth run; the cause was not isolated: the
        sender's digests then run on the GPU while the receiver's process loads).

        Raises:
            TypeError / ValueError: as :func:`checked_item` (before anything is sent);
            RefitInputError: a tensor cannot be digested.
        """
        if self.digests is None:
            return
        t0 = time.perf_counter()
        seen: set[str] = set()
        got = digest_now([checked_item(item, seen) for item in items])
        self._known.update(got)
        self._hex.update(got)
        self.digest_s += time.perf_counter() - t0

    def add_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`add` every item, then :meth:`flush` the last group."""
        for item in named_tensors:
            self.add(item)
        self.flush()

    def flush(self) -> None:
        """Send the pending group, if any (its CUDA digests finished first)."""
        if self.entries:
            self.finish_digests()
            entries = self.entries
            if self.ahead:
                hexes = self._group_hex()
                entries = [DigestEntry(name=e.name, dtype=e.dtype, shape=e.shape, offset=e.offset, nbytes=e.nbytes,
                                       digest=hexes[e.name]) for e in entries]
            self.sink.post(entries, self.used)
        self.entries, self.used, self._est = [], 0, 0

    def _group_hex(self) -> dict[str, str]:
        """Finish the digests added since the last group (one synchronisation on CUDA); return all so far."""
        if self.digests is not None and self.digests._order:
            t0 = time.perf_counter()
            self._hex.update(self.digests.hexdigests())
            self.digests = DigestBatch()  # the next group's digests (formatting stays linear in the refit)
            self.digest_s += time.perf_counter() - t0
        return self._hex

    def finish_digests(self) -> None:
        """Launch (or, with ``sync_digests``, finish) the CUDA digests queued since the last group:
        bounds digest temporaries to one group."""
        if self._cuda_pending and self.digests is not None:
            t0 = time.perf_counter()
            if self.sync_digests:
                self.digests.hexdigests()
            else:
                self.digests.launch()
            self.digest_s += time.perf_counter() - t0
        self._cuda_pending = False

    def manifest(self) -> dict[str, str] | None:
        """Return the sender's manifest ``{name: 32-hex}`` (``None`` when not verifying)."""
        if self.digests is None:
            return None
        if self.ahead:
            return dict(self._group_hex())
        t0 = time.perf_counter()
        out = {**self._known, **self.digests.hexdigests()}  # digest_first's, then any added one by one
        self.digest_s += time.perf_counter() - t0
        return out
