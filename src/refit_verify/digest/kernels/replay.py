"""Kept launch plans replayed as one CUDA graph: the digest of the same memory for one launch.

A kept plan (:class:`~refit_verify.digest.kernels.launch.Planned`, held by a
:class:`~refit_verify.digest.kept.DigestSet`) is run again at every refit: the worker's check before
loading, the engine-state snapshot, the read-back, a trainer's held tensors. Its up to four Triton
launches cost about 0.5 ms of host time a run on an H200 host, however few bytes they read. Their arguments never change between runs (the plan's
addresses, its counts, a work area), so the second run of a plan captures them into a CUDA graph and
every run from then on is one ``cudaGraphLaunch`` plus a copy of the output row block.

What replay changes, and what it does not:

* The kernels, their arguments and the bytes they read are those of the captured run; the digests
  are bit-identical (``tests/gpu/test_graph_replay_gpu.py`` compares them with the reference
  across changing memory, interleaved launches, streams and threads).
* **Checked once.** At capture, the work area and output block are filled with a sentinel, the
  graph is replayed once and compared on the device with a plain run of the same plan
  (``torch.equal``: one synchronisation per plan, once). A graph that did not compute the digest
  (a launch that escaped the capture ran eagerly, leaving an empty or partial graph) gives a
  mismatch: that plan stays on plain launches (logged).
* **One stream.** A graph replays only on the stream that was current when it was captured (its
  output block and work area belong to that stream in the caching allocator's bookkeeping); on any
  other stream the plan runs with plain launches. The graphs captured under one stream of a device
  share one work area (the leaf and upper kernels' scratch, 73.7 KiB per chunk), so their replays
  are ordered by that stream; a lock (bounded wait, plain launches on timeout) serialises capture and
  enqueue between threads. The output block is copied (in stream order) before the replay returns:
  a second replay of the same plan never overwrites a result its caller has not read.
* **Memory.** The work area is allocated at the size a capture needs (rounded up to the allocator's
  granularity, never doubled) and is held only by the graphs captured with it (the device slot
  keeps a weak reference). :func:`release_all` drops every graph and so every area; the plugin calls
  it (and :func:`refit_verify.vllm_plugin.worker_copies.release_pools`) from the worker's ``sleep``, before
  vLLM empties the cache. Kept plans simply capture again at their next runs.
* **A failed capture.** Capture goes to a pool of our own (``torch.cuda.graph_pool_handle()``). When
  anything fails after ``capture_begin`` (a capture-illegal call, an invalidated capture, a launch
  error), the stream capture is ended, the allocator is told to stop routing to that pool and the
  pool is released (``torch._C._cuda_endAllocateToPool`` / ``_cuda_releasePool``, the calls
  ``torch.cuda.use_mem_pool`` makes): without this torch's allocator stays in "capture underway",
  ``empty_cache`` frees nothing and ``record_stream`` blocks are never reclaimed. Replay is then
  turned off for the whole process (one warning).
* **Torch version gate.** Replay runs only on torch >= 2.12 (:data:`MIN_TORCH`), the first release
  whose CUDA graphs keep random-number-generator state per capture (pytorch PR #176752, "[CUDA
  Graph] Per-capture RNG state", in trunk in April 2026 after 2.11's branch cut; ``CUDAGraph.cpp``
  there calls ``capture_epilogue(capture_id_)`` and ``remove_capture_state``, and
  ``CUDAGeneratorImpl.h`` of the 2.13 wheel declares both). Before it, ``capture_begin`` puts the
  device's default generator in capture mode: any eager random op from another thread during a
  capture fails ("Offset increment outside graph capture encountered unexpectedly"), a capture that
  fails midway leaves the generator in that mode for good (vLLM's sampling dies), and every replay
  adds two ``fill_`` kernels. Below the gate replay stays off when asked for with ``1`` (logged
  once); ``REFIT_VERIFY_CUDA_GRAPHS=force`` replays there too (logged once), for processes where no
  other thread draws random numbers on the device during a refit (a vLLM worker runs its refits
  and its sampling in one thread) and on the understanding that a capture failing midway leaves the
  device's generator unusable.
* **Opt-in** (``REFIT_VERIFY_CUDA_GRAPHS=1`` or ``force``, read at each run;
  :func:`refit_verify.config.cuda_graphs_enabled`).

Capture uses ``CUDAGraph.capture_begin`` on a side stream in thread-local capture mode, not the
``torch.cuda.graph`` context manager, which synchronises the whole device, collects garbage and
empties the caching allocator's cache at every capture (the device-wide synchronisation is the
cost). The side stream is one per device, made once. It comes from torch's stream pool
(``torch.cuda.Stream``), shared round-robin with other ``torch.cuda.Stream()`` users of the process:
torch offers no non-blocking stream outside the pool (``torch.cuda.cudart().cudaStreamCreate``
makes a *blocking* stream, whose capture any legacy-default-stream work of another thread would
invalidate). Foreign work enqueued on it during the capture window would be captured; the check at
capture catches a graph that does not compute the digest, and a failed capture is cleaned up.
"""

