"""Shadow work on CUDA (``refit_verify.trainer.overlap``): the helper thread runs on the caller's current device
and stream, so the digests it launches are ordered with what the caller queued before and after.
Needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from refit_verify.digest.batch import tensor_digest
from refit_verify.trainer.exports import StreamDigests
from refit_verify.trainer.overlap import run_in_shadow

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams)")]


def test_the_work_runs_on_the_callers_current_stream():
    side = torch.cuda.Stream()
    seen = {}
    with torch.cuda.stream(side):
        run_in_shadow(lambda: None, lambda: seen.update(stream=torch.cuda.current_stream(), device=torch.cuda.current_device()))
    assert seen["stream"] == side and seen["device"] == side.device.index
    run_in_shadow(lambda: None, lambda: seen.update(stream=torch.cuda.current_stream()))
    assert seen["stream"] == torch.cuda.current_stream()  # the default stream again, as the caller's


def test_deferred_parameters_digested_in_the_shadow_read_the_bytes_queued_before():
    """The caller queues a write on its side stream, then the shadow work digests: stream order makes
    the digest read the written bytes (a helper on another stream could read the old ones)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    ps = {f"p{i}": torch.nn.Parameter(torch.randn(1024, 1024, device="cuda", generator=g, dtype=torch.bfloat16),
                                      requires_grad=False) for i in range(6)}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    s = StreamDigests(hold_parameters=True)
    s.defer_held = True
    with torch.cuda.stream(side):
        for n, p in ps.items():
            s.add(n, p)
        torch.cuda._sleep(50_000_000)  # a long kernel first: a digest not ordered after it would read early
        fresh = {n: torch.full_like(p, i + 1) for i, (n, p) in enumerate(ps.items())}
        for n, p in ps.items():
            p.data.copy_(fresh[n])  # through .data: no version bump, so these are the bytes the digest must read
        run_in_shadow(lambda: None, lambda: s.drain(collect=True, shadow=True))
    torch.cuda.synchronize()
    assert s.deferred == 0 and s.drain_s > 0
    assert s.digests() == {n: tensor_digest(fresh[n]) for n in ps}
