"""The main job: a verified colocated refit into a real vLLM engine, then the same with a fault.

Starts vLLM on a small config with dummy weights, builds trainer-side weights with the same HF
names and fresh random values, pushes them through :class:`~refit_verify.transport.RefitSender`
in ``enforce`` mode, proves the engine holds them (worker read-back of unfused parameters), then
repeats with one byte of one staged slot flipped after the sender digested it and shows the error
naming that parameter.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import torch

from refit_verify import models
from refit_verify.config import RefitConfig, VerifyMode
from refit_verify.digest import digest_tensors
from refit_verify.errors import RefitVerificationError
from refit_verify.transport import RefitSender
from refit_verify import wire


class OneByteFlipSender(RefitSender):
    """A sender that flips one byte of ``target``'s staged slot after digesting and packing it.

    Demo and test utility: it models a staging slot overwritten before the receiver read it.
    """

    def __init__(self, *args, target: str, byte_index: int = 0, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.target, self.byte_index, self.flipped = target, byte_index, False

    def _exchange(self, msg, staging=None):
        if isinstance(msg, wire.Buffer) and staging is not None:
            for e in msg.entries:
                if e.name == self.target and e.nbytes > self.byte_index:
                    staging[e.offset + self.byte_index] ^= 0x01
                    self.flipped = True
            if staging.is_cuda:
                torch.cuda.synchronize(staging.device)
        return super()._exchange(msg, staging)


def readback_names(weights: dict[str, torch.Tensor]) -> list[str]:
    """Names vLLM stores unfused and unrepacked on every backend: embeddings, norms, lm_head."""
    return [n for n in weights if "embed_tokens" in n or n.endswith("norm.weight") or n.startswith("lm_head")]


def _env_defaults(device: str) -> None:
    # The trainer process has usually touched CUDA before vLLM starts (weights, digests), and a
    # forked engine process cannot re-initialise CUDA: always spawn.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(model_dir: str | Path, device: str, console=None, tensor_parallel_size: int = 1):
    """Start ``vllm.LLM`` on ``model_dir`` (config.json only) with dummy weights; a spinner shows progress."""
    from vllm import LLM

    kwargs = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, max_model_len=128, dtype="bfloat16", seed=0,
                  tensor_parallel_size=tensor_parallel_size)
    if device == "cuda":
        kwargs["gpu_memory_utilization"] = 0.3
    if console is None:
        return LLM(**kwargs)
    with console.status("[bold]starting vLLM engine (dummy weights)…", spinner="dots"):
        t0 = time.perf_counter()
        llm = LLM(**kwargs)
    console.print(f"vLLM engine up in {time.perf_counter() - t0:.1f} s")
    return llm


def push(llm, sender: RefitSender, weights: dict[str, torch.Tensor], options: dict) -> tuple[object, list[dict], float]:
    """Run one refit: the sender streams in a thread while the workers receive via ``collective_rpc``.

    Returns:
        (sender report or the raised exception, worker results, wall seconds).
    """
    out: dict[str, object] = {}

    def _send() -> None:
        try:
            out["report"] = sender.send(weights.items())
        except BaseException as e:  # handed back to the caller
            out["report"] = e

    t0 = time.perf_counter()
    th = threading.Thread(target=_send, name="refit-verify-sender", daemon=True)
    th.start()
    workers = llm.collective_rpc("refit_verify_receive", args=(sender.endpoint, options), timeout=options.get("timeout_s", 120.0) + 30)
    th.join(timeout=options.get("timeout_s", 120.0) + 30)
    return out.get("report"), workers, time.perf_counter() - t0


def run_demo(model: str | None = None, device: str = "auto", seed: int = 1234, timeout_s: float = 120.0, buffer_bytes: int = 4 << 20) -> int:
    """Run the demo; return 0 only if the clean refit verified and the fault was named exactly."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 100))
    # validate every option before the engine starts (tens of seconds)
    rcfg = RefitConfig.build(mode="enforce", buffer_bytes=buffer_bytes, timeout_s=timeout_s)
    src_dir = Path(model) if model else models.packaged_config_dir()
    if not (src_dir / "config.json").is_file():
        raise SystemExit(f"refit-verify demo: --model {src_dir}: no config.json there")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    os.environ["REFIT_VERIFY"] = VerifyMode.ENFORCE.value
    _env_defaults(device)
    cfg = models.load_config(src_dir)
    work = Path(tempfile.mkdtemp(prefix="refit-verify-demo-"))
    shutil.copy(src_dir / "config.json", work / "config.json")
    try:
        t0 = time.perf_counter()
        digest_tensors({"warm-up": torch.zeros(4096, dtype=torch.bfloat16, device=device)})  # one-off JIT/compile
        console.print(f"digest kernels ready in {time.perf_counter() - t0:.1f} s (first use compiles; cached after)")
        llm = start_engine(work, device, console)
        weights = models.random_state_dict(cfg, seed=seed, device=device)
        options = {"timeout_s": timeout_s}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())

        with RefitSender(config=rcfg, device=device) as sender:
            report, workers, wall = push(llm, sender, weights, options)
            stats = getattr(sender, "last_stats", {}) or {}
        clean_ok = not isinstance(report, BaseException) and report is not None and report.ok

        readback = readback_names(weights)
        engine_digests = llm.collective_rpc("refit_verify_param_digests", args=(readback,))[0]
        expected = digest_tensors((n, weights[n]) for n in readback)
        readback_ok = engine_digests == expected

        target = "model.layers.1.mlp.down_proj.weight" if "model.layers.1.mlp.down_proj.weight" in weights else next(iter(weights))
        with OneByteFlipSender(config=rcfg, device=device, target=target, byte_index=777) as bad:
            freport, fworkers, fwall = push(llm, bad, weights, options)
            fstats = getattr(bad, "last_stats", {}) or {}
        fault_ok = isinstance(freport, RefitVerificationError) and list(freport.mismatched) == [target] and not freport.missing and not freport.unexpected

        t = Table(title=f"refit-verify demo: {device}, {cfg.get('architectures', ['?'])[0]}, REFIT_VERIFY=enforce")
        for col in ("refit", "tensors", "MiB", "sender digest", "receiver digest", "wall", "verdict"):
            t.add_column(col, no_wrap=True)
        w0 = workers[0] if workers else {}
        fw0 = fworkers[0] if fworkers else {}
        ms = lambda d: f"{d.get('digest_s', float('nan')) * 1e3:.1f}ms"  # noqa: E731
        t.add_row("clean", str(len(weights)), f"{nbytes / 2**20:.2f}", ms(stats), ms(w0), f"{wall:.2f}s",
                  "[green]verified[/]" if clean_ok else "[red]FAILED[/]")
        t.add_row("byte flip", str(len(weights)), f"{nbytes / 2**20:.2f}", ms(fstats), ms(fw0), f"{fwall:.2f}s",
                  "[green]caught[/]" if fault_ok else "[red]NOT caught as expected[/]")
        console.print(t)
        console.print(f"clean refit: {report.describe() if hasattr(report, 'describe') else report}")
        console.print(f"faulty refit (byte 777 of {target} flipped in its staged slot): {type(freport).__name__}: {freport}")
        console.print(("[green]" if readback_ok else "[red]") + f"engine read-back: {sum(engine_digests.get(n) == expected[n] for n in readback)} of {len(readback)} unfused parameters hold the new weights")
        ok = clean_ok and readback_ok and fault_ok
        console.print("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]")
        return 0 if ok else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
