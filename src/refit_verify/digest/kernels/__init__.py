"""Triton kernels (CUDA path) of refit-verify.

Source: docs/digest-spec.md
"""

from refit_verify.digest.kernels.launch import digest_views, to_hex

__all__ = ["digest_views", "to_hex"]
