"""The bookkeeping of direct launches (``refit_verify.digest.kernels.direct``) with stand-in kernels on the CPU:
the check at a plan's second run, a missed or wrong launch caught by it, a launcher that raises, the
switch, misaligned scratch; kinds of launch checked once and launched directly from a later plan's
first run, and Triton's parameters as the kinds read them. The real kernels launched directly are in
``tests/gpu/test_direct_launch_gpu.py`` (bit-identical digests, no JIT dispatch after the check)."""

from __future__ import annotations

import logging

import pytest
import torch

from refit_verify.digest.kernels import direct


class _Compiled:
    """Stands in for a Triton ``CompiledKernel``: ``compiled[grid](*args, stream=...)``."""

    def __init__(self, body, log):
        self.body, self.log = body, log

    def __getitem__(self, grid):
        grid = (grid[0], grid[1], grid[2])  # as Triton's CompiledKernel.__getitem__ reads it

        def runner(*args, stream=None):
            self.log.append(("direct", self.body.__name__, stream))
            self.body(*args)
        return runner


class _Jit:
    """Stands in for a ``JITFunction``: ``fn[grid](*args, **constexprs, **options)`` runs and returns a compiled kernel."""

    def __init__(self, body, log, compiled_body=None):
        self.body, self.log = body, log
        self.compiled = _Compiled(compiled_body or body, log)

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("jit", self.body.__name__, tuple(sorted(kw))))
            consts = [v for k, v in kw.items() if k.isupper()]
            self.body(*args, *consts)
            return self.compiled
        return run


def leaf(src, work, scale):
    work.copy_(src * scale)


def chain(work, out):
    out.copy_(work.sum().expand_as(out))


def leaf_skipped(src, work, scale):  # a launcher that launches nothing
    pass


def leaf_wrong(src, work, scale):
    work.copy_(src * (scale + 1))


_CURRENT = [torch.device("cpu")]  # the stand-in for the current CUDA device


