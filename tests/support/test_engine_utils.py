"""The test engines' environment helper: what it sets is gone after the engine, vLLM's cached reading included."""

from __future__ import annotations

import os

import pytest

from tests.support.engine_utils import engine_env

envs = pytest.importorskip("vllm.envs")


@pytest.mark.skipif(not hasattr(envs, "enable_envs_cache"), reason="this vLLM caches no environment")
def test_engine_env_leaves_vllm_reading_the_restored_environment(monkeypatch):
    """An in-process engine core caches vLLM's environment at its start; after engine_env an engine
    started later in this process must see the environment as restored (multiprocessing on)."""
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        envs.enable_envs_cache()  # what vLLM's EngineCore does as it starts
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING")
        assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is False  # cached: the environment is not read
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING is True
