"""The preloaded engine processes' pure parts: the CPU set read from vLLM's OpenMP variables, the opt-out,
the server's environment. The processes themselves: tests/e2e/test_preloaded_engines.py."""

from __future__ import annotations

import pytest

from tests.support import preload


@pytest.mark.parametrize(("env", "cpus"), [
    ({"GOMP_CPU_AFFINITY": "0 1"}, {0, 1}),  # vLLM with GNU OpenMP
    ({"OMP_PLACES": "{3}", "OMP_PROC_BIND": "true"}, {3}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[2,5]"}, {2, 5}),  # Intel OpenMP
    ({"OMP_NUM_THREADS": "2"}, None),
    ({"GOMP_CPU_AFFINITY": ""}, None),
])
def test_omp_cpus_read_from_the_variables_vllm_sets(env, cpus):
    assert preload._omp_cpus(env) == cpus


def test_spawn_opt_out(monkeypatch):
    monkeypatch.setenv(preload.SPAWN_ENV, "1")
    assert preload.applies() is False


def test_server_starts_without_any_engines_settings(monkeypatch):
    for k, v in {"REFIT_VERIFY": "enforce", "REFIT_VERIFY_WARMUP": "0", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
                 "OMP_NUM_THREADS": "1", "GOMP_CPU_AFFINITY": "0", "RV_KEEP": "1"}.items():
        monkeypatch.setenv(k, v)
    env = preload._server_env()
    assert env["RV_KEEP"] == "1"
    assert not [k for k in env if k.startswith(("REFIT_VERIFY", "VLLM_", "OMP_", "GOMP_"))]
