"""Output shared by the benchmark scripts: print a Markdown table and write it to ``--out``."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | None) -> str:
    """Join ``lines``, print them, write them to ``out`` (when given); return the text."""
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
    return text
