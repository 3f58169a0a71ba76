"""Copies of the tensors vLLM's layerwise reload keeps (instead of views of a staging slot), and the
per-device CUDA memory pools they come from with ``REFIT_VERIFY_CUDA_GRAPHS=1``.
"""

from __future__ import annotations

import logging
import threading


def owned_copies(batch: list) -> list:
    """A clone per tensor of ``batch`` (``[(name, tensor)]``, any dtypes and devices), the copies
    vLLM's layerwise reload keeps instead of views of a staging slot; same names, same order.

    With ``REFIT_VERIFY_CUDA_GRAPHS=1`` (opt-in, :func:`refit_verify.config.cuda_graphs_enabled`),
    CUDA clones come from this process's own memory pool for them (:func:`_copies_pool`): each is
    still its own storage, but no other allocation shares the pool, so the same refit asks it for
    the same sizes in the same order and gets the same addresses back from the second refit on. The
    check before loading then finds its kept set (and its captured graph) for every buffer instead
    of depending on where the device's general cache put each copy this time.

    Fallbacks, all to plain clones of the whole batch: another thread is using the pool (no wait);
    entering the pool fails (the pool is given up for good only when the error says this allocator
    has no pools, e.g. expandable segments); a pooled clone raises ``torch.OutOfMemoryError`` (the
    pool cannot take memory the device's general cache holds; the pool stays for the next refit,
    and if the plain clones run out of memory too, the pool is released — :func:`release_pools` —
    and the plain clones tried once more). The pool keeps its high-water mark reserved until
    :func:`release_pools` (the plugin calls it at the worker's sleep).

    Raises:
        torch.OutOfMemoryError: the plain clones do not fit even with the pool released.
    """
    from refit_verify.config import cuda_graphs_enabled

    if not cuda_graphs_enabled() or not _POOLS_LOCK.acquire(blocking=False):
        return [(n, t.clone()) for n, t in batch]
    try:
        pool = _copies_pool(batch)
        copies = _pooled(batch, *pool) if pool is not None else None
    finally:
        _POOLS_LOCK.release()
    if pool is None:
        return [(n, t.clone()) for n, t in batch]
    if copies is not None:
        return copies
    import torch

    try:
        return [(n, t.clone()) for n, t in batch]
    except torch.OutOfMemoryError:
        pass
    release_pools()  # its cached blocks are the memory the plain clones lack
    torch.cuda.empty_cache()
    return [(n, t.clone()) for n, t in batch]


def _pooled(batch: list, index: int, mp) -> list | None:
    """The clones of ``batch`` from pool ``mp`` on cuda:``index``; None when they must be plain."""
    import torch

    log = logging.getLogger("refit_verify")
    try:
        ctx = torch.cuda.use_mem_pool(mp, device=index)
        ctx.__enter__()  # raises before anything is registered (use_mem_pool begins before its try)
    except Exception as e:  # noqa: BLE001 - plain clones this time; for good only when pools are unsupported
        unsupported = isinstance(e, AttributeError) or any(w in str(e).lower() for w in _NO_POOLS)
        if unsupported:
            _POOLS[index] = False
        log.warning("refit-verify: no memory pool for the layerwise reload's copies on cuda:%s (%s: %s); plain "
                    "clones%s", index, type(e).__name__, e, " from now on" if unsupported else " this time")
        return None
    oom = False
    try:
        return [(n, t.clone()) for n, t in batch]
    except torch.OutOfMemoryError:  # the pool cannot take memory the device's general cache holds
        oom = True
    finally:
        ctx.__exit__(None, None, None)  # ends routing to the pool and drops the context's reference
        if oom:
            log.warning("refit-verify: the layerwise reload's copies ran out of memory in their pool on cuda:%s; plain "
                        "clones for this batch", index)
    return None


_NO_POOLS = ("expandable", "not supported", "unsupported", "does not support")
"""Words of an error saying this allocator has no memory pools (then the pool is given up for good)."""


_POOLS: dict = {}  # CUDA device index -> torch.cuda.MemPool of the layerwise reload's copies (False: none)


_POOLS_LOCK = threading.Lock()  # one user of the pools at a time (begin/end of a pool is per thread)


def release_pools() -> int:
    """Drop this process's pools of the reload's copies; the next pooled refit makes new ones.

    Dropping a ``MemPool`` releases it (its destructor: ``releasePool`` then ``emptyCache`` of its
    id): its free blocks go back to the device, its live blocks when their copies die. Devices
    whose allocator has no pools stay marked so. Waits at most :data:`POOL_WAIT_S` for a pooled
    clone in progress; after that it releases nothing.

    Returns:
        int: how many pools were dropped (0 without CUDA or pools).
    """
    if not _POOLS_LOCK.acquire(timeout=POOL_WAIT_S):
        logging.getLogger("refit_verify").warning("refit-verify: the reload's copies pool is busy; not released")
        return 0
    try:
        dropped = [i for i, mp in _POOLS.items() if mp is not False]
        for i in dropped:
            del _POOLS[i]
        return len(dropped)
    finally:
        _POOLS_LOCK.release()


POOL_WAIT_S = 30.0
"""Seconds :func:`release_pools` waits for a batch being cloned into a pool."""


def _copies_pool(batch: list):
    """``(device index, MemPool)`` for the copies of ``batch`` when its tensors are all on one
    CUDA device and this torch has memory pools; else None (plain clones). The caller holds
    :data:`_POOLS_LOCK`."""
    devs = {t.device for _, t in batch}
    if len(devs) != 1:
        return None
    (dev,) = devs
    if dev.type != "cuda":
        return None
    import torch

    index = dev.index if dev.index is not None else torch.cuda.current_device()
    pool = _POOLS.get(index)
    if pool is None:
        try:
            with torch.cuda.device(index):  # a MemPool binds to the current device (MemPool.cpp: device_ = current_device())
                pool = _POOLS[index] = torch.cuda.MemPool()
        except (AttributeError, RuntimeError):  # no memory pools in this torch / allocator
            _POOLS[index] = False
            return None
    return (index, pool) if pool is not False else None
