"""Kept launch plans replayed as CUDA graphs (``refit_verify.digest.kernels.replay``): the digests stay those
of the reference while the memory changes, launches interleave, two streams and two threads replay, a
work area is outgrown, graphs are released, a capture fails midway, or replay is turned off. Needs a
CUDA GPU (skipped without one: graphs are CUDA-only). Every test that expects replay asserts that a
graph was captured."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")]

if torch.cuda.is_available():
    from refit_verify.config import CUDA_GRAPHS_ENV_VAR
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.digest.kept import DigestSet
    from refit_verify.digest.kernels import replay


@pytest.fixture(autouse=True)
def _graphs_on(monkeypatch):
    """Replay on for each test: the opt-in env set, the torch gate opened (on torch < 2.12 the gate
    keeps replay off in production because other threads' CUDA random numbers break during a capture;
    no test here draws default-generator random numbers while capturing, and the failure that would
    leave the generator broken runs in a child process), the process-wide switch reset, and every
    graph dropped after the test."""
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "1")
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    yield
    replay.release_all()


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


def test_a_capture_failing_before_it_begins_turns_replay_off(monkeypatch, caplog):
    ts = _tensors(5)
    s = DigestSet(ts)
    s.digest()

    def broken(*_a, **_k):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", broken)
    with caplog.at_level("WARNING", logger="refit_verify"):
        assert s.digest() == [tensor_digest(t) for t in ts]
    assert replay._OFF is not None and _graph_of(s).graph is None
    assert sum("could not be captured" in r.getMessage() for r in caplog.records) == 1
    ts[1].view(-1)[0] += 1
    assert s.digest() == [tensor_digest(t) for t in ts]


def test_replay_off_runs_plain_launches(monkeypatch):
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "0")
    ts = _tensors(6)
    s = DigestSet(ts)
    for _ in range(3):
        assert s.digest() == [tensor_digest(t) for t in ts]
    assert _graph_of(s).graph is None


def _captured(*sets) -> None:
    for s in sets:
        assert isinstance(_graph_of(s).graph, replay.Graph), "no graph was captured"


def test_two_streams_replay_at_once_each_on_its_own_work_area():
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = DigestSet(_tensors(3)), DigestSet(_tensors(4))
    for s, st in ((a, s1), (b, s2)):
        with torch.cuda.stream(st):
            st.wait_stream(torch.cuda.default_stream())
            s.digest()
            s.digest()  # captured under st
    _captured(a, b)
    ga, gb = _graph_of(a).graph, _graph_of(b).graph
    assert ga.stream == s1.cuda_stream and gb.stream == s2.cuda_stream and ga.work is not gb.work
    want_a, want_b = [tensor_digest(t) for t in a.tensors], [tensor_digest(t) for t in b.tensors]
    torch.cuda.synchronize()
    with torch.cuda.stream(s1):
        torch.cuda._sleep(1 << 31)  # ~1 s of GPU time on s1
        la = a.launch()
    with torch.cuda.stream(s2):
        lb = b.launch()
    s2.synchronize()
    assert not s1.query()  # b's replay did not wait for s1: the two never share scratch
    with torch.cuda.stream(s2):
        lx = a.launch()  # a's graph belongs to s1: plain launches on s2, same digests
    torch.cuda.synchronize()
    assert DigestSet.collect(la) == want_a and DigestSet.collect(lb) == want_b and DigestSet.collect(lx) == want_a


def test_an_outgrown_work_area_stays_with_the_graphs_captured_on_it():
    small, large = DigestSet(_tensors(7)[:2]), DigestSet(_tensors(8))
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        s1.wait_stream(torch.cuda.default_stream())
        for s in (small, large):
            s.digest()
            s.digest()
    _captured(small, large)
    gs, gl = _graph_of(small).graph, _graph_of(large).graph
    assert gs.work is not gl.work and gl.work.numel() > gs.work.numel()  # the large plan needed a new area
    want = {id(s): [tensor_digest(t) for t in s.tensors] for s in (small, large)}
    got = []
    for r in range(8):  # interleaved: replays on s1, plain launches on s2 (another stream than the capture's)
        st = (s1, s2)[r % 2]
        with torch.cuda.stream(st):
            if r == 0:
                torch.cuda._sleep(1 << 28)
            for s in (small, large):
                got.append((id(s), s.launch()))
    torch.cuda.synchronize()
    for key, launched in got:
        assert DigestSet.collect(launched) == want[key]


def test_two_threads_capture_and_replay_on_one_device():
    sets = [DigestSet(_tensors(20 + i)) for i in range(4)]
    want = [[tensor_digest(t) for t in s.tensors] for s in sets]
    errors = []

    def work(mine):
        try:
            for _ in range(6):
                for i in mine:
                    assert sets[i].digest() == want[i]
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=([0, 1],)), threading.Thread(target=work, args=([2, 3],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and errors == []
    _captured(*sets)


def test_release_all_frees_the_graphs_memory_and_plans_capture_again():
    big = torch.randn(64 << 20, device="cuda", generator=torch.Generator(device="cuda").manual_seed(9))  # 256 MiB: ~32 chunks
    s = DigestSet([big])
    s.digest()
    s.digest()
    _captured(s)
    area = _graph_of(s).graph.work.numel() * 8
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert replay.release_all() >= 1
    assert _graph_of(s).graph is None and _graph_of(s).runs == 0
    assert torch.cuda.memory_allocated() <= before - area
    big.view(-1)[5] += 1
    for _ in range(3):  # plain, capture, replay
        assert s.digest() == [tensor_digest(big)]
    _captured(s)


def test_a_capture_with_a_different_result_than_plain_launches_is_not_used(monkeypatch, caplog):
    from refit_verify.digest.kernels import launch as kd

    ts = _tensors(11)
    s = DigestSet(ts)
    s.digest()
    real = kd._run

    def escapes(p, work, out, launch_fast):  # the chain kernel is missing from the capture: a partial graph
        return real(p, work, None if torch.cuda.is_current_stream_capturing() else out, launch_fast)

    monkeypatch.setattr(kd, "_run", escapes)
    monkeypatch.setattr(replay, "_LOGGED", set())
    with caplog.at_level("WARNING", logger="refit_verify"):
        assert s.digest() == [tensor_digest(t) for t in ts]
    assert _graph_of(s).graph is False and replay._OFF is None
    assert any("differ from plain launches" in r.getMessage() for r in caplog.records)


_MID_CAPTURE = r"""
import torch
from refit_verify.digest.batch import tensor_digest
from refit_verify.digest.kept import DigestSet
from refit_verify.digest.kernels import launch as kd, replay
replay._TORCH_OK = True  # the mechanics under test; the RNG outcome is asserted by torch version below
g = torch.Generator(device="cuda").manual_seed(7)
ts = [torch.randn((1024, 1024), generator=g, device="cuda"), torch.randn((4097,), generator=g, device="cuda").to(torch.bfloat16)]
want = [tensor_digest(t) for t in ts]
real = kd._run
def bad(*a, **k):
    if torch.cuda.is_current_stream_capturing():
        torch.cuda.synchronize()  # illegal while this thread captures (thread_local mode): invalidates the capture
    return real(*a, **k)
