"""Digest backends: which implementation digests the tensors of each device type, chosen once.

Three implementations of digest v1, bit-identical to :mod:`refit_verify.digest.reference`:

* ``triton``: the Triton kernels (:mod:`refit_verify.digest.kernels`), for the kernel device types
  (CUDA; ``refit_verify.digest.backends.KERNEL_DEVICE_TYPES``). Batched: views are queued and launched
  together, words come back in one device-to-host copy.
* ``numba``: :mod:`refit_verify.digest._numba`, CPU tensors (14-33 GB/s on 2 cores, by CPU).
* ``torch``: :mod:`refit_verify.digest._torch`, torch ops only, so any device; 0.2-0.3 GB/s on a
  CPU. The fallback.

:func:`choose` picks one per device type on first use and keeps it for the process: an import that
failed is never retried per tensor. A fallback to ``torch`` where a fast backend exists logs one
WARNING (logger ``refit_verify``) naming the reason and the speed cost. The numba backend is
accepted only after it digests a small probe equal to the reference (so a broken JIT, a read-only
cache or a miscompile falls back loudly instead of failing or lying per tensor).

Source: ``docs/digest-spec.md`` Appendix B.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit_verify.digest import reference as _ref

__all__ = ["Backend", "backend_for", "choose", "cpu_backend", "hexes", "hexes_many", "warmup_cpu"]

logger = logging.getLogger("refit_verify")

Words = tuple[int, int]

KERNEL_DEVICE_TYPES = frozenset({"cuda"})
"""Device types whose tensors go to the Triton kernels (read at each use: tests widen it)."""


@dataclass(frozen=True, eq=False)  # one object per device type: hashed and compared by identity (a dict key per add)
class Backend:
    """One digest implementation, as :class:`refit_verify.digest.batch.DigestBatch` calls it.

    Attributes:
        name: ``"triton"``, ``"numba"`` or ``"torch"``.
        digest_words: immediate backends: ``(u8, seeds) -> (h0, h1)`` for a 1-D contiguous uint8
            tensor of logical bytes and its §3 seeds (ints in [0, 2**64)); ``None`` when batched.
        digest_views: batched backends: ``(views, seeds) -> int64 [N, 2]`` words on the views'
            device, no synchronisation (``kernels.digest.digest_views``); ``None`` when immediate.
        chunk_roots_u8: ``u8 -> [(root_0, root_1), ...]``, the §6 chunk roots of a standalone
            byte string (for ``refit_verify.collective.sharded``), Python ints.
        fallback_reason: why this is not the fast backend of its device type (``None`` if it is).
        plan_views, run_plan: batched backends that can keep a launch plan for the same memory
            (``kernels.digest.plan_views`` / ``run_plan``); ``None`` otherwise.
        digest_many: immediate backends that digest many small strings in one call:
            ``[(address, nbytes, seeds)] -> (h0s, h1s)``, two ``uint64 [N]`` numpy arrays
            (``_numba_many.digest_arrays_many``: 8-byte aligned host addresses,
            ``nbytes < many_max_bytes``); ``None`` otherwise.
        many_max_bytes: the length bound of ``digest_many`` (0 without it).
        plan_many, run_many: with ``digest_many``: its arguments checked once for a fixed list of
            strings (``_numba_many.plan_many``) and run at each call, at the planned addresses or,
            given ``addrs``, at others (``_numba_many.run_many``); ``None`` otherwise.
    """

    name: str
    digest_words: Callable[[torch.Tensor, Words], Words] | None
    digest_views: Callable[[list[torch.Tensor], list[Words]], torch.Tensor] | None
    chunk_roots_u8: Callable[[torch.Tensor], list[Words]]
    fallback_reason: str | None = None
    plan_views: Callable[[list[torch.Tensor], list[Words]], Any] | None = None
    run_plan: Callable[[Any], torch.Tensor] | None = None
    digest_many: Callable[[list[tuple[int, int, Words]]], tuple[Any, Any]] | None = None
    many_max_bytes: int = 0
    plan_many: Callable[[list[tuple[int, int, Words]]], Any] | None = None
    run_many: Callable[..., tuple[Any, Any]] | None = None


_CHOSEN: dict[tuple[str, bool], Backend] = {}
_LOCK = threading.Lock()


def choose(device_type: str, kernel: bool) -> Backend:
    """Return the backend for tensors of ``device_type``, choosing it on the first call only.

    Args:
        device_type: ``torch.device.type`` of the tensors (``"cpu"``, ``"cuda"``, ...).
        kernel: whether this device type goes to the Triton kernels (``digest.backends.KERNEL_DEVICE_TYPES``).

    Returns:
        Backend: ``triton`` for kernel device types (``torch`` if the kernels cannot be imported),
        ``numba`` for ``"cpu"`` (``torch`` if numba is missing or fails its probe), ``torch`` for
        any other device type. Each fallback logs one WARNING.
    """
    key = (device_type, kernel)
    b = _CHOSEN.get(key)
    if b is None:
        with _LOCK:
            b = _CHOSEN.get(key)
            if b is None:
                b = _CHOSEN[key] = _pick(device_type, kernel)
                if b.fallback_reason:
                    logger.warning("refit-verify digests %s tensors with the torch path: %s", device_type, b.fallback_reason)
    return b


def _torch(reason: str | None) -> Backend:
    from refit_verify.digest import _torch as td

    return Backend("torch", td.digest_words, None, td.chunk_roots_u8, reason)


def _pick(device_type: str, kernel: bool) -> Backend:
    if kernel:
        try:
            from refit_verify.digest.kernels import launch as kd
        except Exception as e:  # noqa: BLE001 - any import failure means: no kernels here
            return _torch(f"the Triton kernels are unavailable ({type(e).__name__}: {e}); the torch path is "
                          "roughly 100x slower on a GPU and synchronises once per tensor")
        return Backend("triton", None, kd.digest_views, _kernel_roots, plan_views=kd.plan_views, run_plan=kd.run_plan)
    if device_type == "cpu":
        try:
            from refit_verify.digest import _numba as nd

            probe = torch.arange(13, dtype=torch.uint8)  # one partial lane after a whole one
            seeds = _ref.seed("uint8", (13,), 13)
            want = _ref.chain_and_finalise(seeds, [(_ref.chunk_root(0, _ref.lanes(bytes(range(13)))),
                                                    _ref.chunk_root(1, _ref.lanes(bytes(range(13)))))])
            got = nd.digest_words(probe, seeds)
            if got != want:
                raise RuntimeError(f"probe digest {got} differs from the reference {want}")
            from refit_verify.digest import _numba_many as nm

            aligned = torch.arange(16, dtype=torch.uint8)[:13].clone()  # its own (aligned) allocation
            if aligned.data_ptr() % 8 == 0 and nm.digest_words_many([(aligned.data_ptr(), 13, seeds)]) != [want]:
                raise RuntimeError("the batched probe digest differs from the reference")
        except Exception as e:  # noqa: BLE001 - missing, unusable or wrong: the torch path, loudly
            return _torch(f"numba is unavailable ({type(e).__name__}: {e}); the torch path is about 60x slower "
                          "(0.2-0.3 GB/s against 14-33 GB/s with numba on 2 cores): install numba, a declared dependency")
        return Backend("numba", nd.digest_words, None, nd.chunk_roots_u8, digest_many=nm.digest_arrays_many,
                       many_max_bytes=nm.MANY_MAX_BYTES, plan_many=nm.plan_many, run_many=nm.run_many)
    return _torch(None)  # no faster implementation exists for this device type


def _kernel_roots(u8: torch.Tensor) -> list[Words]:
    from refit_verify.digest.kernels import launch as kd

    m = _ref.MASK64
    return [(a & m, b & m) for a, b in kd.chunk_roots([u8]).cpu().tolist()]


def warmup_cpu() -> None:
    """Compile (or load from numba's cache) every specialisation the CPU digests use: ``digest_u8``
    at a lane tail, a serial and a parallel length, and the batched small-string path.

    Raises:
        ImportError: numba is not installed.
    """
    from refit_verify.digest import _numba as nd
    from refit_verify.digest import _numba_many as nm

    for n in (0, 13, 8 * (nd.PARALLEL_MIN_LANES + 1)):
        nd.digest_u8(torch.zeros(n, dtype=torch.uint8), "uint8", (n,))
    z = torch.zeros(16, dtype=torch.uint8)
    nm.digest_words_many([(z.data_ptr(), 13, (0, 0))])


def backend_for(device_type: str) -> Backend:
    """Return the digest backend of ``device_type`` (chosen on first use, see :mod:`refit_verify.digest.backends`).

    Args:
        device_type: ``torch.device.type`` (``"cpu"``, ``"cuda"``, ...).

    Returns:
        Backend: its ``name`` is ``"triton"``, ``"numba"`` or ``"torch"``; ``fallback_reason`` says
        why a fast backend was not taken.
    """
    return choose(device_type, device_type in KERNEL_DEVICE_TYPES)


def hexes_many(h0: np.ndarray, h1: np.ndarray) -> str:
    """Channel values of ``Backend.digest_many`` (uint64 ``[N]`` each) as one string of ``32 * N``
    hex characters (§9: channel 0 then channel 1, each big-endian)."""
    w = np.empty((len(h0), 2), ">u8")
    w[:, 0], w[:, 1] = h0, h1
    return w.tobytes().hex()


def hexes(words: torch.Tensor) -> str:
    """All rows of int64 ``[N, 2]`` words as one string of ``32 * N`` hex characters (§9), one copy to the host."""
    return np.ascontiguousarray(words.cpu().numpy()).view(np.uint64).astype(">u8").tobytes().hex()


def cpu_backend() -> Backend:
    """The CPU's backend (chosen on the first call, then read from ``_CPU[0]``)."""
    b = _CPU[0] = backend_for("cpu")
    return b


_CPU: list[Backend | None] = [None]  # the CPU backend, once chosen
