"""bench_paths' memory plan, time estimate, floor and target (``benchmarks/_paths_plan.py``), and how the
report pairs engines' refits by the phases they shared (``benchmarks/_paths_report.py``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import _paths_plan as pp  # noqa: E402
from _paths_children import order_for  # noqa: E402
from _paths_report import matched  # noqa: E402
from _paths_worker import Reply  # noqa: E402

from refit_verify.testing import models  # noqa: E402

H100_GIB = 79.19  # what an 80 GB H100 reports
ENGINES = ("off", "enforce", "off-b")
PATHS_OF = {"inproc": ["boundary-per-param", "boundary-bucketed"], "mp": ["transport", "native-unpacked", "native-packed"]}


def _plan(model: str, total: float = H100_GIB, free: float | None = None, engines=ENGINES, paths_of=PATHS_OF, **kw) -> pp.Plan:
    s = pp.sizing(model, models.param_shapes(models.BENCH_LAYOUTS[model]))
    packed = max(64 << 20, -(-s.largest // 4096) * 4096)
    return pp.make_plan(s, device="cuda", total_gib=total, free_gib=total if free is None else free, kinds=list(paths_of),
                        engines=engines, paths_of=paths_of, staging_bytes=256 << 20, packed_bytes=packed, **kw)


def test_sizing_names_bytes_tensors_and_the_largest():
    s = pp.sizing("qwen3-8b-like", models.param_shapes(models.QWEN3_8B_LIKE))
    assert (s.nbytes, s.tensors, s.largest) == (16_381_470_720, 399, 151936 * 4096 * 2)


@pytest.mark.parametrize(("model", "levels", "phases"), [
    ("qwen3-0.6b-like", {"inproc": "all", "mp": "all"}, 1),
    ("qwen3-1.7b-like", {"inproc": "all", "mp": "all"}, 1),
    ("qwen3-4b-like", {"inproc": "kind", "mp": "kind"}, 2),
    ("qwen3-8b-like", {"inproc": "pairs", "mp": "single"}, 5),
])
def test_every_size_fits_an_80_gb_h100(model, levels, phases):
    p = _plan(model)
    assert p.levels == levels and len(p.phases) == phases
    assert p.peak_gib <= p.budget_gib
    live = {(e, k) for ph in p.phases for e, k in ph.live}
    assert live == {(e, k) for e in ENGINES for k in PATHS_OF}  # every engine runs in some phase
    assert p.why == "" and any(ln.startswith("- phases: ") for ln in p.lines)


def test_8b_plan_keeps_off_beside_off_b_and_runs_mp_one_engine_at_a_time():
    p = _plan("qwen3-8b-like")
    assert [ph.live for ph in p.phases] == [
        (("off", "inproc"), ("enforce", "inproc")), (("off", "inproc"), ("off-b", "inproc")),
        (("off", "mp"),), (("enforce", "mp"),), (("off-b", "mp"),)]
    # the engine's budget: weights + KV + activations, as a share of the device, rounded up
    assert p.engine_gib == pytest.approx(16_381_470_720 / 2**30 + pp.KV_GIB + pp.ENGINE_EXTRA_GIB)
    assert p.utilization == 0.21 and p.kv_bytes == pp.KV_GIB * 2**30


def test_a_size_that_does_not_fit_says_why_and_has_no_phases():
    p = _plan("qwen3-8b-like", total=30.0)
    assert p.levels == {"inproc": None, "mp": None} and p.phases == []
    assert "one engine at a time needs" in p.why and "does not fit" in "\n".join(p.lines)
    q = _plan("qwen3-8b-like", total=38.0)  # an inproc child fits alone, an mp child (its own engine process) does not
    assert q.levels == {"inproc": "single", "mp": None} and all(k == "inproc" for ph in q.phases for _, k in ph.live)
    assert q.why.startswith("mp: ")


def test_free_memory_not_total_decides():
    assert _plan("qwen3-1.7b-like", free=40.0).levels == {"inproc": "kind", "mp": "kind"}


def test_forced_level_and_no_control():
    p = _plan("qwen3-0.6b-like", level="pairs")
    assert p.forced and [ph.live for ph in p.phases][:2] == [(("off", "inproc"), ("enforce", "inproc")),
                                                             (("off", "inproc"), ("off-b", "inproc"))]
    q = _plan("qwen3-8b-like", engines=("off", "enforce"))
    assert q.levels == {"inproc": "kind", "mp": "single"}  # with two engines pairs is kind: never chosen after it
    assert all(len(ph.live) <= 2 for ph in q.phases)
    with pytest.raises(ValueError, match="unknown plan level"):
        pp.phases_of("both", ["mp"], ENGINES)


def test_given_utilization_is_kept():
    p = _plan("qwen3-0.6b-like", utilization=0.15)
    assert p.utilization == 0.15 and p.engine_gib == pytest.approx(0.15 * H100_GIB)


def test_estimate_counts_starts_rounds_and_stops():
    p = _plan("qwen3-4b-like")  # two phases of three engines
    serial = pp.estimate_s(p, paths_of=PATHS_OF, rounds=12, warmup=1, settle_s=0.0, parallel=False)
    parallel = pp.estimate_s(p, paths_of=PATHS_OF, rounds=12, warmup=1, settle_s=0.0, parallel=True)
    start = pp.START_S["cuda"] + pp.START_S_PER_GIB["cuda"] * p.sizing.gib
    refit = pp.REFIT_S["cuda"][0] + pp.REFIT_S["cuda"][1] * p.sizing.gib
    rounds = 13 * 3 * (2 + 3) * refit
    assert serial == pytest.approx(pp.FLOOR_S + 6 * start + rounds + 2 * pp.STOP_S)
    assert parallel == pytest.approx(pp.FLOOR_S + 2 * start * (1 + 2 * pp.PARALLEL_SHARE) + rounds + 2 * pp.STOP_S)
    single = _plan("qwen3-8b-like", paths_of={"mp": ["transport"]}, level="single")
    assert [len(ph.live) for ph in single.phases] == [1, 1, 1]
    kw = dict(paths_of={"mp": ["transport"]}, rounds=12, warmup=1, settle_s=0.0)
    assert pp.estimate_s(single, parallel=True, **kw) == pp.estimate_s(single, parallel=False, **kw)


def test_floor_target_and_verdict():
    fl = pp.floor_ms(nbytes=10**9, tensors=100, read_gbps=1000.0, launch_us=5.0)
    assert fl == pytest.approx(2.0 + 0.5)
    assert pp.target_ms(fl) == pytest.approx(6.0)
    assert pp.verdict(5.99, 6.0) == "met" and pp.verdict(6.0, 6.0) == "met"
    assert pp.verdict(8.5, 6.0) == "not met (2.50 ms over)"
    assert pp.verdict(float("nan"), 6.0) == "–"


def test_staging_ring_and_trainer_extras():
    s = pp.sizing("qwen3-8b-like", models.param_shapes(models.QWEN3_8B_LIKE))
    assert pp.staging_ring_bytes(s) == s.largest  # the 1.16 GiB embedding, above the 256 MiB floor
    small = pp.sizing("qwen3-shaped-small", models.param_shapes(models.QWEN3_0_6B_SHAPED_SMALL))
    assert pp.staging_ring_bytes(small) == small.nbytes  # never more than the set
    assert pp.trainer_extra_bytes(s, ["native-packed"], 256 << 20, 1 << 30) == 2 << 30
    assert pp.trainer_extra_bytes(s, ["boundary-per-param", "native-unpacked"], 256 << 20, 1 << 30) == 0


def _reps(*walls):
    return [Reply(op="run", ok=True, wall_s=w) for w in walls]


def test_matched_pairs_engines_over_shared_phases():
    res = {"p": {"off": _reps(1, 2, 3, 4), "enforce": _reps(5, 6), "off-b": _reps(7, 8)}}
    ph = {"p": {"off": [0, 0, 1, 1], "enforce": [0, 0], "off-b": [1, 1]}}
    off, enf, together = matched(res, ph, "p", "off", "enforce")
    assert together and [x.wall_s for x in off] == [1, 2] and [x.wall_s for x in enf] == [5, 6]
    off, b, together = matched(res, ph, "p", "off", "off-b")
    assert together and [x.wall_s for x in off] == [3, 4] and [x.wall_s for x in b] == [7, 8]
    single = {"p": {"off": [0, 0, 0, 0], "enforce": [1, 1], "off-b": [2, 2]}}
    off, enf, together = matched(res, single, "p", "off", "enforce")
    assert not together and len(off) == 4 and len(enf) == 2
    assert matched(res, None, "p", "off", "enforce")[2]


def test_order_for_rotates_three_and_alternates_two():
    three = ["off", "enforce", "off-b"]
    orders = [order_for(three, r, 0) for r in range(6)]
    for e in three:  # over 6 rounds each engine holds each place twice
        assert sorted(o.index(e) for o in orders) == [0, 0, 1, 1, 2, 2]
    assert order_for(["off", "enforce"], 0, 0) == ["off", "enforce"]
    assert order_for(["off", "enforce"], 1, 0) == ["enforce", "off"]
    assert order_for(["off"], 5, 2) == ["off"]


def _args(**kw):
    import argparse

    base = dict(model="tiny", device="cpu", no_replay=False, landed_cpu=False, rounds=2, warmup=1, control=True, settle_s=0.0,
                bucket_bytes=1 << 20, paths=["boundary-per-param"], trainer_copy=False, native_tensors=False,
                floor={"read_gbps": "20.0", "launch_us": "3.0", "where": "off/inproc"}, plan_lines=["- memory plan: x"],
                starts=["phase 1: 3 engines together in 9 s"], estimate_s=10.0)
    return argparse.Namespace(**{**base, **kw})


def _run(wall, own_ms):
    ph = {"open": 0.0, "add": 0.0, "m.model": 0.0, "close": own_ms / 1e3, "load_weights": wall / 2, "m.engine": 0.0,
          "snapshot": 0.0, "close_rest": 0.0, "gc": 0.0}
    return Reply(op="run", ok=True, wall_s=wall, phases=ph, counts={"verified": 21, "proven_bytes": 2**20})


def test_report_wall_table_gives_aa_floor_target_and_verdicts():
    from _paths_report import render

    cfg = models.load_config(models.packaged_config_dir())
    res = {"boundary-per-param": {"off": [_run(0.010, 0), _run(0.010, 0)], "enforce": [_run(0.014, 1.0), _run(0.014, 1.0)],
                                  "off-b": [_run(0.011, 0), _run(0.011, 0)]}}
    text = render(_args(), {}, cfg, res, {}, {}, {}, (0.0, 0.0, 0.0), 0.0, {}, None)
    head = next(ln for ln in text.splitlines() if ln.startswith("| path | off median"))
    row = next(ln for ln in text.splitlines() if ln.startswith("| boundary-per-param | 10.00"))
    assert head.count("|") == row.count("|") == 17  # 16 columns
    cells = [c.strip() for c in row.strip("|").split("|")]
    fl = pp.floor_ms(models.state_bytes(cfg), 21, 20.0, 3.0)
    assert cells[5] == "1.400" and cells[6] == "1.100"  # enforce/off, A/A
    assert cells[10] == f"{fl:.2f}" and cells[11] == f"{pp.target_ms(fl):.2f}"
    assert cells[12] == "met"  # own work 1 ms against about 1.1 ms
    assert cells[13] == f"not met ({4.0 - pp.target_ms(fl):.2f} ms over)"  # added 4 ms
    assert "torch.sum" in text and "phase 1: 3 engines together" in text
    missing = render(_args(floor={"error": "gone"}), {}, cfg, res, {}, {}, {}, (0.0, 0.0, 0.0), 0.0, {}, None)
    assert "floor not measured (gone)" in missing
    row = next(ln for ln in missing.splitlines() if ln.startswith("| boundary-per-param | 10.00"))
    assert [c.strip() for c in row.strip("|").split("|")][10:14] == ["–"] * 4
