"""Refit transport: a ZMQ REQ/REP pair streaming tensors through double-buffered staging memory.

The sender (trainer side, :class:`RefitSender`) binds a REQ socket, agrees the verification mode
with the receiver (``Hello`` / ``Welcome``), packs tensors in logical byte order into two ping-pong
staging buffers at aligned offsets, and sends one ``Buffer`` message per filled buffer; the receiver
(vLLM worker side, :class:`RefitReceiver`) connects a REP socket, validates every entry, views it in
place, digests it (when the refit verifies), hands the batch to ``load`` and acknowledges. After
``Complete`` the receiver returns its manifest in ``Done`` and the sender compares it with its own.
A sender-side exception sends ``Abort`` so the receiver stops at once; every wait on either side
is bounded.

Modules: :mod:`.guard` (endpoints, exclusive binds, peer checks), :mod:`.sender` (with :mod:`.send_state`),
:mod:`.receiver`;
the packing and entry checks shared with the broadcast path are :mod:`refit_verify.stream`, the
messages :mod:`refit_verify.wire`. Layout, message sequence and invariants follow NeMo-RL's
colocated ZMQ + CUDA-IPC refit; see ``docs/protocol.md``.
"""

from __future__ import annotations

from refit_verify.stream import Batch, LoadFn, checked_item
from refit_verify.transport.guard import LAST_WORDS_S
from refit_verify.transport.receiver import RECONNECT_IVL_MS, ReceiveResult, RefitReceiver
from refit_verify.transport.sender import ABORT_WAIT_S, RefitSender, RefitStats

__all__ = ["ABORT_WAIT_S", "Batch", "LAST_WORDS_S", "LoadFn", "RECONNECT_IVL_MS", "ReceiveResult", "RefitReceiver", "RefitSender",
           "RefitStats", "checked_item"]
