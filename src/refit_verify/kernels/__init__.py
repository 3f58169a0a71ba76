"""Triton kernels (CUDA path) of refit-verify.

Source: docs/digest-spec.md
"""

from refit_verify.kernels.digest import digest_views, to_hex

__all__ = ["digest_views", "to_hex"]
