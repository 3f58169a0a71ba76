"""A fresh real vLLM engine's first refit replays the plan its worker learned at engine start.

The engine is in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the tiny Llama; on CPU it keeps plain
linear weights (tests/support/plugins.py) and the landing digests are switched on for this module
(``placement.DERIVE_DEVICE_TYPES``), as on a CUDA worker, before the engine starts: the worker's
prepare (a background thread after the model loads) learns the plan dry from vLLM's own loaders, builds
the first close's read-back program and keeps its snapshot as the first close's baseline. On the GPU
machine ``tests/gpu/test_gpu_e2e.py`` checks the same on CUDA.
"""

from __future__ import annotations

import time

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.manifest import from_wire  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import TINY_LLAMA_BYTES, in_process_engine  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    if torch.cuda.is_available():
        pytest.skip("CPU engine test; tests/gpu/test_gpu_e2e.py checks the first refit on CUDA")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
        with in_process_engine(tmp_path_factory, "cpu") as got:
            yield got


def _prepared(llm, timeout_s: float = 60.0):
    from refit_verify.vllm_plugin.worker_sessions import boundary_of

    wb = boundary_of(llm.llm_engine.model_executor.driver_worker.worker)
    deadline = time.monotonic() + timeout_s
    while wb.start is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return wb


def _manifest(llm):
    return from_wire(llm.collective_rpc("refit_verify_session_manifest")[0]["manifest"])


def test_the_first_refit_of_a_fresh_engine_replays_the_plan_learned_at_its_start(engine):
    llm, model, cfg = engine
    wb = _prepared(llm)
    b = wb.modules["model"]
    assert wb.start is not None and wb.last is None, "the worker's prepare did not run"
    assert b.plan is not None and len(b.plan) == 21 and b.layout is not None
    assert b._index.kept["read_back"][0] is b.plan  # the first close's read-back program, built at prepare
    conf = refit_verify.RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0)
    for v in (1, 2):
        w = models.random_state_dict(cfg, seed=v, device="cpu")
        res = refit_verify.push(llm, w, config=conf)
        man = _manifest(llm)
        m = man.modules["model"]
        assert res.report.ok and res.report.verified == 21 and res.report.proven_bytes == TINY_LLAMA_BYTES, res.report
        assert m.replayed == 21 and m.replay_left is None and len(m.in_place) == 21, (v, m.replayed, m.replay_left)
        assert man.audits == [] and man.reads.passes == 1, (man.audits, man.reads)
    assert wb.start is None  # dropped at the first close


def test_a_flipped_byte_after_the_first_replays_is_named(engine):
    """A byte flipped in a staged slot while the plan learned at the start replays is named."""
    from refit_verify.cli.demo import OneByteFlipSender

    llm, model, cfg = engine
    conf = refit_verify.RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0)
    target = "model.layers.0.mlp.down_proj.weight"
    w = models.random_state_dict(cfg, seed=9, device="cpu")
    with OneByteFlipSender(config=conf, device="cpu", target=target, byte_index=7) as tx:
        with pytest.raises(RefitVerificationError) as ei:
            refit_verify.push(llm, w, sender=tx)
    assert tx.flipped and list(ei.value.report.mismatched) == [target]
