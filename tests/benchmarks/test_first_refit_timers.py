"""bench_first_refit's ``--timers`` table (``benchmarks/bench_first_refit.py``): the rows where the first
three refits differ, the first refit's excess first."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from bench_first_refit import _timer_rows  # noqa: E402


def test_rows_differing_by_time_or_calls_sorted_by_the_first_refits_excess():
    timed = [
        {"worker: open": [0.0010, 1], "worker: close": [0.0050, 1], "trainer: send": [0.0020, 1], "worker: jit": [0.0004, 4]},
        {"worker: open": [0.0004, 1], "worker: close": [0.00498, 1], "trainer: send": [0.0020, 1], "worker: jit": [0.0004, 4]},
        {"worker: open": [0.0003, 1], "worker: close": [0.0050, 1], "trainer: send": [0.0020, 1], "gc: every collection": [0.0002, 1]},
    ]
    rows = _timer_rows(timed)
    assert rows[0] == "timer: ms (calls) in refits 1..3, first minus last"
    body = [r.split() for r in rows[1:]]
    # open: 0.7 ms more in the first; jit: same time, but calls 4, 4, 0; gc: only in the third; close: within 0.03 ms, left out
    assert [b[-1] for b in body] == ["open", "jit", "collection"]
    assert body[0][:7] == ["+0.700", "1.000", "(1)", "0.400", "(1)", "0.300", "(1)"]
    assert body[1][:7] == ["+0.400", "0.400", "(4)", "0.400", "(4)", "0.000", "(0)"]
    assert body[2][0] == "-0.200"
    assert not any("send" in r or "close" in r for r in rows)


def test_fewer_than_three_refits_compare_what_there_is():
    rows = _timer_rows([{"a": [0.002, 1]}, {"a": [0.001, 1]}])
    assert rows[0].endswith("refits 1..2, first minus last") and rows[1].split()[:5] == ["+1.000", "2.000", "(1)", "1.000", "(1)"]


def _run(own: list[float], walls: list[float]) -> dict:
    return {"start_s": 40.0, "walls": walls, "own": own, "crit": own, "parts": [[0.001] * 7, [0.0005] * 7]}


def test_the_table_so_far_holds_the_settings_with_runs_and_their_medians():
    from types import SimpleNamespace

    from bench_first_refit import _table

    a = SimpleNamespace(model="tiny-llama", refits=4, fresh_caches=False, rollouts=0)
    names = ["enforce, warm-up on", "enforce, warm-up on, trainer cold"]
    got = {names[0]: [_run([0.005, 0.004, 0.002, 0.002], [0.020, 0.016, 0.015, 0.015]),
                      _run([0.006, 0.004, 0.003, 0.002], [0.024, 0.018, 0.016, 0.014])],
           names[1]: []}  # the call's bound came before its first run
    lines = _table(got, names, a, "cpu")
    assert "2 rounds, 4 refits each (medians), pushes back to back" in lines[0]
    assert _table(got, names, SimpleNamespace(**{**vars(a), "rollouts": 64}), "cpu")[0].endswith(
        ", 64 tokens x 8 prompts generated before every push")
    rows = [x for x in lines if x.startswith("| enforce")]
    assert len(rows) == 2 and all(names[1] + " |" not in r for r in rows)  # its table row and its split row, none for the other
    cells = [c.strip() for c in rows[0].split("|")[1:-1]]
    # medians: 1st 22.0, 2nd 17.0, last 14.5 ms; own 5.5 / 4.0 ms, per-run ratio median (1.25 + 1.5) / 2, control (0.5 + 0.75) / 2
    assert cells[2:5] == ["22.0", "17.0", "14.5"] and cells[7:10] == ["5.5 / 4.0", "1.38", "0.62"]
