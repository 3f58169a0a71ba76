"""End-to-end refit overhead: off vs log vs enforce, trainer process → real vLLM engine.

    python benchmarks/bench_refit.py [--model qwen3-0.6b-like|tiny-llama] [--refits 5] [--out FILE]

On a GPU the 310-tensor, 1.11 GiB Qwen3-0.6B-like set (dummy weights) is staged through CUDA IPC;
on CPU the packaged tiny Llama is used. Prints median wall time per mode, the sender and receiver
digest seconds, and enforce's added wall time over off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from refit_verify import RefitConfig, models
from refit_verify.demo import _env_defaults, push, start_engine
from refit_verify.transport import RefitSender


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = a.model or ("qwen3-0.6b-like" if device == "cuda" else "tiny-llama")
    cfg = models.QWEN3_0_6B_LIKE if name == "qwen3-0.6b-like" else models.load_config(models.packaged_config_dir())
    _env_defaults(device)
    d = Path(tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    llm = start_engine(d, device)
    weights = models.random_state_dict(cfg, seed=0, device=device)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    rows = []
    for mode in ("off", "log", "enforce", "off", "log", "enforce"):
        rc = RefitConfig.build(mode=mode, buffer_bytes=a.buffer_mib << 20, timeout_s=300.0)
        walls, sd, rd = [], [], []
        for _ in range(a.refits):
            with RefitSender(config=rc, device=device) as s:
                rep, workers, wall = push(llm, s, weights, {"timeout_s": 300.0})
                if isinstance(rep, BaseException):
                    raise rep
                walls.append(wall)
                sd.append((s.last_stats or {}).get("digest_s", 0.0))
                rd.append(workers[0]["digest_s"])
        rows.append((mode, statistics.median(walls), statistics.median(sd), statistics.median(rd), min(walls)))
    rows = rows[3:]  # the first pass of each mode is warm-up
    off = rows[0][1]
    lines = [
        f"refit of {len(weights)} tensors, {nbytes / 2**30:.3f} GiB, {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), "
        f"torch {torch.__version__}, {a.refits} refits per mode (median)",
        "",
        "| mode | wall (ms) | min wall (ms) | sender digest (ms) | receiver digest (ms) | added vs off |",
        "|---|---|---|---|---|---|",
    ]
    for mode, w, s_, r_, mn in rows:
        lines.append(f"| {mode} | {w * 1e3:.1f} | {mn * 1e3:.1f} | {s_ * 1e3:.2f} | {r_ * 1e3:.2f} | {100 * (w - off) / off:+.1f} % |")
    text = "\n".join(lines)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
