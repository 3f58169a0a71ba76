"""The children of ``benchmarks/bench_paths.py``: one worker process each (``benchmarks/_paths_worker.py``),
a bounded request/reply channel to it, starting and stopping them in groups, their order in a round,
and ``--pin``'s core blocks."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _paths_worker import ENC, REPLY, Command, Reply

ROOT = Path(__file__).resolve().parents[1]

ORDERS3 = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 2, 1), (1, 0, 2))
"""The A/A control: the order of (off, enforce, off-b) in round r: the three rotations, then the three reversed
(over 6 rounds each engine holds each place twice and directly follows each other engine twice)."""


class ChildGone(Exception):
    """A child died, hung (and was killed) or broke the protocol."""


class Child:
    """One worker process: a mode, an engine kind, and a bounded request/reply channel.

    ``name``: the engine's name in labels and tables (default the mode; ``off-b``: a second off engine).
    """

    def __init__(self, mode: str, kind: str, argv: list[str], env: dict[str, str], log: Path, name: str | None = None) -> None:
        self.mode, self.kind, self.log = mode, kind, log
        self.name = name or mode
        self.dead: str | None = None
        self.ready: Reply | None = None
        self.kv_ok = False  # its vLLM takes kv_cache_memory_bytes (said in its "imported" reply)
        self._logf = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._logf, env=env, cwd=ROOT,
                                     start_new_session=True)  # its own process group: engine processes are killed with it
        self._q: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True, name=f"read-{self.name}-{kind}").start()

    @property
    def label(self) -> str:
        return f"{self.name}/{self.kind}"

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._q.put(line)
        self._q.put(None)

    def wait_reply(self, timeout_s: float) -> Reply:
        """The next reply, within ``timeout_s`` seconds.

        Raises:
            ChildGone: no reply in time (the child is killed), the child exited, or a malformed line.
        """
        if self.dead:
            raise ChildGone(self.dead)
        try:
            line = self._q.get(timeout=timeout_s)
        except queue.Empty:
            self.kill(f"no reply within {timeout_s:g} s; killed")
            raise ChildGone(self.dead) from None
        if line is None:
            try:
                rc = self.proc.wait(10)
            except subprocess.TimeoutExpired:
                rc = "?"
            self.kill(f"exited (rc {rc})")
            raise ChildGone(self.dead)
        try:
            return REPLY.decode(line)
        except Exception as e:  # noqa: BLE001 - a protocol break ends this child
            self.kill(f"sent a malformed reply ({e}): {line[:200]!r}")
            raise ChildGone(self.dead) from None

    def send(self, cmd: Command) -> None:
        """Write ``cmd`` to the child without waiting for its reply.

        Raises:
            ChildGone: the child is dead or its stdin is closed.
        """
        if self.dead:
            raise ChildGone(self.dead)
        try:
            self.proc.stdin.write(ENC.encode(cmd) + b"\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.kill(f"stdin closed ({e})")
            raise ChildGone(self.dead) from None

    def request(self, cmd: Command, timeout_s: float) -> Reply:
        self.send(cmd)
        return self.wait_reply(timeout_s)

    def kill(self, why: str) -> None:
        self.dead = self.dead or why
        with contextlib.suppress(ProcessLookupError, PermissionError):  # the group this child leads: its engine processes too
            os.killpg(self.proc.pid, signal.SIGKILL)

    def stop(self, timeout_s: float = 60.0) -> None:
        if not self.dead:
            with contextlib.suppress(ChildGone):
                self.request(Command(op="quit"), timeout_s)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout_s)
        self.kill(self.dead or "stopped")
        self._logf.close()

    def log_tail(self, n: int = 1200) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


# ------------------------------------------------------------------------------------------ run


def pin_blocks(children: int, per_child_min: int = 4) -> list[str]:
    """``--pin``: ``children`` disjoint blocks ``"lo-hi"`` of the cores this process may use, the last
    core left to the parent when there are enough; [] when a child would get fewer than ``per_child_min``."""
    cores = sorted(os.sched_getaffinity(0))
    spare = 1 if len(cores) - 1 >= children * per_child_min else 0
    per = (len(cores) - spare) // max(children, 1)
    if per < per_child_min:
        return []
    return [f"{cores[i * per]}-{cores[i * per + per - 1]}" for i in range(children)]


def repin(pgid: int, block: str) -> int:
    """Move every thread of every process in process group ``pgid`` (a child and the engine processes
    it started) onto the cores ``block`` (``"lo-hi"``); returns how many threads were moved (a thread
    that ends meanwhile is skipped)."""
    lo, hi = (int(x) for x in block.split("-"))
    cpus = range(lo, hi + 1)
    moved = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:  # after the name: state, ppid, pgrp
                    continue
            for tid in os.listdir(f"/proc/{d}/task"):
                os.sched_setaffinity(int(tid), cpus)
                moved += 1
        except (OSError, ValueError, IndexError):
            continue
    return moved


def order_for(live: list[str], r: int, i: int) -> list[str]:
    """The order of the ``live`` engines (1 to 3, in engine order) for counted round ``r`` of path ``i``: three
    rotate through :data:`ORDERS3` (path i starts 3 orders on, so counted rounds 3k..3k+2 hold each engine once
    per place), two alternate, one is alone."""
    if len(live) == 3:
        return [live[j] for j in ORDERS3[(r + 3 * i) % len(ORDERS3)]]
    if len(live) == 2:
        return list(live) if (r + i) % 2 == 0 else list(live[::-1])
    return list(live)


def start_group(new: list[Child], timeout_s: float, parallel: bool, on_ready: Callable[[Child, Reply, float], None]) -> bool:
    """Start children spawned together: wait for each one's imports (they overlap), then send ``start`` to all
    at once (``parallel``, when every child's vLLM takes a fixed KV cache) or one at a time, waiting for each
    ``ready``; ``on_ready(child, reply, seconds)`` for each, seconds from its ``start`` (a failed import: from
    the call; a failed start: ``reply.ok`` False, the child stopped). Returns whether the engines started together."""
    import time

    t0 = time.perf_counter()
    imported: list[Child] = []
    for c in new:
        try:
            r = c.wait_reply(timeout_s)
        except ChildGone as e:
            r = Reply(op="imported", ok=False, error=str(e))
        if not r.ok:
            c.stop(5)
            on_ready(c, r, time.perf_counter() - t0)
            continue
        c.kv_ok = r.info.get("kv_cache_memory_bytes") == "1"
        imported.append(c)
    together = parallel and len(imported) > 1 and all(c.kv_ok for c in imported)
    for batch in ([imported] if together else [[c] for c in imported]):
        t1 = time.perf_counter()
        for c in batch:
            with contextlib.suppress(ChildGone):
                c.send(Command(op="start"))
        for c in batch:
            try:
                r = c.wait_reply(timeout_s)
            except ChildGone as e:
                r = Reply(op="ready", ok=False, error=str(e))
            if not r.ok:
                c.stop(5)
            else:
                c.ready = r
            on_ready(c, r, time.perf_counter() - t1)
    return together


def stop_group(children: list[Child], timeout_s: float = 60.0) -> None:
    """Stop ``children`` at once (each quits, bounded; its process group is killed after)."""
    if not children:
        return
    with ThreadPoolExecutor(max_workers=len(children)) as ex:
        list(ex.map(lambda c: c.stop(timeout_s), children))
