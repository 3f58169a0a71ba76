"""The sender half of a verified native weight update: :class:`NativeSendVerifier`.

It digests what a trainer exports through vLLM's weight-transfer API (the model's parameters held,
other tensors copied: :class:`~refit_verify.trainer.exports.StreamDigests` with ``hold_parameters``), fetches
every worker's manifest (``refit_verify_native_manifest``, :mod:`refit_verify.vllm_plugin.native_worker`)
and compares. :mod:`refit_verify.vllm_plugin.native_trainer` installs the wrappers that use it with no user
code; this module holds it and the state those wrappers share (which in-process engines have an
open update, which sends wait for their update's finish). Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from refit_verify import verdicts
from refit_verify.compare import compare_manifests, compare_session, wrote_wrong
from refit_verify.config import VerifyMode, act_on_all, mode_from_env
from refit_verify.errors import RefitConfigError, RefitProtocolError
from refit_verify.manifest import digest_map, from_wire
from refit_verify.report import VerificationReport
from refit_verify.trainer.exports import changed_problems
from refit_verify.vllm_plugin.rpc_names import ABANDON_METHOD, MANIFEST_METHOD

logger = logging.getLogger("refit_verify")

__all__ = ["FETCH_TIMEOUT_S", "NativeSendVerifier", "record_verdicts"]

FETCH_TIMEOUT_S = 300.0
"""Bound, in seconds, on fetching the workers' manifests after a send."""

_LOCK = threading.RLock()
_ACTIVE: list[NativeSendVerifier] = []  # sends in progress in this process (for engine tracking)
_LAST: dict[str, Any] = {"reports": [], "key": None, "sender": {}}
_OPEN: list[weakref.ref] = []  # in-process LLMs between start_weight_update and finish_weight_update
_PENDING: list[NativeSendVerifier] = []  # static sends whose whole session is checked at their update's finish


