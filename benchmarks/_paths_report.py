"""The report of ``benchmarks/bench_paths.py``: what each breakdown row is and how it was obtained, the
quantiles, and the Markdown tables (wall time, the ``--control`` A/A row, the breakdown per path).

Kept apart from the runner (children, rounds, timeouts) so that each fits in one reading.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path

from _paths_ext import _loop
from _paths_plan import floor_ms, target_ms, verdict
from _paths_worker import KIND

from refit_verify.testing import models

MODES = ("off", "enforce")
CONTROL = "off-b"
"""``--control``: the second off engine of each kind (mode off, built as the off one)."""
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
    "s.shadow": ("of those, after the first buffer was sent (while the receiver checks and loads it)",
                 "RefitStats.digest_shadow_s (sender.last_stats)"),
    "s.crit": ("sender digests on the refit's critical path (before the first buffer went)", "derived: sender digests - those after it"),
    "s.rdigest": ("receiver digest seconds sent back in Done", "RefitStats.receiver_digest_s (sender.last_stats)"),
    "w.digest": ("worker receive digest seconds", "`refit_verify_receive` result digest_s"),
    "push_rest": ("push outside Hello..Done (thread, RPC call and return)", "derived: wall - RefitStats.wall_s"),
    "staging_copy": ("one copy of every tensor into a byte buffer", "timed apart from the refit (not in the wall): the floor of staging"),
    "c.start": ("client start_weight_update (worker: session open, init reload)", "timed around the client call"),
    "c.update": ("client update_weights (worker: map, load_weights, digests)", "timed: sum over the client calls"),
    "c.finish": ("client finish_weight_update (worker: finalize, close, read-back, snapshot)", "timed around the client call"),
    "t.digest": ("trainer digests of the exported tensors", "NativeSendVerifier.digest_s (read by an observing wrapper of verify)"),
    "t.shadow": ("of those, in the shadow of the engine's update_weights RPCs (a helper thread while the sending thread waits)",
                 "NativeSendVerifier.shadow_s (same wrapper)"),
    "t.crit": ("trainer digests on the refit's critical path", "derived: trainer digests - those in the shadow"),
    "t.verify": ("trainer: fetch the workers' manifests + compare (vLLM 0.26 with an in-process LLM: compare only, the "
                 "manifests come back with the finish RPC)", "timed around NativeSendVerifier.verify (observing wrapper)"),
    "n.rest": ("trainer export outside the client calls (packing, IPC export, file writes)", "derived: wall - client calls - verify"),
    "b.wall": ("sender: header to the receivers' reports gathered", "BroadcastStats.wall_s (sender.last_stats)"),
    "b.digest": ("sender digests (a list: the first bucket's tensors before it, the rest right after it; else each tensor "
                 "before it is packed)", "BroadcastStats.digest_s (sender.last_stats)"),
    "b.shadow": ("of those, after the first bucket was sent", "BroadcastStats.digest_shadow_s (sender.last_stats)"),
    "b.crit": ("sender digests before the first bucket went", "derived: sender digests - those after it"),
    "b.verdict": ("sender: set-up before the header, and the verdict after the reports (manifests compared, mode applied)",
                  "derived: `BroadcastSender.send` timed in the child - BroadcastStats.wall_s"),
    "b.wdigest": ("worker digest seconds sent back (at the model boundary: the reload's finalize and the session close, "
                  "inside ReceiveState.finish)", "`refit_verify_broadcast_receive` result digest_s"),
    "b.rest": ("outside `send`: the receive RPC's helper thread started, the worker's work after its report went back (off: "
               "vLLM's finalize_layerwise_reload, which in enforce runs before the report, in the session close), the RPC's return",
               "derived: wall - `BroadcastSender.send` timed in the child"),
    "m.model": ("worker: digests of delivered tensors at the model boundary", "SessionManifest.modules[*].digest_s"),
    "m.engine": ("worker: read-back of the written regions", "SessionManifest.engine.digest_s"),
    "snapshot": ("worker: engine-state snapshot at session close (with the close's check of the model index, run while the device reads)", ""),
    "w.open": ("worker: session open (the model index's check, the replayed plan or the loader tap)", "SessionManifest.open_s"),
    "w.close": ("worker: session close (the index's check, snapshot, read-back, the plan kept, the manifests)",
                "SessionManifest.close_s"),
    "gc": ("Python's cyclic garbage collector in the child (the engine too, when it runs in-process)",
           "gc.callbacks: start to stop of every collection during the refit"),
}
ORDER = {"transport": ["s.wall", "s.digest", "s.shadow", "s.crit", "w.digest", "m.model", "w.open", "w.close", "m.engine", "snapshot", "push_rest",
                       "staging_copy"],
         "boundary-per-param": ["open", "add", "load_weights", "close", "m.model", "m.engine", "snapshot", "close_rest"],
         "boundary-bucketed": ["open", "add", "init_reload", "load_weights", "finalize_reload", "close", "m.model", "m.engine",
                               "snapshot", "close_rest"],
         "native-unpacked": ["c.start", "c.update", "c.finish", "t.digest", "t.shadow", "t.crit", "t.verify", "n.rest", "m.model", "w.open", "w.close",
                             "m.engine", "snapshot"],
         "broadcast": ["b.wall", "b.digest", "b.shadow", "b.crit", "b.verdict", "b.wdigest", "m.model", "w.open", "w.close", "m.engine", "snapshot",
                       "b.rest"]}
ORDER["native-packed"] = ORDER["native-unpacked"]
for _order in {id(o): o for o in ORDER.values()}.values():  # native-packed shares native-unpacked's list
    _order.append("gc")
OWN = {"transport": ("s.crit", "m.model", "w.open", "w.close"), "boundary-per-param": ("open", "add", "m.model", "close"),
       "boundary-bucketed": ("open", "add", "m.model", "close"),
       "native-unpacked": ("t.crit", "t.verify", "m.model", "w.open", "w.close"),
       "broadcast": ("b.crit", "b.verdict", "m.model", "w.open", "w.close")}
OWN["native-packed"] = OWN["native-unpacked"]
"""Rows that add up to refit-verify's own work in an enforce refit (a close includes its read-back and snapshot)."""
SHORT = {"s.digest": "sender digests", "s.crit": "sender digests before the first buffer", "m.model": "boundary digests", "m.engine": "read-back", "snapshot": "snapshot",
         "open": "open", "add": "r.add", "close": "close", "w.open": "worker open", "w.close": "worker close", "t.digest": "trainer digests", "t.crit": "trainer digests outside the shadow", "t.verify": "fetch + compare",
         "b.digest": "sender digests", "b.crit": "sender digests before the first bucket", "b.verdict": "sender set-up + verdict"}