kd._run = bad
s = DigestSet(ts)
assert s.digest() == want
assert s.digest() == want  # the capture fails; plain launches
assert replay._OFF is not None, "the capture did not fail"
kd._run = real
x = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
del x
torch.cuda.synchronize()
before = torch.cuda.memory_reserved()
torch.cuda.empty_cache()
after = torch.cuda.memory_reserved()
assert after <= before - (256 << 20), ("empty_cache freed nothing: allocator still capturing", before, after)
t2 = ts[0] * 2
s2 = DigestSet([t2])
for _ in range(3):
    assert s2.digest() == [tensor_digest(t2)]
(_p, kept, _b, _l), = s2._groups
assert kept.graph is None and kept.runs == 3, "replay should be off for the whole process"
ts[1].view(-1)[0] += 1
assert s.digest() == [tensor_digest(t) for t in ts]
try:
    torch.randn(8, device="cuda").sum().item()
    rng = "ok"
except RuntimeError as e:
    rng = f"broken: {e}"
if replay.torch_supports_graphs():
    assert rng == "ok", rng
print("MID-CAPTURE-OK", torch.__version__, "rng", rng)
"""


def test_a_capture_failing_midway_leaves_the_allocator_usable_and_turns_replay_off():
    """In a child process: on torch < 2.12 the failed capture leaves the device's default generator
    in capture mode (why the gate exists), which would break later tests of this process."""
    import refit_verify

    src = os.path.dirname(os.path.dirname(refit_verify.__file__))
    env = dict(os.environ, REFIT_VERIFY_CUDA_GRAPHS="1", PYTHONPATH=os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, "-c", _MID_CAPTURE], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "MID-CAPTURE-OK" in r.stdout
