"""What the benchmark scripts share: the common arguments, and printing a Markdown table to ``--out``."""

from __future__ import annotations

import argparse
from pathlib import Path


def parse(doc: str, argv: list[str] | None, rounds: int, extra=None) -> tuple[argparse.Namespace, str]:
    """Parse ``--rounds`` (default ``rounds``), ``--device auto|cuda|cpu`` and ``--out`` (plus what
    ``extra(ap)`` adds); return the arguments and the device (``auto``: CUDA when available)."""
    import torch

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if extra is not None:
        extra(ap)
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    return a, (("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device)


def emit(lines: list[str], out: str | None) -> str:
    """Join ``lines``, print them, write them to ``out`` (when given); return the text."""
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
    return text
