"""Digest backends are chosen once per device type, fall back loudly, and never change a digest.

``refit_verify.digest.backends.choose`` picks numba for CPU tensors (after a probe against the reference),
the Triton kernels for kernel device types, the torch path otherwise; a fallback logs one WARNING
naming the reason and the speed cost, and adding tensors afterwards imports nothing.
"""

from __future__ import annotations

import builtins
import logging
import sys
import threading

import pytest
import torch

import refit_verify
from refit_verify.digest import tensors  # noqa: E402
from refit_verify import tensor_digest
from refit_verify.digest import _torch as _torch_digest
from refit_verify.digest import backends
from refit_verify.digest import batch as digest
from refit_verify.digest import reference
from tests.support.warmups import check_warm_paths, forget_warmups

nd = pytest.importorskip("refit_verify.digest._numba")


def _tensors(n: int = 60) -> list[tuple[str, torch.Tensor]]:
    """``n`` small tensors of several dtypes, shapes, views and byte tails (names t0..)."""
    g = torch.Generator().manual_seed(8)
    out = []
    for i in range(n):
        raw = torch.randint(0, 256, (8 * (i % 7) + 40 + i % 5,), dtype=torch.uint8, generator=g)
        t = [raw, raw[1:].view(-1, 1), raw[: raw.numel() // 2 * 2].view(torch.bfloat16),
             raw[: raw.numel() // 4 * 4].view(torch.float32)[::2]][i % 4]
        out.append((f"t{i}", t))
    return out


def _reference(named: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    out = {}
    for n, t in named:
        u8 = digest.logical_bytes(t)
        out[n] = reference.digest_bytes(u8.numpy().tobytes(), tensors.dtype_name(t.dtype), tuple(t.shape))
    return out


@pytest.fixture
def fresh_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the backends chosen so far (restored after the test)."""
    monkeypatch.setattr(backends, "_CHOSEN", {})


def _count_imports(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    names: list[str] = []
    real = builtins.__import__

    def spy(name, *a, **kw):
        names.append(name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", spy)
    return names


def test_cpu_backend_is_numba_and_adds_import_nothing(fresh_choice, monkeypatch, caplog) -> None:
    named = _tensors()
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        b = backends.backend_for("cpu")
    assert (b.name, b.fallback_reason, b.digest_views) == ("numba", None, None)
    assert b.digest_words is nd.digest_words and b.chunk_roots_u8 is nd.chunk_roots_u8
    assert backends.backend_for("cpu") is b  # chosen once
    assert not caplog.records
    batch = digest.DigestBatch()
    imports = _count_imports(monkeypatch)
    for n, t in named:
        batch.add(n, t)
    got = batch.hexdigests()
    monkeypatch.undo()
    assert imports == []
    assert got == _reference(named)


def test_numba_missing_falls_back_to_torch_once(fresh_choice, monkeypatch, caplog) -> None:
    """numba unimportable: the torch path digests every tensor, one WARNING in all, same digests."""
    named = _tensors()
    want = _reference(named)
    monkeypatch.setitem(sys.modules, "refit_verify.digest._numba", None)  # import now fails
    monkeypatch.delattr(refit_verify, "_numba_digest", raising=False)
    monkeypatch.delattr(sys.modules["refit_verify.digest"], "_numba", raising=False)  # imported by an earlier test
    calls = []
    real = _torch_digest.digest_words
    monkeypatch.setattr(_torch_digest, "digest_words", lambda u8, seeds: calls.append(u8.numel()) or real(u8, seeds))
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        for _ in range(3):  # three batches, 180 tensors
            batch = digest.DigestBatch()
            for n, t in named:
                batch.add(n, t)
            assert batch.hexdigests() == want
        assert tensor_digest(named[0][1]) == want["t0"]
    assert backends.backend_for("cpu").name == "torch"
    assert len(calls) == 3 * len(named) + 1
    msgs = [r.getMessage() for r in caplog.records if r.name == "refit_verify"]
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith("refit-verify digests cpu tensors with the torch path: numba is unavailable (ModuleNotFoundError: import of refit_verify.digest._numba halted")
    assert "about 60x slower (0.2-0.3 GB/s against 14-33 GB/s with numba on 2 cores)" in msgs[0]
    assert caplog.records[0].levelno == logging.WARNING


def test_numba_failing_its_probe_falls_back(fresh_choice, monkeypatch, caplog) -> None:
    """A numba path that runs but gives another value than the reference is not used."""
    monkeypatch.setattr(nd, "digest_words", lambda u8, seeds: (0, 0))
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        b = backends.backend_for("cpu")
    assert b.name == "torch" and "RuntimeError: probe digest (0, 0) differs from the reference" in b.fallback_reason
    assert len(caplog.records) == 1
    t = torch.arange(100, dtype=torch.int16)
    assert tensor_digest(t) == _reference([("t", t)])["t"]


def test_kernels_missing_falls_back_to_torch(fresh_choice, monkeypatch, caplog) -> None:
    """A kernel device type whose Triton kernels cannot be imported takes the torch path, loudly."""
    monkeypatch.setitem(sys.modules, "refit_verify.digest.kernels.launch", None)
    if "refit_verify.digest.kernels" in sys.modules:  # imported by an earlier test: drop its attribute too
        monkeypatch.delattr(sys.modules["refit_verify.digest.kernels"], "launch", raising=False)
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        b = backends.backend_for("cpu")
        assert backends.backend_for("cpu") is b
    assert b.name == "torch" and b.digest_words is _torch_digest.digest_words
    assert "the Triton kernels are unavailable (ModuleNotFoundError: import of refit_verify.digest.kernels.launch halted" in b.fallback_reason
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    named = _tensors(8)
    assert digest.digest_tensors(named) == _reference(named)


def test_other_device_types_take_torch_quietly(fresh_choice, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        b = backends.choose("xpu", False)
    assert (b.name, b.fallback_reason) == ("torch", None)
    assert not caplog.records


# --------------------------------------------------------------------------- warm-up


@pytest.fixture
def fresh_warmups(monkeypatch: pytest.MonkeyPatch) -> None:
    forget_warmups(monkeypatch)


def test_the_cpu_warmup_leaves_numbas_functions_compiled() -> None:
    """In a fresh process: nothing compiled before, every function the CPU digests call compiled after,
    the batched path both as planned (read-only arrays) and relocated (a kept set run where its strings
    moved: the addresses a writable array, which numba specialises apart); running them compiles nothing more."""
    import subprocess

    code = ("import torch\n"
            "from refit_verify.digest import _numba as nd, _numba_many as nm, backends\n"
            "fns = (nd.digest_lanes, nm.digest_many)\n"
            "before = [len(f.signatures) for f in fns]\n"
            "backends.warmup_cpu()\n"
            "after = [len(f.signatures) for f in fns]\n"
            "z = torch.arange(64, dtype=torch.uint8)\n"
            "plan = nm.plan_many([(z.data_ptr(), 21, (1, 2)), (z.data_ptr() + 24, 5, (3, 4))])\n"
            "nm.run_many(plan), nm.run_many(plan, [z.data_ptr() + 8, z.data_ptr() + 32])\n"
            "print(before, after, [len(f.signatures) for f in fns])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.split("\n")[0] == "[0, 0] [1, 2] [1, 2]", out


def test_a_digest_that_comes_during_the_warmup_waits_for_it(fresh_warmups, monkeypatch) -> None:
    """The warm-up is held by an Event; a digest started meanwhile blocks in choose() until it ends."""
    started, release, waiting = threading.Event(), threading.Event(), threading.Event()
    order: list[str] = []

    def held_warmup():
        started.set()
        assert release.wait(30)
        order.append("warm-up done")

    real_wait = backends.wait_for_warmup

    def wait(device_type, timeout_s=None):
        waiting.set()
        real_wait(device_type, timeout_s)

    monkeypatch.setattr(backends, "warmup_cpu", held_warmup)
    monkeypatch.setattr(backends, "wait_for_warmup", wait)
    w = backends.start_warmup("cpu")
    assert w is not None and w.device == torch.device("cpu") and started.wait(30)
    t = torch.arange(100, dtype=torch.int16)
    got: list[str] = []
    th = threading.Thread(target=lambda: (got.append(tensor_digest(t)), order.append("digest")))
    th.start()
    assert waiting.wait(30)  # the digest reached the warm-up's gate ...
    assert th.is_alive() and order == []  # ... and stays there
    release.set()
    th.join(30)
    assert order == ["warm-up done", "digest"] and got == [_reference([("t", t)])["t"]]
    assert w.done.is_set() and w.error is None and w.backend == "numba" and backends._WARMING == {}
    assert backends.start_warmup("cpu") is w  # once per device per process


def test_a_failing_warmup_is_logged_once_and_digests_still_work(fresh_warmups, monkeypatch, caplog) -> None:
    def broken():
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(backends, "warmup_cpu", broken)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        w = backends.start_warmup("cpu")
        assert w.done.wait(30)
        assert backends.start_warmup("cpu") is w  # not retried, not logged again
        t = torch.arange(50, dtype=torch.float32)
        assert tensor_digest(t) == _reference([("t", t)])["t"]
    assert isinstance(w.error, RuntimeError)
    assert [r.getMessage() for r in caplog.records] == [
        "refit-verify: the digest warm-up on cpu failed (RuntimeError: no compiler here); the first refit compiles the digests itself"]


def test_a_warmup_that_outlasts_its_bound_is_waited_for_no_more(fresh_warmups, monkeypatch, caplog) -> None:
    release = threading.Event()
    monkeypatch.setattr(backends, "warmup_cpu", lambda: release.wait(30))
    w = backends.start_warmup("cpu")
    try:
        with caplog.at_level(logging.WARNING, logger="refit_verify"):
            backends.wait_for_warmup("cpu", timeout_s=0)
            backends.wait_for_warmup("cpu", timeout_s=0)
        assert backends._WARMING == {} and not w.done.is_set()
        assert [r.getMessage() for r in caplog.records] == [
            "refit-verify: the digest warm-up on cpu still runs after 0 s; digests no longer wait for it"]
    finally:
        release.set()
    assert w.done.wait(30)


def test_no_warmup_when_switched_off_and_none_after_one_in_the_callers_thread(fresh_warmups, monkeypatch) -> None:
    monkeypatch.setenv("REFIT_VERIFY_WARMUP", "0")
    assert backends.start_warmup("cpu") is None and backends._WARMUPS == {}
    monkeypatch.delenv("REFIT_VERIFY_WARMUP")
    assert backends.warmup("cpu") == "numba"
    w = backends.start_warmup("cpu")
    assert w.done.is_set() and w.thread is None and backends._WARMING == {}


def test_the_kernel_warmup_takes_every_launch_of_a_run(fresh_warmups, monkeypatch) -> None:
    """The views the kernel warm-up runs need the fast leaf, general leaf, upper and chain launches
    (each a Triton specialisation of its own; none specialises on a view's address or length), again
    as COPY variants (the sender's fused copy into staging), and the gather of a derived view (a
    close's region beside its fused parameter): none of them compiles inside a refit."""
    kd = pytest.importorskip("refit_verify.digest.kernels.launch")
    if not kd._INTERPRETED:
        pytest.skip("CPU views need TRITON_INTERPRET=1 (CUDA: tests/gpu)")
    from refit_verify.digest.kernels import _leaf, _upper

    ran = []

    def run_plan(p):
        work = torch.empty(1, dtype=torch.int64)
        ran.append((p.copy, p.G > 0, {la.fn for la in kd._launches(p, work, torch.empty((p.V, 2), dtype=torch.int64))}))
        return torch.zeros((p.V, 2), dtype=torch.int64)

    monkeypatch.setattr(kd, "run_plan", run_plan)
    monkeypatch.setattr(backends, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(backends, "_PATHS", [])  # the kernels' runs only (the refit paths' warm-up: tests/stream, tests/gpu)
    assert backends.warmup("cpu") == "triton"
    every = {_leaf._leaf_fast_kernel, _leaf._digest_leaf_kernel, _upper._digest_upper_kernel, _upper._digest_chain_kernel}
    # plain; COPY variants (the same functions, COPY a constexpr); a derived view's gather
    plain = (False, False, every)
    assert ran == [plain] * backends._WARM_RUNS + [(True, False, every), (False, True, every | {_upper._digest_gather_kernel})]
    from refit_verify.digest.kernels import direct
    assert backends._WARM_RUNS == direct.MIN_RUNS + 1  # the check, then a direct launch, before any refit


def test_a_gpu_warmup_warms_the_cpu_digests_too(fresh_warmups, monkeypatch) -> None:
    """A GPU worker digests host tensors too (the read-back's): its warm-up starts the CPU's, each in a thread of its own."""
    warmed = []
    monkeypatch.setattr(backends, "warmup", lambda device=None: warmed.append(str(device)) or "stub")
    w = backends.start_warmup("cuda:0")
    assert w.done.wait(30) and backends._WARMUPS["cpu"].done.wait(30)
    assert sorted(warmed) == ["cpu", "cuda:0"] and backends.start_warmup("cuda:0") is w



def test_a_kernel_variant_failing_its_warmup_leaves_the_plain_kernels_warm(fresh_warmups, monkeypatch, caplog) -> None:
    """The COPY and derived-view runs of the kernel warm-up are each tried on their own: one that
    raises is logged (the first refit that uses it compiles it), and the warm-up still succeeds."""
    kd = pytest.importorskip("refit_verify.digest.kernels.launch")
    if not kd._INTERPRETED:
        pytest.skip("CPU views need TRITON_INTERPRET=1 (CUDA: tests/gpu)")
    ran = []

    def run_plan(p):
        if p.copy:
            raise RuntimeError("no COPY kernel here")
        ran.append(p.G > 0)
        return torch.zeros((p.V, 2), dtype=torch.int64)

    monkeypatch.setattr(kd, "run_plan", run_plan)
    monkeypatch.setattr(backends, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    monkeypatch.setattr(backends, "_PATHS", [])  # the kernels' runs only (the refit paths' warm-up: tests/stream, tests/gpu)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        assert backends.warmup("cpu") == "triton"
    assert ran == [False] * backends._WARM_RUNS + [True]  # the plain runs and the derived one
    assert any("warming the COPY digest kernels on cpu failed (RuntimeError: no COPY kernel here)" in r.getMessage() for r in caplog.records)


def test_the_refit_paths_warm_up_on_a_kernel_device_through_the_kernels(fresh_warmups, monkeypatch, caplog) -> None:
    """On a kernel device (CUDA; here the CPU through the Triton interpreter, the same code), the warm
    paths run a verifying Packer whose grouped tensors all go through the fused COPY kernels and
    digest_now's first sight / moved / expected-ahead sets (:func:`check_warm_paths`; GPU:
    tests/gpu/test_fused_copy_gpu.py)."""
    kd = pytest.importorskip("refit_verify.digest.kernels.launch")
    if not kd._INTERPRETED:
        pytest.skip("CPU views need TRITON_INTERPRET=1 (CUDA: tests/gpu)")
    monkeypatch.setattr(backends, "KERNEL_DEVICE_TYPES", frozenset({"cuda", "cpu"}))
    check_warm_paths(monkeypatch, caplog, "cpu")
