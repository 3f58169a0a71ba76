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