from __future__ import annotations

import logging
import re
import threading
import weakref
from collections.abc import Callable

import torch

from refit_verify.config import cuda_graphs_enabled, cuda_graphs_forced

__all__ = ["Graph", "MIN_TORCH", "release_all", "replay", "torch_supports_graphs"]

logger = logging.getLogger("refit_verify")

MIN_RUNS = 2
"""A plan is captured at its second run (the first compiles the kernels and may be its only one)."""

MIN_TORCH = (2, 12)
"""First torch release with per-capture RNG state in its CUDA graphs (see the module docstring)."""

LOCK_WAIT_S = 5.0
"""Seconds a replay waits for its device's lock (another thread capturing) before plain launches."""

_SENTINEL = -0x5A5A5A5A5A5A5A5B  # fills work area and output block before the check replay


def torch_supports_graphs(version: str | None = None) -> bool:
    """True iff torch ``version`` (default: the installed one) is at least :data:`MIN_TORCH`.

    Pre-releases of 2.12 (``2.12.0a0+…``, ``2.12.0.dev…``) count as older: nightlies from before the
    per-capture RNG change carry that number. Unparsable versions count as older.
    """
    text = str(torch.__version__ if version is None else version).split("+", 1)[0]
    m = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(.*)", text)
    if m is None or m.group(4):  # unparsable, or a pre-release / dev build (a0, rc1, .dev2026...)
        return False
    return (int(m.group(1)), int(m.group(2))) >= MIN_TORCH


_TORCH_OK = torch_supports_graphs()
_OFF: str | None = None  # why replay is off for the whole process (a failed capture), None while it is not
_STATE_LOCK = threading.Lock()
_LOGGED: set[str] = set()


def _log_once(key: str, msg: str, *args) -> None:
    with _STATE_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.warning(msg, *args)


def active() -> bool:
    """True iff replay would be used now: asked for (env), torch passes the gate (or ``force``), and no capture failed."""
    if _OFF is not None or not cuda_graphs_enabled():
        return False
    if not _TORCH_OK:
        if cuda_graphs_forced():
            _log_once("forced", "refit-verify: REFIT_VERIFY_CUDA_GRAPHS=force: CUDA graph replay on torch %s, older than %s "
                      "(its graphs share the device's random-number state: no other thread may draw random numbers on "
                      "the device during a refit)", torch.__version__, ".".join(map(str, MIN_TORCH)))
            return True
        _log_once("torch", "refit-verify: REFIT_VERIFY_CUDA_GRAPHS=1 ignored: torch %s is older than %s (CUDA graphs keep "
                  "random-number state per capture from 2.12 on); plain launches", torch.__version__,
                  ".".join(map(str, MIN_TORCH)))
        return False
    return True


class _Device:
    """One device's lock, its capture stream (made once) and a weak reference per replay stream to
    the work area the graphs captured under that stream share."""

    __slots__ = ("lock", "side", "areas")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.side: torch.cuda.Stream | None = None
        self.areas: dict[int, weakref.ref] = {}


