"""One call for a colocated refit over refit-verify's own staged transport.

:func:`push` runs :meth:`RefitSender.send <refit_verify.transport.RefitSender.send>` in a thread of
this process while every vLLM worker receives through ``collective_rpc("refit_verify_receive")``,
waits for both with a bound, and re-raises the sender's error in the caller.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_verify.config import RefitConfig, check_version
from refit_verify.digest import backends as _backends
from refit_verify.errors import RefitConfigError, RefitTimeoutError
from refit_verify.report import VerificationReport
from refit_verify.trainer.channel import require_channel
from refit_verify.transport.sender import RefitSender

__all__ = ["PushResult", "push"]

RECEIVE_METHOD = "refit_verify_receive"
GRACE_S = 30.0
"""Seconds allowed beyond ``timeout_s`` for the workers' answer and the sender thread's end."""


@dataclass
class PushResult:
    """What one :func:`push` did.

    Attributes:
        report: the sender's verification report (None when the mode is ``off``).
        workers: every worker's ``refit_verify_receive`` result (rank, tensors, bytes, digest_s, ...).
        seconds: wall time of the push.
    """

    report: VerificationReport | None
    workers: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.report is None or self.report.ok


def push(engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
         sender: RefitSender | None = None, config: RefitConfig | None = None, device: str | torch.device | None = None,
         options: Mapping[str, Any] | None = None, version: int | None = None) -> PushResult:
    """Push one refit into ``engine`` through the staged transport and verify it.

    Args:
        engine: a ``vllm.LLM`` (or anything :mod:`refit_verify.trainer.channel` reaches) whose workers run
            the refit-verify plugin; one worker (TP=1). For TP=N use one
            :class:`~refit_verify.transport.RefitSender` per trainer rank (``docs/scale.md``).
        named_tensors: ``(name, tensor)`` pairs or a mapping (a ``state_dict``), HF names.
        sender: a sender to reuse across refits; default one made for this push and closed after.
        config: the sender's :class:`~refit_verify.config.RefitConfig` when ``sender`` is None
            (default: mode from ``REFIT_VERIFY``, 120 s timeouts).
        device: staging device when ``sender`` is None (default: the first tensor's).
        options: receiver options passed to the workers (``timeout_s``, ``connect_timeout_s``);
            default the sender's timeouts.
        version: the weight version (the trainer's step, an int >= 0), carried to every worker
            (:meth:`RefitSender.send <refit_verify.transport.RefitSender.send>`): a worker that already
            closed this version or a newer one reports this push as stale (a failure: ``enforce``
            raises). None (default): unversioned, never out of order.

    Returns:
        PushResult: the report (``enforce`` never returns a failing one), worker results, seconds.

    Raises:
        RefitVerificationError: ``enforce`` and the engine's manifest differs (names the parameters).
        RefitTimeoutError: the workers or the sender did not finish within the bound.
        RefitConfigError: ``version`` is neither None nor an int >= 0 (before anything is sent); the
            engine lacks refit-verify's plugin or answered for no worker (raised
            once the sender, which no receiver reached, gave up: after ``timeout_s``).
        RefitConfigError, RefitProtocolError, RefitReceiveError: as :meth:`RefitSender.send`.
    """
    version = check_version(version)
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else named_tensors
    own = sender is None
    if own:
        sender = RefitSender(config=config, device=device)
    cfg = sender.config
    if cfg.mode.verifies:
        _backends.start_warmup(sender.device)  # once per device: this push's digests wait for it, later ones find them compiled
    opts = dict(options or {"timeout_s": cfg.timeout_s, "connect_timeout_s": cfg.connect_timeout_s})
    bound = max(cfg.timeout_s, cfg.connect_timeout_s, float(opts.get("timeout_s", 0)), float(opts.get("connect_timeout_s", 0))) + GRACE_S
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["report"] = sender.send(items, version=version)
        except BaseException as e:  # noqa: BLE001 - handed back to the caller, re-raised there
            out["error"] = e

    ch = require_channel(engine)
    t0 = time.perf_counter()
    th = threading.Thread(target=run, name="refit-verify-push", daemon=True)
    th.start()
    try:
        workers = ch.call(RECEIVE_METHOD, sender.endpoint, opts, timeout_s=bound)
    except BaseException as worker_error:
        th.join(bound)
        if isinstance(worker_error, RefitConfigError):  # no worker took part (no plugin, none answered): the sender only timed out
            raise worker_error from out.get("error")
        if "error" in out:  # the sender's view (e.g. "receiver disconnected"), caused by the workers' own error
            raise out["error"] from worker_error
        raise
    finally:
        if own and not th.is_alive():
            sender.close()
    th.join(bound)
    if th.is_alive():
        raise RefitTimeoutError(f"refit-verify push: the sender did not finish within {bound:g} s after the workers answered",
                                {"waiting_for": "sender"})
    if own:
        sender.close()
    if "error" in out:
        raise out["error"]
    return PushResult(out.get("report"), list(workers), time.perf_counter() - t0)
