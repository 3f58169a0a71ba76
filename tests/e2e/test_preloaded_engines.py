"""The CPU suite's engines fork their processes from a preloaded server (``tests/support/preload.py``):
each engine process must still be what spawn would give, a fresh process in the mode and environment
its starter set, whatever this pytest process and the server hold. A fork of the pytest process would
take its loaded plugins and refit-verify's applied patches (an engine in ``enforce`` after an ``off`` one
would verify nothing); a server's environment would give every engine the mode of the first."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

from refit_verify.vllm_plugin import patches  # noqa: E402
from tests.support import preload  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA engines are spawned")]
PYTEST_ONLY = "rv-test-only-in-the-pytest-process"
VERIFYING = {p.name for p in patches.PATCHES if p.verifying_only and p.name in patches._APPLY}
"""The verifying patches :func:`refit_verify.vllm_plugin.patches.apply` applies itself (the others ride on these)."""


def _start_and_report(d, mode: str) -> list[dict]:
    """Start a preloaded engine with ``REFIT_VERIFY=mode``; each worker's ``process_report``; shut it down."""
    from refit_verify.vllm_plugin.engine import start_dummy_engine

    with engine_env(REFIT_VERIFY=mode, RV_TEST_ENGINE=mode):
        llm = start_dummy_engine(d, "cpu", worker_extension_cls="tests.support.preload.ProcessReportExtension")
    try:
        return llm.collective_rpc("pr_report")
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The server's pid and environment, then the worker reports of an ``off`` engine and an ``enforce``
    one, both started after this process was left as an in-process ``off`` engine leaves it (vLLM's
    plugins loaded, refit-verify registered ``off``, plus a mark in its patch ledger no engine process
    may hold)."""
    import vllm.plugins

    from refit_verify.vllm_plugin import register

    if not preload.applies():
        pytest.skip("REFIT_VERIFY_TEST_SPAWN=1: the engines spawn")
    d = tiny_model_dir(tmp_path_factory)
    with engine_env(REFIT_VERIFY="off"):
        vllm.plugins.load_general_plugins()
        register()
    patches._DONE.add(PYTEST_ONLY)
    try:
        preload.ensure_server()
        server = preload.server_pid()
        env = dict(e.split("=", 1) for e in Path(f"/proc/{server}/environ").read_text().split("\0") if "=" in e)
        yield server, env, _start_and_report(d, "off"), _start_and_report(d, "enforce")
    finally:
        patches._DONE.discard(PYTEST_ONLY)


def test_each_worker_is_a_fork_of_the_preloaded_server(reports):
    server, env, off, enforce = reports
    assert not [k for k in env if k.startswith(("REFIT_VERIFY", "RV_TEST_"))]  # started with no engine's settings
    for r in off + enforce:
        assert r["ppid"] == server, "forked by the server, not spawned (nor forked from the EngineCore)"
        assert r["started"]["preloaded"] == list(preload.PRELOAD)


def test_off_engine_started_off_whatever_the_server_and_this_process_hold(reports):
    _, _, off, _ = reports
    (r,) = off
    assert r["env"] == {"REFIT_VERIFY": "off", "RV_TEST_ENGINE": "off"}  # the starter's, not the server's
    assert r["mode"] == "off"
    assert PYTEST_ONLY not in r["patches"] and not VERIFYING & set(r["patches"])


def test_enforce_engine_after_an_off_one_verifies(reports):
    """The server and this process were left ``off``: the worker reads ``enforce`` from its starter's
    environment and applies every verifying patch (a fork of this process would have none: its
    ledger says they were handled, its vLLM says the plugins were loaded)."""
    _, _, _, enforce = reports
    (r,) = enforce
    assert r["env"] == {"REFIT_VERIFY": "enforce", "RV_TEST_ENGINE": "enforce"}
    assert r["mode"] == "enforce"
    assert set(r["patches"]) >= VERIFYING and PYTEST_ONLY not in r["patches"]
    assert PYTEST_ONLY in patches._DONE  # this process kept its own
