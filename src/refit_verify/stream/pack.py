"""The sender's half of the stream layer: :class:`Packer` cuts a refit into groups of aligned slots.

Both transports pack through it (the staged ZMQ transport, :mod:`refit_verify.transport`, into a
shared staging buffer; the broadcast path, :mod:`refit_verify.collective.broadcast`, into a bucket): digest
**before** packing, the slot layout ``offset = used; used += round_up(nbytes, alignment)``, a group
cut when the next slot or the entry list does not fit, and the oversized path (a tensor whose
aligned size exceeds a group travels alone). A :class:`PackSink` per transport provides buffers and
sends groups. The receiver's half and what both share are in :mod:`refit_verify.stream.unpack`.

When verifying, a tensor packed into a group that has a fused copy+digest (:func:`~refit_verify.digest.batch.fuses`:
CUDA; a CPU tensor below 1 MiB, numba) is copied into its slot and digested by one op that reads it once
(:meth:`~refit_verify.digest.batch.DigestBatch.add_copy`, run at the group's launch); otherwise (a larger CPU
tensor, an oversized tensor sent alone) the digest and the copy read it separately.

Source: ``docs/protocol.md`` (sender steps, invariants).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

import torch

from refit_verify.digest import backends as _backends
from refit_verify.digest.batch import DigestBatch, fuses
from refit_verify.digest.incremental import digest_now
from refit_verify.digest.tensors import check_tensor, dtype_name, logical_bytes
from refit_verify.stream.items import check_items, checked_item, entry_cost, round_up
from refit_verify.wire.fields import MAX_ENTRIES_BYTES, DigestEntry, Entry

__all__ = ["PackSink", "Packer"]


class PackSink(Protocol):
    """What a transport gives the :class:`Packer`: memory for a group, and the way to send one."""

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        """Return the current group's 1-D uint8 buffer (of at least the packer's capacity), allocated
        on first use; ``like`` is the first tensor (a transport may take its device)."""

    def post(self, entries: list[Entry], used: int) -> None:
        """Send the current group: ``entries`` at their offsets in the buffer, ``used`` aligned bytes."""

    def post_alone(self, u8: torch.Tensor, entry: Entry, aligned: int, meanwhile: Callable[[], None] | None = None) -> None:
        """Send one oversized tensor alone: its logical bytes ``u8``, its entry (offset 0) and its
        aligned size in bytes. ``meanwhile``: the packer's work to run once the tensor is sent and
        before the sink waits for the receivers to take it (:meth:`Packer.digest_first`'s rest):
        called at most once; a sink that waits for no one calls it after sending."""


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
        digests_ahead: give every entry its digest (:class:`~refit_verify.wire.staged.DigestEntry`), so
            the receiver can check each tensor before loading it: each group's digests are
            finished (one synchronisation per group on CUDA) before the group is sent. Needs
            ``digests``.

    Attributes:
        tensors (int): tensors packed. bytes (int): their exact bytes. digest_s (float): seconds
        in digest code, the fused copy+digest of grouped tensors included (queued at their add,
        launched and, with ``digests_ahead`` / ``sync_digests``, waited for before their group is
        sent: those seconds hold the copy too). fused (int): tensors copied and digested by the fused op.
        digest_shadow_s (float): of ``digest_s``, the seconds :meth:`digest_first` spent
        after the first group was sent (while the receivers check and load it; after an oversized
        first tensor sent alone: between its send and the wait for the receivers, when the sink
        runs :meth:`PackSink.post_alone`'s ``meanwhile``). last_name
        (str | None): the last name taken from the stream.
    """

    def __init__(self, sink: PackSink, *, capacity: int, alignment: int, digests: DigestBatch | None,
                 sync_digests: bool = False, max_entries_bytes: int = MAX_ENTRIES_BYTES, digests_ahead: bool = False) -> None:
        self.sink, self.capacity, self.alignment = sink, capacity, alignment
        self.digests, self.sync_digests, self.max_entries_bytes = digests, sync_digests, max_entries_bytes
        self.ahead = digests_ahead and digests is not None
        self._hex: dict[str, str] = {}  # digests of finished groups (digests_ahead), and all of digest_first's
        self._known: dict[str, str] = {}  # digest_first's
        self._rest: list[tuple[str, torch.Tensor]] | None = None  # digest_first's items left for after the first post
        self.names: set[str] = set()
        self.entries: list[Entry] = []
        self.used = 0
        self._est = 0
        self._cuda_pending = False
        self.tensors = 0
        self.bytes = 0
        self.digest_s = 0.0
        self.digest_shadow_s = 0.0
        self.fused = 0
        self.last_name: str | None = None

    def _fuses(self, t: torch.Tensor, aligned: int) -> bool:
        """Whether a tensor of ``aligned`` slot bytes is copied and digested by the fused op when
        verifying: it goes into a group (not alone), its device has the fused kernels (:func:`fuses`)
        and the slots hold whole 8-byte lanes (the fused op writes the last lane's zero padding)."""
        return self.digests is not None and aligned <= self.capacity and self.alignment % 8 == 0 and fuses(t)

    def add(self, item: tuple[str, torch.Tensor]) -> None:
        """Digest one ``(name, tensor)`` (if verifying), then pack it; may send groups.

        Raises:
            RefitInputError: as :func:`checked_item`; what the digest raises for a tensor it
            cannot read (sparse, meta); what the sink raises.
        """
        name, t = checked_item(item, self.names)
        self.last_name = name
        check_tensor(t)  # (its logical bytes are taken below, unless the fused op reads it)
        n = t.numel() * t.element_size()
        a = round_up(n, self.alignment)
        dt, shape = dtype_name(t.dtype), list(t.shape)
        alone = a > self.capacity
        cost = 0 if alone else entry_cost(name, dt, t.dim())
        if alone or self.used + a > self.capacity or self._est + cost > self.max_entries_bytes:
            self.flush()  # the previous group goes first (after the first one, digest_first's rest is digested)
        buf = None if alone else self.sink.buffer(t)
        fused = (buf is not None and name not in self._known and buf.device == t.device and buf.data_ptr() % 8 == 0
                 and self._fuses(t, a))
        if fused:  # one read of t: its bytes into the slot (and the last lane's padding), its digest from the same loads
            t0 = time.perf_counter()
            self.digests.add_copy(name, t, buf[self.used : self.used + round_up(n, 8)], checked=True)  # checked above
            self.digest_s += time.perf_counter() - t0
            self._cuda_pending = True  # the copy runs at the group's launch: always before it is sent
            self.fused += 1
        u8 = None if fused else logical_bytes(t)
        if not fused and self.digests is not None and name not in self._known:
            t0 = time.perf_counter()
            self.digests.add(name, t)  # before packing: covers the pack, the transport and the slicing
            self.digest_s += time.perf_counter() - t0
            self._cuda_pending |= t.is_cuda
        if alone:
            self.finish_digests()
            if self.ahead:
                entry: Entry = DigestEntry(name=name, dtype=dt, shape=shape, offset=0, nbytes=n, digest=self._group_hex()[name])
            else:
                entry = Entry(name=name, dtype=dt, shape=shape, offset=0, nbytes=n)
            # digest_first's rest once the tensor is sent, while the receivers read it (before our transport waits
            # for its Ack); a sink that did not run it leaves it for now, out of the receivers' shadow
            if self._rest is None:  # (a sink written before meanwhile existed takes three arguments)
                self.sink.post_alone(u8, entry, a)
            else:
                self.sink.post_alone(u8, entry, a, meanwhile=self._digest_rest)
                self._digest_rest(shadow=False)
        else:
            if n and not fused:
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
        """When verifying: digest a refit given as a sequence ahead of its groups, in two parts, each
        read at once through :func:`~refit_verify.digest.incremental.digest_now` (kept sets: the
        trainer's memory at every refit; no per-tensor check besides one signature):

        * now: the tensors the first group can hold (at most ``capacity`` aligned bytes, or the
          first tensor alone when it is larger);
        * the rest: right after the first group is sent, while the receivers check and load it
          (after an oversized first tensor: once it is sent, before the sink waits for the
          receivers, :meth:`PackSink.post_alone`'s ``meanwhile``); its seconds are also counted in
          ``digest_shadow_s``.

        Two synchronisations per device for the refit, not one per group, and only the first part's
        on the critical path. No digest work is left to :meth:`add`, except for the tensors it
        will copy and digest in one read (grouped tensors with a fused op, :func:`fuses`: see
        :meth:`_fuses`): those are not digested here but as they are packed, by the fused op.

        Every item is validated before anything is sent (:func:`~refit_verify.stream.items.check_items`:
        names, duplicates, tensors the digest can read, storage that holds them), so a bad item anywhere in the list raises before the receiver
        loads any of it. Only a tensor whose storage is freed or resized under it after this call is
        found later, when its digest is taken (the transport then aborts the refit).

        The tensors are the trainer's, unchanged while it sends them; one changed in between differs
        from its digest where the receiver reads it (refused before loading with ``digests_ahead``,
        a mismatch in the verdict without): a failure, never a pass. A tensor of the rest changed
        before the first group is sent is digested as it is packed.

        Raises:
            RefitInputError: as :func:`checked_item`, or a tensor cannot be digested (before anything
            is sent; a storage freed under a tensor of the rest after this call: once the first
            group went).
        """
        if self.digests is None:
            return
        check_items(items)  # every item, before anything is sent
        sizes = [round_up(t.numel() * t.element_size(), self.alignment) for _, t in items]
        head, used = 0, 0
        for a in sizes:
            used += a
            if head and used > self.capacity:
                break
            head += 1
        ahead = [not self._fuses(t, a) for (_, t), a in zip(items, sizes)]  # the fused ones are digested as packed
        first = [it for it, k in zip(items[:head], ahead) if k]
        rest = [it for it, k in zip(items[head:], ahead[head:]) if k]
        if first:
            self._digest_known(first, checked=True)  # check_items just checked them, nothing ran since
        self._rest = rest or None

    def _digest_known(self, items: Sequence[tuple[str, torch.Tensor]], checked: bool = False) -> float:
        """Digest ``items`` (checked: :func:`~refit_verify.stream.items.check_items`; ``checked``: just
        now, nothing ran since, so not again) together now (one synchronisation per device); return
        the seconds it took."""
        t0 = time.perf_counter()
        got = digest_now(items, checked=checked)
        self._known.update(got)
        self._hex.update(got)
        dt = time.perf_counter() - t0
        self.digest_s += dt
        return dt

    def _digest_rest(self, shadow: bool = True) -> None:
        """After a group was sent: digest what :meth:`digest_first` left for then, if anything
        (``shadow``: counted in ``digest_shadow_s``, the receivers work on that group meanwhile)."""
        if self._rest is not None:
            rest, self._rest = self._rest, None
            dt = self._digest_known(rest)
            if shadow:
                self.digest_shadow_s += dt

    def add_all(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`add` every item, then :meth:`flush` the last group."""
        for item in named_tensors:
            self.add(item)
        self.flush()

    def flush(self) -> None:
        """Send the pending group, if any (its CUDA digests finished first); after the first,
        digest what :meth:`digest_first` left for then."""
        entries, used = self.entries, self.used
        self.entries, self.used, self._est = [], 0, 0
        if entries:
            self.finish_digests()
            if self.ahead:
                hexes = self._group_hex()
                entries = [DigestEntry(name=e.name, dtype=e.dtype, shape=e.shape, offset=e.offset, nbytes=e.nbytes,
                                       digest=hexes[e.name]) for e in entries]
            self.sink.post(entries, used)
            self._digest_rest()

    def _group_hex(self) -> dict[str, str]:
        """Finish the digests added since the last group (one synchronisation on CUDA); return all so far."""
        if self.digests is not None and self.digests._order:
            t0 = time.perf_counter()
            self._hex.update(self.digests.hexdigests())
            self.digests = DigestBatch()  # the next group's digests (formatting stays linear in the refit)
            self.digest_s += time.perf_counter() - t0
        return self._hex

    def finish_digests(self) -> None:
        """Launch (or, with ``sync_digests``, finish) the digests queued since the last group, CUDA ones
        and fused copies (whose copy into the slots runs at this launch): bounds digest temporaries to one group."""
        if self._cuda_pending and self.digests is not None:
            t0 = time.perf_counter()
            if self.sync_digests:
                self.digests.hexdigests()
            else:
                self.digests.launch()
            self.digest_s += time.perf_counter() - t0
        self._cuda_pending = False

    def release(self) -> None:
        """After a refit failed: drop the digests and fused copies still queued (they hold views of the
        sink's buffers, which the transport frees next) and :meth:`digest_first`'s rest."""
        if self.digests is not None:
            self.digests.discard_queued()
        self._rest = None

    def stop_digests(self) -> None:
        """Digest nothing from here on (the refit turned out unverified): what is added next is copied
        plainly, its entries carry no digest, and :meth:`manifest` returns None. Call it between groups
        (nothing queued since the last one was sent)."""
        if self.digests is not None:
            self.digests.discard_queued()
        self.digests, self.ahead, self._rest = None, False, None

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


class _Discard:
    """A :class:`PackSink` that sends nothing: one group's buffer on ``device``, groups dropped (the warm-up's)."""

    def __init__(self, nbytes: int, device: torch.device | str = "cpu") -> None:
        self.buf = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        return self.buf

    def post(self, entries: list[Entry], used: int) -> None:
        pass

    def post_alone(self, u8: torch.Tensor, entry: Entry, aligned: int, meanwhile: Callable[[], None] | None = None) -> None:
        if meanwhile is not None:
            meanwhile()


@_backends.warm_path
def _warm_pack(device: torch.device) -> None:
    """On the CPU and a kernel device (CUDA), the first use of a verifying :class:`Packer`'s
    paths (the digests ahead of the first group, the fused copy+digest of grouped tensors, the digests
    of the rest, the entries) on a few throwaway tensors of each float dtype a refit pushes, into a
    throwaway buffer on ``device``: otherwise the first refit's sender runs them for the first time.
    Nothing is sent or kept. Other devices: nothing."""
    if device.type != "cpu" and device.type not in _backends.KERNEL_DEVICE_TYPES:
        return
    items = [(f"{i}.{j}", torch.zeros(shape, dtype=dt, device=device))
             for i, dt in enumerate((torch.bfloat16, torch.float16, torch.float32)) for j, shape in enumerate(((4, 8), (8,)))]
    for ahead in (True, False):
        p = Packer(_Discard(4096, device), capacity=2048, alignment=256, digests=DigestBatch(), digests_ahead=ahead)
        p.digest_first(items)
        p.add_all(items)
        p.manifest()
