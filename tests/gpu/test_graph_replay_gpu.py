"""Kept launch plans replayed as CUDA graphs (``refit_verify.kernels.replay``): the digests stay those
of the reference while the memory changes, launches interleave, two streams replay, a capture
fails, or replay is turned off. Needs a CUDA GPU (skipped without one: graphs are CUDA-only)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")]


@pytest.fixture(autouse=True)
def _graphs_on(monkeypatch):
    """Graph replay and the copies' pool are opt-in (``REFIT_VERIFY_CUDA_GRAPHS=1``): on for these tests."""
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")

if torch.cuda.is_available():
    from refit_verify.config import CUDA_GRAPHS_ENV_VAR
    from refit_verify.digest import tensor_digest
    from refit_verify.digest_set import DigestSet
    from refit_verify.kernels import replay


def _tensors(seed: int) -> list[torch.Tensor]:
    """Sizes across the kernels' paths: a one-lane tensor, odd bytes, one leaf program, several
    chunks (8 MiB each), bf16 and fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    specs = [((1,), torch.float32), ((3, 5), torch.bfloat16), ((4096, 17), torch.bfloat16),
             ((1024, 1024), torch.float32), (((5 << 20) + 3,), torch.bfloat16)]
    return [torch.randn(shape, generator=g, device="cuda").to(dtype) for shape, dtype in specs]


def _graph_of(s: DigestSet):
    (_pos, kept, _backend, _large), = s._groups
    return kept


def test_replays_follow_the_memory_and_equal_the_reference():
    ts = _tensors(1)
    s = DigestSet(ts)
    for r in range(6):  # run 1 plain, run 2 captures, then replays
        ts[r % len(ts)].view(-1)[0] += 1  # a change in place between runs: the replay reads it
        assert s.digest() == [tensor_digest(t) for t in ts], f"run {r + 1}"
    p = _graph_of(s)
    assert p.runs == 6 and isinstance(p.graph, replay.Graph)


def test_a_result_is_never_overwritten_by_a_later_replay():
    ts = _tensors(2)
    s = DigestSet(ts)
    s.digest()
    s.digest()  # captured
    assert isinstance(_graph_of(s).graph, replay.Graph)
    first = [tensor_digest(t) for t in ts]
    a = s.launch()
    ts[0].view(-1)[0] += 1  # in stream order, after replay a, before replay b
    b = s.launch()
    second = [tensor_digest(t) for t in ts]
    assert first != second
    assert DigestSet.collect(a) == first
    assert DigestSet.collect(b) == second


def test_two_streams_replay_one_work_area_in_turn():
    sets = [DigestSet(_tensors(3)), DigestSet(_tensors(4))]
    want = [[tensor_digest(t) for t in s.tensors] for s in sets]
    for s in sets:
        s.digest()
        s.digest()
        assert isinstance(_graph_of(s).graph, replay.Graph)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    launched = []
    for r in range(8):
        with torch.cuda.stream(streams[r % 2]):
            launched.append((r % 2, sets[r % 2].launch()))
    torch.cuda.synchronize()
    for i, got in launched:
        assert DigestSet.collect(got) == want[i]


def test_a_failed_capture_leaves_the_plan_on_plain_launches(monkeypatch, caplog):
    ts = _tensors(5)
    s = DigestSet(ts)
    s.digest()

    def broken(*_a, **_k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", broken)
    with caplog.at_level("WARNING", logger="refit_verify"):
        assert s.digest() == [tensor_digest(t) for t in ts]
    assert _graph_of(s).graph is False
    assert any("could not be captured" in r.getMessage() for r in caplog.records)
    ts[1].view(-1)[0] += 1
    assert s.digest() == [tensor_digest(t) for t in ts]


def test_replay_off_runs_plain_launches(monkeypatch):
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "0")
    ts = _tensors(6)
    s = DigestSet(ts)
    for _ in range(3):
        assert s.digest() == [tensor_digest(t) for t in ts]
    assert _graph_of(s).graph is None
