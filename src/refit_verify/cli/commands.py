"""refit-verify command line.

``refit-verify demo``
    a verified refit into a real vLLM engine, then one with an injected fault.
``refit-verify selftest``
    does verification work on this machine's vLLM? a corrupted refit must be caught, a clean one
    verified and certified; exit 0 when so, 1 otherwise.
``refit-verify digest PATH [-o MANIFEST]``
    digest every tensor of a safetensors file or checkpoint directory into a manifest (JSON).
``refit-verify compare A B``
    compare two manifests (checkpoint manifests, saved session manifests, plain ``{name: 32-hex}``
    JSON); exit 0 when equal, 1 when they differ, 2 on bad input.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path

EXIT_EQUAL, EXIT_DIFFER, EXIT_BAD_INPUT = 0, 1, 2

_NEEDS = {"demo": ("rich",), "selftest": ("rich",), "digest": ("rich", "safetensors", "tqdm"), "compare": ("rich",)}


def _missing(modules: tuple[str, ...]) -> list[str]:
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules, a broken install
            found = False
        if not found:
            out.append(m)
    return out


def _engine_options(cmd: argparse.ArgumentParser, timeout: str) -> None:
    """The options of a command that starts vLLM (``demo``, ``selftest``): model, device, seed, timeout, log file."""
    cmd.add_argument("--model", default=None, help="directory with config.json (default: the packaged tiny Llama)")
    cmd.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="staging device (auto: cuda if available)")
    cmd.add_argument("--seed", type=int, default=1234, help="seed of the trainer-side random weights")
    cmd.add_argument("--timeout", type=float, default=120.0, help=timeout)
    cmd.add_argument("--log-file", default=None, help="where vLLM's full log goes (default: a new file in the temp directory)")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="refit-verify", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="verified refit into a real vLLM engine, clean and with an injected fault",
                       description="Start vLLM on a small config with dummy weights, push fresh weights with REFIT_VERIFY=enforce "
                                   "(refit_verify.push), show the engine's read-back, then repeat with one staged byte flipped. "
                                   "vLLM's log goes to a file named at the end. Exit 0 only if both outcomes are as expected.")
    _engine_options(d, timeout="bound on every transport wait, seconds")
    d.add_argument("--buffer-mib", type=int, default=4, help="staging budget in MiB (two ping-pong halves)")
    t = sub.add_parser("selftest", help="check that verification works on a real vLLM engine: a corrupted refit caught, a clean one verified",
                       description="Start vLLM on a small config with dummy weights and run refit_verify.selftest: a refit with one "
                                   "staged byte flipped must be refused naming that tensor, a clean refit must verify, and the "
                                   "worker's certificate must name the clean refit's engine state. vLLM's log goes to a file named "
                                   "at the end. Exit 0 only if every check held.")
    _engine_options(t, timeout="bound on every wait, seconds")
    g = sub.add_parser("digest", help="digest every tensor of a safetensors file or checkpoint directory into a manifest",
                       description="Read PATH (a .safetensors file, or a directory of them with or without "
                                   "model.safetensors.index.json) with the safetensors library, digest every tensor (digest v1, "
                                   "on CUDA when available) and write a checkpoint manifest (JSON): per tensor its digest, dtype, "
                                   "shape and bytes.")
    g.add_argument("path", metavar="PATH", help="a .safetensors file or a checkpoint directory")
    g.add_argument("-o", "--output", metavar="MANIFEST", default=None,
                   help="manifest file to write ('-': standard output; default: ./<name>.manifest.json)")
    g.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="where to digest (auto: cuda if available)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = sub.add_parser("compare", help="compare two manifests; exit 0 equal, 1 different, 2 bad input",
                       description="Compare manifests A and B name by name: checkpoint manifests (refit-verify digest), "
                                   "SessionManifest records saved from vLLM workers, or plain JSON objects {name: 32-hex digest}. "
                                   "Prints every difference: other bytes (both digests), dtype or shape changes (same bytes or "
                                   "not, for checkpoint manifests), names only in A, names only in B.")
    c.add_argument("a", metavar="A", help="manifest A (JSON)")
    c.add_argument("b", metavar="B", help="manifest B (JSON)")
    c.add_argument("--limit", type=int, default=200, help="rows shown at most (default 200; 0: all)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``refit-verify`` console script.

    Returns:
        int: the exit code: 0 success (or manifests equal), 1 a failed demo or differing
        manifests, 2 bad input (arguments, unreadable or malformed files, a missing extra).
    """
    p = _parser()
    args = p.parse_args(argv)
    missing = _missing(_NEEDS.get(args.cmd, ()))
    if missing:
        print(f"refit-verify {args.cmd}: needs {', '.join(missing)}; install the command line's extra: "
              "pip install 'refit-verify[cli]'", file=sys.stderr)
        return EXIT_BAD_INPUT
    from refit_verify.errors import RefitConfigError

    try:
        if args.cmd == "demo":
            return _demo(p, args)
        if args.cmd == "selftest":
            return _selftest(p, args)
        if args.cmd == "digest":
            return _digest(args)
        if args.cmd == "compare":
            return _compare(args)
    except RefitConfigError as e:
        print(f"refit-verify {args.cmd}: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    return EXIT_BAD_INPUT


def _demo(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from refit_verify.cli.demo import run_demo

    if args.buffer_mib <= 0:
        p.error("--buffer-mib must be a positive number of MiB")
    if not (args.timeout > 0 and args.timeout < float("inf")):
        p.error("--timeout must be a positive, finite number of seconds")
    return run_demo(model=args.model, device=args.device, seed=args.seed, timeout_s=args.timeout,
                    buffer_bytes=args.buffer_mib << 20, log_file=args.log_file)


def _selftest(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Start vLLM (dummy weights) and run :func:`refit_verify.selftest` with fresh random weights of
    the model's HF names (the engine is left holding them); the screen is the demo's
    (:func:`refit_verify.cli.demo.run_on_engine`). Returns 0 only if it passed."""
    from refit_verify.cli.demo import engine_up, run_on_engine
    from refit_verify.errors import SelftestError
    from refit_verify.testing import models
    from refit_verify.trainer.selftest import selftest

    if not (args.timeout > 0 and args.timeout < float("inf")):
        p.error("--timeout must be a positive, finite number of seconds")

    def body(console, work: Path, cfg: dict, device: str) -> bool:
        with engine_up(console, work, device) as llm:
            weights = models.random_state_dict(cfg, seed=args.seed, device=device)
            try:
                res = selftest(llm, weights, mode="enforce", timeout_s=args.timeout)
            except SelftestError as e:
                res = e.result
            _show_selftest(console, res)
            return res.passed

    return run_on_engine("selftest", body, model=args.model, device=args.device, log_file=args.log_file)


def _show_selftest(console, res) -> None:
    """The self-test's lines: the corrupted refit, the clean one, the certificates, what failed, the verdict."""
    t = res.timings
    sec = lambda k: f" ({t[k]:.2f} s)" if k in t else ""  # noqa: E731
    if "corrupted" in t:
        verdict = f"[green]caught[/], named {res.caught}" if res.caught else "[red]NOT caught as expected[/]"
        console.print(f"corrupted refit: byte {res.byte_index} of {res.target} flipped after the sender digested it: {verdict}"
                      + sec("corrupted"), soft_wrap=True)
    rep = res.report
    if rep is not None and rep.ok:
        console.print(f"[green]clean refit[/]: {rep.verified} tensors verified at the model boundary on {rep.worker}{sec('clean')}",
                      soft_wrap=True)
    for c in res.certificates:
        console.print(("[green]" if c.ok else "[red]") + f"certificate[/]: {c.describe()}", soft_wrap=True)
    for problem in res.problems:
        console.print(f"[red]problem[/]: {problem}", soft_wrap=True)
    total = f" in {t['total']:.2f} s" if "total" in t else ""
    console.print(f"[bold green]PASS[/]: selftest{total}" if res.passed else f"[bold red]FAIL[/]: selftest{total}")


def _digest(args: argparse.Namespace) -> int:
    from refit_verify.cli.checkpoint import digest_checkpoint, encode_manifest, write_manifest
    from refit_verify.errors import RefitConfigError

    src = Path(args.path)
    if args.output == "-":
        out = None
    else:
        out = Path(args.output) if args.output else Path.cwd() / f"{(src.stem if src.is_file() else src.resolve().name) or 'checkpoint'}.manifest.json"
        if out.is_dir():
            raise RefitConfigError(f"-o {out}: a directory, not a file name")
        if not out.parent.is_dir():
            raise RefitConfigError(f"-o {out}: directory {out.parent} does not exist")
    device = None if args.device == "auto" else args.device
    warm = _warm_up(device)
    t0 = time.perf_counter()
    m = digest_checkpoint(src, device=device, progress=not args.no_progress)
    wall = time.perf_counter() - t0
    nbytes = m.total_bytes
    if out is None:
        sys.stdout.buffer.write(encode_manifest(m))
        sys.stdout.flush()
        where = "standard output"
    else:
        write_manifest(m, out)
        where = str(out)
    rate = f", {nbytes / wall / 1e9:.2f} GB/s" if wall > 0 and nbytes >= 1 << 20 else ""
    print(f"digested {len(m.tensors)} tensors ({_size(nbytes)}) from {len(m.files)} file{'s' * (len(m.files) != 1)} "
          f"in {wall:.2f} s{rate} (digest v{m.digest_spec}; kernels ready in {warm:.1f} s before); manifest: {where}", file=sys.stderr)
    return EXIT_EQUAL


def _warm_up(device: str | None) -> float:
    """Compile or load the digest kernels once (first use in a process); return the seconds taken."""
    import torch

    from refit_verify.digest.batch import digest_tensors
    from refit_verify.errors import RefitConfigError

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise RefitConfigError("--device cuda: CUDA is not available")
    t0 = time.perf_counter()
    digest_tensors({"warm-up": torch.zeros(1 << 16, dtype=torch.uint8, device=dev)})
    return time.perf_counter() - t0


def _size(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.2f} {unit}"
    return f"{n} B"


def _compare(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from refit_verify.cli.checkpoint import compare, load_manifest

    a, b = load_manifest(args.a), load_manifest(args.b)
    diff = compare(a, b)
    rows = list(diff.differences)
    shown = rows if args.limit <= 0 else rows[: args.limit]
    cols = ("tensor", "difference", "digest A", "digest B", "detail")
    cells = [(d.name, d.kind, d.digest_a or "-", d.digest_b or "-", d.detail) for d in shown]
    t = Table(title="differences (A → B)", title_justify="left")
    for col in cols:
        t.add_column(col, no_wrap=True, overflow="fold")
    for row in cells:
        t.add_row(*row)
    # one line per row when the output is not a terminal (a file, a pipe): greppable, diffable
    need = sum(max(len(x) for x in (c, *(r[i] for r in cells))) + 3 for i, c in enumerate(cols)) + 1
    probe = Console()
    console = probe if probe.is_terminal else Console(width=max(need, 100), highlight=False)
    console.print(f"A: {a.label}, {len(a.digests)} tensors", soft_wrap=True)
    console.print(f"B: {b.label}, {len(b.digests)} tensors", soft_wrap=True)
    if diff.ok:
        console.print(f"[green]equal[/]: {diff.equal} tensors, same names and digests", soft_wrap=True)
        return EXIT_EQUAL
    console.print(t)
    if len(shown) < len(rows):
        console.print(f"… {len(rows) - len(shown)} more differences not shown (--limit 0 shows all)", soft_wrap=True)
    kinds = ", ".join(f"{n} {k}" for k, n in diff.counts.items())
    console.print(f"[red]differ[/]: {len(rows)} names ({kinds}); {diff.equal} equal", soft_wrap=True)
    return EXIT_DIFFER


if __name__ == "__main__":
    sys.exit(main())
