"""The plan of a ``benchmarks/bench_paths.py`` run: which engines live together on the device (the memory
plan), what each size is estimated to take, and the floor and target each row is read against.

Pure arithmetic over the layout, the device's memory and the run's options (no torch, no vLLM): the
runner executes the plan, the report prints it.

**Memory.** Every child holds the trainer's copy of the weights and its engine (its own process for
``mp``). On CUDA a child is estimated at ``CTX_GIB`` per CUDA process + the trainer's weights + what the
trainer's side of its paths allocates (transport staging, native packed buffers, the staging-copy ring)
+ the engine's budget (weights + ``KV_GIB`` + ``ENGINE_EXTRA_GIB``) + ``TRANSIENT_LARGEST`` times the
largest tensor (the engine's copies during a refit: the layerwise reload's materialised layer, the
receiver's owned copy of an oversized staged tensor). The planner takes ``all`` when it fits the device's
free memory less ``RESERVE_SHARE`` (at least ``RESERVE_MIN_GIB``), else per engine kind the first of the
others that fits:

* ``all``: every engine of every kind at once (every path's rounds interleaved, as before this plan);
* ``kind``: the engines of one kind at once (off, enforce, off-b), the kinds one after another;
* ``pairs``: per kind off + enforce, then enforce stopped and off-b started beside the same off;
* ``single``: one engine at a time (off, enforce, off-b in turn): nothing interleaved between engines,
  each ratio compares phases that ran one after the other (the A/A row then shows that drift too).

``REFIT_VERIFY`` cannot change per refit in one engine: the plugin patches vLLM only when the process
starts with a verifying mode (``vllm_plugin.patches.apply``), and ``off`` runs no wrapper at all; an
``off`` refit inside an ``enforce`` engine would still pass through the loader tap. So every mode keeps
engines of its own, and a plan that cannot hold them together runs them in phases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 2**30
CTX_GIB = 0.75
"""Per CUDA process (the child; an ``mp`` engine's worker): the CUDA context, torch's and the libraries' own
allocations (cuBLAS workspaces)."""
KV_GIB = 0.25
"""The engine's KV cache (``max_model_len`` 128: one sequence of the 8B-like layout needs 19 MB)."""
ENGINE_EXTRA_GIB = 1.0
"""The engine's activations and workspaces beyond weights and KV (``max_num_batched_tokens`` 512,
``max_num_seqs`` 8 in the children)."""
TRANSIENT_LARGEST = 2
"""Copies of the largest tensor an engine may hold during a refit."""
RESERVE_SHARE, RESERVE_MIN_GIB = 0.03, 1.0
"""Device memory the plan leaves free: this share of the total, at least this many GiB."""
CPU_PROCESS_GIB = 1.0
"""On CPU: one Python process with torch and vLLM imported (host memory)."""
CPU_KV_GIB = 1.0
"""On CPU: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) of each engine."""
LEVELS = ("all", "kind", "pairs", "single")

START_S = {"cuda": 50.0, "cpu": 35.0}
"""Seconds one engine takes to start alone: the child's imports, the trainer's weights, ``LLM(...)``."""
START_S_PER_GIB = {"cuda": 1.0, "cpu": 6.0}
"""Further start seconds per GiB of weights (drawn on the device, the engine's dummy load)."""
PARALLEL_SHARE = 0.35
"""``--start parallel``: each further engine started at the same time adds this share of one start."""
REFIT_S = {"cuda": (0.08, 0.04), "cpu": (0.08, 4.0)}
"""(seconds, seconds per GiB) of one refit including its request (both modes alike)."""
STOP_S, FLOOR_S = 6.0, 3.0
"""Seconds to stop the engines of a phase (in parallel), and to measure the floor once per size."""


@dataclass(frozen=True)
class Sizing:
    """What a layout weighs: ``nbytes`` of bf16 weights in ``tensors`` tensors, the largest of ``largest`` bytes."""

    model: str
    nbytes: int
    tensors: int
    largest: int

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


def sizing(model: str, shapes: dict[str, tuple[int, ...]], element_size: int = 2) -> Sizing:
    """The :class:`Sizing` of a layout's ``{name: shape}`` (``refit_verify.testing.models.param_shapes``)."""
    sizes = [math.prod(s) * element_size for s in shapes.values()]
    return Sizing(model, sum(sizes), len(sizes), max(sizes))


@dataclass(frozen=True)
class Phase:
    """Engines ``(name, kind)`` alive together for some rounds; engines not in it are stopped (or not started yet)."""

    live: tuple[tuple[str, str], ...]


@dataclass
class Plan:
    """One size's plan: ``levels`` per engine kind (None: that kind does not fit, ``why``), the phases in
    order, each child's estimate (``child_gib``, by ``name/kind``), the largest phase's sum. Sizes in GiB."""

    sizing: Sizing
    device: str
    total_gib: float
    free_gib: float
    budget_gib: float
    levels: dict[str, str | None]
    phases: list[Phase]
    child_gib: dict[str, float]
    peak_gib: float
    engine_gib: float
    utilization: float
    kv_bytes: int
    why: str = ""
    forced: bool = False
    lines: list[str] = field(default_factory=list)


def trainer_extra_bytes(s: Sizing, paths: list[str], staging_bytes: int, packed_bytes: int) -> int:
    """Device bytes the trainer's side of ``paths`` allocates beside its weights in one child."""
    extra = 0
    if "transport" in paths:
        extra += staging_bytes + staging_ring_bytes(s)  # the sender's ping-pong buffers; the staging-copy row's ring
    if "native-packed" in paths:
        extra += 2 * packed_bytes  # vLLM's ipc packer: two buffers in flight
    if "broadcast" in paths:
        extra += 2 * packed_bytes
    return extra


def staging_ring_bytes(s: Sizing) -> int:
    """The ring the ``staging_copy`` row copies every tensor into: the largest tensor, at least 256 MiB, at most the set."""
    return min(s.nbytes, max(s.largest, 256 << 20))


def engine_budget_gib(s: Sizing) -> float:
    """The engine's own budget on CUDA (``gpu_memory_utilization`` times the device): weights, KV, activations."""
    return s.gib + KV_GIB + ENGINE_EXTRA_GIB


def child_gib(s: Sizing, kind: str, paths: list[str], device: str, staging_bytes: int, packed_bytes: int,
              engine_gib: float) -> float:
    """Estimated memory of one child (the trainer, its engine and the engine's processes), in GiB: device
    memory on CUDA, host memory on CPU."""
    extra = trainer_extra_bytes(s, paths, staging_bytes, packed_bytes) / GIB
    transient = TRANSIENT_LARGEST * s.largest / GIB
    if device == "cuda":
        return CTX_GIB * (2 if kind == "mp" else 1) + s.gib + extra + engine_gib + transient
    return CPU_PROCESS_GIB * (2 if kind == "mp" else 1) + 2 * s.gib + extra + CPU_KV_GIB + transient


def phases_of(level: str, kinds: list[str], engines: tuple[str, ...]) -> list[Phase]:
    """The phases of ``level`` (:data:`LEVELS`) for engine ``kinds`` and ``engines`` (off, enforce[, off-b])."""
    if level == "all":
        return [Phase(tuple((e, k) for k in kinds for e in engines))]
    if level == "kind":
        return [Phase(tuple((e, k) for e in engines)) for k in kinds]
    if level == "pairs":
        pairs = [(engines[0], engines[1])] + [(engines[0], e) for e in engines[2:]]
        return [Phase(tuple((e, k) for e in pair)) for k in kinds for pair in pairs]
    if level == "single":
        return [Phase(((e, k),)) for k in kinds for e in engines]
    raise ValueError(f"unknown plan level {level!r}; known: {', '.join(LEVELS)}")


def make_plan(s: Sizing, *, device: str, total_gib: float, free_gib: float, kinds: list[str], engines: tuple[str, ...],
              paths_of: dict[str, list[str]], staging_bytes: int, packed_bytes: int, utilization: float | None = None,
              level: str = "auto") -> Plan:
    """Choose how the engines share the device: ``all`` when every engine fits at once, else per kind the
    first of ``kind``, ``pairs``, ``single`` whose largest phase fits ``free_gib`` less the reserve (``level``
    other than ``auto``: that level, fitting or not); and the engines' ``gpu_memory_utilization``
    (``utilization`` when given).

    Args:
        s: the layout. device: ``cuda`` or ``cpu``. total_gib, free_gib: the device's (CPU: the host's available) memory.
        kinds: engine kinds the paths need (``inproc``, ``mp``). engines: engine names per kind.
        paths_of: ``{kind: paths}``. staging_bytes: the transport sender's budget. packed_bytes: the native packed buffer.
    """
    budget = free_gib - max(RESERVE_MIN_GIB, RESERVE_SHARE * total_gib)
    eng = engine_budget_gib(s) if utilization is None else utilization * total_gib
    util = utilization if utilization is not None else min(0.95, math.ceil(100 * eng / total_gib) / 100) if device == "cuda" else 0.1
    per = {f"{e}/{k}": child_gib(s, k, paths_of[k], device, staging_bytes, packed_bytes, eng) for k in kinds for e in engines}

    def peak(phs: list[Phase]) -> float:
        return max((sum(per[f"{e}/{k}"] for e, k in ph.live) for ph in phs), default=0.0)

    levels: dict[str, str | None] = {}
    if level != "auto" or peak(phases_of("all", kinds, engines)) <= budget:
        lv = "all" if level == "auto" else level
        levels = dict.fromkeys(kinds, lv)
        phs = phases_of(lv, kinds, engines)
    else:
        phs = []
        for k in kinds:
            for lv in LEVELS[1:]:
                cand = phases_of(lv, [k], engines)
                if peak(cand) <= budget:
                    levels[k] = lv
                    phs += cand
                    break
            else:
                levels[k] = None
    why = "; ".join(f"{k}: one engine at a time needs {max(per[f'{e}/{k}'] for e in engines):.1f} GiB, more than the "
                    f"{budget:.1f} GiB planned ({free_gib:.1f} GiB free less the reserve)" for k, lv in levels.items() if lv is None)
    plan = Plan(s, device, total_gib, free_gib, budget, levels, phs, per, peak(phs), eng, util, int(KV_GIB * GIB), why,
                forced=level != "auto")
    plan.lines = describe(plan)
    return plan


def describe(p: Plan) -> list[str]:
    """The plan in a few Markdown bullet lines."""
    mem = "device" if p.device == "cuda" else "host (CPU engines)"
    out = [f"- memory plan: {p.sizing.model}, {p.sizing.nbytes / 1e9:.2f} GB ({p.sizing.gib:.2f} GiB) bf16 in {p.sizing.tensors} "
           f"tensors, largest {p.sizing.largest / 2**20:.0f} MiB; {mem} memory {p.total_gib:.1f} GiB, {p.free_gib:.1f} free, "
           f"{p.budget_gib:.1f} planned"]
    if p.device == "cuda":
        out.append(f"- engines: gpu_memory_utilization {p.utilization:.2f} each ({p.engine_gib:.2f} GiB: weights "
                   f"{p.sizing.gib:.2f} + KV {KV_GIB:g} + activations and workspaces {ENGINE_EXTRA_GIB:g}; the KV cache fixed "
                   "by vLLM's kv_cache_memory_bytes where it has it, else what the budget leaves after vLLM's profiling), "
                   "max_num_seqs 8, max_num_batched_tokens 512")
    how = {"all": "every engine at once, every path's rounds interleaved",
           "kind": "one kind's engines at once (rounds interleaved among them), the kinds one after another",
           "pairs": "off + enforce, then enforce stopped and off-b started beside the same off (each ratio over the "
                    "rounds its two engines shared)",
           "single": "one engine at a time, in turn: nothing interleaved between engines (each ratio compares phases "
                     "run one after the other)",
           None: "does not fit"}
    per = ", ".join(f"{k} {v:.1f}" for k, v in p.child_gib.items())
    kinds = set(p.levels.values())
    lv = (f"{kinds.pop()} ({how[next(iter(p.levels.values()))]})" if len(kinds) == 1 and p.levels
          else "; ".join(f"{k}: {v} ({how[v]})" for k, v in p.levels.items()))
    out.append(f"- level{' (forced by --plan)' if p.forced else ''}: {lv}; peak {p.peak_gib:.1f} GiB of {p.budget_gib:.1f}; "
               f"per child (trainer + engine, GiB): {per}")
    if p.phases:
        out.append("- phases: " + "; ".join(f"{i + 1}: {', '.join(f'{e}/{k}' for e, k in ph.live)}" for i, ph in enumerate(p.phases)))
    if p.why:
        out.append(f"- does not fit: {p.why}")
    return out


def estimate_s(p: Plan, *, paths_of: dict[str, list[str]], rounds: int, warmup: int, settle_s: float,
               parallel: bool) -> float:
    """Seconds a size is estimated to take under plan ``p`` (starts, rounds, stops, the floor): the constants
    of this module, to be read as a rough figure (the run prints what it measured next to it)."""
    dev = p.device
    start_one = START_S[dev] + START_S_PER_GIB[dev] * p.sizing.gib
    base, per_gib = REFIT_S[dev]
    refit = base + per_gib * p.sizing.gib
    total, live = FLOOR_S, set()
    for ph in p.phases:
        new = [x for x in ph.live if x not in live]
        if new:
            total += start_one * (1 + PARALLEL_SHARE * (len(new) - 1)) if parallel else start_one * len(new)
        if live - set(ph.live):
            total += STOP_S
        live = set(ph.live)
        for k in {k for _, k in ph.live}:
            n = sum(1 for _, kk in ph.live if kk == k)
            settle = settle_s if k == "mp" else 0.0
            total += (warmup + rounds) * len(paths_of.get(k, [])) * n * (refit + settle)
    return total + STOP_S


# ------------------------------------------------------------------------------------------ floor and target


def floor_ms(nbytes: int, tensors: int, read_gbps: float, launch_us: float) -> float:
    """Two reads of ``nbytes`` (the trainer's side and the engine's) at ``read_gbps`` (GB/s), plus one
    launch of ``launch_us`` per tensor: the least any check of every byte could add, in ms."""
    return 2 * nbytes / (read_gbps * 1e9) * 1e3 + tensors * launch_us * 1e-3


def target_ms(floor: float) -> float:
    """The target of a row: 2 × floor + 1 ms."""
    return 2 * floor + 1.0


def verdict(value_ms: float, target: float) -> str:
    """``met`` or ``not met (x ms over)`` for a cost ``value_ms`` against ``target`` (ms)."""
    if value_ms != value_ms or target != target:
        return "–"
    return "met" if value_ms <= target else f"not met ({value_ms - target:.2f} ms over)"
