"""The main job: a verified colocated refit into a real vLLM engine, then the same with a fault.

Starts vLLM on a small config with dummy weights, builds trainer-side weights with the same HF
names and fresh random values, pushes them twice with :func:`refit_verify.push` in ``enforce`` mode
(the first refit's time next to the second's: the worker compiled its digests in the background as
the engine started; each split into refit-verify's own work and vLLM's reload), shows what the
engine holds (the read-back at the worker's model boundary, which travels back in the transport's
``Done``, and a direct read of the parameters vLLM keeps unfused), then repeats with one byte of one staged slot flipped after the sender digested it and
shows the error naming that parameter.

vLLM's log, from this process and the engine-core and worker processes it spawns, goes to a file
named at the end (:func:`quiet_engine_output`); the screen shows the engine spinner, the table,
the verdicts and a one-line summary of that log.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import torch

from refit_verify.config import WARMUP_ENV_VAR, RefitConfig, VerifyMode, warmup_enabled
from refit_verify.digest import backends
from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitConfigError, RefitVerificationError
from refit_verify.report import VerificationReport
from refit_verify.testing import models
from refit_verify.trainer.audits import certificate
from refit_verify.trainer.push import push as push_refit
from refit_verify.transport.faults import OneByteFlipSender
from refit_verify.transport.sender import RefitSender

__all__ = ["OneByteFlipSender", "engine_up", "push", "quiet_engine_output", "readback_names", "run_demo", "run_on_engine",
           "start_engine", "summarize_log", "through_forward"]


def readback_names(weights: Mapping[str, torch.Tensor]) -> list[str]:
    """Names vLLM stores unfused and unrepacked on every backend: embeddings, norms, lm_head."""
    return [n for n in weights if "embed_tokens" in n or n.endswith("norm.weight") or n.startswith("lm_head")]


def through_forward(llm) -> list[str]:
    """The parameters the last session on worker rank 0 proved through their layer's forward
    (:mod:`refit_verify.engine.forward`: linear weights the engine handed to its GEMM kernel)."""
    from refit_verify.engine.forward import THROUGH_FORWARD
    from refit_verify.manifest import from_wire

    for answer in llm.collective_rpc("refit_verify_session_manifest"):
        man = from_wire(answer["manifest"]) if answer.get("manifest") is not None else None
        if man is not None and man.worker.rank == 0 and man.engine is not None:
            return sorted(p for p, st in man.engine.params.items()
                          if st.status == "verified" and st.blocks and all(w.endswith(THROUGH_FORWARD) for _, w in st.blocks))
    return []


def _env_defaults(device: str) -> None:
    # The trainer process has usually touched CUDA before vLLM starts (weights, digests), and a
    # forked engine process cannot re-initialise CUDA: always spawn.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    if device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def start_engine(model_dir: str | Path, device: str, console=None, tensor_parallel_size: int = 1):
    """Start ``vllm.LLM`` on ``model_dir`` (config.json only) with dummy weights.

    With a rich ``console``, a spinner runs while vLLM is imported and started, then one line
    gives the seconds it took."""
    if console is not None:
        with console.status("[bold]starting vLLM engine (dummy weights)…", spinner="dots"):
            t0 = time.perf_counter()
            llm = start_engine(model_dir, device, None, tensor_parallel_size)
        console.print(f"vLLM engine up in {time.perf_counter() - t0:.1f} s")
        return llm
    from refit_verify.vllm_plugin.engine import start_dummy_engine

    return start_dummy_engine(model_dir, device, tensor_parallel_size)


def push(llm, sender: RefitSender, weights: Mapping[str, torch.Tensor], options: dict) -> tuple[object, list[dict], float]:
    """Run one refit through :func:`refit_verify.push` and hand back its error instead of raising it.

    Kept for tests and benchmarks written against the demo's former helper.

    Returns:
        (the sender's report, or the exception the push raised; every worker's
        ``refit_verify_receive`` result, empty when the push raised; wall seconds).
    """
    t0 = time.perf_counter()
    try:
        res = push_refit(llm, weights, sender=sender, options=options)
    except Exception as e:  # noqa: BLE001 - handed back to the caller, as the former helper did
        return e, [], time.perf_counter() - t0
    return res.report, res.workers, res.seconds


def refit_split(stats: Mapping[str, Any], workers: list[dict]) -> tuple[float, float, float, float] | None:
    """One verified push's wall split: ``(refit-verify's own seconds, the sender's digest seconds, the
    slowest worker's own seconds, the slowest worker's vLLM reload seconds)``; own = sender + worker.

    ``stats``: the sender's ``last_stats`` (``digest_s``); ``workers``: the push's worker results, each
    with ``seconds`` (``open_s`` + ``boundary_s`` + ``close_s`` = ``own_s``, and ``reload_s``: vLLM's
    ``load_weights`` and layerwise reload without ours). None when a worker did not say (an older
    plugin, a failed push).
    """
    secs = [w.get("seconds") for w in workers]
    if not secs or any(not isinstance(x, Mapping) for x in secs) or "digest_s" not in stats:
        return None
    work = max(float(x["own_s"]) for x in secs)
    send = float(stats["digest_s"])
    return send + work, send, work, max(float(x["reload_s"]) for x in secs)


# ------------------------------------------------------------------------------ engine output


_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) (\S+) pid=\d+ \[([^\]]*)\] (.*)$")
_FORMAT = "%(asctime)s %(levelname)s %(processName)s pid=%(process)d [%(name)s] %(message)s"


def _logging_config(log_path: Path) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` sending vLLM's (and refit-verify's) records to ``log_path``."""
    handler = {"class": "logging.FileHandler", "filename": str(log_path), "mode": "a", "encoding": "utf-8",
               "formatter": "plain", "level": "DEBUG"}
    return {"version": 1, "disable_existing_loggers": False,
            "formatters": {"plain": {"format": _FORMAT}},
            "handlers": {"file": handler},
            "loggers": {"vllm": {"handlers": ["file"], "level": "INFO", "propagate": False},
                        "refit_verify": {"handlers": ["file"], "level": "INFO", "propagate": False}},
            "root": {"handlers": ["file"], "level": "WARNING"}}


