"""Worker session methods (refit_verify.vllm_plugin.worker_sessions) on the toy model, without vLLM."""

from __future__ import annotations

import pytest

from refit_verify.errors import RefitConfigError, RefitProtocolError
from refit_verify.vllm_plugin import worker_sessions as sessions
from tests.support.toy_model import toy_worker


def test_layout_map_learns_dry_on_request_and_returns_the_map(monkeypatch):
    worker, wb, model = toy_worker()
    monkeypatch.setattr(sessions, "attach_models", lambda *a, **k: None)  # the toy model is attached already
    got = sessions.refit_verify_layout_map(worker)
    assert got["maps"] == {"model": None} and got["notes"] == {}
    got = sessions.refit_verify_layout_map(worker, {"model": {"k_proj": [[4, 8], "bfloat16"], "embed": [[13, 8], "bfloat16"]}})
    assert got["maps"]["model"]["entries"] == {"k_proj": ["qkv_proj rows 8:12"], "embed": ["embed rows 0:13"]}
    assert got["maps"]["model"]["padding"] == {"embed": ["rows 13:16"]}
    assert got["notes"]["model"][0].startswith("dry learn of 2 names")
    with pytest.raises(RefitConfigError, match="specs must be"):
        sessions.refit_verify_layout_map(worker, {"model": {"k_proj": "4x8"}})
    wb.open("s1")
    with pytest.raises(RefitProtocolError, match="is open; learn the layout before or after a refit"):
        sessions.refit_verify_layout_map(worker, {"model": {"v_proj": [[4, 8], "bfloat16"]}})


def test_close_refuses_a_malformed_announcement():
    worker, wb, _model = toy_worker()
    wb.open("s1")
    with pytest.raises(RefitConfigError, match="announced must be"):
        sessions.refit_verify_session_close(worker, "s1", None, {"model": {"k_proj": ["0" * 32, "4x8", "bfloat16"]}})
