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

Warm-up: :func:`warmup` compiles (or loads from the on-disk caches) and runs once every digest
kernel a refit runs on a device; :func:`start_warmup` does it in a background thread, once per
device per process (the vLLM plugin starts it when a worker's device is set, the trainer API at its
first refit). Meanwhile :func:`choose` makes a digest of that device type wait for it (at most
:data:`WARMUP_WAIT_S`) instead of compiling alongside it.

Source: ``docs/digest-spec.md`` Appendix B.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from refit_verify.digest import _numba_lock
from refit_verify.digest import reference as _ref

__all__ = ["Backend", "Warmup", "backend_for", "choose", "cpu_backend", "hexes", "hexes_many", "start_warmup",
           "wait_for_warmup", "warmup", "warmup_cpu"]

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
            (``kernels.launch.plan_views(views, seeds, align=8, derive=False)`` / ``run_plan``);
            ``None`` otherwise.
        digest_many: immediate backends that digest many small strings in one call:
            ``[(address, nbytes, seeds)] -> (h0s, h1s)``, two ``uint64 [N]`` numpy arrays
            (``_numba_many.digest_arrays_many``: 8-byte aligned host addresses,
            ``nbytes < many_max_bytes``); ``None`` otherwise.
        many_max_bytes: the length bound of ``digest_many`` (0 without it).
        plan_many, run_many: with ``digest_many``: its arguments checked once for a fixed list of
            strings (``_numba_many.plan_many``) and run at each call, at the planned addresses or,
            given ``addrs``, at others (``_numba_many.run_many``); ``None`` otherwise.
        copy_many: immediate backends that copy and digest many strings in one pass over each source
            (``DigestBatch.add_copy``): ``[(source address, destination address, nbytes, seeds)] ->
            (h0s, h1s)`` (``_numba_copy.copy_digest_arrays``; taken for ``nbytes < many_max_bytes``);
            ``None`` otherwise.
    """

    name: str
    digest_words: Callable[[torch.Tensor, Words], Words] | None
    digest_views: Callable[[list[torch.Tensor], list[Words]], torch.Tensor] | None
    chunk_roots_u8: Callable[[torch.Tensor], list[Words]]
    fallback_reason: str | None = None
    plan_views: Callable[..., Any] | None = None
    run_plan: Callable[[Any], torch.Tensor] | None = None
    digest_many: Callable[[list[tuple[int, int, Words]]], tuple[Any, Any]] | None = None
    many_max_bytes: int = 0
    plan_many: Callable[[list[tuple[int, int, Words]]], Any] | None = None
    run_many: Callable[..., tuple[Any, Any]] | None = None
    copy_many: Callable[[list[tuple[int, int, int, Words]]], tuple[Any, Any]] | None = None


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

    While a warm-up of ``device_type`` runs in another thread (:func:`start_warmup`), the call
    first waits for it (:func:`wait_for_warmup`).
    """
    if _WARMING:  # a warm-up in progress (start_warmup): wait for it rather than compile alongside it
        wait_for_warmup(device_type)
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
        with _numba_lock.held(WARMUP_WAIT_S):  # the first use of the numba digests, one process at a time
            return _pick_numba()
    return _torch(None)  # no faster implementation exists for this device type


def _pick_numba() -> Backend:
    """The numba backend, its probes compared with the reference; the torch path (with its reason) otherwise."""
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
                   many_max_bytes=nm.MANY_MAX_BYTES, plan_many=nm.plan_many, run_many=nm.run_many,
                   copy_many=_numba_copy(want, seeds))


def _numba_copy(want: Words, seeds: Words) -> Callable[[list[tuple[int, int, int, Words]]], tuple[Any, Any]] | None:
    """The numba copy+digest (``_numba_copy.copy_digest_arrays``) if it copies and digests the 13-byte
    probe (from an odd address) as the reference does; else None (one WARNING: ``add_copy`` on CPU
    then copies, then digests)."""
    try:
        from refit_verify.digest import _numba_copy as nc

        src = torch.arange(14, dtype=torch.uint8)[1:]
        src.copy_(torch.arange(13, dtype=torch.uint8))
        dst = torch.full((24,), 0xA5, dtype=torch.uint8)
        h0, h1 = nc.copy_digest_arrays([(src.data_ptr(), dst.data_ptr(), 13, seeds)])
        if (int(h0[0]), int(h1[0])) != want or dst[:16].tolist() != [*range(13), 0, 0, 0] or int(dst[16]) != 0xA5:
            raise RuntimeError("the copy+digest probe differs from the reference")
    except Exception as e:  # noqa: BLE001 - missing or wrong: add_copy copies, then digests
        logger.warning("refit-verify: no fused copy+digest on CPU (%s: %s); add_copy copies, then digests (two reads)",
                       type(e).__name__, e)
        return None
    return nc.copy_digest_arrays