@contextlib.contextmanager
def quiet_engine_output(log_path: str | Path) -> Iterator[IO[str]]:
    """Send everything vLLM prints, in this process and in every process it spawns, to ``log_path``.

    vLLM's logging is configured through ``VLLM_CONFIGURE_LOGGING=1`` and
    ``VLLM_LOGGING_CONFIG_PATH`` (a ``dictConfig`` with a file handler; vLLM applies it in this
    process when an engine starts and in its engine-core and worker processes), and file
    descriptors 1 and 2 are pointed at the log while the block runs, so what bypasses logging
    (C++ warnings, ``print``, Python warnings, a child's traceback) lands there too: spawned
    processes inherit them. :mod:`faulthandler` is on meanwhile, so a crash in native code leaves
    its Python stack in the log.

    Yields:
        a text stream on the original standard output (for the screen).

    Raises:
        RefitConfigError: ``log_path`` cannot be opened for appending.
    """
    log_path = Path(log_path)
    try:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as e:
        raise RefitConfigError(f"log file {log_path}: cannot open: {e.strerror or e}") from None
    conf_dir = Path(tempfile.mkdtemp(prefix="refit-verify-logging-"))
    conf = conf_dir / "logging.json"
    conf.write_text(json.dumps(_logging_config(log_path)))
    keys = ("VLLM_CONFIGURE_LOGGING", "VLLM_LOGGING_CONFIG_PATH")
    saved_env = {k: os.environ.get(k) for k in keys}
    os.environ.update({"VLLM_CONFIGURE_LOGGING": "1", "VLLM_LOGGING_CONFIG_PATH": str(conf)})
    for s in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            s.flush()
    saved = os.dup(1), os.dup(2)
    screen = open(os.dup(saved[0]), "w", encoding="utf-8", errors="replace", buffering=1)  # noqa: SIM115 - closed in finally below
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    had_faulthandler = faulthandler.is_enabled()
    if not had_faulthandler:  # a crash in native code (a kernel, a library) leaves its stack in the log
        with contextlib.suppress(Exception):
            faulthandler.enable()
    try:
        yield screen
    finally:
        if not had_faulthandler:
            faulthandler.disable()
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                s.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in saved:
            os.close(f)
        screen.close()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(conf_dir, ignore_errors=True)