SNAPSHOT_HOW = {"inproc": "WorkerBoundary.baseline.digest_s (the close's own snapshot, read in-process)",
                "mp": "SessionManifest.snapshot_s (the close's own snapshot)"}



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


# ------------------------------------------------------------------------------------------ report


CI_LOOP_MS = 0.22
"""10,000 steps of :func:`python_speed`'s loop on this project's 2-core CPU machine (CI), in ms."""


def python_speed(steps: int = 10_000, repeat: int = 5) -> float:
    """Milliseconds of ``steps`` steps of a plain Python loop (median of ``repeat``): how fast this host runs
    Python. refit-verify's own work is host Python over every tensor, so its milliseconds scale with this figure
    from host to host (the lent GPU hosts: 0.33–0.56 ms; this project's CPU machine: about :data:`CI_LOOP_MS`)."""
    return statistics.median(_loop(steps) for _ in range(repeat)) * 1e3


def matched(res: dict, phase_of: dict | None, p: str, x: str, y: str) -> tuple[list, list, bool]:
    """Engine ``x``'s and ``y``'s counted refits of path ``p`` over the phases both were live in, and True; or,
    when they shared none (a plan of one engine at a time), all of each, and False. ``phase_of``: the phase of
    each refit in ``res`` (None: one phase)."""
    xs, ys = res.get(p, {}).get(x, []), res.get(p, {}).get(y, [])
    if phase_of is None:
        return xs, ys, True
    px, py = phase_of[p][x], phase_of[p][y]
    shared = set(px) & set(py)
    if not shared:
        return xs, ys, False
    return [r for r, i in zip(xs, px) if i in shared], [r for r, i in zip(ys, py) if i in shared], True