def _kernel_roots(u8: torch.Tensor) -> list[Words]:
    from refit_verify.digest.kernels import launch as kd

    m = _ref.MASK64
    return [(a & m, b & m) for a, b in kd.chunk_roots([u8]).cpu().tolist()]


def warmup_cpu() -> None:
    """Compile (or load from numba's cache) every specialisation the CPU digests use: ``digest_u8``
    at a lane tail, a serial and a parallel length, the batched small-string path, planned (its
    arrays read-only) and run again where the strings moved (a kept set's relocated run: the
    addresses a writable array), and the fused copy+digest (``DigestBatch.add_copy``); holding the
    numba compile lock (:mod:`refit_verify.digest._numba_lock`, at most :data:`WARMUP_WAIT_S`).

    Raises:
        ImportError: numba is not installed.
    """
    from refit_verify.digest import _numba as nd
    from refit_verify.digest import _numba_copy as nc
    from refit_verify.digest import _numba_many as nm

    with _numba_lock.held(WARMUP_WAIT_S):  # one process at a time compiles into numba's cache
        for n in (0, 13, 8 * (nd.PARALLEL_MIN_LANES + 1)):
            nd.digest_u8(torch.zeros(n, dtype=torch.uint8), "uint8", (n,))
        z = torch.zeros(16, dtype=torch.uint8)
        nm.digest_words_many([(z.data_ptr(), 13, (0, 0))])
        nm.run_many(nm.plan_many([(z.data_ptr(), 13, (0, 0))]), [z.data_ptr()])
        d = torch.zeros(16, dtype=torch.uint8)
        nc.copy_digest_arrays([(z.data_ptr() + 1, d.data_ptr(), 13, (0, 0))])


WARMUP_WAIT_S = 120.0
"""Seconds a digest waits for a warm-up of its device type in progress before it goes on without it
(compiling what it needs itself; logged once per warm-up)."""


class Warmup:
    """One device's warm-up (:func:`warmup`) in a background thread, started by :func:`start_warmup`.

    Attributes:
        device: the device warmed. thread: the daemon thread running it (None: :func:`warmup` ran
            in its caller's thread).
        done: a ``threading.Event`` set when the warm-up ended, finished or failed.
        backend: the backend's name once finished (``"triton"``, ``"numba"``, ``"torch"``), else None.
        error: the exception it raised (logged once), else None. seconds: how long it ran, once done.
    """

    __slots__ = ("device", "thread", "done", "backend", "error", "seconds")

    def __init__(self, device: torch.device) -> None:
        self.device, self.done = device, threading.Event()
        self.thread: threading.Thread | None = None
        self.backend: str | None = None
        self.error: Exception | None = None
        self.seconds: float | None = None


_WARMUPS: dict[str, Warmup] = {}  # str(device) -> its warm-up, started at most once per process
_WARMING: dict[str, Warmup] = {}  # the warm-ups still running (what choose() waits for)


def warmup(device: torch.device | str | None = None) -> str:
    """Compile (or load from the on-disk caches) and run once, in this thread, every digest kernel a
    refit runs on ``device``.

    CPU: :func:`warmup_cpu`. A kernel device type (CUDA): one launch plan whose views take each
    Triton launch of ``kernels.launch.run_plan`` (fast leaf, general leaf, upper, chain; they
    specialise on no view address, length or count), run on ``device`` and read back: the kernels
    are compiled, loaded on the device and their launchers built. Other device types: nothing. Then
    the first use of the refit's digest paths registered with :func:`warm_path` (:func:`warm_paths`).

    A device warmed here is not warmed again by :func:`start_warmup`.

    Args:
        device: as :func:`start_warmup` (None: the current CUDA device if CUDA is initialised, else the CPU).

    Returns:
        str: the backend's name (``"triton"``, ``"numba"`` or ``"torch"``).

    Raises:
        Exception: what choosing, compiling or launching raises (a Triton compile error, a device error).
    """
    t0 = time.perf_counter()
    dev = _device(device)
    b = backend_for(dev.type)
    if b.name == "numba":
        warmup_cpu()
    elif b.name == "triton":
        _warmup_kernels(dev)
    warm_paths(dev)
    with _LOCK:
        if str(dev) not in _WARMUPS:  # warmed in the caller's thread: a later start_warmup has nothing to do
            w = _WARMUPS[str(dev)] = Warmup(dev)
            w.backend, w.seconds = b.name, time.perf_counter() - t0
            w.done.set()
    return b.name


