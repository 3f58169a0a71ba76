"""One process at a time makes the first use of the digests' numba functions (compile or cache load).

numba writes each cached function's machine code to its cache directory (``__pycache__`` beside the
module, or ``NUMBA_CACHE_DIR``). Processes that compile the same functions at once from a cold cache
(a trainer's warm-up and a vLLM worker's, started together on a fresh machine) can leave a cache that
makes later processes segfault when they load it (numba issue #10128: symbol names depend on each
process's compile order). :func:`held` takes an exclusive ``flock`` on a per-user lock file keyed by
that cache location around the first use of those functions: a second process waits, then loads what
the first wrote. Re-entrant within a process (other threads of it wait for the holder). Every wait is
bounded (``timeout_s``): past it the caller goes on without the lock (one warning). Where no lock file
can be opened (no writable temporary directory), nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator

__all__ = ["held", "lock_path"]

logger = logging.getLogger("refit_verify")

_RLOCK = threading.RLock()
_depth = 0  # held() calls open in this process (under _RLOCK); the file lock is taken by the outermost


def lock_path() -> str:
    """The lock file of this user and numba cache location (``NUMBA_CACHE_DIR``, else this package's
    directory, whose ``__pycache__`` numba uses), in the temporary directory."""
    where = os.environ.get("NUMBA_CACHE_DIR") or os.path.dirname(os.path.abspath(__file__))
    key = hashlib.sha256(os.path.realpath(where).encode()).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), f"refit-verify-numba-{os.getuid()}-{key}.lock")


def _acquire(timeout_s: float) -> int | None:
    """An open descriptor of :func:`lock_path` holding its exclusive ``flock``, or None (no lock file;
    another process held it past ``timeout_s`` seconds)."""
    path = lock_path()
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        logger.debug("refit-verify: no numba compile lock (%s: %s)", path, e)
        return None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                logger.warning("refit-verify: another process held the numba compile lock %s for %.0f s; "
                               "going on without it", path, timeout_s)
                return None
            time.sleep(0.02)
        except OSError as e:  # a file system without flock
            os.close(fd)
            logger.debug("refit-verify: no numba compile lock (%s: %s)", path, e)
            return None


@contextlib.contextmanager
def held(timeout_s: float = 120.0) -> Iterator[None]:
    """Hold the numba compile lock (module docstring) for the ``with`` block; waits at most
    ``timeout_s`` seconds for another thread of this process and as long again for another process."""
    global _depth
    if not _RLOCK.acquire(timeout=timeout_s):
        logger.warning("refit-verify: another thread held the numba compile lock for %.0f s; going on without it", timeout_s)
        yield
        return
    try:
        fd = _acquire(timeout_s) if _depth == 0 else None
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
            if fd is not None:
                os.close(fd)  # releases the flock
    finally:
        _RLOCK.release()
