"""Kept launch plans replayed as one CUDA graph: the digest of the same memory for one launch.

A kept plan (:class:`~refit_verify.kernels.digest.Planned`, held by a
:class:`~refit_verify.digest_set.DigestSet`) is run again at every refit: the worker's check before
loading, the engine-state snapshot, the read-back, a trainer's held tensors. Its up to four Triton
launches cost about 0.5 ms of host time a run on the H200 host measured (``docs/performance.md``,
nineteenth run), however few bytes they read. Their arguments never change between runs (the plan's
addresses, its counts, a work area), so the second run of a plan captures them into a CUDA graph and
every run from then on is one ``cudaGraphLaunch`` plus a copy of the output row block.

What replay changes, and what it does not:

* The kernels, their arguments and the bytes they read are those of the captured run; the digests
  are bit-identical (``tests/gpu/test_graph_replay_gpu.py`` compares them with the reference
  across changing memory, interleaved launches and two streams).
* The graphs of one device share one work area (the leaf and upper kernels' scratch, 73.7 KiB per
  chunk, grown by doubling; a graph keeps the area it was captured with alive). Replays on a device
  are serialised: a lock, and each replay's stream waits for the previous replay's completion
  event, so two streams never share the work area at once. The output block of a graph is copied
  (in stream order) before the replay returns: a second replay of the same plan never overwrites a
  result its caller has not read.
* A capture that fails (an allocator or launcher that cannot be captured) leaves the plan on plain
  launches for good, logged once per plan.
* **Opt-in** (``REFIT_VERIFY_CUDA_GRAPHS=1``, read at each run; :func:`refit_verify.config.cuda_graphs_enabled`):
  a review found failure paths to fix before it can be the default — a capture that fails after
  ``capture_begin`` leaves torch's allocator routing to the capture (``empty_cache`` then frees
  nothing; on torch before per-capture generator state it also breaks the device's random numbers),
  and the shared work area is kept for the process's life (not given back at vLLM's sleep).

Capture uses ``CUDAGraph.capture_begin`` on a side stream in thread-local capture mode, not the
``torch.cuda.graph`` context manager, which synchronises the whole device, collects garbage and
empties the caching allocator's cache at every capture.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from refit_verify.config import cuda_graphs_enabled

__all__ = ["replay"]

logger = logging.getLogger("refit_verify")

MIN_RUNS = 2
"""A plan is captured at its second run (the first compiles the kernels and may be its only one)."""


class _Device:
    """One device's shared work area, the lock that serialises its replays and the last replay's event."""

    __slots__ = ("lock", "work", "done")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.work: torch.Tensor | None = None
        self.done: torch.cuda.Event | None = None


_DEVICES: dict[int, _Device] = {}
_DEVICES_LOCK = threading.Lock()


def _device(index: int) -> _Device:
    with _DEVICES_LOCK:
        d = _DEVICES.get(index)
        if d is None:
            d = _DEVICES[index] = _Device()
        return d


class Graph:
    """A captured plan: the graph, its output block and the work area it was captured with (kept alive)."""

    __slots__ = ("graph", "out", "work")

    def __init__(self, graph: torch.cuda.CUDAGraph, out: torch.Tensor, work: torch.Tensor) -> None:
        self.graph, self.out, self.work = graph, out, work


def replay(p, work_len: int, launch: Callable[[torch.Tensor, torch.Tensor], None]) -> torch.Tensor | None:
    """Run plan ``p`` (a CUDA :class:`~refit_verify.kernels.digest.Planned`) as a CUDA graph.

    Args:
        p: the plan; its ``runs`` / ``graph`` slots are kept up to date here.
        work_len: int64 elements of work area the plan's kernels use.
        launch: ``launch(work, out)`` launches the plan's kernels (int64 ``work``, int64 ``out``
            ``[V, 2]``) on the current stream: captured once, never run here otherwise.

    Returns:
        torch.Tensor | None: a fresh int64 ``[V, 2]`` on the plan's device, as the plain launches
        return it (ready in stream order); None when the plan runs with plain launches this time
        (its first run, replay turned off, or its capture failed).
    """
    p.runs += 1
    if p.graph is False or p.runs < MIN_RUNS or not cuda_graphs_enabled():
        return None
    dev = p.device
    d = _device(dev.index if dev.index is not None else torch.cuda.current_device())
    with d.lock, torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        if torch.cuda.is_current_stream_capturing():
            return None  # inside someone's capture: plain launches are captured with it
        g = p.graph
        if g is None:
            g = p.graph = _capture(d, dev, p.V, work_len, launch)
            if g is False:
                return None
        if d.done is not None:
            stream.wait_event(d.done)  # the last replay on this device (any stream) has left the work area
        g.graph.replay()
        out = g.out.clone()
        if d.done is None:
            d.done = torch.cuda.Event()
        d.done.record(stream)
        return out


def _capture(d: _Device, dev: torch.device, V: int, work_len: int, launch) -> Graph | bool:
    """Capture ``launch`` on a side stream (thread-local mode); False (logged) when it cannot be."""
    try:
        work = d.work
        if work is None or work.numel() < work_len:
            n = max(work_len, 2 * work.numel() if work is not None else 0)
            work = d.work = torch.empty(n, dtype=torch.int64, device=dev)  # older graphs keep theirs
        out = torch.empty((V, 2), dtype=torch.int64, device=dev)
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))  # nothing runs at capture; keeps the allocator's streams apart
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                launch(work, out)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(dev).wait_stream(side)
        return Graph(graph, out, work)
    except Exception as e:  # noqa: BLE001 - replay only saves host time: plain launches from here on
        logger.warning("refit-verify: a kept digest plan could not be captured as a CUDA graph, plain launches "
                       "from now on (%s: %s)", type(e).__name__, e)
        return False
