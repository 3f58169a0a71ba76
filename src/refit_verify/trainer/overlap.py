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
future), so the helper gets it then. Both still share the GIL while the call runs Python of its
own (encoding the request, and at the reply vLLM's output thread decoding it): the work should
hand the GIL over now and then (``time.sleep(0)``; :meth:`~refit_verify.trainer.exports.StreamDigests.drain`
does every 32 tensors), or the call can wait up to the interpreter's switch interval (5 ms) for
it. The helper runs the work on the caller's current CUDA device and stream (captured at the
call), so stream order with what the caller queued before and after is kept.

Where the work is slower than the call, the caller waits for the rest (bounded by
``timeout_s``; the wait is reported through ``on_wait``). One helper thread per calling thread,
ending shortly after its caller does. Nothing here knows vLLM.
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


IDLE_POLL_S = 1.0
"""Seconds an idle helper waits for a job before it checks that its calling thread still lives."""


class _Helper:
    """One daemon thread per calling thread, fed jobs one at a time through a queue; it ends once
    its calling thread has ended and no job is left."""

    def __init__(self, owner: threading.Thread) -> None:
        self.jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self.busy = False  # a job was handed over and not finished (a timed-out one included)
        self.thread = threading.Thread(target=self._loop, args=(owner,), name="refit-verify-shadow", daemon=True)
        self.thread.start()

    def _loop(self, owner: threading.Thread) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=IDLE_POLL_S)
            except queue.Empty:
                if not owner.is_alive():
                    return
                continue
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
                job.work = None  # nothing of the caller's stays alive through an idle helper
                self.busy = False
                job.done.set()
                job = None


_LOCAL = threading.local()


def _helper() -> _Helper | None:
    """This thread's helper, started on first use; None while a timed-out job of it still runs."""
    h = getattr(_LOCAL, "helper", None)
    if h is None or not h.thread.is_alive():
        h = _LOCAL.helper = _Helper(threading.current_thread())
    return None if h.busy else h


def _current_stream() -> Any:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


def run_in_shadow(call: Callable[[], T], work: Callable[[], None], *, timeout_s: float = SHADOW_TIMEOUT_S,
                  on_wait: Callable[[float], None] | None = None) -> T:
    """Return ``call()``, running ``work()`` in a helper thread meanwhile (on this thread's current
    CUDA device and stream).

    ``work`` must not touch what ``call`` uses. An exception of ``call`` propagates unchanged,
    after ``work`` ended (at most ``timeout_s``; at once for a ``KeyboardInterrupt`` or another
    non-``Exception``); an exception of ``work`` is then logged. An exception of ``work`` alone is
    raised after ``call`` returned. When this thread's helper still runs an earlier job that timed
    out, ``work`` runs here, after ``call``. ``on_wait(seconds)``: how long this thread waited for
    ``work`` after ``call`` returned (the part of ``work`` that was not in the shadow).

    Raises:
        RefitTimeoutError: ``call`` returned but ``work`` did not end within ``timeout_s`` seconds
            (it is left running in its daemon thread; this thread's next shadow work runs inline).
        BaseException: whatever ``work`` raised.
    """
    helper = _helper()
    if helper is None:
        out = call()
        t0 = time.perf_counter()
        work()
        if on_wait is not None:
            on_wait(time.perf_counter() - t0)
        return out
    job = _Job(work, _current_stream())
    helper.busy = True
    helper.jobs.put(job)
    try:
        out = call()
    except Exception:
        if not job.done.wait(timeout_s):
            logger.warning("refit-verify: shadow work still running %.0f s after the call it shadowed failed", timeout_s)
        elif job.error is not None:
            logger.warning("refit-verify: shadow work failed beside a call that failed too: %s: %s",
                           type(job.error).__name__, job.error)
        raise
    t0 = time.perf_counter()
    ended = job.done.wait(timeout_s)
    waited = time.perf_counter() - t0
    if on_wait is not None:
        on_wait(waited)
    if not ended:
        raise RefitTimeoutError(f"refit-verify: the sender's digest work did not end within {timeout_s:g} s of the call it ran "
                                "beside (a device that stopped answering?); the call itself completed",
                                {"waiting_for": "shadow work", "waited_s": round(waited, 3)})
    if job.error is not None:
        error, job.error = job.error, None
        raise error
    return out
