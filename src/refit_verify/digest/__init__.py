"""Bytes to digests on every device: digest v1 (``docs/digest-spec.md``) of tensors, CPU or CUDA.

Modules: :mod:`.reference` (the pure-Python spec), :mod:`.tensors` (what a digestible tensor is:
checks, logical bytes, dtype names, seeds, views by geometry), :mod:`.backends` (Triton / numba /
torch, chosen once per device type), :mod:`.kernels` (Triton), :mod:`.batch` (:class:`DigestBatch`,
:func:`tensor_digest`), :mod:`.kept` (sets read again at every refit), :mod:`.incremental` (batches
of tensors added while their memory may change).

May import: ``errors``, ``config``. Never: ``wire``, ``stream``, ``transport``, ``collective``,
``boundary``, ``engine``, ``trainer``, ``vllm_plugin`` (digests know no wire and no loader).
"""

from refit_verify._lazy import face

_EXPORTS = {
    "DigestBatch": "refit_verify.digest.batch",
    "backend_for": "refit_verify.digest.backends",
    "digest_tensors": "refit_verify.digest.batch",
    "dtype_name": "refit_verify.digest.tensors",
    "logical_bytes": "refit_verify.digest.tensors",
    "plain_tensor_ops": "refit_verify.digest.tensors",
    "tensor_digest": "refit_verify.digest.batch",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
