"""Lazy package faces: a package's public names are imported from their module on first use.

``__getattr__, __dir__ = face(__name__, {"name": "refit_verify.pkg.module", ...})`` in a package's
``__init__`` keeps ``import refit_verify.pkg`` free of torch, Triton, ZMQ and vLLM, and gives the
package no import edges of its own (the house's import rules count each module's own imports).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def face(package: str, exports: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """Return ``(__getattr__, __dir__)`` for ``package`` exporting ``exports`` (name -> module path).

    Raises (from the returned ``__getattr__``):
        AttributeError: a name ``exports`` does not list.
    """
    import sys

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(exports))

    return __getattr__, __dir__
