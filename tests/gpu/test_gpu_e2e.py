"""The CPU end-to-end tests of tests/e2e/test_staged_path.py, on a CUDA engine staging through CUDA IPC.

Needs a CUDA GPU and a CUDA vLLM (0.26 on the H200 via ../shared/gpu-vllm/); skipped otherwise.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from refit_verify import RefitConfig  # noqa: E402
from refit_verify.cli.demo import push  # noqa: E402
from refit_verify.manifest import from_wire  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from refit_verify.transport import RefitSender  # noqa: E402
from tests.e2e.test_staged_path import engine  # noqa: E402,F401

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def device():
    return "cuda"


def _manifest(llm):
    return from_wire(llm.collective_rpc("refit_verify_session_manifest")[0]["manifest"])


def test_the_first_refit_replays_the_plan_learned_at_engine_start(engine, device):
    """The module's engine is fresh: its first refit replays the plan the worker learned dry when it
    prepared (vLLM's own loaders on placeholders), with the loader tap off; the read-back of where
    that plan says each tensor landed verifies every tensor. A second refit replays it again."""
    llm, cfg = engine
    for seed in (5, 6):
        weights = models.random_state_dict(cfg, seed=seed, device=device)
        with RefitSender(config=RefitConfig.build(mode="enforce", buffer_bytes=64 << 10, timeout_s=60.0), device=device) as s:
            report, _, _ = push(llm, s, weights, {"timeout_s": 60.0})
        assert not isinstance(report, BaseException), report
        assert report.ok and report.verified == len(weights) == 21
        man = _manifest(llm)
        m = man.modules["model"]
        assert m.replayed == len(weights) and m.replay_left is None, (m.replayed, m.replay_left)
        assert man.audits == [] and man.engine is not None and man.engine.proven_bytes > 0


from tests.e2e.test_staged_path import (  # noqa: E402,F401 - after the first-refit test: pytest runs them in this order
    test_clean_refit_enforce_verifies_and_loads,
    test_flipped_byte_named_exactly,
    test_log_mode_logs_and_continues,
    test_off_mode_computes_no_digests,
)
