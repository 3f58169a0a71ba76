"""One process at a time makes the first use of the numba digests (``refit_verify.digest._numba_lock``):
numba issue #10128, a cache written by concurrent cold compiles that later processes segfault on."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time

import pytest

from refit_verify.digest import _numba_lock


@pytest.fixture
def lock_file(tmp_path, monkeypatch):
    """A lock file of this test's own (the session's numba cache location keeps its own)."""
    path = str(tmp_path / "numba.lock")
    monkeypatch.setattr(_numba_lock, "lock_path", lambda: path)
    return path


def _held_elsewhere(path: str) -> int:
    """The lock taken through another open file description, as another process's would be."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_the_lock_file_is_per_user_and_cache_location(monkeypatch):
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    here = _numba_lock.lock_path()
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/somewhere/else")
    other = _numba_lock.lock_path()
    assert here != other and f"refit-verify-numba-{os.getuid()}-" in os.path.basename(here)


def test_held_takes_the_file_lock_once_reentrantly_and_releases_it(lock_file):
    with _numba_lock.held(timeout_s=1.0):
        with _numba_lock.held(timeout_s=1.0):  # a nested first use (the backend's probe inside the warm-up)
            with pytest.raises(BlockingIOError):
                _held_elsewhere(lock_file)
        with pytest.raises(BlockingIOError):  # still held by the outer block
            _held_elsewhere(lock_file)
    os.close(_held_elsewhere(lock_file))  # free again


def test_another_thread_waits_for_the_holder(lock_file):
    order = []

    def other():
        with _numba_lock.held(timeout_s=10.0):
            order.append("other")

    with _numba_lock.held(timeout_s=1.0):
        th = threading.Thread(target=other)
        th.start()
        time.sleep(0.3)
        order.append("holder")
    th.join(10)
    assert order == ["holder", "other"]


def test_a_lock_held_past_the_bound_is_gone_around_with_a_warning(lock_file, caplog):
    fd = _held_elsewhere(lock_file)
    try:
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="refit_verify"), _numba_lock.held(timeout_s=0.3):
            waited = time.monotonic() - t0
        assert 0.3 <= waited < 5 and "held the numba compile lock" in caplog.text
    finally:
        os.close(fd)


def test_no_lock_file_locks_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(_numba_lock, "lock_path", lambda: str(tmp_path / "missing" / "numba.lock"))
    with _numba_lock.held(timeout_s=0.3):
        pass


_WARM = """
import json, sys, time
import torch
from refit_verify.digest import _numba_lock, backends
_numba_lock.lock_path = lambda: sys.argv[1]
print("ready", flush=True)
t0 = time.monotonic()
backends.warmup_cpu()
print(json.dumps({"waited_s": time.monotonic() - t0}), flush=True)
"""


def test_a_second_process_warms_its_numba_digests_only_after_the_holder(lock_file):
    fd = _held_elsewhere(lock_file)
    p = subprocess.Popen([sys.executable, "-c", _WARM, lock_file], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.5)
        assert p.poll() is None  # still waiting
    finally:
        os.close(fd)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1])["waited_s"] >= 1.4
