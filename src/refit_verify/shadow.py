"""Host work done while the calling thread waits for a call that blocks: "in its shadow".

A trainer that sends weights to an engine in another process spends most of a refit blocked in
an RPC (vLLM's ``LLM.update_weights`` waits for the engine core's reply; on the H200 about 20 ms
per packed chunk, most of the ~100 ms refit). Host work of the verification that does not need
the reply (the sender's digest bookkeeping: checks, signatures, launches, and once every tensor
is out, the read of the digests) can run then, in a second thread, instead of before or after
the call on the refit's critical path.

:func:`run_in_shadow` runs ``call()`` in the calling thread and ``work()`` in a helper thread
started by then; it returns ``call()``'s result once both are done. Why the call stays in the
caller's thread and the work moves: the call releases the GIL while it waits (a socket, a
future), so the helper gets it at once; were it the other way round, the call's own Python
(encoding, sending) would wait for the helper's work to yield the GIL, up to the interpreter's
switch interval (5 ms). The helper runs the work on the caller's current CUDA device and stream
(captured at the call), so stream order with what the caller queued before and after is kept.

Where the work is slower than the call, the caller waits for the rest (bounded by
``timeout_s``). Nothing here knows vLLM.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TypeVar

from refit_verify.errors import RefitTimeoutError

logger = logging.getLogger("refit_verify")

__all__ = ["SHADOW_TIMEOUT_S", "run_in_shadow"]

T = TypeVar("T")

SHADOW_TIMEOUT_S = 120.0
"""Seconds the caller waits, after its call returned, for the shadow work still running."""


class _Job:
    __slots__ = ("done", "error", "stream", "work")

    def __init__(self, work: Callable[[], None], stream: Any) -> None:
        self.work, self.stream = work, stream
        self.done = threading.Event()
        self.error: BaseException | None = None


class _Helper:
    """One daemon thread per calling thread, fed jobs one at a time through a queue."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.busy = False  # a job was handed over and not finished (a timed-out one included)
        self.thread = threading.Thread(target=self._loop, name="refit-verify-shadow", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                with ExitStack() as stack:
                    if job.stream is not None:
                        import torch

                        stack.enter_context(torch.cuda.device(job.stream.device))
                        stack.enter_context(torch.cuda.stream(job.stream))
                    job.work()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                job.error = e
            finally:
                self.busy = False
                job.done.set()


_LOCAL = threading.local()


def _helper() -> _Helper | None:
    """This thread's helper, started on first use; None while a timed-out job of it still runs."""
    h = getattr(_LOCAL, "helper", None)
    if h is None or not h.thread.is_alive():
        h = _LOCAL.helper = _Helper()
    return None if h.busy else h


def _current_stream() -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


def run_in_shadow(call: Callable[[], T], work: Callable[[], None], *, timeout_s: float = SHADOW_TIMEOUT_S) -> T:
    """Return ``call()``, running ``work()`` in a helper thread meanwhile (on this thread's current
    CUDA device and stream).

    ``work`` must not touch what ``call`` uses. An exception of ``call`` propagates unchanged
    (after ``work`` ended, or after ``timeout_s``); an exception of ``work`` is raised after
    ``call`` returned. When this thread's helper still runs an earlier job that timed out, ``work``
    runs here, after ``call``.

    Raises:
        RefitTimeoutError: ``call`` returned but ``work`` did not end within ``timeout_s`` seconds
            (it is left running in its daemon thread; this thread's next shadow work runs inline).
        BaseException: whatever ``work`` raised.
    """
    helper = _helper()
    if helper is None:
        out = call()
        work()
        return out
    job = _Job(work, _current_stream())
    helper.busy = True
    helper.jobs.put(job)
    try:
        out = call()
    except BaseException:
        if not job.done.wait(timeout_s):
            logger.warning("refit-verify: shadow work still running %.0f s after the call it shadowed failed", timeout_s)
        raise
    t0 = time.perf_counter()
    if not job.done.wait(timeout_s):
        raise RefitTimeoutError(f"refit-verify: the sender's digest work did not end within {timeout_s:g} s of the call it ran "
                                "beside (a device that stopped answering?)", {"waiting_for": "shadow work",
                                                                            "waited_s": round(time.perf_counter() - t0, 3)})
    if job.error is not None:
        raise job.error
    return out
