"""Tests for refit_verify.config: the REFIT_VERIFY mode and refit options."""

import subprocess
import sys

import pytest

from refit_verify import RefitConfig, RefitConfigError, VerifyMode, mode_from_env

REJECTED = ["Enforce", "ENFORCE", "Off", "LOG", "true", "false", "1", "0", "", " enforce", "enforce ", "enfroce", "none", "null", "yes"]


class TestModeFromEnv:
    def test_unset_is_off(self):
        assert mode_from_env({}) is VerifyMode.OFF

    @pytest.mark.parametrize("value", ["off", "log", "enforce"])
    def test_accepted(self, value):
        assert mode_from_env({"REFIT_VERIFY": value}).value == value

    @pytest.mark.parametrize("value", REJECTED)
    def test_rejected_lists_accepted_values(self, value):
        with pytest.raises(RefitConfigError) as ei:
            mode_from_env({"REFIT_VERIFY": value})
        msg = str(ei.value)
        assert "REFIT_VERIFY" in msg and "'off', 'log', 'enforce'" in msg and repr(value) in msg

    def test_is_value_error(self):
        with pytest.raises(ValueError):
            mode_from_env({"REFIT_VERIFY": "1"})


class TestRefitConfig:
    def test_defaults(self, monkeypatch):
        monkeypatch.delenv("REFIT_VERIFY", raising=False)
        c = RefitConfig.build()
        assert (c.mode, c.buffer_bytes, c.alignment, c.timeout_s) == (VerifyMode.OFF, 256 << 20, 512, 120.0)

    def test_mode_from_env(self, monkeypatch):
        monkeypatch.setenv("REFIT_VERIFY", "log")
        assert RefitConfig.build().mode is VerifyMode.LOG

    @pytest.mark.parametrize(
        "options, needle",
        [({"verfiy": "log"}, "verfiy"), ({"mode": None}, "mode"), ({"mode": False}, "mode"), ({"timeout_s": None}, "timeout_s"),
         ({"buffer_bytes": 0}, "buffer_bytes"), ({"timeout_s": -1.0}, "timeout_s"), ({"alignment": 100}, "alignment"), ({"buffer_bytes": "1"}, "buffer_bytes")],
    )
    def test_rejected_options_named(self, options, needle):
        with pytest.raises(RefitConfigError, match=needle):
            RefitConfig.build(**options)


def test_typo_aborts_vllm_plugin_loading():
    """vLLM's own plugin loader (entry point discovery) fails in a process whose REFIT_VERIFY has a typo."""
    pytest.importorskip("vllm")
    code = "import vllm.plugins as p; p.load_general_plugins(); print('loaded')"
    env = {"REFIT_VERIFY": "Enforce", "PATH": "/usr/bin:/bin", "VLLM_PLUGINS": "refit_verify"}
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "'off', 'log', 'enforce'" in bad.stderr
    env["REFIT_VERIFY"] = "enforce"
    good = subprocess.run([sys.executable, "-c", code + "; from vllm.v1.worker.worker_base import WorkerBase; print(hasattr(WorkerBase, 'refit_verify_receive'))"], env=env, capture_output=True, text=True, timeout=120)
    assert good.returncode == 0, good.stderr[-2000:]
    assert good.stdout.split()[-2:] == ["loaded", "True"]


@pytest.mark.parametrize(("value", "on"), [(None, False), ("", False), ("0", False), ("off", False), ("no", False),
                                           ("2", False), ("1", True), ("true", True), (" ON ", True), ("Yes", True),
                                           ("force", True), (" FORCE", True), ("forced", False)])
def test_cuda_graph_replay_and_the_copies_pool_are_opt_in(value, on):
    from refit_verify.config import CUDA_GRAPHS_ENV_VAR, cuda_graphs_enabled, cuda_graphs_forced

    env = {} if value is None else {CUDA_GRAPHS_ENV_VAR: value}
    assert CUDA_GRAPHS_ENV_VAR == "REFIT_VERIFY_CUDA_GRAPHS"
    assert cuda_graphs_enabled(env) is on
    assert cuda_graphs_forced(env) is (value is not None and value.strip().lower() == "force")


def test_cpu_copies_never_use_a_pool_even_opted_in(monkeypatch):
    import torch

    from refit_verify.vllm_plugin import worker_copies as worker

    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")
    monkeypatch.setattr(worker, "_POOLS", {})
    src = torch.arange(12, dtype=torch.float32)
    batch = [("a", src[:6].view(2, 3)), ("b", src[6:])]
    copies = worker.owned_copies(batch)
    assert [n for n, _ in copies] == ["a", "b"]
    for (_, c), (_, v) in zip(copies, batch):
        assert torch.equal(c, v) and c.untyped_storage().data_ptr() != v.untyped_storage().data_ptr()
    assert worker._POOLS == {}  # no pool was made for CPU tensors


@pytest.mark.parametrize("value", ["forced", "forse", "2", "enforce"])
def test_a_cuda_graphs_value_that_means_nothing_is_refused_at_register(value):
    from refit_verify.config import check_cuda_graphs_env

    with pytest.raises(RefitConfigError, match=f"REFIT_VERIFY_CUDA_GRAPHS='{value}' is not accepted"):
        check_cuda_graphs_env({"REFIT_VERIFY_CUDA_GRAPHS": value})
    for ok in ("", "0", "off", "No", "1", "TRUE", "force"):
        check_cuda_graphs_env({"REFIT_VERIFY_CUDA_GRAPHS": ok})
    check_cuda_graphs_env({})


@pytest.mark.parametrize("value", ["of", "2", "enforce", "never"])
@pytest.mark.parametrize("var, check, enabled", [("REFIT_VERIFY_DIRECT_LAUNCH", "check_direct_launch_env", "direct_launch_enabled"),
                                                 ("REFIT_VERIFY_WARMUP", "check_warmup_env", "warmup_enabled")])
def test_an_on_off_switch_value_that_means_nothing_is_refused_at_register(value, var, check, enabled):
    from refit_verify import config

    check, enabled = getattr(config, check), getattr(config, enabled)
    with pytest.raises(RefitConfigError, match=f"{var}='{value}' is not accepted"):
        check({var: value})
    for ok, on in (("", True), ("1", True), ("Yes", True), (" on ", True), ("0", False), ("OFF", False), ("no", False)):
        check({var: ok})
        assert enabled({var: ok}) is on
    check({})
    assert enabled({}) is True
