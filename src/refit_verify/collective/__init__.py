"""The ``torch.distributed`` refit path: a broadcast of checked buckets, and digests of dim-0 shards.

Modules: :mod:`.broadcast` (:class:`~refit_verify.collective.broadcast.BroadcastSender` /
``BroadcastReceiver``), :mod:`.sharded` (a full tensor's digest from its shards, no gather).

May import: ``stream``, ``wire``, ``digest``, the foundation. Never: ``transport`` (torch.distributed
needs no ZMQ), ``boundary``, ``engine``, ``trainer``, ``vllm_plugin``.
"""

from refit_verify._lazy import face

_EXPORTS = {
    "BroadcastReceiver": "refit_verify.collective.broadcast",
    "BroadcastSender": "refit_verify.collective.broadcast",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
