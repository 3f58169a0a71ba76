"""The CPU end-to-end tests of tests/e2e/test_staged_path.py, on a CUDA engine staging through CUDA IPC.

Needs a CUDA GPU and a CUDA vLLM (0.26 on the H200 via ../shared/gpu-vllm/); skipped otherwise.
"""

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("vllm")

from tests.e2e.test_staged_path import (  # noqa: E402,F401
    engine,
    test_clean_refit_enforce_verifies_and_loads,
    test_flipped_byte_named_exactly,
    test_log_mode_logs_and_continues,
    test_off_mode_computes_no_digests,
)

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


@pytest.fixture(scope="module")
def device():
    return "cuda"