class _Plan:
    def __init__(self):
        self.runs, self.direct, self.device = 0, None, torch.device("cpu")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(direct, "_OFF", None)
    monkeypatch.setattr(direct, "_LOGGED", set())
    monkeypatch.setattr(direct, "_KNOWN", {})
    monkeypatch.setattr(direct, "_NO_KINDS", [False])
    monkeypatch.setattr(direct, "_stream", lambda device: 7)
    monkeypatch.setattr(direct, "_on_device", lambda device: _CURRENT[0] == device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.delenv("REFIT_VERIFY_DIRECT_LAUNCH", raising=False)


def _setup(log, leaf_compiled=None):
    src = torch.arange(8, dtype=torch.int64)
    work, out = torch.zeros(8, dtype=torch.int64), torch.zeros((1, 2), dtype=torch.int64)
    launches = [direct.Launch(_Jit(leaf, log, leaf_compiled), (8,), (src, work), (("SCALE", 3),), {"num_warps": 4}),
                direct.Launch(_Jit(chain, log), (1,), (work, out))]
    return src, work, out, launches


def _checked(log):
    """A plan run twice: checked, its next runs go straight to the compiled kernels."""
    src, work, out, launches = _setup(log)
    p = _Plan()
    _run(p, launches, work, out)
    _run(p, launches, work, out)
    assert p.direct
    return src, work, out, launches, p


def _run(p, launches, work, out):
    p.runs += 1  # as kernels.digest.run_plan counts them (through kernels.replay)
    out.zero_()
    direct.run(p, launches, work, out)
    return out.clone()


def test_the_second_run_checks_then_later_runs_go_straight_to_the_compiled_kernels():
    log = []
    src, work, out, launches = _setup(log)
    p = _Plan()
    assert _run(p, launches, work, out).tolist() == [[84, 84]]
    assert [e[0] for e in log] == ["jit", "jit"] and p.direct is None  # run 1: JIT only, not checked
    assert log[0][2] == ("SCALE", "num_warps")  # constexprs and options as keywords to JITFunction.run
    log.clear()
    assert _run(p, launches, work, out).tolist() == [[84, 84]]
    assert [e[0] for e in log] == ["jit", "jit", "direct", "direct"]  # run 2: JIT result returned, direct checked
    assert p.direct[0] == [launches[0].fn.compiled, launches[1].fn.compiled]
    src.add_(1)  # the memory changes: the direct launches read it as it is now
    log.clear()
    assert _run(p, launches, work, out).tolist() == [[108, 108]]
    assert log == [("direct", "leaf", 7), ("direct", "chain", 7)]  # constexprs passed positionally, on the current stream


def chain_skipped(work, out):  # the last launch does nothing: only the probe's sentinel can show it
    pass


@pytest.mark.parametrize(("leaf_body", "chain_body"), [(leaf_skipped, None), (leaf_wrong, None), (None, chain_skipped),
                                                       (leaf_skipped, chain_skipped)])
def test_a_direct_launch_that_misses_or_differs_keeps_that_plan_on_jit(caplog, leaf_body, chain_body):
    log = []
    src, work, out, launches = _setup(log, leaf_compiled=leaf_body)
    if chain_body is not None:
        launches[1].fn.compiled.body = chain_body
    p = _Plan()
    _run(p, launches, work, out)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        assert _run(p, launches, work, out).tolist() == [[84, 84]]  # the JIT result stands
    assert p.direct is False and direct._OFF is None  # this plan only
    assert "gave other words through its compiled kernels than through the JIT" in caplog.text
    log.clear()
    assert _run(p, launches, work, out).tolist() == [[84, 84]]
    assert [e[0] for e in log] == ["jit", "jit"]


def test_a_launcher_that_raises_turns_direct_launches_off_for_the_process(caplog):
    log = []

    def leaf_raising(*args):
        raise TypeError("function takes exactly 2 arguments (3 given)")

    src, work, out, launches = _setup(log, leaf_compiled=leaf_raising)
    p = _Plan()
    _run(p, launches, work, out)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        assert _run(p, launches, work, out).tolist() == [[84, 84]]
    assert p.direct is False and "TypeError" in direct._OFF
    assert "JIT launches from now on" in caplog.text
    q = _Plan()  # another plan: never checked while off
    for _ in range(3):
        assert _run(q, launches, work, out).tolist() == [[84, 84]]
    assert q.direct is None


def test_a_launcher_that_raises_after_the_check_reruns_the_whole_plan_through_jit():
    log = []
    src, work, out, launches, p = _checked(log)

    def chain_raising(*args):
        raise RuntimeError("launch failed")

    launches[1].fn.compiled.body = chain_raising  # the first direct launch runs, the second raises
    src.add_(2)
    log.clear()
    assert _run(p, launches, work, out).tolist() == [[132, 132]]
    assert [e[0] for e in log] == ["direct", "direct", "jit", "jit"] and p.direct is False and direct._OFF


def test_switched_off_misaligned_or_without_an_output_block_it_stays_on_jit(monkeypatch):
    log = []
    src, work, out, launches = _setup(log)
    monkeypatch.setenv("REFIT_VERIFY_DIRECT_LAUNCH", "0")
    p = _Plan()
    for _ in range(3):
        _run(p, launches, work, out)
    assert p.direct is None and all(e[0] == "jit" for e in log)
    monkeypatch.setenv("REFIT_VERIFY_DIRECT_LAUNCH", "1")
    _run(p, launches, work, out)
    assert p.direct  # checked at the next run once on again
    log.clear()
    monkeypatch.setenv("REFIT_VERIFY_DIRECT_LAUNCH", "off")
    _run(p, launches, work, out)
    assert [e[0] for e in log] == ["jit", "jit"]  # read at each run
    monkeypatch.delenv("REFIT_VERIFY_DIRECT_LAUNCH")
    odd = torch.zeros(9, dtype=torch.int64)[1:]  # 8 bytes past a 16-byte boundary
    assert odd.data_ptr() % 16 == 8
    mis = [launches[0]._replace(args=(src, odd)), direct.Launch(launches[1].fn, (1,), (odd, out))]
    log.clear()
    p.runs += 1
    direct.run(p, mis, odd, out)
    assert [e[0] for e in log] == ["jit", "jit"] and out.tolist() == [[84, 84]]
    log.clear()
    q = _Plan()
    for _ in range(3):
        q.runs += 1
        direct.run(q, launches[:1], work, None)  # roots left in the work area (chunk_roots): never direct
    assert q.direct is None and [e[0] for e in log] == ["jit"] * 3


def test_no_check_while_a_graph_is_being_captured(monkeypatch):
    log = []
    src, work, out, launches = _setup(log)
    p = _Plan()
    _run(p, launches, work, out)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    _run(p, launches, work, out)
    assert p.direct is None  # a synchronising check cannot run inside a capture: checked at a later run
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    _run(p, launches, work, out)
    assert p.direct


def test_a_launch_shaped_otherwise_than_at_the_check_goes_through_the_jit():
    """A module constant changed since the check (a constexpr, an option, the grid): the compiled
    kernel of the check is not the one the JIT would pick, so the run goes through the JIT."""
    log = []
    src, work, out, launches, p = _checked(log)
    other = torch.arange(8, dtype=torch.int64)
    for changed in (launches[0]._replace(consts=(("SCALE", 4),)), launches[0]._replace(options={"num_warps": 8}),
                    launches[0]._replace(grid=(16,)), launches[0]._replace(args=(other, work)),  # another input tensor
                    launches[0]._replace(args=(src.to(torch.int32), work))):  # another dtype
        log.clear()
        got = _run(p, [changed, launches[1]], work, out)
        assert [e[0] for e in log] == ["jit", "jit"]
        if changed.consts != launches[0].consts:
            assert got.tolist() == [[112, 112]]  # what the JIT's kernel for SCALE=4 computes
    log.clear()
    _run(p, launches, work, out)
    assert [e[0] for e in log] == ["direct", "direct"]  # the checked shape again: direct


def test_a_jit_run_while_another_device_is_current_is_not_compared_with_the_kinds():
    """The JIT loads its kernels for the current device: other objects than the plan's device's,
    which must not empty the table."""
    log = []
    src, work, out, launches, p = _checked(log)
    _CURRENT[0] = torch.device("meta")
    try:
        launches[0].fn.compiled = _Compiled(leaf, log)  # what the other device's JIT hands back
        q = _Plan()
        q.direct = False
        direct.run(q, launches, work, out)
    finally:
        _CURRENT[0] = torch.device("cpu")
    assert len(direct._KNOWN) == 2 and not direct._NO_KINDS[0]


def test_a_run_while_another_device_is_current_goes_through_the_jit():
    """The compiled kernels were loaded on the plan's device: with another device current, the JIT
    (which loads for the current device) runs them; nothing is checked there either."""
    log = []
    src, work, out, launches, p = _checked(log)
    q = _Plan()
    _CURRENT[0] = torch.device("meta")
    try:
        log.clear()
        assert _run(p, launches, work, out).tolist() == [[84, 84]]
        assert [e[0] for e in log] == ["jit", "jit"] and p.direct
        for _ in range(3):
            _run(q, launches, work, out)
        assert q.direct is None
    finally:
        _CURRENT[0] = torch.device("cpu")
    log.clear()
    _run(p, launches, work, out)
    assert [e[0] for e in log] == ["direct", "direct"]


def test_a_plan_whose_launches_are_of_checked_kinds_launches_directly_from_its_first_run():
    """Another plan of the same kernels, constexprs, options and argument types (other tensors, same
    integers: the stand-ins have no Triton parameter list, so their integers are kept by value)."""
    log = []
    src, work, out, launches, p = _checked(log)
    src2 = torch.arange(8, dtype=torch.int64) * 2
    work2, out2 = torch.zeros(8, dtype=torch.int64), torch.zeros((1, 2), dtype=torch.int64)
    second = [launches[0]._replace(args=(src2, work2)), launches[1]._replace(args=(work2, out2))]
    q = _Plan()
    log.clear()
    assert _run(q, second, work2, out2).tolist() == [[168, 168]]
    assert log == [("direct", "leaf", 7), ("direct", "chain", 7)] and q.direct
    # a kind never checked (another constexpr): JIT at the first run, checked at the second
    third = [launches[0]._replace(args=(src2, work2), consts=(("SCALE", 5),)), launches[1]._replace(args=(work2, out2))]
    r = _Plan()
    log.clear()
    assert _run(r, third, work2, out2).tolist() == [[280, 280]]
    assert [e[0] for e in log] == ["jit", "jit"] and r.direct is None


def test_a_failed_check_teaches_no_kind():
    log = []
    src, work, out, launches = _setup(log, leaf_compiled=leaf_wrong)
    p = _Plan()
    _run(p, launches, work, out)
    _run(p, launches, work, out)
    assert p.direct is False and direct._KNOWN == {}
    q = _Plan()
    log.clear()
    assert _run(q, launches, work, out).tolist() == [[84, 84]]
    assert [e[0] for e in log] == ["jit", "jit"]


def test_triton_giving_another_kernel_for_a_known_kind_empties_the_table(caplog):
    """The kinds must be at least as fine as Triton's cache key: a JIT launch of a known kind that
    returns another compiled kernel ends launching plans directly before their own check."""
    log = []
    src, work, out, launches, p = _checked(log)
    assert len(direct._KNOWN) == 2
    launches[0].fn.compiled = _Compiled(leaf, log)  # Triton now picks another kernel for the same kind
    q = _Plan()
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        direct.run(q, [launches[0]._replace(options={"num_warps": 8}), launches[1]], work, out)  # a JIT run...
        assert direct._KNOWN  # ...of another kind: nothing compared
        direct.run(q, launches, work, out)  # q went direct from its first run: no JIT run to compare
        assert q.direct and q.direct[2]  # from the table
    r = _Plan()
    r.direct = False  # stays on the JIT: its runs are compared with the table
    direct.run(r, launches, work, out)
    assert direct._KNOWN == {} and direct._NO_KINDS[0]
    assert "another compiled kernel for a kind of digest launch" in caplog.text
    assert "Kind (" in caplog.text and "the checked kernel" in caplog.text  # what tells them apart, for the report
    assert p.direct and not p.direct[2]  # checked on its own: stays direct
    log.clear()
    q.runs = direct.MIN_RUNS
    direct.run(q, launches, work, out)  # direct from the table emptied since: JIT, and its own check now
    assert [e[0] for e in log] == ["jit", "jit", "direct", "direct"] and q.direct and not q.direct[2]
    s_ = _Plan()
    log.clear()
    _run(s_, launches, work, out)
    assert [e[0] for e in log] == ["jit", "jit"] and s_.direct is None  # checked at its own second run again
    _run(s_, launches, work, out)
    assert s_.direct and direct._KNOWN == {}


class _Param:
    def __init__(self, do_not_specialize=False, is_constexpr=False):
        self.do_not_specialize, self.is_constexpr = do_not_specialize, is_constexpr


class _Fn:
    def __init__(self, *params):
        self.params = list(params)


def test_a_kind_keeps_what_triton_specialises_on():
    dev = torch.device("cuda", 0)
    fn = _Fn(_Param(), _Param(do_not_specialize=True), _Param(), _Param(is_constexpr=True))
    t = torch.zeros(4, dtype=torch.int64)
    kind = lambda *args, consts=(), options=None: direct._kind(direct.Launch(fn, (1,), args, consts, options), dev)  # noqa: E731
    base = kind(t, 5, 7)
    assert base == (fn, 0, (), (), ((torch.int64, True), "i32", ("=", 7)))
    assert kind(torch.ones(4, dtype=torch.int64), 2**31 - 1, 7) == base  # another tensor, an i32 count: same kind
    assert kind(t, 2**31, 7)[-1][1] == "i64" and kind(t, -(2**31) - 1, 7)[-1][1] == "i64"
    assert kind(t, 2**63, 7)[-1][1] == "u64" and kind(t, -(2**31), 7)[-1][1] == "i32"
    assert kind(t, 2**64, 7) is None and kind(t, True, 7) is None and kind(t, 1.5, 7) is None
    assert kind(t, 5, 8) != base  # a specialised integer: its value
    assert kind(t.to(torch.int32), 5, 7) != base and kind(torch.zeros(9, dtype=torch.int64)[1:], 5, 7) != base
    assert kind(t, 5, 7, consts=(("B", 1),)) != base and kind(t, 5, 7, options={"num_warps": 2}) != base
    assert kind(t, 5, 7, 1) is None  # a positional argument at a constexpr parameter
    assert direct._kind(direct.Launch(fn, (1,), (t, 5, 7)), torch.device("cuda", 1)) != base


def test_describing_a_kernel_for_the_log_never_raises():
    """The warning that empties the table describes both kernels; an attribute that raises leaves a
    placeholder, never an error in the launch path."""
    class Raising:
        @property
        def src(self):
            raise RuntimeError("driver gone")

    class Src:
        signature, constants, attrs = {"tab_ptr": "*i64", "V": "i32"}, {}, {}

    class Kernel:
        hash, src = "abc123", Src()

    assert direct._describe(Raising()) == "<not described: RuntimeError>"
    assert "'hash': 'abc123'" in direct._describe(Kernel()) and "'V': 'i32'" in direct._describe(Kernel())
