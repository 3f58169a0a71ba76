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
:mod:`.receiver`, :mod:`.faults` (a sender that corrupts a staged byte on purpose, for self-tests);
the packing and entry checks shared with the broadcast path are :mod:`refit_verify.stream.unpack`, the
messages :mod:`refit_verify.wire.staged`. Layout, message sequence and invariants follow NeMo-RL's
colocated ZMQ + CUDA-IPC refit; see ``docs/protocol.md``.
"""

from refit_verify._lazy import face

_EXPORTS = {
    "ABORT_WAIT_S": "refit_verify.transport.sender",
    "LAST_WORDS_S": "refit_verify.transport.guard",
    "OneByteFlipSender": "refit_verify.transport.faults",
    "RECONNECT_IVL_MS": "refit_verify.transport.receiver",
    "ReceiveResult": "refit_verify.transport.receiver",
    "RefitReceiver": "refit_verify.transport.receiver",
    "RefitSender": "refit_verify.transport.sender",
    "RefitStats": "refit_verify.transport.sender",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
