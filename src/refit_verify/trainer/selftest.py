"""Does verification work on this engine? One call at job start: :func:`selftest`.

.. code-block:: python

    refit_verify.selftest(llm, model.state_dict())   # enforce: raises SelftestError when it does not

Against the live engine it checks, in order: every worker verifies (refit-verify's plugin loaded,
``REFIT_VERIFY`` set there); a refit of ``weights`` with one staged byte of one tensor flipped after
the sender digested it is refused and names exactly that tensor; a clean refit of ``weights``
verifies; every worker's certificate then says its engine holds that refit's state. The clean
refit runs last, so the engine is left holding ``weights``, verified. Both refits go through
:func:`refit_verify.push` in ``enforce`` (the worker checks each tensor before loading it), which
serves an engine of one worker.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from refit_verify.config import RefitConfig, VerifyMode, mode_from_env
from refit_verify.errors import RefitConfigError, RefitError, RefitInputError, RefitVerificationError, SelftestError
from refit_verify.manifest import Certificate
from refit_verify.report import VerificationReport
from refit_verify.trainer.audits import certificate
from refit_verify.trainer.channel import require_channel
from refit_verify.trainer.push import push
from refit_verify.transport.faults import OneByteFlipSender
from refit_verify.transport.sender import RefitSender

logger = logging.getLogger("refit_verify")

__all__ = ["SelftestResult", "selftest"]


@dataclass(frozen=True)
class SelftestResult:
    """What :func:`selftest` checked and found.

    Attributes:
        passed: every check held (never True when a check did not run).
        checked: what was checked and held, one sentence each.
        problems: what failed or could not run, one sentence each (empty when passed).
        target: the tensor whose staged byte was flipped. byte_index: which of its bytes.
        caught: ``target`` when the corrupted refit named exactly it, else None.
        workers: workers of the engine. tensors / bytes: what each refit pushed (bytes: logical bytes).
        timings: seconds of ``"workers"`` (the check that every worker verifies), ``"corrupted"`` and
            ``"clean"`` (each refit), ``"certificate"`` and ``"total"``; a step that did not run is absent.
        report: the clean refit's report (None when it did not run or raised).
        certificates: every worker's certificate after the clean refit.
    """

    passed: bool
    checked: tuple[str, ...]
    problems: tuple[str, ...]
    target: str
    byte_index: int
    caught: str | None
    workers: int
    tensors: int
    bytes: int
    timings: Mapping[str, float] = field(default_factory=dict)
    report: VerificationReport | None = field(default=None, repr=False)
    certificates: tuple[Certificate, ...] = field(default=(), repr=False)

    def describe(self) -> str:
        """One paragraph: passed and what was checked, or what failed."""
        if self.passed:
            return f"refit-verify selftest passed in {self.timings.get('total', 0.0):.2f} s: " + "; ".join(self.checked)
        return "refit-verify selftest FAILED: " + "; ".join(self.problems) + (
            f" (what held: {'; '.join(self.checked)})" if self.checked else "")


def _items(weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(weights, (str, bytes)) or not isinstance(weights, (Mapping, Iterable)):
        raise RefitInputError(f"weights must be a mapping or an iterable of (name, tensor) pairs, got {type(weights).__name__}")
    items = list(weights.items()) if isinstance(weights, Mapping) else list(weights)
    for i, it in enumerate(items):
        if not (isinstance(it, tuple) and len(it) == 2 and isinstance(it[0], str) and isinstance(it[1], torch.Tensor)):
            raise RefitInputError(f"weights item {i} is not a (name: str, tensor) pair: {it!r:.80}")
    if not items:
        raise RefitInputError("weights is empty: the self-test pushes the weights the engine holds (at job start, the "
                              "trainer's state dict) and needs at least one tensor")
    return items


def _target(items: list[tuple[str, torch.Tensor]], target: str | None, byte_index: int | None) -> tuple[str, int]:
    sizes = {n: t.numel() * t.element_size() for n, t in items}
    if target is None:
        target = max(sizes, key=sizes.__getitem__)  # the largest tensor (the first of equals)
    elif target not in sizes:
        raise RefitConfigError(f"target {target!r} is not one of the weights' names")
    if sizes[target] == 0:
        raise RefitInputError(f"target {target!r} has no bytes to corrupt")
    if byte_index is None:
        byte_index = sizes[target] // 2
    if isinstance(byte_index, bool) or not isinstance(byte_index, int) or not 0 <= byte_index < sizes[target]:
        raise RefitConfigError(f"byte_index must be an int from 0 to {sizes[target] - 1} (the bytes of {target}), got {byte_index!r}")
    return target, byte_index


class _Run:
    """One self-test's steps, each recording what held (``checked``) or failed (``problems``)."""

    def __init__(self, engine: Any, items: list[tuple[str, torch.Tensor]], target: str, byte_index: int, timeout_s: float) -> None:
        self.engine, self.items, self.target, self.byte_index, self.timeout_s = engine, items, target, byte_index, timeout_s
        self.config = RefitConfig.build(mode="enforce", timeout_s=timeout_s, connect_timeout_s=timeout_s)
        self.checked: list[str] = []
        self.problems: list[str] = []
        self.timings: dict[str, float] = {}
        self.workers = 0
        self.caught: str | None = None
        self.report: VerificationReport | None = None
        self.certificates: tuple[Certificate, ...] = ()

    def _step(self, key: str, what: str, fn: Callable[[], Any]) -> tuple[Any, bool]:
        """``(fn(), True)``, timed under ``timings[key]``; a refit-verify error becomes a problem
        about ``what`` and ``(None, False)``."""
        t0 = time.perf_counter()
        try:
            return fn(), True
        except RefitVerificationError as e:
            self.problems.append(f"{what} did not verify: {e.report.describe()}")
        except RefitError as e:  # no plugin in the engine, no worker answered, no answer in time, ...
            self.problems.append(f"{what} failed: {type(e).__name__}: {e}")
        finally:
            self.timings[key] = time.perf_counter() - t0
        return None, False

    def workers_verify(self) -> bool:
        """Every worker verifies and has no session open; the engine has one worker (what push serves)."""
        ch = require_channel(self.engine)  # an engine that reaches no workers is bad input, raised as it is
        answers, done = self._step("workers", "asking the engine's workers whether they verify",
                                   lambda: ch.call("refit_verify_session_manifest", timeout_s=self.timeout_s))
        if not done:
            return False
        self.workers = len(answers)
        if self.workers > 1:
            raise RefitConfigError(f"selftest pushes through refit_verify.push, which serves an engine of one worker; this "
                                   f"engine has {self.workers} (tensor or pipeline parallel): run it on a one-worker engine")
        for a in answers:
            rank = a.get("rank") if isinstance(a, Mapping) else "?"
            if not (isinstance(a, Mapping) and a.get("verifying")):
                why = a.get("reason", "no reason given") if isinstance(a, Mapping) else repr(a)
                self.problems.append(f"vLLM worker rank {rank} does not verify ({why}): set REFIT_VERIFY in the engine's "
                                     "environment and install refit-verify there")
            elif a.get("open"):
                self.problems.append(f"vLLM worker rank {rank} has refit session {a['open']!r} open: the self-test "
                                     "runs before the job's refits, not during one")
        if not self.problems:
            self.checked.append("the engine's worker verifies (refit-verify's plugin loaded, REFIT_VERIFY set there)")
        return not self.problems

    def corrupted(self) -> None:
        """A refit with one staged byte of ``target`` flipped after the sender's digest must name exactly ``target``."""
        what = f"a refit with byte {self.byte_index} of {self.target} flipped after the sender digested it"
        t0 = time.perf_counter()
        with OneByteFlipSender(config=self.config, target=self.target, byte_index=self.byte_index) as s:
            try:
                push(self.engine, self.items, sender=s)
                err: RefitError | None = None
            except RefitError as e:
                err = e
        self.timings["corrupted"] = time.perf_counter() - t0
        if not s.flipped:
            self.problems.append(f"{what}: the byte was never flipped ({self.target} was not staged)")
        elif err is None:
            self.problems.append(f"{what} verified: the corruption was NOT caught")
        elif not isinstance(err, RefitVerificationError):
            self.problems.append(f"{what} failed otherwise: {type(err).__name__}: {err}")
        elif tuple(err.report.mismatched) != (self.target,):
            self.problems.append(f"{what} was refused but named {list(err.report.mismatched) or 'no tensor'} as mismatched, "
                                 f"not {self.target}: {err.report.describe()}")
        else:
            self.caught = self.target
            kept = f"; {len(err.report.kept)} engine parameters kept their previous bytes" if err.report.kept else ""
            self.checked.append(f"{what} was refused before loading and named {self.target}{kept}")

    def clean(self) -> None:
        """A clean refit of the weights verifies (the engine is left holding them)."""

        def run() -> VerificationReport | None:
            with RefitSender(config=self.config) as s:
                return push(self.engine, self.items, sender=s).report

        self.report, done = self._step("clean", "the clean refit", run)
        if not done:
            return
        rep = self.report
        if rep is None or not rep.ok:  # an enforce sender raises on a failing report; never a pass without one
            self.problems.append(f"the clean refit returned {'no report' if rep is None else rep.describe()}")
            return
        proven = f", {rep.proven_bytes} bytes proven by read-back in the engine's layout" if rep.proven_bytes is not None else ""
        self.checked.append(f"a clean refit of {rep.verified} tensors verified at the model boundary on {rep.worker or 'the worker'}{proven}")

    def certified(self) -> None:
        """Every worker's certificate: it holds the clean refit's state, verified by this trainer."""
        certs, done = self._step("certificate", "reading the certificates", lambda: certificate(self.engine, timeout_s=self.timeout_s))
        if not done:
            return
        self.certificates = tuple(certs)
        rep = self.report
        for c in self.certificates:
            if not c.ok:
                self.problems.append(f"after the clean refit the certificate does not hold: {c.describe()}")
            elif (c.session, c.state_digest) != (rep.session, rep.state_digest):
                self.problems.append(f"the certificate names session {c.session} (engine state {c.state_digest}), the clean "
                                     f"refit's report session {rep.session} (engine state {rep.state_digest})")
            else:
                self.checked.append(f"the certificate: {c.describe()}")


