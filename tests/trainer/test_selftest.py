"""refit_verify.selftest's checks before any refit, and its bad input. The refits themselves run
against a real engine (tests/e2e/test_selftest.py); here the engine is a fake. No vLLM needed."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

import refit_verify
from refit_verify.errors import RefitConfigError, RefitInputError, SelftestError
from tests.support.toy_model import ToyEngine

W = {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(16, dtype=torch.float32), "c": torch.ones(16)}


def _engine(answer):
    return ToyEngine(answer={"refit_verify_session_manifest": answer})


@pytest.mark.parametrize("weights, kw, err, says", [
    ({}, {}, RefitInputError, "weights is empty"),
    ([("a", [1.0])], {}, RefitInputError, "weights item 0 is not a (name: str, tensor) pair"),
    ("ab", {}, RefitInputError, "weights must be a mapping or an iterable"),
    (W, {"target": "nope"}, RefitConfigError, "target 'nope' is not one of the weights' names"),
    (W, {"target": "a", "byte_index": 8}, RefitConfigError, "byte_index must be an int from 0 to 7 (the bytes of a)"),
    (W, {"byte_index": True}, RefitConfigError, "byte_index must be an int"),
    ({"z": torch.ones(0)}, {}, RefitInputError, "target 'z' has no bytes to corrupt"),
    (W, {"mode": "on"}, RefitConfigError, "mode='on' is not accepted"),
    (W, {"timeout_s": 0}, RefitConfigError, "timeout_s"),
])
def test_bad_input_is_refused_before_the_engine_is_touched(weights, kw, err, says):
    eng = _engine(AssertionError("not called"))
    with pytest.raises(err, match=re.escape(says)):
        refit_verify.selftest(eng, weights, **kw)
    assert eng.calls == []


def test_off_runs_nothing_and_never_passes():
    eng = _engine(AssertionError("not called"))
    res = refit_verify.selftest(eng, W, mode="off")
    assert not res.passed and res.problems == ("REFIT_VERIFY is off: the self-test did not run",) and eng.calls == []
    assert (res.target, res.byte_index, res.tensors, res.bytes) == ("b", 32, 3, 8 + 64 + 64)  # the largest, the first of equals


NOT_VERIFYING = {"rank": 0, "verifying": False, "reason": "REFIT_VERIFY=off in this vLLM worker"}


@pytest.mark.parametrize("answer, says", [
    ([NOT_VERIFYING], "vLLM worker rank 0 does not verify (REFIT_VERIFY=off in this vLLM worker): set REFIT_VERIFY in the "
                      "engine's environment and install refit-verify there"),
    ([{"rank": 0, "verifying": True, "manifest": None, "open": "s9"}],
     "vLLM worker rank 0 has refit session 's9' open: the self-test runs before the job's refits, not during one"),
    ([], "asking the engine's workers whether they verify failed: RefitConfigError: refit-verify: refit_verify_session_manifest "
         "through ToyEngine answered for no worker"),
    (AttributeError("'Worker' object has no attribute 'refit_verify_session_manifest'"),
     "asking the engine's workers whether they verify failed: RefitConfigError: refit-verify: refit_verify_session_manifest "
     "failed through ToyEngine"),
])
def test_an_engine_that_does_not_verify_fails_the_selftest_before_any_refit(caplog, answer, says):
    eng = _engine(answer)
    with pytest.raises(SelftestError) as ei:
        refit_verify.selftest(eng, W, mode="enforce")
    res = ei.value.result
    assert not res.passed and res.problems[0].startswith(says) and res.checked == () and res.caught is None
    assert eng.calls == ["refit_verify_session_manifest"]  # no refit was tried
    assert str(ei.value) == "refit-verify selftest failed: " + "; ".join(res.problems)
    assert pickle.loads(pickle.dumps(ei.value)).result == res
    with caplog.at_level("WARNING", logger="refit_verify"):
        res = refit_verify.selftest(eng, W, mode="log")
    assert not res.passed and f"refit-verify selftest FAILED: {says}" in caplog.text


def test_an_engine_that_reaches_no_workers_is_refused():
    with pytest.raises(RefitConfigError, match="refit-verify cannot reach the vLLM workers through object"):
        refit_verify.selftest(object(), W, mode="log")


def test_an_engine_of_several_workers_is_refused():
    w = {"rank": 0, "verifying": True, "manifest": None, "open": None}
    with pytest.raises(RefitConfigError, match="serves an engine of one worker; this engine has 2"):
        refit_verify.selftest(_engine([w, {**w, "rank": 1}]), W, mode="enforce")