def floor_of(a, nbytes: int, tensors: int) -> tuple[float, str]:
    """(floor ms, how it was obtained) of a set of ``nbytes`` in ``tensors`` tensors from the run's ``a.floor``
    (the child's ``floor`` reply); NaN and why when it was not measured."""
    f = getattr(a, "floor", None) or {}
    if not f.get("read_gbps"):
        return float("nan"), f"floor not measured ({f.get('error', 'no engine started')})"
    gbps, us = float(f["read_gbps"]), float(f["launch_us"])
    fl = floor_ms(nbytes, tensors, gbps, us)
    return fl, (f"floor {fl:.2f} ms = two reads of {nbytes / 1e9:.3f} GB at {gbps:.0f} GB/s (the read roofline measured in this "
                f"run in {f.get('where', '?')}: `torch.sum` over a 1 GiB float32 buffer on the {a.device}, fastest of 5) + "
                f"{tensors} tensors × {us:.2f} µs (one `x.add_(1)` launch on a 1-element {a.device} tensor per tensor, Python "
                "loop, fastest of 5); target = 2 × floor + 1 ms, read against own work and against added ms")


def render(a, info, cfg, res, skipped, failed, children, load0, t_start, ctl=None, phase_of=None) -> str:
    """The report of one size. ``res[path][engine]``: the counted replies; ``phase_of``: the phase of each
    (None: every engine in one phase); ``children`` is unused (kept for callers)."""
    shapes = models.param_shapes(cfg)
    nbytes = sum(2 * _prod(s) for s in shapes.values())
    every = res
    res, inter = {}, {}
    for p in every:
        off, enf, inter[p] = matched(every, phase_of, p, MODES[0], MODES[1])
        res[p] = {MODES[0]: off, MODES[1]: enf}
    fl, fl_how = floor_of(a, nbytes, len(shapes))
    tgt = target_ms(fl) if fl == fl else float("nan")
    cpu = next((ln.split(":", 1)[1].strip() for ln in _lines("/proc/cpuinfo") if ln.startswith("model name")), platform.processor())
    dev = info.get("device_name", "?") if a.device == "cuda" else f"CPU ({cpu})"
    lines = [f"# Refit paths: REFIT_VERIFY=off vs enforce ({a.model}, {a.device})", "",
             f"- date: {datetime.datetime.fromtimestamp(t_start, datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
             f"run took {time.time() - t_start:.0f} s"
             + (f" (estimated {a.estimate_s:.0f} s)" if getattr(a, "estimate_s", None) else ""),
             *getattr(a, "plan_lines", []),
             *([f"- engine starts (imports overlapped): {'; '.join(a.starts)}"] if getattr(a, "starts", None) else []),
             f"- {fl_how}",
             f"- machine: {platform.node()} ({platform.platform()}), {os.cpu_count()} cores, load average "
             f"{load0[0]:.1f} at start / {os.getloadavg()[0]:.1f} at end, niceness {os.nice(0)}",
             f"- device: {dev}",
             *([f"- host speed: 10,000 steps of a Python loop take {a.host_speed[0]:.2f} ms at the start, {a.host_speed[1]:.2f} ms "
                f"at the end (median of 5; this project's CPU machine: about {CI_LOOP_MS} ms): the host's Python speed, which "
                "refit-verify's own work (Python over every tensor) scales with"] if getattr(a, "host_speed", None) else []),
             f"- torch {info.get('torch', '?')}, vLLM {info.get('vllm', '?')}, triton {info.get('triton', '?')}, "
             f"Python {info.get('python', '?')}",
             f"- model: {a.model}, {len(shapes)} tensors, {nbytes / 2**30:.3f} GiB bf16 (dummy weights, seed 0 in every engine)",
             "- plan replay (refit_verify.boundary.plan): " + ("off (`--no-replay`: every refit watched by the loader tap)" if a.no_replay
                                                          else "on (a steady-state refit replays the last watched one's plan)")
             + (f"; kept plans as CUDA graphs, the reload's copies from their own pool (`REFIT_VERIFY_CUDA_GRAPHS={a.cuda_graphs}`)"
                if getattr(a, "cuda_graphs", None) else "")
             + ("; kept plans through Triton's JIT dispatch (`--no-direct-launch`)" if getattr(a, "no_direct_launch", False)
                else "; kept plans launched straight to their compiled kernels")
             + ("; landed digests on the CPU (`--landed-cpu`)" if a.landed_cpu else ""),
             *([f"- placement (`--pin`): {a.pinned}"] if getattr(a, "pinned", "") else []),
             *(["- `BENCH_NO_SHADOW=1`: the native trainer's digest work runs on its sending thread, between the engine's "
                "RPCs (no helper thread beside them)"] if os.environ.get("BENCH_NO_SHADOW") == "1" else []),
             *(["- `BENCH_SENDER_WHOLE=1`: the transport sender digests the whole list before its first buffer (the "
                "earlier behaviour), none after it"] if os.environ.get("BENCH_SENDER_WHOLE") == "1" else []),
             *([f"- `BENCH_PAUSE_AFTER_MS={os.environ['BENCH_PAUSE_AFTER_MS']}`: the transport sender pauses after each "
                "posted buffer (`--timers`)"] if os.environ.get("BENCH_PAUSE_AFTER_MS") else []),
             f"- rounds: {a.rounds} counted after {a.warmup} warm-up; "
             + ("per round and path one refit on each live engine (off, enforce, off-b), the order rotating round by round (the "
                "three rotations, then the three reversed; two engines alternate)" if a.control else
                "per round and path one refit on each live engine, the one that goes first alternating round by round")
             + f"; {a.settle_s:g} s pause before a refit that follows one in another `mp` engine",
             f"- buckets: {_mib(a.bucket_bytes)} (boundary-bucketed: {info.get('buckets', '?')} buckets); native packed buffer "
             f"{_mib(int(info.get('packed_bytes') or 0))}; transport staging "
             f"{_mib(int(info['transport_buffer_bytes'])) if info.get('transport_buffer_bytes') else '–'} (two ping-pong halves)"
             + (f"; broadcast: {_mib(a.bucket_bytes)} buckets" if "broadcast" in a.paths else ""),
             f"- trainer side of the boundary paths: `refit(copy={a.trainer_copy})` "
             + ("(one device copy per `r.add`)" if a.trainer_copy else "(tensors held and digested at the end, no copy)"),
             "- trainer side of the native paths: " + ("plain tensors (a `state_dict()`: one device copy per tensor)"
                                                       if a.native_tensors else "`nn.Parameter`s (`model.named_parameters()`: held, no copy)"),
             "- engines: one per mode and kind, each in its own child process; `inproc` = engine in the child "
             "(VLLM_ENABLE_V1_MULTIPROCESSING=0, direct `load_weights`), `mp` = engine core and worker in their own processes "
             "(transport, native, broadcast)" + ("; A/A control: one more off engine per kind (off-b), built the same way"
                                                 if a.control else "; no A/A control (`--no-control`)")]
    if info.get("broadcast"):
        lines.append(f"- broadcast: {info['broadcast']}; per refit the sender in the child's main thread, "
                     "`refit_verify_broadcast_receive` in a helper thread; one sender and one group per child, reused")
    if a.device == "cpu":
        lines.append("- CPU: plain linear weights kept in every engine (tests/support/plugins.py); native = the test backend "
                     "tests/support/native_cpu_backend.py (files in /dev/shm), not a vLLM built-in; OMP_WAIT_POLICY=PASSIVE")
    elif info.get("native_api"):
        lines.append(f"- native: vLLM `ipc` backend, {info['native_api']} trainer API")
    lines += ["", "## Wall time per refit (ms)", "",
              "| path | off median | off p25–p75 | enforce median | enforce p25–p75 | enforce/off | A/A: off-b/off | added "
              "| added ms | own work ms (% of off) | floor ms | target ms | own work vs target | added vs target | n "
              "| enforce verified |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    empty = "|" * 15
    for p in a.paths:
        if p in skipped:
            lines.append(f"| {p} | skipped: {skipped[p]} {empty}")
            continue
        off, enf = ([x.wall_s for x in res.get(p, {}).get(m, [])] for m in MODES)
        if not off or not enf:
            lines.append(f"| {p} | failed: {failed.get(p, 'no rounds')[:300]} {empty}")
            continue
        mo, me = pct(off, .5), pct(enf, .5)
        last = res[p]["enforce"][-1].counts
        ver = f"{last.get('verified', '?')}/{len(shapes)} tensors, {last.get('proven_bytes', 0) / 2**20:.2f} MiB read back" + (
            f", {last['replayed']} replayed" if last.get("replayed") else "")
        own = pct([sum(x.phases.get(k, 0.0) for k in OWN[p]) for x in res[p]["enforce"]], .5)
        aa = _aa(every, phase_of, p) if a.control else "off (`--no-control`)"
        lines.append(f"| {p} | {ms(mo)} | {ms(pct(off, .25))}–{ms(pct(off, .75))} | {ms(me)} | {ms(pct(enf, .25))}–{ms(pct(enf, .75))} "
                     f"| {me / mo:.3f}{'' if inter[p] else ' (phases in turn)'} | {aa} | {100 * (me / mo - 1):+.1f} % | {ms(me - mo)} "
                     f"| {ms(own)} ({100 * own / mo:.1f} %) | {_f2(fl)} | {_f2(tgt)} | {verdict(own * 1e3, tgt)} "
                     f"| {verdict((me - mo) * 1e3, tgt)} | {len(off)} | {ver} |")
    lines += ["", "*own work*: the median over the enforce rounds of the breakdown rows that are refit-verify's own work on the "
              "refit's critical path (listed under each path below; work in the shadow of a blocked call excluded), as a "
              "share of the off median: a measure of the overhead that does not rest on comparing two processes' wall clocks. "
              "The worker's whole session open and close are in it (the index checks, snapshot, read-back, the plan kept, the "
              "manifests). A lower bound still: it leaves out what no row covers (the loader tap's pass-through, the manifest's "
              "encoding and RPC; the difference line under each path).",
              "", "*A/A*: the second off engine's median over off's, over the rounds both ran (the noise floor of the "
              "enforce/off ratio; – when it has none). *floor*, *target*: see the header; *vs target* reads own work, and "
              "then the added milliseconds (enforce − off medians), against the target. *(phases in turn)*: off and enforce "
              "never ran together (the memory plan), so the ratio holds the drift between the phases too."]
    if a.control:
        lines += _control_table(a, every, skipped, failed, ctl or {}, phase_of)
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
                     f"{ms(walls[1] - walls[0] - own)} ms, is work no figure of refit-verify covers (the loader tap in "
                     "every weight_loader, the manifest's encoding and RPC) plus noise.")
        lines += _timers_table(res[p])
        c_off, c_enf = res[p]["off"][-1].counts, res[p]["enforce"][-1].counts
        extra = ", ".join(f"{'gc collections' if k == 'gc' else k} {c_off.get(k, '–')} / {c_enf.get(k, '–')}" for k in ("calls", "buffers", "buckets", "updates", "gc")
                          if k in c_off or k in c_enf)
        if extra:
            lines.append(f"\nCounts (off / enforce, last round): {extra}.")
    return "\n".join(lines)


