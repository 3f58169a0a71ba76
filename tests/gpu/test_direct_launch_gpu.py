"""Kept plans launched straight through their compiled Triton kernels (``refit_verify.digest.kernels.direct``):
from the second run on no ``JITFunction.run`` dispatch happens, the digests stay those of the
reference while the memory changes, on another stream too, and with the switch off every run goes
through the JIT. Needs a CUDA GPU (skipped without one: the Triton interpreter has no compiled kernels)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

if torch.cuda.is_available():
    from refit_verify.config import CUDA_GRAPHS_ENV_VAR, DIRECT_LAUNCH_ENV_VAR
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.digest.kept import DigestSet
    from refit_verify.digest.kernels import direct, replay


@pytest.fixture(autouse=True)
def _plain(monkeypatch):
    """Graph replay off (direct launches are what is under test), direct launches on and not turned off."""
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "0")
    monkeypatch.delenv(DIRECT_LAUNCH_ENV_VAR, raising=False)
    monkeypatch.setattr(direct, "_OFF", None)
    monkeypatch.setattr(direct, "_KNOWN", {})  # each test starts with no kind checked (no warm-up ran)
    monkeypatch.setattr(direct, "_NO_KINDS", [False])


@pytest.fixture
def jit_calls(monkeypatch):
    """Count the launches that go through ``JITFunction.run``."""
    calls = []
    real = direct.jit

    def counting(launches):
        calls.extend(la.fn.__name__ if hasattr(la.fn, "__name__") else str(la.fn) for la in launches)
        return real(launches)

    monkeypatch.setattr(direct, "jit", counting)
    return calls


def _tensors(seed: int) -> list[torch.Tensor]:
    """Every kernel of a plan: a one-lane tensor, odd bytes, one leaf program, several chunks (8 MiB
    each: FAST and general leaf programs, upper and chain), bf16 and fp32."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    specs = [((1,), torch.float32), ((3, 5), torch.bfloat16), ((4096, 17), torch.bfloat16),
             ((1024, 1024), torch.float32), (((5 << 20) + 3,), torch.bfloat16)]
    return [torch.randn(shape, generator=g, device="cuda").to(dtype) for shape, dtype in specs]


def _reference(ts: list[torch.Tensor]) -> list[str]:
    """The digests on the CPU path (numba): independent of the CUDA launches under test (a CUDA
    ``tensor_digest`` runs kept plans through ``direct.run`` too)."""
    return [tensor_digest(t.cpu()) for t in ts]


def _plan_of(s: DigestSet):
    (_pos, kept, _backend, _large), = s._groups
    return kept


def test_from_the_second_run_no_jit_dispatch_and_the_reference_digests(jit_calls):
    ts = _tensors(1)
    s = DigestSet(ts)
    p = _plan_of(s)
    for r in range(6):
        ts[r % len(ts)].view(-1)[-1] += 1  # a change in place between runs: the direct launches read it
        want = _reference(ts)
        jit_calls.clear()
        assert s.digest() == want, f"run {r + 1}"
        if r >= 2:
            assert jit_calls == [], f"run {r + 1} went through the JIT"
    assert isinstance(p.direct, tuple) and len(p.direct[0]) == 4  # FAST leaf, general leaf, upper, chain
    assert p.runs == 6 and direct._OFF is None


def test_direct_launches_run_on_the_current_stream():
    ts = _tensors(2)
    s = DigestSet(ts)
    s.digest()
    s.digest()
    assert _plan_of(s).direct
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # the write lands late: a launch on any other stream would read the old bytes
        ts[3].mul_(-1)  # written on the side stream, read there in stream order
        launched = s.launch()
    side.synchronize()
    assert DigestSet.collect(launched) == _reference(ts)


def test_two_sets_interleaved_keep_their_own_kernels():
    a, b = _tensors(3), _tensors(4)[:3]
    sa, sb = DigestSet(a), DigestSet(b)
    for r in range(4):
        la, lb = sa.launch(), sb.launch()  # both in flight: each has its own scratch
        assert DigestSet.collect(lb) == _reference(b)
        assert DigestSet.collect(la) == _reference(a)
        a[0].add_(1)
        b[2].add_(1)
    assert _plan_of(sa).direct and _plan_of(sb).direct


def test_switched_off_every_run_goes_through_the_jit(monkeypatch, jit_calls):
    monkeypatch.setenv(DIRECT_LAUNCH_ENV_VAR, "0")
    ts = _tensors(5)
    s = DigestSet(ts)
    for _ in range(3):
        want = _reference(ts)
        jit_calls.clear()
        assert s.digest() == want
        assert len(jit_calls) == 4
    assert _plan_of(s).direct is None


