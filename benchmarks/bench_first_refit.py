"""First verified refit against the second on a fresh engine, with the digest warm-up on and off.

    python benchmarks/bench_first_refit.py [--rounds 3] [--refits 3] [--device auto|cuda|cpu] [--model tiny-llama]
        [--settings 1,3] [--rollouts TOKENS] [--fresh-caches] [--profile FILE] [--timers FILE] [--out FILE]

Each round runs every setting in a fresh child process: the trainer starts a fresh vLLM engine (the
packaged tiny Llama the demo uses, dummy weights; ``--model qwen3-0.6b-like`` for the 310-tensor
set) and pushes the same weights ``--refits`` times through :func:`refit_verify.push`, the first
push as soon as ``LLM(...)`` returned. The order of the settings rotates from round to round.

``--rollouts TOKENS``: before every push (the first included), the engine generates ``TOKENS`` tokens
for each of 8 prompts (``llm.generate``, sampling, EOS ignored), as an RL loop generates rollouts
between refits: every refit then finds the caches the engine's generation left, not the ones the
refit just before it warmed. Default 0: the pushes run back to back.

Settings (``--settings``: their numbers, default all):

0. ``off``: ``REFIT_VERIFY=off`` (vLLM's own first-refit cost; no digest code runs).
1. ``enforce, warm-up off, trainer cold``: ``REFIT_VERIFY_WARMUP=0`` and nothing warmed beforehand:
   the trainer and the worker compile (or load from the on-disk caches) their digests inside the
   first refit, as before the warm-up existed.
2. ``enforce, warm-up off``: the same, but the trainer warms its digests before the engine starts
   (:func:`refit_verify.digest.backends.warmup`, as the demo does).
3. ``enforce, warm-up on``: the trainer as in 2; the worker warms its digests in the background from
   ``init_device`` on.
4. ``enforce, warm-up on, trainer cold``: the worker as in 3; the trainer calls nothing, as a user's
   does: on CUDA its warm-up starts as its process initialises CUDA (making its weights, before the
   engine starts); on the CPU at its first push, which waits for it.

Prints the median over rounds of the engine's start (s), the first, second and last refit (ms),
the first refit over the second, and the first refit's excess over the median of the later ones
(ms); and, where it verifies, refit-verify's own work in the first and second refit (ms: the
sender's digest and the worker's session open, model boundary and close,
:func:`refit_verify.cli.demo.refit_split`), its ratio (per round, median), the figure #53 item 4 holds
to 10 %, and the same ratio of the third refit to the second as the control (what two steady refits
differ by on this machine); the same for the own work on the critical path (less the sender's digest
seconds run while the receiver worked: ``digest_shadow_s``, and ``digest_before_welcome_s``, the first
group's, while it answered ``Hello``); then
that split part by part, first and second refit, with the sender's staging ahead (the first staging
buffer allocated and its pages touched while the sender waits for the receiver's ``Welcome``:
transport, not in the own work). numba's and Triton's on-disk caches are as the
machine has them (warm after any earlier run); ``--fresh-caches`` gives each run empty ones (``NUMBA_CACHE_DIR``, ``TRITON_CACHE_DIR``: a
fresh machine, where whichever process compiles first writes the cache the others read).

``--profile FILE``: each verifying run appends to FILE its refits' split (ms: the sender's digest; the
worker's open, boundary, close and vLLM's reload) and a cProfile of the trainer's send
(``RefitSender._send_refit``, in the thread that runs it): the functions whose own time differs most
between the first refit and the third, the first refit's excess in the trainer process.

``--out FILE`` is written again after every run (the table so far), so a run cut short by its caller's
bound still leaves one.

``--timers FILE``: each verifying run appends to FILE the wall-clock timers of ``benchmarks/_paths_ext.py``
(the trainer's and the worker's functions, the worker's read through a ``worker_extension_cls``) per refit,
ms and calls: the rows where the first three refits differ, the first refit's excess function by function.
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SETTINGS = {
    "off": {"REFIT_VERIFY": "off", "REFIT_VERIFY_WARMUP": "1"},
    "enforce, warm-up off, trainer cold": {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "0", "BENCH_TRAINER_COLD": "1"},
    "enforce, warm-up off": {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "0"},
    "enforce, warm-up on": {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "1"},
    "enforce, warm-up on, trainer cold": {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "1", "BENCH_TRAINER_COLD": "1"},
}


PARTS = ("sender's digest", "of it before the Welcome", "sender's staging ahead", "worker open", "model boundary", "close", "vLLM's reload")
"""The split of a verified refit each child reports per refit (:func:`refit_verify.cli.demo.refit_split`)."""


def _child(device: str, model: str, refits: int) -> None:
    """One fresh engine: print ``{"start_s": s, "walls": [s, ...]}`` as the last line."""
    import torch

    from refit_verify.cli.demo import _env_defaults, refit_split
    from refit_verify.digest import backends
    from refit_verify.testing import models
    from refit_verify.trainer.push import push
    from refit_verify.vllm_plugin.engine import start_dummy_engine
    from refit_verify.transport.sender import RefitSender

    _env_defaults(device)
    cfg = models.QWEN3_0_6B_LIKE if model == "qwen3-0.6b-like" else models.load_config(models.packaged_config_dir())
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    weights = models.random_state_dict(cfg, seed=0, device=device)
    if os.environ["REFIT_VERIFY"] != "off" and not os.environ.get("BENCH_TRAINER_COLD"):
        backends.warmup(device)  # as the demo does, before the engine starts
    timers = os.environ.get("BENCH_TIMERS") if os.environ["REFIT_VERIFY"] != "off" else None
    t0 = time.perf_counter()
    # with timers, the worker process times itself (benchmarks/_paths_ext.py), read through collective_rpc
    llm = start_dummy_engine(d, device, **({"worker_extension_cls": "benchmarks._paths_ext.WorkerProfile"} if timers else {}))
    start_s = time.perf_counter() - t0
    rollouts = int(os.environ.get("BENCH_ROLLOUTS", "0"))
    if rollouts:
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": [1 + i, 5 + i, 9 + i, 13 + i]} for i in range(8)]
        sampling = SamplingParams(max_tokens=rollouts, temperature=1.0, ignore_eos=True, detokenize=False, seed=0)
    timed: list[dict] = []
    if timers:
        from _paths_ext import TIMED_TRAINER, install_timers, read_timers

        install_timers(TIMED_TRAINER)
        llm.collective_rpc("bench_profile", args=("timers",))
    walls, own, crit, parts = [], [], [], []
    profile = os.environ.get("BENCH_PROFILE") if os.environ["REFIT_VERIFY"] != "off" else None
    profiles: list = []
    if profile:
        send = RefitSender._send_refit

        def profiled(self, *a, **k):  # the send runs in push()'s thread: its profiler is enabled there
            profiles[-1].enable()
            try:
                return send(self, *a, **k)
            finally:
                profiles[-1].disable()

        RefitSender._send_refit = profiled
    lines = []
    for i in range(refits):
        if profile:
            profiles.append(cProfile.Profile())
        if rollouts:  # an RL loop's rollouts before the refit
            llm.generate(prompts, sampling, use_tqdm=False)
        if timers:  # what ran since the last read (the engine's start, the last manifest) is not this refit's
            read_timers()
            llm.collective_rpc("bench_profile", args=("read",))
        with RefitSender(device=device) as sender:  # a sender per push, as push() makes when handed none
            res = push(llm, weights, sender=sender, options={"timeout_s": 300.0})
            split = refit_split(sender.last_stats or {}, res.workers) if os.environ["REFIT_VERIFY"] != "off" else None
        if timers:
            timed.append({**{f"trainer: {k}": v for k, v in read_timers().items()},
                          **{f"worker: {k}": v for k, v in llm.collective_rpc("bench_profile", args=("read",))[0].items()}})
        walls.append(res.seconds)
        own.append(None if split is None else split[0])
        st = sender.last_stats or {}
        hidden = float(st.get("digest_shadow_s", 0.0)) + float(st.get("digest_before_welcome_s", 0.0))
        crit.append(None if split is None else split[0] - hidden)
        if split is not None:
            w = max((x["seconds"] for x in res.workers), key=lambda x: x["own_s"])
            parts.append([split[1], float(st.get("digest_before_welcome_s", 0.0)), float(st.get("stage_s", 0.0)), w["open_s"], w["boundary_s"], w["close_s"], w["reload_s"]])
        if profile and split is not None:
            lines.append(f"refit {i}: wall {res.seconds * 1e3:.1f}, sender digest {split[1] * 1e3:.2f}, staging ahead "
                         f"{parts[-1][2] * 1e3:.2f} (Welcome taken after {st['welcome_s'] * 1e3:.2f}, digest before it "
                         f"{parts[-1][1] * 1e3:.2f}), worker open "
                         f"{w['open_s'] * 1e3:.2f} boundary {w['boundary_s'] * 1e3:.2f} close {w['close_s'] * 1e3:.2f}, "
                         f"reload {w['reload_s'] * 1e3:.2f}")
    if profile:
        lines += _profile_diff(profiles[0], profiles[min(2, len(profiles) - 1)])
        with open(profile, "a", encoding="utf-8") as f:
            f.write("\n".join([f"## {os.environ['REFIT_VERIFY']}, warm-up {os.environ['REFIT_VERIFY_WARMUP']}, "
                               f"trainer {'cold' if os.environ.get('BENCH_TRAINER_COLD') else 'warmed'}", *lines, "", ""]))
    if timers:
        with open(timers, "a", encoding="utf-8") as f:
            f.write("\n".join([f"## {os.environ['REFIT_VERIFY']}, warm-up {os.environ['REFIT_VERIFY_WARMUP']}, "
                               f"trainer {'cold' if os.environ.get('BENCH_TRAINER_COLD') else 'warmed'}", *_timer_rows(timed), "", ""]))
    if device == "cuda":
        torch.cuda.synchronize()
    print(json.dumps({"start_s": start_s, "walls": walls, "own": own, "crit": crit, "parts": parts}), flush=True)


def _profile_diff(first: cProfile.Profile, later: cProfile.Profile, top: int = 25) -> list[str]:
    """The functions whose own time (tottime) in the trainer's send differs most between two refits."""
    a, b = pstats.Stats(first).stats, pstats.Stats(later).stats  # type: ignore[attr-defined]
    rows = []
    for k, v in a.items():
        w = b.get(k)
        rows.append((v[2] - (w[2] if w else 0.0), v[3] - (w[3] if w else 0.0), v[1], w[1] if w else 0, k))
    out = ["trainer send, first refit minus third: own ms, cumulative ms, calls first / third, function"]
    for d_own, d_cum, n1, n3, (path, line, fn) in sorted(rows, key=lambda r: -r[0])[:top]:
        out.append(f"    {d_own * 1e3:8.2f} {d_cum * 1e3:8.2f} {n1:5d} / {n3:<5d} {path[-48:]}:{line}({fn})")
    return out


