"""A sender that corrupts one staged byte on purpose (:class:`OneByteFlipSender`): the fault the
self-test (:func:`refit_verify.selftest`), the demo and the tests inject to see it caught."""

from __future__ import annotations

import torch

from refit_verify.transport.sender import RefitSender
from refit_verify.wire import staged as wire

__all__ = ["OneByteFlipSender"]


class OneByteFlipSender(RefitSender):
    """A sender that flips one byte of ``target``'s staged slot after digesting and packing it.

    It models a staging slot overwritten before the receiver read it: the receiver's digest of
    ``target`` differs from the sender's, and the refit must name ``target``.

    Args:
        target: the wire name whose staged bytes are corrupted (every send that carries it).
        byte_index: which byte of its logical bytes flips its lowest bit (a tensor with no more
            bytes than that is left alone).
        args, kwargs: as :class:`~refit_verify.transport.sender.RefitSender`.

    Attributes:
        flipped: True once a byte was flipped.
    """

    def __init__(self, *args, target: str, byte_index: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target, self.byte_index, self.flipped = target, byte_index, False

    def _exchange(self, msg, staging=None):
        if isinstance(msg, wire.Buffer) and staging is not None:
            for e in msg.entries:
                if e.name == self.target and e.nbytes > self.byte_index:
                    staging[e.offset + self.byte_index] ^= 0x01
                    self.flipped = True
            if staging.is_cuda:
                torch.cuda.synchronize(staging.device)
        return super()._exchange(msg, staging)