def summarize_log(log_path: str | Path) -> dict[str, Any]:
    """Count the records of a log written through :func:`quiet_engine_output`.

    Returns:
        dict: ``levels`` (``{"INFO": n, "WARNING": n, ...}`` of log records), ``other`` (lines
        that are not records: tracebacks, C++ and Python warnings, prints), ``errors`` (the first
        distinct ERROR/CRITICAL messages, at most 3), ``warnings`` (the most frequent distinct
        WARNING messages, at most 3, as ``(message, count)``).
    """
    levels: collections.Counter[str] = collections.Counter()
    warnings: collections.Counter[str] = collections.Counter()
    errors: list[str] = []
    other = 0
    try:
        lines = Path(log_path).read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        lines = []
    for line in lines:
        m = _RECORD.match(line)
        if m is None:
            other += bool(line.strip())
            continue
        level, msg = m.group(1), m.group(4)
        levels[level] += 1
        if level == "WARNING":
            warnings[msg[:120]] += 1
        elif level in ("ERROR", "CRITICAL") and msg not in errors and len(errors) < 3:
            errors.append(msg[:200])
    return {"levels": dict(levels), "other": other, "errors": errors, "warnings": warnings.most_common(3)}


def _shutdown(llm, timeout_s: float = 2.0) -> None:
    """Stop the engine's processes now, waiting at most ``timeout_s`` before killing them.

    vLLM would stop them at exit, logging to the screen, after a 5 s grace period that a CPU
    worker always uses up; the demo's engine holds nothing worth a longer wait.
    """
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    stop = getattr(core, "shutdown", None)
    if callable(stop):
        try:
            stop(timeout=timeout_s)
        except Exception:  # noqa: BLE001 - best effort; the log has vLLM's own account
            traceback.print_exc()


# ------------------------------------------------------------------------------ the demo


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _readback_cell(rep: VerificationReport | None) -> str:
    if rep is None or rep.proven_bytes is None:
        return "-"
    return f"{_mib(rep.proven_bytes)} MiB"


def _report_of(outcome: object) -> VerificationReport | None:
    if isinstance(outcome, VerificationReport):
        return outcome
    return getattr(outcome, "report", None)


def run_demo(model: str | None = None, device: str = "auto", seed: int = 1234, timeout_s: float = 120.0, buffer_bytes: int = 4 << 20,
             log_file: str | Path | None = None) -> int:
    """Run the demo; return 0 only if the clean refit verified and the fault was named exactly.

    Args:
        model: directory with ``config.json`` (default: the packaged tiny Llama).
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (staging and trainer weights).
        seed: seed of the trainer-side random weights.
        timeout_s: bound on every transport wait, seconds. buffer_bytes: staging budget, bytes.
        log_file: where vLLM's full log goes (default: a new file in the temp directory).

    Raises:
        RefitConfigError: an option is not accepted, ``model`` has no ``config.json``, ``cuda``
            was asked for without CUDA, the log file cannot be opened.
    """
    rcfg = RefitConfig.build(mode="enforce", buffer_bytes=buffer_bytes, timeout_s=timeout_s)  # before the engine starts

    def body(console, work: Path, cfg: dict, device: str) -> bool:
        return _run(console, work, cfg, device, seed, timeout_s, rcfg)

    return run_on_engine("demo", body, model=model, device=device, log_file=log_file)