def _timer_rows(timed: list[dict], at_least_ms: float = 0.03) -> list[str]:
    """Per timer: ms (calls) in each refit, where the first three differ by at least ``at_least_ms``;
    sorted by the first refit's excess over the third."""
    n = min(3, len(timed))
    keys = sorted({k for t in timed[:n] for k in t})
    rows = []
    for k in keys:
        got = [t.get(k, [0.0, 0]) for t in timed[:n]]
        if max(g[0] for g in got) - min(g[0] for g in got) >= at_least_ms / 1e3 or len({g[1] for g in got}) > 1:
            rows.append((got[0][0] - got[-1][0], k, got))
    out = [f"timer: ms (calls) in refits 1..{n}, first minus last"]
    for diff, k, got in sorted(rows, key=lambda r: -r[0]):
        out.append(f"    {diff * 1e3:+8.3f}  " + "  ".join(f"{g[0] * 1e3:8.3f} ({int(g[1])})" for g in got) + f"  {k}")
    return out


def _run_child(setting: str, device: str, model: str, refits: int, fresh_caches: bool, profile: str | None = None,
               timers: str | None = None, rollouts: int = 0) -> dict:
    env = {**os.environ, **SETTINGS[setting], "BENCH_ROLLOUTS": str(rollouts)}
    if profile:
        env["BENCH_PROFILE"] = profile
    if timers:
        here = str(Path(__file__).resolve().parent)  # _paths_ext: the child imports it as a module, the worker as benchmarks._paths_ext
        env["BENCH_TIMERS"] = timers
        env["PYTHONPATH"] = os.pathsep.join([here, str(Path(here).parent), *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]])
    if "BENCH_TRAINER_COLD" not in SETTINGS[setting]:
        env.pop("BENCH_TRAINER_COLD", None)
    if fresh_caches:
        env["NUMBA_CACHE_DIR"], env["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="numba-"), tempfile.mkdtemp(prefix="triton-")
    cmd = [sys.executable, __file__, "--child", "--device", device, "--model", model, "--refits", str(refits)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{setting}: child failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    said = dict.fromkeys(line.strip() for line in p.stderr.splitlines() if "refit-verify:" in line)
    for line in said:  # what refit-verify warned of in the run (a warm-up that failed, direct launches turned off)
        print(f"  {setting}: {line[-400:]}", flush=True)
    return json.loads(lines[-1])


def _table(got: dict[str, list[dict]], names: list[str], a, device: str) -> list[str]:
    """The report's lines over the runs in ``got`` so far (medians of each setting's runs; a setting
    with none yet left out; "rounds": the most runs of any setting)."""
    import platform

    import torch

    names = [n for n in names if got[n]]
    rounds = max((len(got[n]) for n in names), default=0)
    med = statistics.median
    lines = [f"First vs second verified refit, fresh engine per run: {a.model}, {device} "
             f"({torch.cuda.get_device_name() if device == 'cuda' else platform.processor() or platform.machine()}, "
             f"{os.cpu_count()} cores), torch {torch.__version__}, {rounds} rounds, {a.refits} refits each (medians)"
             f"{', fresh numba and Triton caches per run' if a.fresh_caches else ''}"
             f"{f', {a.rollouts} tokens x 8 prompts generated before every push' if a.rollouts else ', pushes back to back'}", "",
             "| setting | engine start (s) | 1st refit (ms) | 2nd refit (ms) | last refit (ms) | 1st / 2nd | 1st − later (ms) "
             "| own work 1st / 2nd (ms) | own 1st / 2nd | control: own 3rd / 2nd | own on the critical path 1st / 2nd (ms) "
             "| critical 1st / 2nd | control: critical 3rd / 2nd |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for n in names:
        runs = got[n]
        first, second, last = (med([x["walls"][i] for x in runs]) for i in (0, 1, -1))
        excess = med([x["walls"][0] - med(x["walls"][1:]) for x in runs])
        row = (f"| {n} | {med([x['start_s'] for x in runs]):.1f} | {first * 1e3:.1f} | {second * 1e3:.1f} | {last * 1e3:.1f} | "
               f"{first / second:.2f} | {excess * 1e3:+.1f} |")
        if all(None not in x["own"] and None not in x["crit"] for x in runs):
            o1, o2 = (med([x["own"][i] for x in runs]) for i in (0, 1))
            row += f" {o1 * 1e3:.1f} / {o2 * 1e3:.1f} | {med([x['own'][0] / x['own'][1] for x in runs]):.2f} |"
            row += f" {med([x['own'][2] / x['own'][1] for x in runs]):.2f} |" if a.refits >= 3 else " - |"
            c1, c2 = (med([x["crit"][i] for x in runs]) for i in (0, 1))
            row += f" {c1 * 1e3:.1f} / {c2 * 1e3:.1f} | {med([x['crit'][0] / x['crit'][1] for x in runs]):.2f} |"
            row += f" {med([x['crit'][2] / x['crit'][1] for x in runs]):.2f} |" if a.refits >= 3 else " - |"
        else:
            row += " - | - | - | - | - | - |"
        lines.append(row)
    split = [n for n in names if all(len(x.get("parts", ())) >= 2 for x in got[n])]
    if split:
        lines += ["", "Split of the first and second refit (ms, medians; the slowest worker's parts):", "",
                  "| setting | " + " | ".join(f"{p} 1st / 2nd" for p in PARTS) + " |", "|---" * (len(PARTS) + 1) + "|"]
        for n in split:
            cells = [" / ".join(f"{med([x['parts'][i][j] for x in got[n]]) * 1e3:.2f}" for i in (0, 1)) for j in range(len(PARTS))]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _tables import emit, parse

    a, device = parse(__doc__, argv, rounds=3, extra=lambda ap: (ap.add_argument("--refits", type=int, default=3),
                                                                 ap.add_argument("--model", default="tiny-llama"),
                                                                 ap.add_argument("--settings", default=None),
                                                                 ap.add_argument("--fresh-caches", action="store_true"),
                                                                 ap.add_argument("--rollouts", type=int, default=0),
                                                                 ap.add_argument("--profile", default=None),
                                                                 ap.add_argument("--timers", default=None),
                                                                 ap.add_argument("--child", action="store_true")))
    if a.child:
        _child(device, a.model, a.refits)
        return
    names = [list(SETTINGS)[int(i)] for i in a.settings.split(",")] if a.settings else list(SETTINGS)
    got: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        for n in names[r % len(names):] + names[: r % len(names)]:
            got[n].append(_run_child(n, device, a.model, a.refits, a.fresh_caches, a.profile, a.timers, a.rollouts))
            w, o = got[n][-1]["walls"], got[n][-1]["own"]
            own = f"; own work {', '.join(f'{x * 1e3:.1f}' for x in o)} ms" if None not in o else ""
            print(f"round {r}: {n}: start {got[n][-1]['start_s']:.1f} s, refits {', '.join(f'{x * 1e3:.1f}' for x in w)} ms{own}",
                  flush=True)
            if a.out:  # the table so far: a run cut short by its caller's bound still leaves one
                Path(a.out).write_text("\n".join(_table(got, names, a, device)) + "\n")
    emit(_table(got, names, a, device), a.out)


if __name__ == "__main__":
    main()