_DEVICES: dict[int, _Device] = {}
_CAPTURED: weakref.WeakSet = weakref.WeakSet()  # the Planned objects holding a Graph (for release_all)


def _device(index: int) -> _Device:
    with _STATE_LOCK:
        d = _DEVICES.get(index)
        if d is None:
            d = _DEVICES[index] = _Device()
        return d


class Graph:
    """A captured plan: the graph, its output block, the work area it was captured with (kept alive
    here) and the stream (``cuda_stream`` handle) it replays on."""

    __slots__ = ("graph", "out", "work", "stream")

    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor, work: torch.Tensor, stream: int) -> None:
        self.graph, self.out, self.work, self.stream = graph, out, work, stream


def replay(p, work_len: int, launch: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor | None:
    """Run plan ``p`` (a CUDA :class:`~refit_verify.digest.kernels.launch.Planned`) as a CUDA graph.

    Args:
        p: the plan; its ``runs`` / ``graph`` slots are kept up to date here.
        work_len: int64 elements of work area the plan's kernels use.
        launch: ``launch(work, out)`` launches the plan's kernels (int64 ``work``, int64 ``out``
            ``[V, 2]``) on the current stream: captured once and run once plainly for the check.

    Returns:
        torch.Tensor | None: a fresh int64 ``[V, 2]`` on the plan's device, as the plain launches
        return it (ready in stream order); None when the plan runs with plain launches this time
        (its first run, replay off or not possible on this torch, its capture failed or did not
        match, another stream than its capture's, the device lock busy past :data:`LOCK_WAIT_S`).
    """
    p.runs += 1
    if p.graph is False or p.runs < MIN_RUNS or not active():
        return None
    dev = p.device
    d = _device(dev.index if dev.index is not None else torch.cuda.current_device())
    if not d.lock.acquire(timeout=LOCK_WAIT_S):
        return None
    try:
        with torch.cuda.device(dev):
            if torch.cuda.is_current_stream_capturing():
                return None  # inside someone's capture: plain launches are captured with it
            stream = torch.cuda.current_stream(dev).cuda_stream
            g = p.graph
            if g is None:
                if _OFF is not None:
                    return None
                got = _capture(d, dev, p.V, work_len, launch, stream)
                if got is None:
                    return None  # replay is off for the process now
                g, first = got
                p.graph = g
                if g is False:
                    return None
                _CAPTURED.add(p)
                return first
            if g.stream != stream:
                return None  # its memory belongs to the capture-time stream
            g.graph.replay()
            return g.out.clone()
    finally:
        d.lock.release()


def release_all() -> int:
    """Drop every captured graph and the work areas they hold; their plans capture again later.

    Each captured plan's ``graph`` goes back to None and its ``runs`` to 0. The memory goes back to
    the caching allocator's cache (``torch.cuda.empty_cache()`` returns it to the device; vLLM's
    sleep calls it). A replay already enqueued keeps running: CUDA defers the graph's destruction,
    and its work area and output block were allocated under the stream it runs on.

    Returns:
        int: how many graphs were dropped (0 without CUDA or when none was captured).
    """
    plans = list(_CAPTURED)
    for p in plans:
        d = _DEVICES.get(p.device.index) if p.device.index is not None else None
        locked = d is not None and d.lock.acquire(timeout=LOCK_WAIT_S)
        try:
            p.graph, p.runs = None, 0
        finally:
            if locked:
                d.lock.release()
    _CAPTURED.clear()
    with _STATE_LOCK:
        for d in _DEVICES.values():
            d.areas.clear()
    return len(plans)


def _round_up(n: int) -> int:
    """int64 elements for ``n``: whole 512 B blocks below 1 MiB, whole 2 MiB above (the caching
    allocator's granularity: the rounding costs no memory the allocator would not take anyway)."""
    nbytes = 8 * n
    unit = 512 if nbytes < (1 << 20) else (2 << 20)
    return (nbytes + unit - 1) // unit * unit // 8


def _work_area(d: _Device, dev: torch.device, work_len: int, stream: int) -> torch.Tensor:
    ref = d.areas.get(stream)
    work = ref() if ref is not None else None
    if work is None or work.numel() < work_len:
        work = torch.empty(_round_up(work_len), dtype=torch.int64, device=dev)  # older graphs keep theirs
        d.areas[stream] = weakref.ref(work)
    return work


def _capture(d: _Device, dev: torch.device, V: int, work_len: int, launch, stream: int):
    """Capture ``launch`` on the device's side stream and check it once.

    Returns ``(Graph, first digests)``; ``(False, None)`` when the check found a mismatch (logged);
    None when the capture failed (cleaned up, replay off for the process, logged once).
    """
    global _OFF
    idx = dev.index
    cur = torch.cuda.current_stream(dev)
    try:
        work = _work_area(d, dev, work_len, stream)
        out = torch.empty((V, 2), dtype=torch.int64, device=dev)
        if d.side is None:
            d.side = torch.cuda.Stream(dev)
        side = d.side
        graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
    except Exception as e:  # noqa: BLE001 - nothing captured yet: this plan on plain launches
        logger.warning("refit-verify: no CUDA graph for a kept digest plan (%s: %s); plain launches", type(e).__name__, e)
        return False, None
    try:
        side.wait_stream(cur)  # nothing runs at capture; keeps the allocator's streams apart
        with torch.cuda.stream(side):
            try:
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                launch(work, out)
                graph.capture_end()
            except BaseException:
                _abandon(graph, idx, pool)
                raise
        cur.wait_stream(side)
    except Exception as e:  # noqa: BLE001 - replay only saves host time: plain launches from here on
        _OFF = f"{type(e).__name__}: {e}"
        _log_once("capture", "refit-verify: a kept digest plan could not be captured as a CUDA graph; CUDA graph "
                  "replay is off for this process, plain launches from now on (%s)", _OFF)
        return None
    g = Graph(graph, out, work, stream)
    first = _check(g, V, work_len, launch, dev)
    return (g, first) if first is not None else (False, None)


def _check(g: Graph, V: int, work_len: int, launch, dev: torch.device) -> torch.Tensor | None:
    """Replay ``g`` once over sentinel-filled scratch and compare with a plain run (one sync).

    Returns the replay's digests (int64 ``[V, 2]``), or None on a mismatch (logged).
    """
    g.work.fill_(_SENTINEL)
    g.out.fill_(_SENTINEL)
    g.graph.replay()
    got = g.out.clone()
    want = torch.empty((V, 2), dtype=torch.int64, device=dev)
    launch(torch.empty(work_len, dtype=torch.int64, device=dev), want)
    if torch.equal(got, want):
        return got
    _log_once("mismatch", "refit-verify: a captured CUDA graph's digests differ from plain launches of the same plan "
              "(a launch escaped the capture?); that plan stays on plain launches (later mismatches are not logged)")
    return None


def _abandon(graph: torch.cuda.CUDAGraph, idx: int, pool) -> None:
    """After a failure between ``capture_begin`` and a completed ``capture_end``: end the stream
    capture if it is still open and give the capture's pool back to the allocator, unless the graph
    already owns it (``capture_end`` got that far; its destructor releases it then)."""
    try:
        if torch.cuda.is_current_stream_capturing():
            graph.capture_end()  # cudaStreamEndCapture first: ends an invalidated capture too, then raises
    except Exception:  # noqa: BLE001 - the capture is ended either way
        pass
    try:
        graph.pool()  # raises unless capture_end completed: then the pool is the graph's to release
        return
    except Exception:  # noqa: BLE001
        pass
    # 2.11-2.13 (use_mem_pool): _cuda_endAllocateToPool; older torch: _cuda_endAllocateCurrentStreamToPool
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or getattr(torch._C, "_cuda_endAllocateCurrentStreamToPool", None)
    for fn in (end, getattr(torch._C, "_cuda_releasePool", None)):
        try:
            fn(idx, pool)
        except Exception:  # noqa: BLE001 - e.g. capture_begin failed before it began allocating to the pool
            pass
