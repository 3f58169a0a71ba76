"""refit-verify: prove that a refit (weight sync) into vLLM delivered exactly the trainer's bytes.

The sender digests each tensor it exports, each vLLM worker digests each staged slice it loads,
and the two manifests are compared; every difference is named.
"""

from refit_verify.config import RefitConfig, VerifyMode, mode_from_env
from refit_verify.digest import DigestBatch, digest_tensors, logical_bytes, tensor_digest
from refit_verify.errors import (
    RefitAbortedError,
    RefitConfigError,
    RefitProtocolError,
    RefitTimeoutError,
    RefitVerificationError,
    RefitVerifyError,
)
from refit_verify.report import VerificationReport, compare_manifests

__version__ = "0.1.0"

__all__ = [
    "DigestBatch",
    "RefitAbortedError",
    "RefitConfig",
    "RefitConfigError",
    "RefitProtocolError",
    "RefitTimeoutError",
    "RefitVerificationError",
    "RefitVerifyError",
    "VerificationReport",
    "VerifyMode",
    "compare_manifests",
    "digest_tensors",
    "logical_bytes",
    "mode_from_env",
    "tensor_digest",
]