def _timers_table(rp: dict) -> list[str]:
    """``--timers``: per timed function, the median seconds per refit off and enforce (inclusive of what it
    calls; ``t:`` the trainer, ``w:`` the worker process), largest difference first."""
    keys = sorted({k for m in MODES for x in rp[m] for k in x.phases if k.startswith("T:")})
    if not keys:
        return []
    rows = []
    for k in keys:
        v = [pct([x.phases.get(k, 0.0) for x in rp[m]], .5) for m in MODES]
        n = [x.counts.get(k, 0) for m in MODES for x in rp[m][-1:]]
        rows.append((v[1] - v[0], k[2:], v, n))
    out = ["", "Timed functions (`--timers`: wall-clock wrappers, inclusive, every thread; t: trainer, w: worker process; "
           "median ms per refit, calls in the last round):", "", "| function | off | enforce | enforce − off | calls off / enforce |",
           "|---|---|---|---|---|"]
    alloc = [r for r in rows if r[1][1:].startswith(":cuda: ")]  # the allocator's counters (_paths_ext._allocator_counts)
    for d, k, v, n in sorted((r for r in rows if r not in alloc), key=lambda r: -r[0]):
        out.append(f"| `{k}` | {ms(v[0])} | {ms(v[1])} | {ms(d)} | {n[0]} / {n[1]} |")
    if alloc:
        out += ["", "CUDA caching allocator per process (the last round's refit; counts since the previous read, memory at the "
                "read):", "", "| counter | off | enforce |", "|---|---|---|"]
        out += [f"| `{k}` | {n[0]} | {n[1]} |" for _d, k, _v, n in sorted(alloc, key=lambda r: r[1])]
    return out