_PATHS: list[Callable[[torch.device], object]] = []


def warm_path(fn: Callable[[torch.device], object]) -> Callable[[torch.device], object]:
    """Register ``fn(device)`` to run at the end of every :func:`warmup` (after the kernels, in its
    thread): a module's own first-use work on the refit path (a first call of its Python code on
    throwaway tensors), which otherwise lands in the first refit. Registered at the module's import
    (a module not imported yet is not warmed); a failure is logged, never raised. Returns ``fn``."""
    if fn not in _PATHS:
        _PATHS.append(fn)
    return fn


def warm_paths(device: torch.device | str) -> None:
    """Run every function :func:`warm_path` registered, on ``device`` (the end of :func:`warmup`; a
    worker's prepare runs them again once the modules of its refit are imported). Never raises: a
    failure is logged, and the first refit runs that path for the first time instead."""
    dev = torch.device(device)
    for fn in list(_PATHS):
        try:
            fn(dev)
        except Exception as e:  # noqa: BLE001 - logged; the first refit runs them for the first time instead
            logger.warning("refit-verify: warming %s on %s failed (%s: %s)", getattr(fn, "__qualname__", fn), dev,
                           type(e).__name__, e)


def _device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device``: None is the current CUDA device when CUDA is initialised, else
    the CPU; a CUDA device without an index is the current one."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else torch.device("cpu")
    dev = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if dev.type == "cuda" and dev.index is None else dev


_WARM_RUNS = 3
"""Runs of the kernel warm-up's plain plan: its first compiles, its second makes the one-time check
of its kinds of launch (``kernels.direct.MIN_RUNS``: a device comparison whose kernels load at a
process's first use, tens of milliseconds) and its third launches directly."""


PINNED_BINS = range(9, 21)
"""log2 of the pinned host block sizes the CUDA warm-up caches (512 B to 1 MiB, :func:`_warm_pinned`)."""


def _warm_pinned() -> None:
    """Leave two pinned host blocks of each size in :data:`PINNED_BINS` in torch's caching host
    allocator (about 4 MiB): every launch plan goes to the device through a pinned block
    (``kernels.launch._device_plan``), and the allocator keeps one list per power of two, so the
    first plan of a size the process had not pinned before pays a ``cudaHostAlloc`` (a system call
    that page-locks the block) inside a refit's first digests. Plans above 1 MiB (models of
    thousands of tensors) still pin their first block when first planned."""
    held = [torch.empty(1 << k, dtype=torch.uint8, pin_memory=True) for k in PINNED_BINS for _ in range(2)]
    del held


def _warmup_kernels(dev: torch.device) -> None:
    """On CUDA, pinned host blocks for plans of every size up to 1 MiB (:func:`_warm_pinned`); then one
    run of every Triton launch ``run_plan`` makes, on ``dev``, synchronised by the read-back:
    the plain leaf kernels, their COPY variants (a sender's fused copy into staging,
    ``DigestBatch.add_copy``) and the gather of derived views (a close's regions beside their fused
    parameter), so none of them compiles inside a refit. The plain plan runs :data:`_WARM_RUNS` times
    and the variants twice, so every kind of launch a refit makes is checked for direct launches
    (``kernels.direct``): a refit's kept plans launch directly from their first run."""
    from refit_verify.digest.kernels import direct as _direct
    from refit_verify.digest.kernels import launch as kd
    from refit_verify.digest.kernels._mix import MID_N

    if dev.type == "cuda":
        _warm_pinned()
    seeds = lambda views: [_ref.seed("uint8", (v.numel(),), v.numel()) for v in views]  # noqa: E731
    # A view of 16 * MID_N + 1 whole lanes and 5 bytes: one chunk, its first leaf program fast (big,
    # aligned, no partial lane), its second general (holds the partial lane); a view at an odd
    # offset: general. Two chunks for the upper kernel, two views for the chain.
    sb = 8 * 16 * MID_N  # bytes of one leaf superblock
    n = sb + 8 + 5
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        buf = torch.zeros(2 * sb + 16, dtype=torch.uint8, device=dev)
        views = [buf[:n], buf[1:100]]
        plain = kd.plan_views(views, seeds(views))
        for _ in range(_WARM_RUNS):
            kd.run_plan(plain).cpu()
        k = (n + 7) // 8 * 8  # whole lanes: the COPY kernels write the last lane zero-padded
        out = torch.empty(k + 8 + 104, dtype=torch.uint8, device=dev)
        pair = [buf[: 2 * sb + 13], buf[sb : 2 * sb + 13]]  # a region at a superblock offset of its parent
        for what, run in (("COPY", lambda: kd.plan_views(views, seeds(views), dsts=[out[:k], out[k + 8 : k + 8 + 104]])),
                          ("derived-view gather", lambda: kd.plan_views(pair, seeds(pair), derive=True))):
            try:  # the variants: one failing here leaves the plain kernels warm and says so
                planned = run()
                for _ in range(_direct.MIN_RUNS if dev.type == "cuda" else 1):  # checked: direct launches at once
                    kd.run_plan(planned).cpu()
            except Exception as e:  # noqa: BLE001 - logged; the first refit that needs it compiles it
                logger.warning("refit-verify: warming the %s digest kernels on %s failed (%s: %s); the first refit "
                               "that uses them compiles them", what, dev, type(e).__name__, e)