class NativeSendVerifier:
    """Sender half of a verified native weight update: digest what is exported, then compare.

    The automatic wrappers use it; call it yourself where they cannot run (a trainer process in
    which vLLM's plugins are never loaded, e.g. a Ray actor):

    .. code-block:: python

        v = NativeSendVerifier(llm)                  # or a Ray handle, an HTTP base URL, a client
        llm.start_weight_update()
        IPCWeightTransferEngine.trainer_send_weights(v.wrap(model.named_parameters()), args)  # 0.26
        llm.finish_weight_update()
        v.verify()                                   # raises in enforce, warns in log

    Args:
        target: where the workers are: an object with ``collective_rpc`` (``LLM``), a Ray actor
            handle or a list of them, an HTTP base URL (``VLLM_SERVER_DEV_MODE=1`` server), a
            ``VLLMWeightSyncClient`` (Ray, HTTP, or one holding such an object as an attribute),
            or None: then the in-process ``LLM`` engines that received ``update_weights`` while
            the verifier was entered (``with v:``) are asked.
        mode: verification mode; default ``REFIT_VERIFY``.
    """

    def __init__(self, target: Any = None, *, mode: VerifyMode | str | None = None) -> None:
        from refit_verify.trainer.exports import StreamDigests

        self.mode = mode_from_env() if mode is None else VerifyMode.parse(mode)
        self._target, self._weak_target = target, False  # see target and _hold_target_weakly
        self._stream = StreamDigests(hold_parameters=True)  # the model's parameters held, temporaries copied
        self.engines: list[weakref.ref] = []
        self.open_updates = False
        self.checked = False  # verify() fetched and compared (or the mode does not verify)
        self.workers: list[dict[str, Any]] = []  # the workers' manifest results the last verify() compared with
        self._earlier: list[NativeSendVerifier] = []  # earlier sends into the same update (deferred to its finish)
        self._thread = threading.get_ident()  # the sending thread (its CUDA stream orders the digests)
        self.exhausted = False  # the wrapped iterator ran out: every exported tensor was added
        self.shadow_wait_s = 0.0  # seconds the sending thread waited for shadow work after its RPC returned
        self._shadow_error: BaseException | None = None  # shadow work that failed: raised by verify()
        self._shadow_llm: weakref.ref | None = None  # the LLM whose update_weights the deferred work shadows
        self.send_error: str | None = None  # the send raised (set by the wrappers): the update holds part of it at most

    @property
    def target(self) -> Any:
        """Where the workers are (as given); None when it was held weakly while this send waited for
        its update's finish and that engine has been garbage-collected since."""
        return self._target() if self._weak_target else self._target

    @target.setter
    def target(self, value: Any) -> None:
        self._target, self._weak_target = value, False

    def _hold_target_weakly(self) -> None:
        """While this send waits in the process-wide pending list for its in-process engine's
        ``finish_weight_update``: hold that engine weakly, so one the user drops (a failed update
        never finished, the engine rebuilt) is freed with its workers, not kept alive by this list."""
        if self._target is not None and not self._weak_target:
            try:
                self._target, self._weak_target = weakref.ref(self._target), True
            except TypeError:  # not weakly referenceable (a Ray handle's proxy, a URL): held as given
                pass

    def _target_gone(self) -> bool:
        """True iff the engine this send went to has been garbage-collected: its target, held weakly,
        or, with no target (``nccl``), every in-process engine it was seen to feed."""
        if self._weak_target:
            return self._target() is None
        return self._target is None and bool(self.engines) and all(r() is None for r in self.engines)

    @property
    def digests(self) -> dict[str, str]:
        """``{name: 32-hex}`` of every tensor added so far (collects launched CUDA digests first)."""
        return self._stream.digests()

    @property
    def digest_s(self) -> float:
        """Host seconds spent digesting."""
        return self._stream.digest_s

    @property
    def shadow_s(self) -> float:
        """Of :attr:`digest_s`, the seconds spent while the sending thread waited for the engine's
        ``update_weights`` RPC (:meth:`shadow_work`, less what the sending thread waited for it after
        the RPC returned): off the refit's critical path."""
        return max(0.0, self._stream.drain_s - self.shadow_wait_s)

    def add(self, name: str, tensor: Any) -> None:
        """Digest one exported tensor (:class:`refit_verify.trainer.exports.StreamDigests`: launched now, no
        per-tensor sync; with :meth:`defer`, a parameter is only recorded, for :meth:`shadow_work`)."""
        self._stream.add(name, tensor)

    def defer(self, budget_bytes: float = math.inf, llm: Any = None) -> None:
        """Leave the digest work of exported parameters to :meth:`shadow_work` (the automatic wrappers
        turn it on when the send goes to an in-process ``LLM`` whose engine runs in another process).
        ``budget_bytes``: deferred bytes past which an add does the work at once (no shadow came);
        ``llm``: the engine whose ``update_weights`` the work shadows (default: the target's)."""
        self._stream.defer_held = True
        self._stream.defer_bytes = budget_bytes
        self._shadow_llm = weakref.ref(llm) if llm is not None else None

    def shadow_ready(self, llm: Any) -> bool:
        """True iff this send, from the calling thread, has deferred digest work (or, every tensor
        exported, digests to read) and feeds ``llm`` (or names no engine)."""
        s = self._stream
        if not (s.deferred or (self.exhausted and s.defer_held and s.uncollected)):
            return False
        if self._thread != threading.get_ident() or self._shadow_error is not None:
            return False
        if self._shadow_llm is not None:
            return self._shadow_llm() is llm
        target = self.target
        if target is None:
            return not self._weak_target  # names no engine (a weakly held one that is gone feeds none)
        return target is llm or getattr(target, "__self__", None) is llm

    def shadow_work(self) -> None:
        """The deferred digest work so far (checks, signatures, launches), run while the sending thread
        waits for an ``update_weights`` RPC; once every exported tensor was added, the digests are
        read too (one synchronisation), so :meth:`verify` only compares. Never raises into that RPC:
        a failure is kept and raised by :meth:`verify`."""
        try:
            self._stream.drain(collect=self.exhausted, shadow=True)
        except Exception as e:  # noqa: BLE001 - a device error while digesting: the check fails at verify()
            self._shadow_error = e

    def _waited(self, seconds: float) -> None:
        self.shadow_wait_s += seconds

    def wrap(self, pairs: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Yield ``pairs`` unchanged, digesting each tensor before it is handed on.

        A vLLM 0.26 static ``trainer_send_weights`` that is handed this iterator leaves the
        verification to this verifier (no second digest, no automatic ``verify``)."""
        return _Wrapped(self, pairs)

    # -- engine tracking
    def __enter__(self) -> NativeSendVerifier:
        with _LOCK:
            _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        with _LOCK:
            if self in _ACTIVE:
                _ACTIVE.remove(self)

    def _saw_engine(self, llm: Any) -> None:
        if not any(r() is llm for r in self.engines):
            self.engines.append(weakref.ref(llm))

    def _feeds(self, llm: Any) -> bool:
        """True iff this send went to in-process engine ``llm`` and to no other: its target is ``llm``
        (or a method of it), or, with no target (``nccl``), ``llm`` is the one engine that received
        ``update_weights`` during the send."""
        target = self.target
        if target is not None:
            return target is llm or getattr(target, "__self__", None) is llm
        if self._weak_target:  # its engine is gone: it feeds none
            return False
        seen = [e for e in (r() for r in self.engines) if e is not None]
        return len(seen) == 1 and seen[0] is llm

    # -- comparing
    def fetch(self) -> list[dict[str, Any]]:
        """Return every worker's ``refit_verify_native_manifest`` result.

        Raises:
            RefitConfigError: no way to reach the workers; no target and more than one in-process
                engine could have received this send; or a worker lacks the method.
        """
        results: list[dict[str, Any]] = []
        for ch in self._channels():
            results.extend(ch.call(MANIFEST_METHOD, timeout_s=FETCH_TIMEOUT_S))
        return results

    def abandon(self) -> None:
        """Tell the workers of the update this send fed that the send raised (:attr:`send_error`): that
        update's session records it as an error when it closes, so its state fails the audit whoever
        asks (a remote engine, whose finish this process does not see). Never raises (logged)."""
        try:
            for ch in self._channels():
                ch.call(ABANDON_METHOD, self.send_error or "the send raised", timeout_s=FETCH_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - the send's own error is what the caller gets
            logger.warning("refit-verify: could not tell the workers that this send raised; the update it fed closes "
                           "unchecked (its certificate says so)", exc_info=True)

    def _channels(self) -> list[Any]:
        """The channels to the workers this send went to (see :meth:`fetch`, which raises what this raises)."""
        from refit_verify.trainer.channel import channel

        if self._target_gone():
            raise RefitConfigError("refit-verify cannot fetch the manifests of this send: the in-process vLLM engine it went "
                                   "to was garbage-collected before its weight update finished")
        chans = [c for c in (channel(self.target),) if c is not None]
        if not chans:
            seen = [llm for llm in (r() for r in self.engines) if llm is not None]
            how = "received update_weights during this send"
            if not seen:  # e.g. nccl: the update went out before this send began; use the open updates
                with _LOCK:
                    seen = [llm for llm in (r() for r in _OPEN) if llm is not None]
                how = "have an open weight update (start_weight_update without finish_weight_update)"
            if len(seen) > 1:  # which one this send fed is unknown: comparing with all would blame the others
                raise RefitConfigError(
                    f"refit-verify cannot tell which of {len(seen)} in-process vLLM engines this send updated (all {how}); "
                    "pass the engine explicitly: NativeSendVerifier(target=llm) with trainer_send_weights(v.wrap(params), args)")
            for llm in seen:
                self._saw_engine(llm)
            chans = [c for c in (channel(llm) for llm in seen) if c is not None]
        if not chans:
            raise RefitConfigError(
                f"refit-verify cannot reach the vLLM workers to fetch their manifests (client: {type(self.target).__name__}). "
                "Use a client with collective_rpc, a Ray or HTTP client, an in-process LLM, or "
                "refit_verify.vllm_plugin.native_trainer.NativeSendVerifier(target=...)."
            )
        return chans

    def verify(self, workers: list[dict[str, Any]] | None = None) -> list[VerificationReport]:
        """Fetch the worker manifests, compare each with the sender's, act on the mode.

        ``workers``: the workers' ``refit_verify_native_manifest`` results when the caller already
        has them (the finish RPC that returns them, :func:`~refit_verify.vllm_plugin.native_worker.refit_verify_native_finish`);
        fetched here otherwise.

        Every worker receives full tensors, so each manifest is compared with the whole sender
        manifest. Digests of several sends into one worker update (0.26: more than one
        ``trainer_send_weights`` between start and finish) are merged.

        Returns:
            list[VerificationReport]: one per worker, in worker order.

        Raises:
            RefitVerificationError: ``enforce`` and a worker's manifest differs; names the
                parameters and the worker rank (other failing workers are logged first).
            RefitConfigError: a worker does not verify (``REFIT_VERIFY`` off in the server), or
                the workers cannot be reached (``enforce``; ``log`` logs it).
            RefitProtocolError: a worker could not build its manifest, or the digest work beside an
                ``update_weights`` failed (``enforce``; ``log`` logs it).
        """
        self.checked = True
        for v in self._earlier:
            v.checked = True
        if not self.mode.verifies:
            return []
        try:
            workers = self.fetch() if workers is None else list(workers)
            self.workers = workers
            failed = next((v._shadow_error for v in (*self._earlier, self) if v._shadow_error is not None), None)
            if failed is not None:
                raise RefitProtocolError(f"refit-verify: digesting the exported tensors failed beside update_weights: "
                                         f"{type(failed).__name__}: {failed}") from failed
            broken = [w for w in workers if w.get("error")]
            if broken:
                raise RefitProtocolError(f"refit-verify: vLLM worker rank {broken[0].get('rank')} could not give its manifest "
                                         f"after the update's finish: {broken[0]['error']}")
            idle = [w for w in workers if not w.get("verifying")]
            if idle or not workers:
                w = idle[0] if idle else {}
                raise RefitConfigError(
                    f"refit-verify: REFIT_VERIFY={self.mode.value} in the trainer but vLLM worker rank {w.get('rank')} does not "
                    f"verify ({w.get('reason', 'no workers answered')}); set REFIT_VERIFY in the vLLM server's environment too"
                )
            sender, changed = self._sent()  # a drain still running beside (shadow work that timed out): RefitProtocolError
        except (RefitConfigError, RefitProtocolError) as e:
            if self.mode is VerifyMode.ENFORCE:
                raise
            logger.warning("%s", e)
            return []
        key = tuple(sorted((str(w.get("token")), int(w.get("session", 0))) for w in workers))
        with _LOCK:
            if _LAST["key"] == key:  # a further send into the same worker update
                sender = {**_LAST["sender"], **sender}
                for name in changed:  # what this send exported under it is unknown
                    sender.pop(name, None)
            _LAST.update(key=key, sender=sender)
        problems = self._sender_problems(changed)
        if self.send_error is not None:  # (a later send into the same update is checked on its own digests)
            problems.append(f"the trainer's send raised before it finished ({self.send_error}): the update holds at most "
                            "part of it")
        compared = [self._compare(sender, w, problems, tuple(changed)) for w in workers]
        reports = [rep for rep, _ in compared]
        self.open_updates = any(w.get("active") for w in workers)
        with _LOCK:
            _LAST["reports"] = reports
        record_verdicts(reports, [wrong for _, wrong in compared])
        if all(r.ok for r in reports):
            logger.info("refit verified (native weight transfer): %d tensors on %d worker(s)", len(sender), len(reports))
        if self.send_error is not None:  # the send already raised to its caller: recorded and logged, not raised again
            return act_on_all(reports, VerifyMode.LOG)
        return act_on_all(reports, self.mode)


    def _sent(self) -> tuple[dict[str, str], dict[str, str]]:
        """``(digests, changed)`` of what was exported: this send's and those of the earlier sends into
        the same update whose verification was left to this one (a later send of a name wins)."""
        sender: dict[str, str] = {}
        changed: dict[str, str] = {}
        for v in (*self._earlier, self):
            got = v.digests
            for name, why in v._stream.changed.items():
                sender.pop(name, None)
                changed[name] = why
            for name in got:
                changed.pop(name, None)
            sender.update(got)
        return sender, changed

    @staticmethod
    def _sender_problems(changed: dict[str, str]) -> list[str]:
        """The exported parameters (held, not copied) that changed before their digests were taken."""
        return changed_problems(changed, verb="exported", more="more exported parameters changed before verify()",
                                hint="a parameter handed to the send is held until verify(); leave it untouched until then")

    @staticmethod
    def _compare(sender: dict[str, str], w: dict[str, Any], problems: list[str],
                 changed: tuple[str, ...]) -> tuple[VerificationReport, set[str] | None]:
        """A finished update is compared as a whole session (coverage, apply-time digests, read-back);
        one still open (0.26: the send runs between start and finish) by its delivered digests, and
        the report says what it could not check yet. ``problems``: the sender's own (each a failure),
        about the names ``changed``. Returns the report and, for a failed closed session, what it
        wrote wrong (:func:`~refit_verify.compare.wrote_wrong`; None: unknown, or nothing failed)."""
        data = w.get("session_manifest")
        if data is not None and not w.get("active"):
            man = from_wire(data)
            rep = compare_session({"model": sender}, man, sender_problems=problems, undigested=changed)
            wrong = None if rep.ok else wrote_wrong({"model": sender}, man, rep, sender_problems=problems, undigested=changed)
            return rep, wrong
        r = compare_manifests(sender, digest_map(w.get("manifest")) or {}, rank=w.get("rank"))
        r = dataclasses.replace(r, unexpected=tuple(n for n in r.unexpected if n not in changed),
                                problems=(*r.problems, *problems))
        return dataclasses.replace(r, unchecked=(
            "coverage, apply-time digests and read-back: the worker's update was still open (checked again when "
            "LLM.finish_weight_update closes it in this process; call NativeSendVerifier.verify() after finish otherwise)",)), None


def record_verdicts(reports: Sequence[VerificationReport], wrong: Sequence[set[str] | None] | None = None) -> None:
    """Record in :mod:`refit_verify.verdicts` the verdict on each closed worker session the reports
    compared whole: passed only where every worker's report on that session passed (a report of an
    update still open has no session: it is checked again at its close). ``wrong``: per report, the
    parameters its failed session wrote wrong (None, or no list: any)."""
    closed: dict[str, bool] = {}
    bad: dict[str, set[str] | None] = {}
    for r, w in zip(reports, wrong if wrong is not None else [None] * len(reports)):
        if r.session is not None:
            closed[r.session] = closed.get(r.session, True) and r.ok
            if not r.ok:
                before = bad.get(r.session, set())
                bad[r.session] = None if w is None or before is None else before | w
    for session, ok in closed.items():
        wrong = bad.get(session)
        verdicts.record(session, ok, bad=None if wrong is None else frozenset(wrong))


class _Wrapped:
    """Iterator returned by :meth:`NativeSendVerifier.wrap` (marks iterators already verified)."""

    def __init__(self, verifier: NativeSendVerifier, pairs: Iterable[tuple[str, Any]]) -> None:
        self.verifier, self._it = verifier, iter(pairs)

    def __iter__(self) -> _Wrapped:
        return self

    def __next__(self) -> tuple[str, Any]:
        try:
            name, tensor = next(self._it)
        except StopIteration:
            self.verifier.exhausted = True
            raise
        if tensor is not None:
            self.verifier.add(name, tensor)
        return name, tensor
