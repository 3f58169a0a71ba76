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


class _Sleeper:
    """A worker whose ``sleep(level=2)`` discards its weights (CUDA's level 2 frees them; their memory
    holds other bytes after the wake) and whose ``sleep(level=1)`` loses one element (vLLM #29341),
    wrapped as the plugin wraps vLLM's ``Worker.sleep`` / ``wake_up``."""

    def __init__(self, worker, model) -> None:
        setattr(self, sessions._ATTR, getattr(worker, sessions._ATTR))
        self.model = model

    @sessions.wrap_sleep
    def sleep(self, level: int = 1) -> None:
        import torch

        with torch.no_grad():
            if level == 2:
                for p in self.model.parameters():
                    p.fill_(7)
            else:
                self.model.norm[0] += 1

    @sessions.wrap_wake_up
    def wake_up(self, tags=None) -> None:
        pass


def test_weights_discarded_by_sleep_at_level_2_must_be_refit_and_a_full_refit_verifies(monkeypatch):
    """verl's step: sleep(level=2), wake_up(["weights"]), a full refit, wake_up(["kv_cache"]). The
    weights the sleep discarded fail audits and certificates until a refit writes them; a full refit
    verifies (the wake is no failure of it), a partial one that leaves some fails. A weight lost by a
    sleep at level 1 is still reported with the next refit."""
    import refit_verify
    from tests.support.toy_model import ToyEngine, toy_weights

    monkeypatch.setattr(sessions, "attach_models", lambda *a, **k: None)  # the toy model is attached already
    worker, wb, model = toy_worker()
    w = _Sleeper(worker, model)
    engine = ToyEngine(w)

    def refit(weights, **kw):
        with refit_verify.refit(engine, mode="enforce", **kw) as r:
            for n, t in weights.items():
                r.add(n, t)
            model.load_weights(list(weights.items()))
        return r.reports[0]

    assert refit(toy_weights(1), version=1).ok
    for version in (2, 3):
        w.sleep(level=2)
        w.wake_up(["weights"])
        (a,) = refit_verify.audit(engine, mode="log")
        assert not a.ok and not refit_verify.certificate(engine)[0].ok
        assert refit(toy_weights(version), version=version).ok  # every parameter written: verified
        w.wake_up(["kv_cache"])
        assert refit_verify.audit(engine, mode="enforce")[0].ok and refit_verify.certificate(engine)[0].ok
    w.sleep(level=2)
    w.wake_up()
    with pytest.raises(refit_verify.RefitVerificationError, match="embed"):  # what it leaves holds discarded bytes
        refit({"norm": toy_weights(4)["norm"]}, version=4, partial=True)
    assert refit(toy_weights(5), version=5).ok
    w.sleep(level=1)
    w.wake_up()
    with pytest.raises(refit_verify.RefitVerificationError, match="changed outside any refit before this session"):
        refit(toy_weights(6), version=6)