def start_warmup(device: torch.device | str | None = None, then: Callable[[], object] | None = None) -> Warmup | None:
    """Start :func:`warmup` of ``device`` in a daemon thread, once per device per process.

    Until it ends, :func:`choose` (every digest of that device type) waits for it, at most
    :data:`WARMUP_WAIT_S`. A warm-up that raises logs one WARNING; digests then compile what they
    need themselves. Never raises. A device other than the CPU also starts the CPU's warm-up (a
    thread of its own): a GPU worker digests host tensors too (the read-back's), and numba's first
    compile of them took about 19 s on an H100 host.

    Args:
        device: the device to warm; None: the current CUDA device when this process has initialised
            CUDA, else the CPU (CUDA is never initialised here).
        then: called in the warm-up's thread after it, as part of it (the plugin imports the worker's
            refit modules there); ignored when this device's warm-up was started before.

    Returns:
        Warmup | None: this device's warm-up (the one started earlier, if any); None when
        ``REFIT_VERIFY_WARMUP`` is off or the device cannot be named.
    """
    from refit_verify.config import warmup_enabled

    if not warmup_enabled():
        return None
    try:
        dev = _device(device)
    except Exception:  # noqa: BLE001 - a device that cannot be named: no warm-up, digests compile as they go
        logger.warning("refit-verify: no digest warm-up for device %r", device, exc_info=True)
        return None
    if dev.type != "cpu":
        start_warmup("cpu")
    key = str(dev)
    with _LOCK:
        w = _WARMUPS.get(key)
        if w is not None:
            return w
        w = _WARMUPS[key] = Warmup(dev)
        w.thread = threading.Thread(target=_run_warmup, args=(w, key, then), name=f"refit-verify-warmup-{key}", daemon=True)
        _WARMING[key] = w
        if dev.type == "cpu":
            _CPU[0] = None  # the CPU digests' shortcut past choose() goes through it (and waits) again
        try:
            w.thread.start()
        except Exception as e:  # noqa: BLE001 - no thread to be had: digests compile as they go
            _end_warmup(w, key, e)
    return w


def _run_warmup(w: Warmup, key: str, then: Callable[[], object] | None) -> None:
    t0 = time.perf_counter()
    try:
        w.backend = warmup(w.device)
        if then is not None:
            then()
    except Exception as e:  # noqa: BLE001 - logged once; the refit path compiles what it needs itself
        w.seconds = time.perf_counter() - t0
        _end_warmup(w, key, e)
        return
    w.seconds = time.perf_counter() - t0
    logger.info("refit-verify: digest warm-up on %s (%s) done in %.2f s", key, w.backend, w.seconds)
    _end_warmup(w, key, None)


def _end_warmup(w: Warmup, key: str, error: Exception | None) -> None:
    if error is not None:
        w.error = error
        logger.warning("refit-verify: the digest warm-up on %s failed (%s: %s); the first refit compiles the "
                       "digests itself", key, type(error).__name__, error)
    _WARMING.pop(key, None)
    w.done.set()


def wait_for_warmup(device_type: str, timeout_s: float | None = None) -> None:
    """Wait until no warm-up of ``device_type`` runs (:func:`start_warmup`), at most ``timeout_s``
    (default :data:`WARMUP_WAIT_S`) for each; a call from a warm-up's own thread does not wait for it.

    A warm-up still running at the bound is no longer waited for by anyone (logged once): the caller
    goes on and compiles what it needs itself.
    """
    me = threading.current_thread()
    for key, w in list(_WARMING.items()):
        if w.device.type != device_type or w.thread is me:
            continue
        bound = WARMUP_WAIT_S if timeout_s is None else timeout_s
        if not w.done.wait(bound) and _WARMING.pop(key, None) is not None:
            logger.warning("refit-verify: the digest warm-up on %s still runs after %g s; digests no longer wait for it",
                           key, bound)


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