def test_graph_capture_and_direct_launches_together(monkeypatch):
    """With graph replay on, the capture's launches and the check's plain run stay correct."""
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "1")
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    try:
        ts = _tensors(6)
        s = DigestSet(ts)
        for r in range(5):
            ts[r % len(ts)].view(-1)[0] += 1
            assert s.digest() == _reference(ts), f"run {r + 1}"
        assert _plan_of(s).graph
    finally:
        replay.release_all()


def test_a_checked_plan_captured_into_a_graph_later(monkeypatch):
    """Direct launches first (checked at run 2, direct at run 3), then graph replay turned on: the
    capture records the direct launches and the replays follow the memory."""
    ts = _tensors(7)
    s = DigestSet(ts)
    for _ in range(3):
        assert s.digest() == _reference(ts)
    assert _plan_of(s).direct and not _plan_of(s).graph
    monkeypatch.setenv(CUDA_GRAPHS_ENV_VAR, "1")
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    try:
        for r in range(4):
            ts[r % len(ts)].view(-1)[-1] -= 1  # the last element (the first tensor has one)
            assert s.digest() == _reference(ts), f"run {r + 4}"
        assert _plan_of(s).graph
    finally:
        replay.release_all()


def test_the_warmup_makes_the_direct_launch_check_and_a_direct_launch(monkeypatch):
    """The kernel warm-up runs its plan through the direct-launch check (a device comparison, whose
    kernels load at a process's first use) and one direct launch: neither is a refit's first cost."""
    from refit_verify.digest import backends

    checked, launched = [], []
    real_direct, real_run = direct.direct, direct.run

    def spy_run(p, launches, work, out):
        before = p.direct
        real_run(p, launches, work, out)
        if before is None and p.direct:
            checked.append(p)

    def spy_direct(compiled, launches, stream):
        launched.append(len(launches))
        return real_direct(compiled, launches, stream)

    monkeypatch.setattr(direct, "run", spy_run)
    monkeypatch.setattr(direct, "direct", spy_direct)
    backends._warmup_kernels(torch.device("cuda", torch.cuda.current_device()))
    # the plain plan checked at its second run; the COPY and gather plans: their new kinds checked at theirs
    assert [p.runs for p in checked] == [backends._WARM_RUNS, direct.MIN_RUNS, direct.MIN_RUNS]
    assert len(launched) == 4  # the plain plan's check and third run, the variants' checks
    fns = {k[0].__name__ for k in direct._KNOWN}
    assert fns == {"_leaf_fast_kernel", "_digest_leaf_kernel", "_digest_upper_kernel", "_digest_chain_kernel",
                   "_digest_gather_kernel"}
    assert {dict(k[2]).get("COPY") for k in direct._KNOWN if k[0].__name__ == "_leaf_fast_kernel"} == {False, True}


def test_after_the_warmup_a_new_plan_launches_directly_from_its_first_run(jit_calls):
    """Plans of other sizes, counts and dtypes than the warm-up's (other integers, other plan tensors):
    no JIT dispatch at their first run, and the reference digests, run after run."""
    from refit_verify.digest import backends

    backends._warmup_kernels(torch.device("cuda", torch.cuda.current_device()))
    for seed, n in ((11, 5), (12, 3), (13, 1)):
        ts = _tensors(seed)[-n:]
        s = DigestSet(ts)
        for r in range(3):
            ts[0].view(-1)[0] += 1
            jit_calls.clear()
            assert s.digest() == _reference(ts), f"{n} tensors, run {r + 1}"
            assert jit_calls == [], f"{n} tensors, run {r + 1} went through the JIT"
        assert _plan_of(s).direct


def test_integers_are_not_what_triton_specialises_on(monkeypatch):
    """What the kinds rest on: Triton's JIT gives plans of other counts and offsets the same compiled
    kernel for the same function, constexprs and options (every run through the JIT here)."""
    monkeypatch.setenv(DIRECT_LAUNCH_ENV_VAR, "0")
    seen = []
    real = direct.jit

    def recording(launches):
        compiled = real(launches)
        seen.extend(zip(launches, compiled))
        return compiled

    monkeypatch.setattr(direct, "jit", recording)
    for seed, n in ((21, 5), (22, 2), (23, 1)):
        ts = _tensors(seed)[-n:]
        assert DigestSet(ts).digest() == _reference(ts)
    kernels, ints = {}, {}
    for la, ck in seen:
        key = (la.fn, la.consts, tuple(sorted((la.options or {}).items())))
        kernels.setdefault(key, set()).add(id(ck))
        ints.setdefault(key, set()).add(tuple(a for a in la.args if isinstance(a, int)))
    assert len(kernels) >= 4 and all(len(v) == 1 for v in kernels.values())
    assert all(len(v) > 1 for v in ints.values())  # other integers did reach every kernel
