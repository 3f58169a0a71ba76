"""The kernels' launch plan without derived views, built by one compiled call (numba).

:func:`refit_verify.digest.kernels.launch._plan_numpy` builds the plan with about three dozen numpy
calls; on arrays of a few dozen views each call costs more than its arithmetic, and a refit makes a
plan the first time it sees its tensors (``docs/performance.md``, First refit). :func:`plan` is the
same plan, entry for entry, from one compiled loop over the views
(``tests/digest/kernels/test_plan_numba.py`` compares the two). Derived views (``parents``) stay on
the numpy path.

Compiled (``cache=True`` where a cache directory is writable: ``_numba._jit``) at the first plan, which
the digest warm-up makes; :func:`plan` gives None where numba cannot be imported or compile it.

Source: the plan's layout, :func:`~refit_verify.digest.kernels.launch._plan_numpy`'s docstring.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import numpy as np

from refit_verify.digest import _numba_lock
from refit_verify.digest import reference as _ref
from refit_verify.digest.kernels import _mix

__all__ = ["plan"]

logger = logging.getLogger("refit_verify")

def _build(ad, nb, ds, s0, s1, align, cl, mid):  # pragma: no cover - compiled; its twin is launch._plan_numpy
    # cl (reference.CHUNK_LANES) and mid (_mix.MID_N) come as arguments: numba's on-disk cache
    # notices changes to this file only, never to another module's constants
    sb = 16 * mid  # lanes of one leaf program of a big chunk: one superblock (16 of them per chunk)
    V = nb.shape[0]
    P = 0
    C = 0
    F = 0
    for v in range(V):
        nl = (nb[v] + 7) // 8
        nch = (nl + cl - 1) // cl
        C += nch
        if nch == 0:
            continue
        last = nl - (nch - 1) * cl
        nb0 = (last + mid - 1) // mid
        P += (nch - 1) * 16 + ((last + sb - 1) // sb if nb0 >= 16 else nb0)
    plan = np.zeros(8 * V + P + C, dtype=np.int64)
    codes = np.empty(P, dtype=np.int64)
    fast = np.empty(P, dtype=np.bool_)
    p = 0
    c = 0
    for v in range(V):
        n = nb[v]
        nl = (n + 7) // 8
        nch = (nl + cl - 1) // cl
        plan[v] = ad[v]
        plan[V + v] = n
        plan[2 * V + v] = ds[v]
        plan[3 * V + v] = c
        plan[4 * V + v] = s0[v]
        plan[5 * V + v] = s1[v]
        if nch == 0:
            continue
        for k in range(nch):
            plan[8 * V + P + c + k] = v
        c += nch
        last = nl - (nch - 1) * cl
        nb0 = (last + mid - 1) // mid
        nprog = (nch - 1) * 16 + ((last + sb - 1) // sb if nb0 >= 16 else nb0)
        aligned = ad[v] % align == 0
        full = n // 8
        for q in range(nprog):
            lo = q // 16 * cl
            end = min(nl, lo + cl)
            f = aligned and end - lo > 15 * mid and min(end, lo + q % 16 * sb + sb) <= full
            codes[p] = (q << 24) | v
            fast[p] = f
            F += 1 if f else 0
            p += 1
    i = 8 * V
    j = 8 * V + F
    for k in range(P):
        if fast[k]:
            plan[i] = codes[k]
            i += 1
        else:
            plan[j] = codes[k]
            j += 1
    return plan, P, F, C


_BUILD: list[Callable | None] = []  # the compiled _build once asked for (None: no numba here)


_LOCK = threading.Lock()


def _compiled() -> Callable | None:
    if not _BUILD:
        with _LOCK:
            if not _BUILD:
                try:
                    from refit_verify.digest._numba import _jit

                    _BUILD.append(_jit()(_build))
                except Exception:  # noqa: BLE001 - no numba here: the numpy plan
                    _BUILD.append(None)
    return _BUILD[0]


def _bits(xs) -> np.ndarray:
    """Python ints in [-2**63, 2**64) as the int64 array of their 64-bit patterns.

    Raises:
        OverflowError: a value outside that range (as numpy's ``uint64`` conversion does).
    """
    try:
        return np.asarray(xs, dtype=np.uint64).view(np.int64)
    except OverflowError:  # a negative int64 among them
        if any(not -(1 << 63) <= x < 1 << 64 for x in xs):
            raise
        return np.asarray([x % (1 << 64) for x in xs], dtype=np.uint64).view(np.int64)


def plan(addrs: list[int], sizes: list[int], seeds: list[tuple[int, int]], align: int,
         dsts: list[int] | None) -> tuple[np.ndarray, int, int, int] | None:
    """``launch._plan_numpy(addrs, sizes, seeds, align, None, dsts)``, or None without numba (the caller
    takes the numpy path). Same arguments and result: an int64 plan array and P, F, C; ``addrs``,
    ``dsts`` byte addresses and ``seeds`` 64-bit pairs, per view; ``sizes`` bytes; ``align`` 8 or 16;
    fewer than ``2**24`` views (checked by ``launch._plan``).

    Raises:
        ValueError: lists of other lengths than ``sizes``, or a seed that is no pair.
        OverflowError: an address, destination or seed outside [-2**63, 2**64).
    """
    build = _compiled()
    if build is None:
        return None
    V = len(sizes)
    if len(addrs) != V or len(seeds) != V or (dsts is not None and len(dsts) != V) or any(len(p) != 2 for p in seeds):
        raise ValueError(f"a plan takes one address, seed pair and destination per view: {len(addrs)} addresses, "
                         f"{V} sizes, {len(seeds)} seed pairs, {'no' if dsts is None else len(dsts)} destinations")
    ad = _bits(addrs)
    nb = np.asarray(sizes, dtype=np.int64)
    ds = np.zeros(V, dtype=np.int64) if dsts is None else _bits(dsts)
    sd = _bits([s for pair in seeds for s in pair]).reshape(V, 2) if V else np.zeros((0, 2), dtype=np.int64)
    first = not getattr(build, "signatures", None)  # this call compiles it, or loads it from numba's cache
    try:
        with _numba_lock.held() if first else contextlib.nullcontext():
            out, P, F, C = build(ad, nb, ds, np.ascontiguousarray(sd[:, 0]), np.ascontiguousarray(sd[:, 1]), align,
                                 _ref.CHUNK_LANES, _mix.MID_N)
    except Exception:  # noqa: BLE001 - numba could not compile it here (its first call compiles): the numpy plan from now on
        if not getattr(build, "signatures", None):
            with _LOCK:
                if _BUILD[0] is build:
                    _BUILD[0] = None
                    logger.warning("refit-verify: the compiled launch plan could not be built; launch plans are made "
                                   "with numpy", exc_info=True)
            return None
        raise
    return out, int(P), int(F), int(C)