def _aa(res, phase_of, p) -> str:
    """off-b / off medians of path ``p`` over the rounds both ran (– when off-b has none)."""
    off, b, together = matched(res, phase_of, p, MODES[0], CONTROL)
    if not b or not off:
        return "–"
    off = off[:len(b)] if together else off
    r = pct([x.wall_s for x in b], .5) / pct([x.wall_s for x in off], .5)
    return f"{r:.3f}" + ("" if together else " (phases in turn)")


def _control_table(a, res, skipped, failed, ctl, phase_of=None) -> list[str]:
    """The A/A control: off-b against off per path, over the counted rounds both ran (off-b's are a prefix of its phase's)."""
    lines = ["", "## A/A control: a second off engine (off-b) vs off, wall time per refit (ms)", "",
             "off-b is a second `off` child of the same kind, built the same way (same seed), its refits interleaved with the "
             "other live engines' (the memory plan says which). A/A = off-b / off over the rounds both ran: how far two "
             "processes doing the same work differ in this run, the noise floor of the enforce/off ratio (enforce/off here "
             "over its own rounds, as in the wall table).", "",
             "| path | off median | off p25–p75 | off-b median | off-b p25–p75 | A/A: off-b / off | A/A ms | enforce/off | n |",
             "|---|---|---|---|---|---|---|---|---|"]
    stopped = []
    for p in a.paths:
        if p in skipped:
            lines.append(f"| {p} | skipped: {skipped[p]} ||||||||")
            continue
        off_r, b_r, together = matched(res, phase_of, p, MODES[0], CONTROL)
        off, b = [x.wall_s for x in off_r], [x.wall_s for x in b_r]
        eo_off, eo_enf, _ = matched(res, phase_of, p, MODES[0], MODES[1])
        eo = pct([x.wall_s for x in eo_enf], .5) / pct([x.wall_s for x in eo_off], .5) if eo_off and eo_enf else float("nan")
        if not b:
            lines.append(f"| {p} | no control: {(ctl.get(p) or failed.get(p) or 'no rounds')[:300]} ||||||||")
            continue
        n = len(b)
        off = off[:n] if together else off
        mo, mb = pct(off, .5), pct(b, .5)
        lines.append(f"| {p} | {ms(mo)} | {ms(pct(off, .25))}–{ms(pct(off, .75))} | {ms(mb)} | {ms(pct(b, .25))}–{ms(pct(b, .75))} "
                     f"| {mb / mo:.3f}{'' if together else ' (phases in turn)'} | {ms(mb - mo)} | {eo:.3f} | {n} |")
        if p in ctl:
            stopped.append(f"- {p}: off-b stopped after {n} counted rounds: {ctl[p][:600]}")
    return lines + (["", *stopped] if stopped else [])


def _f2(x: float) -> str:
    return "–" if x != x else f"{x:.2f}"


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
