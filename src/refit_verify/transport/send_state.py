"""The state of one refit on the sender of the staged transport (:class:`RefitSender`'s helpers).

:class:`Progress` counts how far the refit got (``RefitTimeoutError.progress``); :class:`SendState`
is the refit's REQ/REP sequencing and its two ping-pong staging buffers, and the
:class:`~refit_verify.stream.pack.PackSink` the packer fills.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from refit_verify.config import VerifyMode
from refit_verify.stream.items import round_up
from refit_verify.transport import staging as _staging
from refit_verify.wire.fields import Entry

__all__ = ["Progress", "SendState"]

PAGE_BYTES = mmap.PAGESIZE
"""The stride at which :meth:`SendState.stage_ahead` touches CPU staging (one write per page)."""


class PackCounts(Protocol):
    """What :class:`Progress` reads of the refit's :class:`~refit_verify.stream.pack.Packer`, and the sender uses."""

    tensors: int
    last_name: str | None
    digest_s: float

    def stop_digests(self) -> None: ...


@dataclass(frozen=True)
class PackedCounts:
    """A finished refit's :class:`PackCounts`, kept by :class:`Progress` in place of its packer: the
    packer refers back to the sender (through the send state's ``send`` and ``settle``), so holding
    it would keep a finished sender, its sockets and digest buffers alive until a garbage collection."""

    tensors: int
    last_name: str | None
    digest_s: float

    def stop_digests(self) -> None:
        """Nothing to stop: the refit ended."""


@dataclass
class Progress:
    """How far the current refit got (``RefitTimeoutError.progress``); packing counts come from the packer."""

    refit_id: str = ""
    mode: str = ""
    buffers_sent: int = 0
    buffers_acked: int = 0
    tensors_sent: int = 0
    tensors_acked: int = 0
    bytes_sent: int = 0
    last_acked_name: str | None = None
    waiting_for: str = ""
    hello_sent: int = 0
    last_reply: str | None = None
    packer: PackCounts | None = None

    @property
    def tensors_packed(self) -> int:
        return self.packer.tensors if self.packer is not None else 0

    @property
    def last_name(self) -> str | None:
        return self.packer.last_name if self.packer is not None else None

    def as_dict(self, **extra: object) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "packer"}
        d.update(tensors_packed=self.tensors_packed, last_name=self.last_name, **extra)
        return d


@dataclass
class SendState:
    """One refit on the sender: REQ/REP sequencing and the staging buffers (the packer's sink).

    Attributes:
        send: ``(state, buffer, entries, used bytes)``: sends one filled buffer (the sender's ``_post``).
        settle: ``(state)``: takes the reply of the buffer in flight (the sender's ``_settle``).
        requested / mode: the configured and the agreed mode. progress: counts for errors.
        welcome_pending: ``Hello`` sent, its ``Welcome`` not taken yet (taken as the first group is posted).
        outstanding: seq of the unanswered ``Buffer`` (``None``: nothing outstanding).
        in_flight: ``{seq: (entries, last name)}`` of sent, unacknowledged buffers.
        pool: the two ping-pong staging buffers (allocated on first use); cur: the one being packed.
        dedicated: an oversized tensor's own buffer while it is in flight.
        stage_s: seconds :meth:`stage_ahead` took (0.0 when it did nothing).
        hello_t: ``time.perf_counter()`` when ``Hello`` went. welcome_s: seconds from then until
            its ``Welcome`` was taken.
        before_welcome_s: the packer's ``digest_s`` when the ``Welcome`` was taken, if it had not arrived by then, else 0.0.
    """

    send: Callable[[SendState, _staging.StagingBuffer, list[Entry], int], None]
    settle: Callable[[SendState], None]
    requested: VerifyMode
    mode: VerifyMode
    progress: Progress
    capacity: int
    device: torch.device | None
    hello_sent: bool = False
    welcome_pending: bool = False
    outstanding: int | None = None
    in_flight: dict[int, tuple[int, str | None]] = field(default_factory=dict)
    next_seq: int = 0
    pool: list[_staging.StagingBuffer | None] = field(default_factory=lambda: [None, None])
    cur: int = 0
    dedicated: _staging.StagingBuffer | None = None
    stage_s: float = 0.0
    hello_t: float = 0.0
    welcome_s: float = 0.0
    before_welcome_s: float = 0.0

    # -- PackSink ---------------------------------------------------------------------------------

    def _device_for(self, like: torch.Tensor) -> torch.device:
        if self.device is None:  # the first tensor's device: a CUDA tensor's GPU, else CPU
            self.device = like.device if like.is_cuda else torch.device("cpu")
        return self.device

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self.pool[self.cur] is None:
            self.pool[self.cur] = _staging.allocate(self.capacity, self._device_for(like))
        return self.pool[self.cur].tensor

    def stage_ahead(self, items: Sequence, alignment: int) -> int:
        """Allocate the first staging buffer for ``items`` (a refit given as a sequence) and, on the
        CPU, touch every page its first group will fill (one byte each): the kernel's page faults of
        fresh shared memory are taken here, after ``Hello`` and before the receiver's ``Welcome`` is
        taken, instead of inside the first group's copy. Returns the bytes staged (0: nothing done, e.g. an
        empty refit, a first tensor too large for a group, or an item that is not a
        ``(name, tensor)`` pair, which the packer then reports). Never raises for bad items."""
        t0 = time.perf_counter()
        n, like = 0, None
        for item in items:
            t = item[1] if isinstance(item, tuple) and len(item) == 2 else None
            if not isinstance(t, torch.Tensor) or t.is_sparse or t.is_meta:
                break
            a = round_up(t.numel() * t.element_size(), alignment)
            if n + a > self.capacity:
                break
            n, like = n + a, t if like is None else like
        if like is None or n == 0 or self.pool[self.cur] is not None:
            return 0
        buf = self.buffer(like)
        if buf.device.type == "cpu":
            buf[:n:PAGE_BYTES].fill_(0)
        self.stage_s = time.perf_counter() - t0
        return n

    def post(self, entries: list[Entry], used: int) -> None:
        self.send(self, self.pool[self.cur], entries, used)
        self.cur ^= 1

    def post_alone(self, u8: torch.Tensor, entry: Entry, aligned: int, meanwhile: Callable[[], None] | None = None) -> None:
        # Alone in a dedicated buffer of the exact aligned size (packed while the flushed group is
        # in flight), sent alone, ``meanwhile`` run while the receiver reads it, its Ack taken, then
        # freed (an error in ``meanwhile`` leaves it to the refit's abort, as a group in flight).
        self.dedicated = _staging.allocate(aligned, self._device_for(u8))
        self.dedicated.tensor[: entry.nbytes].copy_(u8, non_blocking=self.dedicated.tensor.is_cuda)
        self.send(self, self.dedicated, [entry], aligned)
        if meanwhile is not None:
            meanwhile()
        self.settle(self)
        self.dedicated.close()
        self.dedicated = None

    def free_pool(self) -> None:
        """Free every staging buffer (all acknowledged, or the refit failed)."""
        for i, b in enumerate(self.pool):
            if b is not None:
                b.close()
                self.pool[i] = None
        if self.dedicated is not None:
            self.dedicated.close()
            self.dedicated = None