def run_on_engine(command: str, body: Callable[[Any, Path, dict, str], bool], *, model: str | Path | None = None,
                  device: str = "auto", log_file: str | Path | None = None) -> int:
    """The screen of a command that starts vLLM: run ``body(console, work, cfg, device)``; return 0 only if it returned True.

    ``REFIT_VERIFY=enforce`` in this process and the engine's; vLLM's log (every process) goes to
    ``log_file`` (:func:`quiet_engine_output`), the screen shows ``body``'s lines and a summary of
    that log. ``work`` is a fresh directory holding the model's ``config.json`` (start the engine
    there with :func:`engine_up`), ``cfg`` that config, ``device`` ``"cpu"`` or ``"cuda"``. An
    exception from ``body`` is shown in one line (its traceback goes to the log) and fails.

    Args:
        command: the command's name (in messages). model: directory with ``config.json`` (default:
            the packaged tiny Llama). device: ``"auto"``, ``"cpu"`` or ``"cuda"``.
        log_file: where vLLM's full log goes (default: a new file in the temp directory).

    Raises:
        RefitConfigError: ``model`` has no ``config.json``, ``cuda`` was asked for without CUDA, the
            log file cannot be opened (checked before the engine starts).
    """
    from rich.console import Console

    src_dir = Path(model) if model else models.packaged_config_dir()
    if not (src_dir / "config.json").is_file():
        raise RefitConfigError(f"--model {src_dir}: no config.json there")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RefitConfigError("--device cuda: CUDA is not available")
    if log_file is None:
        fd, name = tempfile.mkstemp(prefix=f"refit-verify-{command}-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    else:
        log_path = Path(log_file)
    os.environ["REFIT_VERIFY"] = VerifyMode.ENFORCE.value
    _env_defaults(device)
    cfg = models.load_config(src_dir)
    work = Path(tempfile.mkdtemp(prefix=f"refit-verify-{command}-"))
    shutil.copy(src_dir / "config.json", work / "config.json")
    ok = False
    try:
        with quiet_engine_output(log_path) as screen:
            console = Console(file=screen, width=max(Console(file=screen).width, 100), highlight=False)
            console.print(f"vLLM's log (every process) goes to {log_path}", soft_wrap=True)
            try:
                ok = body(console, work, cfg, device)
            except Exception as e:  # noqa: BLE001 - shown in one line; the traceback goes to the log
                traceback.print_exc()
                console.print(f"[bold red]{command} failed[/]: {type(e).__name__}: {e}")
            summary = summarize_log(log_path)
            lv = summary["levels"]
            console.print(f"vLLM log (not shown above): {lv.get('INFO', 0)} info, {lv.get('WARNING', 0)} warning, "
                          f"{lv.get('ERROR', 0) + lv.get('CRITICAL', 0)} error records, {summary['other']} other lines "
                          "(tracebacks, C++ and Python warnings)", soft_wrap=True)
            for msg in summary["errors"]:
                console.print(f"  [red]error[/]: {msg}")
            console.print(f"full log: {log_path}", soft_wrap=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


@contextlib.contextmanager
def engine_up(console, work: Path, device: str) -> Iterator[Any]:
    """Compile the digests, start vLLM on ``work`` (its ``config.json``, dummy weights) on ``device``
    with a spinner on ``console``, yield the ``vllm.LLM``, and stop its processes after the block."""
    t0 = time.perf_counter()
    backends.warmup(device)  # the trainer's digests, compiled (or loaded from the caches) before the engine starts
    console.print(f"digest kernels ready in {time.perf_counter() - t0:.1f} s (first use compiles; cached after)")
    llm = start_engine(work, device, console)
    try:
        yield llm
    finally:
        with console.status("[bold]stopping vLLM engine…", spinner="dots"):
            _shutdown(llm)
            del llm
            gc.collect()


def _run(console, work: Path, cfg: dict, device: str, seed: int, timeout_s: float, rcfg: RefitConfig) -> bool:
    from rich.table import Table

    with engine_up(console, work, device) as llm:
        weights = models.random_state_dict(cfg, seed=seed, device=device)
        options = {"timeout_s": timeout_s}
        nbytes = sum(t.numel() * t.element_size() for t in weights.values())

        with RefitSender(config=rcfg, device=device) as sender:
            clean, workers, wall = push(llm, sender, weights, options)
            stats = dict(sender.last_stats or {})
            again, workers2, wall2 = push(llm, sender, weights, options)
            stats2 = dict(sender.last_stats or {})
        kernel = through_forward(llm)
        crep = _report_of(clean)
        certs = certificate(llm, timeout_s=timeout_s)  # what every worker holds now, verified by this trainer or not
        verified = lambda r: isinstance(r, VerificationReport) and r.ok  # noqa: E731
        clean_ok = verified(clean) and verified(again)

        readback = readback_names(weights)
        engine_digests = llm.collective_rpc("refit_verify_param_digests", args=(readback,))[0]
        expected = digest_tensors((n, weights[n]) for n in readback)
        held = sum(engine_digests.get(n) == expected[n] for n in readback)

        target = "model.layers.1.mlp.down_proj.weight" if "model.layers.1.mlp.down_proj.weight" in weights else next(iter(weights))
        with OneByteFlipSender(config=rcfg, device=device, target=target, byte_index=777) as bad:
            fault, _, fwall = push(llm, bad, weights, options)
            fstats = dict(bad.last_stats or {})
        frep = _report_of(fault)
        fault_ok = (isinstance(fault, RefitVerificationError) and list(fault.mismatched) == [target]
                    and not fault.missing and not fault.unexpected)

        t = Table(title=f"refit-verify demo: {device}, {cfg.get('architectures', ['?'])[0]}, REFIT_VERIFY=enforce")
        for col in ("refit", "tensors", "MiB", "sender digest", "receiver digest", "proven", "wall", "verdict"):
            t.add_column(col, no_wrap=True)
        ms = lambda d, k: f"{d[k] * 1e3:.1f}ms" if k in d else "-"  # noqa: E731
        t.add_row("clean", str(len(weights)), _mib(nbytes), ms(stats, "digest_s"), ms(stats, "receiver_digest_s"), _readback_cell(crep),
                  f"{wall:.2f}s", "[green]verified[/]" if verified(clean) else "[red]FAILED[/]")
        t.add_row("clean, again", str(len(weights)), _mib(nbytes), ms(stats2, "digest_s"), ms(stats2, "receiver_digest_s"),
                  _readback_cell(_report_of(again)), f"{wall2:.2f}s", "[green]verified[/]" if verified(again) else "[red]FAILED[/]")
        t.add_row("byte flip", str(len(weights)), _mib(nbytes), ms(fstats, "digest_s"), ms(fstats, "receiver_digest_s"), _readback_cell(frep),
                  f"{fwall:.2f}s", "[green]caught[/]" if fault_ok else "[red]NOT caught as expected[/]")
        t.caption = "proven: engine bytes read back in the engine's layout, equal to the delivered bytes"
        console.print(t)
        how = ("the worker compiled its digest kernels in the background as the engine started" if warmup_enabled()
               else f"{WARMUP_ENV_VAR}=0: the first refit compiled the worker's digest kernels")
        console.print(f"first verified refit {wall:.3f} s, second {wall2:.3f} s ({how})")
        split = refit_split(stats, workers), refit_split(stats2, workers2)
        if None not in split:
            (own, send, work, reload), (own2, send2, work2, reload2) = split
            console.print(f"  refit-verify's own work {own * 1e3:.1f} ms, then {own2 * 1e3:.1f} ms (first / second "
                          f"{own / own2 if own2 > 0 else float('inf'):.2f}; sender digest {send * 1e3:.1f}, "
                          f"{send2 * 1e3:.1f}; worker {work * 1e3:.1f}, {work2 * 1e3:.1f}: session open, model boundary, close); "
                          f"vLLM's reload {reload * 1e3:.1f} ms, then {reload2 * 1e3:.1f} ms; the rest is staging, transport and "
                          "vLLM's RPC", soft_wrap=True)
        if clean_ok:
            console.print(f"[green]clean refit[/]: {crep.verified} of {len(weights)} tensors verified at the model boundary, bytes identical, "
                          f"on {crep.worker or 'the worker'}")
        else:
            console.print(f"[red]clean refit[/]: {crep.describe() if crep is not None else f'{type(clean).__name__}: {clean}'}")
        if crep is not None and crep.proven_bytes is not None:
            console.print(f"engine read-back (model boundary): {crep.proven_bytes:,} of {nbytes:,} delivered bytes proven in the engine's layout; "
                          f"{len(crep.not_proven)} engine parameters not coverable")
            by_why: dict[str, list[str]] = {}
            for name, why in crep.not_proven.items():
                by_why.setdefault(why.split(": ", 1)[0], []).append(name)
            for why, names in by_why.items():
                console.print(f"  not coverable, {len(names)}: {why}: {', '.join(names)}")
        if kernel:
            console.print(f"linear weights in the engine's GEMM kernel (an empty parameter left): {len(kernel)} proven through the "
                          "layer's own forward on the identity, up to the sign of zero: " + ", ".join(kernel))
        else:
            console.print("linear weights: the engine kept them as loaded (its GEMM kernel took no copy of its own), read back "
                          "directly")
        for c in certs:
            console.print(("[green]" if c.ok else "[red]") + f"certificate[/]: {c.describe()}")
        ok_held = held == len(readback)
        console.print(("[green]" if ok_held else "[red]") + f"engine parameters read directly[/]: {held} of {len(readback)} unfused "
                      "parameters (embeddings, norms, lm_head) hold the new weights")
        console.print(f"{'[green]' if fault_ok else '[red]'}faulty refit[/] (byte 777 of {target} flipped in its staged slot): "
                      f"{type(fault).__name__}: {fault}")
        ok = clean_ok and ok_held and fault_ok and all(c.ok for c in certs)
        console.print("[bold green]PASS[/]" if ok else "[bold red]FAIL[/]")
        return ok
