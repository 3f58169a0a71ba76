"""refit_verify.push against an engine no worker of which takes part: the engine's own error is
raised (not the sender's timeout it caused), within the sender's bound. No vLLM needed."""

from __future__ import annotations

import re
import time

import pytest
import torch

import refit_verify
from refit_verify.errors import RefitConfigError, RefitTimeoutError


@pytest.mark.parametrize("answer, says", [([], "refit_verify_receive through Engine answered for no worker"),
                                          (AttributeError("'Worker' object has no attribute 'refit_verify_receive'"),
                                           "is refit-verify installed in the vLLM engine's environment?")])
def test_a_push_no_worker_takes_part_in_raises_the_engines_error(answer, says):
    class Engine:
        def collective_rpc(self, method, args=(), timeout=None):
            if isinstance(answer, BaseException):
                raise answer
            return answer

    cfg = refit_verify.RefitConfig.build(mode="enforce", timeout_s=1.0, connect_timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(RefitConfigError, match=re.escape(says)) as ei:
        refit_verify.push(Engine(), {"w": torch.ones(4)}, config=cfg, options={"timeout_s": 1.0, "connect_timeout_s": 1.0})
    assert time.monotonic() - t0 < 10.0
    assert isinstance(ei.value.__cause__, RefitTimeoutError)  # the sender's view, kept as the cause


@pytest.mark.parametrize("bad", [-3, 2.0, "7", False])
def test_a_push_with_a_version_that_is_not_an_int_from_0_is_refused_before_anything_is_sent(bad):
    class Engine:
        def collective_rpc(self, method, args=(), timeout=None):  # never reached
            raise AssertionError(method)

    with pytest.raises(RefitConfigError, match="version must be an int >= 0"):
        refit_verify.push(Engine(), {"w": torch.ones(4)}, version=bad)