def selftest(engine: Any, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *, target: str | None = None,
             byte_index: int | None = None, mode: VerifyMode | str | None = None, timeout_s: float = 120.0) -> SelftestResult:
    """Check, against the live engine, that a refit is verified and a corrupted one is caught.

    Runs a refit of ``weights`` with one staged byte of ``target`` flipped (it must be refused and
    name exactly ``target``), then a clean refit of ``weights`` (it must verify, and every worker's
    certificate must then name its state). Frameworks call it once at job start, with the weights
    the engine loaded (the trainer's state dict): the engine is left holding them, verified.

    Args:
        engine: a ``vllm.LLM`` (or anything :func:`refit_verify.push` reaches) of one worker.
        weights: ``(name, tensor)`` pairs or a mapping, HF names, as the engine's ``load_weights``
            takes them (any device, dtype and shape; pushed twice).
        target: the name whose byte is flipped (default: the largest tensor, the first of equals).
        byte_index: which of its logical bytes flips its lowest bit (default: the middle one).
        mode: what a failed self-test does: ``enforce`` raises, ``log`` warns, ``off`` runs nothing
            (the result says so, never ``passed``); default ``REFIT_VERIFY``. The refits themselves
            always run in ``enforce``.
        timeout_s: bound on every wait for the engine, seconds (each refit's waits, each call).

    Returns:
        SelftestResult: ``passed``, what was checked, ``caught`` (the name the corrupted refit
        named), timings, the clean refit's report and the certificates.

    Raises:
        SelftestError: ``enforce`` and a check failed or could not run (``.result`` says which).
        RefitInputError: ``weights`` is empty or not ``(str, tensor)`` pairs, or ``target`` has no bytes.
        RefitConfigError: a bad ``target``, ``byte_index``, ``mode`` or ``timeout_s``; ``engine``
            reaches no workers, or has more than one worker.
    """
    m = mode_from_env() if mode is None else VerifyMode.parse(mode)
    items = _items(weights)
    target, byte_index = _target(items, target, byte_index)
    run = _Run(engine, items, target, byte_index, RefitConfig.build(timeout_s=timeout_s).timeout_s)
    t0 = time.perf_counter()
    if not m.verifies:
        run.problems.append("REFIT_VERIFY is off: the self-test did not run")
    else:
        if run.workers_verify():
            run.corrupted()
            run.clean()
            if run.report is not None and run.report.ok:
                run.certified()
        run.timings["total"] = time.perf_counter() - t0
    result = SelftestResult(passed=not run.problems, checked=tuple(run.checked), problems=tuple(run.problems), target=target,
                            byte_index=byte_index, caught=run.caught, workers=run.workers, tensors=len(items),
                            bytes=sum(t.numel() * t.element_size() for _, t in items), timings=dict(run.timings),
                            report=run.report, certificates=run.certificates)
    if result.passed:
        logger.info("%s", result.describe())
    elif m is VerifyMode.ENFORCE:
        raise SelftestError(result)
    elif m is VerifyMode.LOG:
        logger.warning("%s", result.describe())
    return result
