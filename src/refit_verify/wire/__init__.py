"""Typed messages on the wire (msgpack through msgspec; never pickle); no module here computes a digest.

Modules: :mod:`.fields` (bounded field types, limits, ``Entry``, the encoder and decoder loop), :mod:`.staged` (the staged ZMQ protocol: ``Hello`` ... ``Reject``, shared-memory and CUDA IPC
handles, ``decode_request`` / ``decode_reply``), :mod:`.collective` (broadcast and shard messages over
``torch.distributed``, length first). The staged protocol's names are exported here too
(``refit_verify.wire.Buffer``).

May import: ``errors``, ``manifest``. Never: ``digest`` and everything above it.
"""

from refit_verify._lazy import face

_EXPORTS = {
    "Abort": "refit_verify.wire.staged",
    "Ack": "refit_verify.wire.staged",
    "Buffer": "refit_verify.wire.staged",
    "CheckedDone": "refit_verify.wire.staged",
    "Complete": "refit_verify.wire.staged",
    "CudaIpcHandle": "refit_verify.wire.staged",
    "DigestBuffer": "refit_verify.wire.staged",
    "DigestEntry": "refit_verify.wire.fields",
    "Done": "refit_verify.wire.staged",
    "Entry": "refit_verify.wire.fields",
    "Hello": "refit_verify.wire.staged",
    "MAX_ALIGNMENT": "refit_verify.wire.fields",
    "MAX_ENTRIES_BYTES": "refit_verify.wire.fields",
    "MAX_MESSAGE_BYTES": "refit_verify.wire.fields",
    "MAX_NAME_BYTES": "refit_verify.wire.fields",
    "MAX_NDIM": "refit_verify.wire.fields",
    "MIN_ALIGNMENT": "refit_verify.wire.fields",
    "PROTOCOL_VERSION": "refit_verify.wire.staged",
    "Reject": "refit_verify.wire.staged",
    "Reply": "refit_verify.wire.staged",
    "Request": "refit_verify.wire.staged",
    "ShmHandle": "refit_verify.wire.staged",
    "Welcome": "refit_verify.wire.staged",
    "decode_message": "refit_verify.wire.fields",
    "decode_reply": "refit_verify.wire.staged",
    "decode_request": "refit_verify.wire.staged",
    "encode": "refit_verify.wire.fields",
    "torch_dtype": "refit_verify.wire.fields",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
