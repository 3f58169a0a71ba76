"""Test-session set-up shared by every module.

On a machine without CUDA the Triton digest kernels can only run under the interpreter, and
Triton reads ``TRITON_INTERPRET`` once, when it is first imported. The kernel test modules set it
at their import, which is too late if an earlier module (a vLLM engine test) imported Triton
first; setting it here, before any test module is imported, makes the test order irrelevant.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from refit_verify.digest import warm_start  # noqa: E402 - after TRITON_INTERPRET

warm_start.at_import = False  # no warm-up thread starting at a random moment of a test; tests/digest/test_warm_start.py runs it


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker per core, at most 4 (each worker may run a vLLM engine of its own)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_configure(config) -> None:
    """Compile the CPU digests once, in the controller, before the workers start: concurrent first
    compilations of the same cached numba functions in several processes can leave a cache that
    segfaults later (numba issue #10128)."""
    if hasattr(config, "workerinput"):
        return
    try:
        from refit_verify.digest import backends

        backends.warmup_cpu()
    except ImportError:  # no numba: the torch path needs no warm-up
        pass


FIRST_ON_SHARED = "/e2e/test_direct_writes.py"
"""Runs first on the shared engine: it tests what a fresh engine (one that never loaded) learns dry."""


def pytest_collection_modifyitems(config, items) -> None:
    """Longest files first (engine tests, then the Triton-interpreter kernel tests, then the rest), so that
    the two workers are packed evenly; the tests of each shared engine together (its group first), and
    :data:`FIRST_ON_SHARED` first in its group; each file's own order kept."""
    from tests.support.shared_engine import group_of

    def key(item) -> tuple:
        path = str(item.fspath)
        weight = 0 if "/e2e/" in path else 1 if "/digest/kernels/" in path or path.endswith("digest/test_batch.py") else 2
        group = group_of(item.path)
        return (weight, group is None, group or "", not path.endswith(FIRST_ON_SHARED))

    items.sort(key=key)  # stable: collection order within each class


def pytest_xdist_make_scheduler(config, log):
    """Schedule whole files, as ``--dist loadfile`` does, except that the modules sharing one engine
    (``tests/support/shared_engine.py``) are one unit: they run on one worker, after each other, with one
    engine start. (xdist's ``loadgroup`` cannot do this under pytest 9: the group suffix it writes to
    ``item._nodeid`` never reaches ``item.nodeid``, so every test became a unit of its own.)"""
    from xdist.scheduler import LoadScopeScheduling

    from tests.support.shared_engine import group_of

    class EngineGroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return group_of(Path(path)) or path

    return EngineGroupScheduling(config, log)
