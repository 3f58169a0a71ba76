"""The trainer API for any transport: say which tensors you are pushing, get every worker checked.

.. code-block:: python

    import refit_verify

    with refit_verify.refit(llm, version=step) as r:      # LLM, engine client, Ray handle, HTTP URL
        for name, t in export():
            r.add(name, t)                                 # digested on t's device, no sync
            push(name, t)                                  # whatever the framework does
    # on exit: every worker's manifest is fetched and compared; enforce raises, log warns

On enter a session is opened on every worker (``refit_verify_session_open``): every
``load_weights`` of every model of the engine until exit belongs to it, whatever moved the bytes.
On exit the sessions are closed, each worker's :class:`~refit_verify.manifest.SessionManifest` is
compared with the full expected manifest (every worker gets every tensor), and the coverage,
identity and read-back checks of the session are applied (:func:`compare_session`).

With ``REFIT_VERIFY=off`` (and no ``mode``), :func:`refit` returns a check that does nothing.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from refit_verify import verdicts
from refit_verify.compare import compare_session, wrote_wrong
from refit_verify.config import RefitConfig, VerifyMode, act_on_all, check_version, mode_from_env
from refit_verify.digest import backends as _backends
from refit_verify.digest.tensors import PLAIN_TYPES, dtype_name, version_of
from refit_verify.errors import RefitConfigError, RefitProtocolError, RefitTimeoutError
from refit_verify.manifest import START_BYTES, SessionManifest, from_wire, local_reply_token
from refit_verify.report import VerificationReport
from refit_verify.trainer.channel import WorkerChannel, require_channel
from refit_verify.trainer.exports import StreamDigests, changed_problems
from refit_verify.trainer.slices import resolve as resolve_slices

logger = logging.getLogger("refit_verify")

MODULES = ("model", "drafter")
"""The model modules a worker verifies: the main model and the draft / MTP model of speculative decoding."""

__all__ = ["RefitCheck", "refit", "verify_state"]

OPEN_METHOD, CLOSE_METHOD = "refit_verify_session_open", "refit_verify_session_close"



_RELEARN: set[Any] = set()
"""Engines (:func:`_engine_key`) whose last verified refit failed: their next session is watched by
the loader tap again instead of replaying a refit plan (``replay=False``; :mod:`refit_verify.boundary.plan`),
so its report can tell a corrupted delivery from a misplaced write."""


def _engine_key(engine: Any) -> Any:
    if isinstance(engine, str):
        return engine
    if isinstance(engine, (list, tuple)):
        return tuple(id(e) for e in engine)
    return id(engine)


class RefitCheck:
    """One verified refit of an engine, whatever moves the bytes (returned by :func:`refit`).

    Attributes:
        reports: one :class:`~refit_verify.report.VerificationReport` per worker, after exit.
        manifests: the workers' :class:`~refit_verify.manifest.SessionManifest`, after exit (from an
            in-process engine, the worker's own record: read it, do not edit it).
        session: the session id.
    """

    def __init__(self, engine: Any, *, version: int | None = None, mode: VerifyMode | str | None = None, partial: bool = False,
                 allow: Iterable[str] = (), readback: bool = True, timeout_s: float = 120.0, session_id: str | None = None,
                 copy: bool = True, base: int | None = None) -> None:
        self.mode = mode_from_env() if mode is None else VerifyMode.parse(mode)
        self.version = check_version(version)
        self.base = check_version(base)
        if self.base is not None:
            if self.version is not None and self.base >= self.version:
                raise RefitConfigError(f"a delta's base version must be older than its version, got base={base!r}, version={version!r}")
            partial = True
        if not isinstance(partial, bool) or not isinstance(readback, bool) or not isinstance(copy, bool):
            raise RefitConfigError(f"partial, readback and copy must be True or False, got {partial!r}, {readback!r}, {copy!r}")
        self.copy = copy
        if isinstance(allow, (str, bytes)):
            raise RefitConfigError(f"allow must be a list of fnmatch patterns, not one string: allow=[{allow!r}]")
        self.allow = tuple(allow)
        if not all(isinstance(p, str) for p in self.allow):
            raise RefitConfigError(f"allow must be an iterable of fnmatch patterns (str), got {allow!r}")
        self.timeout_s = RefitConfig.build(timeout_s=timeout_s).timeout_s
        self.partial, self.readback = partial, readback
        self.session = session_id or uuid.uuid4().hex[:16]
        self.reports: list[VerificationReport] = []
        self.manifests: list[SessionManifest] = []
        self._streams: dict[str, StreamDigests] = {}
        self._specs: dict[str, dict[str, tuple[Any, Any]]] = {}
        self._state_only = False  # verify_state: nothing is pushed (a region holding other bytes differs, whatever it held before)  # module -> {name: (shape, dtype)} of its adds (the close's announcement)
        # copy=False: the model's plain tensors as taken by add, (name, tensor, version, data_ptr, nbytes), handed to its stream in one
        # loop (_feed) at the close, before any other add to it, and whenever they hold the stream's held_flush_bytes
        self._taken: list[tuple[str, torch.Tensor, int, int, int]] | None = None
        self._taken_bytes = 0
        self._taken_flush: float = 0
        # {module: {name: (tensor, version)}} as added, kept for the close when the engine has several workers
        # (tensor-parallel shards: the trainer digests the slices a worker's layout map puts in its regions)
        self._kept: dict[str, dict[str, tuple[torch.Tensor, int | None]]] | None = None
        self._channel: WorkerChannel | None = require_channel(engine) if self.mode.verifies else None
        if self.mode.verifies:
            _backends.start_warmup()  # once per process: the digests compile while the sessions open
        self._key = _engine_key(engine)
        self._opened = False
        self._closed = False  # the session was verified or aborted: this RefitCheck takes nothing more
        self._workers = 0
        self._unverified: str | None = None  # log: why the workers could not be checked (the report verify() returns)

    # -- the trainer's side -----------------------------------------------------------------

    def add(self, name: str, tensor: torch.Tensor, module: str = "model") -> None:
        """Record one tensor the trainer is pushing (digested on its device now; no sync).

        Args:
            name: the name the engine's ``load_weights`` receives (HF checkpoint name).
            tensor: the tensor, as pushed (any device, dtype, layout of dense strided tensors).
            module: ``"model"`` or ``"drafter"`` (the draft / MTP module the tensor is for).

        Host cost under ``copy=False``: from the model's second add on, a plain tensor or parameter
        with a storage address is only taken (a few attribute reads and an append: an add runs
        between a loader's calls, where every step costs more than in a loop of its own); what was taken goes to the digest
        stream in one loop at the close, before any add that goes through the stream at once, and
        whenever it holds ``StreamDigests.held_flush_bytes``. The checks and what is reported are
        those of :meth:`HeldBatch.add <refit_verify.digest.incremental.HeldBatch.add>` made at the add.

        Raises:
            RefitInputError: a name that is not a str, or a value that is not a digestable tensor.
            RefitConfigError: ``module`` is neither ``"model"`` nor ``"drafter"``, or the session was already
                verified or aborted (a RefitCheck serves one session).
            RefitError: a digest launch this add starts (the held flush) finds that an earlier one failed;
                the launch's own error (a device error) as it is.
        """
        taken = self._taken  # an add runs per tensor, between a loader's calls: the fewest steps
        if taken is not None and type(module) is str and module == "model" and type(tensor) in PLAIN_TYPES and type(name) is str:
            try:  # HeldBatch.add's own first checks (a storage with an address, not quantized or nested); the rest at the feed
                ptr = tensor.data_ptr()
                ok = ptr and ptr != tensor.storage_offset() * tensor.itemsize and not (tensor.is_quantized or tensor.is_nested)
                item = (name, tensor, tensor._version, ptr, tensor.nbytes) if ok else None
            except RuntimeError:  # no storage (sparse), an inference tensor's version: every check, in the stream's add
                item = None
            if item is not None:
                taken.append(item)  # its shape and dtype are read at the feed
                self._taken_bytes += item[4]
                if self._taken_bytes >= self._taken_flush:
                    self._feed()  # a launch that raises here raises from this add, as the stream's own add would
                return
        if self._closed:
            raise RefitConfigError(f"refit {self.session} is already verified or aborted: an add after its close is "
                                   "checked by no session (start a new refit_verify.refit(...))")
        stream = self._streams.get(module) if type(module) is str else None
        if stream is None:
            if module not in MODULES:
                raise RefitConfigError(f"module must be one of {', '.join(map(repr, MODULES))}, got {module!r}")
            module = MODULES[MODULES.index(module)]  # the str itself (a str subclass or numpy.str_ of it: the same stream)
            stream = self._streams.get(module)
            if stream is None:
                if not self.mode.verifies:
                    return
                stream = self._streams[module] = StreamDigests(copy=self.copy)
                if not self.copy and module == "model":
                    self._taken, self._taken_flush = [], stream.held_flush_bytes
        if self.mode is VerifyMode.OFF:
            return
        if taken:  # taken adds first: a later add of a name replaces an earlier one
            self._feed()
        stream.add(name, tensor)
        self._specs.setdefault(module, {})[name] = (tensor.shape, tensor.dtype)
        if self._kept is not None:
            self._kept.setdefault(module, {})[name] = (tensor, version_of(tensor))

    def _feed(self) -> None:
        """Hand the model's taken adds to its stream (:meth:`StreamDigests.add_taken`), in order."""
        taken = self._taken
        if taken:
            self._taken, self._taken_bytes = [], 0
            self._specs.setdefault("model", {}).update({n: (t.shape, t.dtype) for n, t, *_ in taken})
            if self._kept is not None:
                self._kept.setdefault("model", {}).update({n: (t, v) for n, t, v, *_ in taken})
            self._streams["model"].add_taken(taken)

    def wrap(self, named_tensors: Iterable[tuple[str, torch.Tensor]], module: str = "model") -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``named_tensors`` unchanged, recording each tensor as it passes (iterator-style trainers)."""
        for name, t in named_tensors:
            self.add(name, t, module)
            yield name, t

    # -- sessions -----------------------------------------------------------------------------

    def __enter__(self) -> RefitCheck:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            verdicts.record(self.session, False, f"the refit was aborted ({exc_type.__name__})")
            _RELEARN.add(self._key)
            try:
                self._close_quietly()
            finally:
                self._end()
            return False
        self.verify()
        return False

    def _end(self) -> None:
        """No add or open after this: the session was verified or aborted."""
        self._closed, self._taken, self._kept = True, None, None

    def open(self) -> None:
        """Open the session on every worker (what ``with`` does on enter).

        Raises:
            RefitConfigError: in ``enforce``, a worker does not verify (``REFIT_VERIFY`` unset there), lacks
                refit-verify's plugin, or the engine answered for no worker; in ``log`` this is logged,
                the refit goes unverified and :meth:`verify` returns one failing report saying why.
            RefitConfigError: this RefitCheck's session was already verified or aborted, or its session id
                was used by another refit of this process.
            RefitTimeoutError: the workers did not answer within ``timeout_s``.
        """
        if self._closed:
            raise RefitConfigError(f"refit {self.session} is already verified or aborted: a RefitCheck serves one "
                                   "session (start a new refit_verify.refit(...))")
        if self._channel is None or self._opened:
            return
        if not verdicts.claim(self.session):
            raise RefitConfigError(f"session id {self.session!r} was already used by a refit in this trainer process: each "
                                   "refit needs an id of its own (its verdict is kept by id); leave session_id unset for a "
                                   "fresh random one")
        opts = {"version": self.version, "partial": self.partial, "allow": list(self.allow), "readback": self.readback,
                "deadline": time.time() + self.timeout_s, "replay": self._key not in _RELEARN}
        if self.base is not None:  # (a worker of an older refit-verify refuses an option it does not know)
            opts["base"] = self.base
        if self._state_only:
            opts["state"] = True
        try:
            results = self._channel.call(OPEN_METHOD, self.session, opts, timeout_s=self.timeout_s)
        except RefitConfigError as e:  # no plugin in the engine, or no worker answered: nothing can be checked
            self._not_checked(str(e))
            return
        except RefitTimeoutError:
            # the open may still reach the workers later: queue a close behind it, so no session is left open
            verdicts.record(self.session, False, "its session open timed out")
            threading.Thread(target=self._close_quietly, kwargs={"results_known": True}, daemon=True,
                             name=f"refit-verify close {self.session}").start()
            raise
        if any(isinstance(r, Mapping) and r.get("expired") for r in results):
            self._close_quietly(results_known=True)
            raise RefitTimeoutError(f"refit-verify: session {self.session} reached a worker after {self.timeout_s:g} s "
                                    "(timeout_s); it was not opened", {"waiting_for": OPEN_METHOD, "timeout_s": self.timeout_s})
        idle = [r for r in results if not (isinstance(r, Mapping) and r.get("verifying"))]
        if idle:  # (the channel never answers with no worker at all)
            r = idle[0]
            why = r.get("reason", "no reason given") if isinstance(r, Mapping) else repr(r)
            hint = ("set REFIT_VERIFY in the vLLM engine's environment too" if str(why).startswith("REFIT_VERIFY=")
                    else "this vLLM worker cannot be verified: see docs/versions.md")
            msg = (f"refit-verify: REFIT_VERIFY={self.mode.value} in the trainer but vLLM worker rank "
                   f"{r.get('rank') if isinstance(r, Mapping) else '?'} does not verify ({why}); {hint}")
            self._close_quietly(results_known=True)  # the workers that verify opened the session
            self._not_checked(msg)
            return
        self._opened, self._workers = True, len(results)
        if len(results) > 1 or self._state_only:  # several workers (tensor parallel): their maps may hold slices
            self._kept = {}
        _RELEARN.discard(self._key)

    def _not_checked(self, msg: str) -> None:
        """The workers cannot be checked (``msg`` says why): raise in ``enforce``; in ``log`` warn and
        go unverified (:meth:`verify` then returns one failing report saying why)."""
        verdicts.record(self.session, False, "its workers could not be checked")
        if self.mode is VerifyMode.ENFORCE:
            raise RefitConfigError(msg)
        logger.warning("%s", msg)
        self._channel, self._unverified = None, msg

    def _close_quietly(self, results_known: bool = False) -> None:
        if self._channel is None or not (self._opened or results_known):
            return
        try:
            self._channel.call(CLOSE_METHOD, self.session, timeout_s=self.timeout_s)
        except Exception:  # noqa: BLE001 - the body's exception is the one to see
            logger.exception("refit-verify: closing session %s after a failed refit failed", self.session)
        self._opened = False

    def expected(self) -> dict[str, dict[str, str]]:
        """``{module: {name: 32-hex}}`` of everything added (collects the trainer's digests)."""
        self._feed()
        return {m: s.digests() for m, s in self._streams.items()}

    def _sender_problems(self) -> tuple[list[str], list[str]]:
        """Held tensors (``copy=False``) that changed before their digests were taken (after
        :meth:`expected`): ``(problems, their labels)``, drafter labels as ``"drafter:name"``."""
        out, labels = [], []
        for m, s in self._streams.items():
            label = (lambda n: n) if m == "model" else (lambda n, m=m: f"{m}:{n}")
            labels += [label(n) for n in s.changed]
            out += changed_problems(s.changed, verb="pushed", label=label, more=f"more tensors of {m} changed after r.add",
                                    hint="refit(copy=False) holds the tensors until the refit ends; pass copy=True when "
                                         "the trainer changes or frees them before")
        return out, labels

    def verify(self) -> list[VerificationReport]:
        """Close the sessions, compare every worker's manifest, act on the mode (what ``with`` does on exit).

        Returns:
            list[VerificationReport]: one per worker, in worker order; empty when the mode is ``off``;
            in ``log``, when the workers could not be checked (see :meth:`open`), one failing report
            saying why (nothing checked is never a pass).

        Raises:
            RefitVerificationError: ``enforce`` and a worker's report is not ok (the others are logged);
                a report that compared no tensor is not ok.
            RefitProtocolError: a worker's reply is malformed, or it closed no such session.
            RefitConfigError: the engine answered the close for no worker.
        """
        if self._closed:
            return self.reports
        if self._unverified is not None:
            self._end()
            self.reports = [VerificationReport.unchecked_because(self._unverified, session=self.session, version=self.version)]
            return self.reports
        if self._channel is None or not self._opened:
            self._end()
            return []
        try:
            return self._verify()
        except Exception as e:
            _RELEARN.add(self._key)
            if verdicts.failed(self.session) is None:  # a timeout, a malformed reply: never a pass
                verdicts.record(self.session, False, f"its verification did not complete ({type(e).__name__})")
            raise
        finally:
            self._end()

    def _verify(self) -> list[VerificationReport]:
        try:
            self._feed()
            for s in self._streams.values():  # the device digests the trainer's last tensors while the workers close
                s.launch()
        except BaseException:  # the trainer's digests are not known: close the workers' session, then raise
            self._close_quietly()
            raise
        # every announced tensor with its digest, shape and dtype: a worker judges those no load_weights
        # delivered (direct writes, a restore) by what its engine holds where its layout map puts them
        expected = self.expected()
        announced = {m: {n: [h, list(self._specs[m][n][0]), dtype_name(self._specs[m][n][1])] for n, h in e.items()
                         if n in self._specs.get(m, {})} for m, e in expected.items()}
        # an in-process engine's workers hand the manifest over as it is (no JSON both ways)
        reply = local_reply_token() if self._channel.local else None
        results = self._channel.call(CLOSE_METHOD, self.session, reply, announced, timeout_s=self.timeout_s)
        self._opened = False
        held, undigested = self._sender_problems()
        reports = []
        mans = []
        bad: set[str] | None = set()  # the parameters this session wrote wrong, on any worker (None: unknown)
        for r in results:
            data = r.get("manifest") if isinstance(r, Mapping) else None
            if data is None:
                why = (f"does not verify ({r.get('reason')})" if isinstance(r, Mapping) and r.get("verifying") is False
                       else f"closed no session {self.session!r} (was it restarted?)")
                raise RefitProtocolError(f"worker rank {r.get('rank') if isinstance(r, Mapping) else '?'} {why}")
            mans.append(from_wire(data))
        # slices the workers' layout maps put in their regions (tensor-parallel shards): digested here, all at once
        mans = resolve_slices(mans, expected, self._kept or {}, self._specs)
        self._kept = None
        for man in mans:
            self.manifests.append(man)
            rep = compare_session(expected, man, session=self.session, version=self.version, partial=self.partial,
                                  sender_problems=held, undigested=undigested)
            based = self.base is not None and man.base_session is not None
            if based and not verdicts.passed(man.base_session):
                # a delta vouches for its patch over the state it applies to: that state must be one this trainer verified
                failed = verdicts.failed(man.base_session)
                why = f"failed in this trainer ({failed})" if failed else "this trainer process did not verify"
                rep = dataclasses.replace(rep, problems=(*rep.problems, f"delta refit: it applies to the state session "
                                                         f"{man.base_session!r} left, which {why}"))
            if not rep.ok and bad is not None:
                worker_bad = wrote_wrong(expected, man, rep, sender_problems=held, undigested=undigested)
                bad = None if worker_bad is None else bad | worker_bad
            # a full refit's unwritten parameters already fail (all but those ``allow`` exempts)
            inherited = (_inherited_failures(man, bool(rep.sender or rep.receiver), man.base_session if based else None)
                         if self.partial or man.partial or not rep.unwritten else [])
            if inherited:  # what this refit did not write is vouched for only as far as the sessions that wrote it
                rep = dataclasses.replace(rep, problems=(*rep.problems, *inherited))
            reports.append(rep)
        self.reports = reports
        ok = all(r.ok for r in reports)
        verdicts.record(self.session, ok, bad=None if bad is None else frozenset(bad))
        if not ok:
            _RELEARN.add(self._key)
        if ok:
            logger.info("refit %s verified on %d worker(s)", self.session, len(reports))
        return act_on_all(reports, self.mode)


def _inherited_failures(man: SessionManifest, wrote: bool, base: str | None = None) -> list[str]:
    """Why parameters the session of ``man`` did not write (or wrote in part) are not the trainer's,
    one sentence per cause: bytes a session wrote that this process failed (those it names, or any)
    or did not verify (a restarted trainer), and bytes changed outside any refit since written.
    ``wrote``: the session stated or loaded something (else "wrote nothing" is said); ``base``: a
    delta's base session, judged by the delta's own check (not named twice)."""
    out = []
    what = (lambda n: f"this partial refit wrote nothing, and {n} parameters it found") if not wrote else \
        (lambda n: f"{n} parameters this refit did not write (or wrote in part)")
    for sid, labels in (man.unchanged_by or {}).items():
        if sid == base:
            continue
        state, why, wrong = verdicts.writes(sid)
        if state == "passed":
            continue
        if state == "unknown":
            out.append(f"{what(len(labels))} hold what session {sid!r} wrote, which this trainer process did not verify "
                       "(a restarted trainer, or a refit it did not check): refit them in full once")
            continue
        suspect = labels if wrong is None else [n for n in labels if n in wrong]
        if suspect:
            shown = ", ".join(suspect[:4]) + (", …" if len(suspect) > 4 else "")
            out.append(f"{what(len(suspect))} hold what session {sid!r} wrote, which {why} in this trainer ({shown}): "
                       "push them again, or refit in full")
    for why, labels in man.tainted.items():
        shown = ", ".join(labels[:4]) + (", …" if len(labels) > 4 else "")
        if why == START_BYTES:
            out.append(f"{what(len(labels))} hold {why} ({shown}): push them, or check them with "
                       "refit_verify.verify_state, once")
        else:
            out.append(f"{what(len(labels))} hold bytes {why}, and no refit has written them whole since ({shown})")
    if man.unchanged_by is None and man.unchanged and not wrote and (why := verdicts.failed(man.unchanged_since)) is not None:
        out.append(f"this partial refit wrote nothing, and the state it found is what session {man.unchanged_since} left, "
                   f"which {why} in this trainer")  # a worker of an earlier release: no writers in its manifest
    return out


def refit(engine: Any, *, version: int | None = None, mode: VerifyMode | str | None = None, partial: bool = False,
          allow: Iterable[str] = (), readback: bool = True, timeout_s: float = 120.0, session_id: str | None = None,
          copy: bool = True, base: int | None = None) -> RefitCheck:
    """Return a context manager that verifies one refit of ``engine`` at its model boundary.

    Args:
        engine: the vLLM engine: an ``LLM``, an object with ``collective_rpc``, a Ray actor handle (or a
            list, one per replica) whose actor exposes ``collective_rpc``, or the HTTP base URL of a
            ``vllm serve`` started with ``VLLM_SERVER_DEV_MODE=1``.
        version: the weight version (the trainer's step, an int >= 0), recorded by every worker; a worker
            that already closed this version or a newer one reports this refit as stale (a ``problems``
            entry: a failure). None: unversioned, never out of order.
        mode: ``off`` / ``log`` / ``enforce``; default ``REFIT_VERIFY``.
        partial: the refit pushes only some parameters (e.g. the trainable ones): parameters no load
            wrote are not failures.
        allow: fnmatch patterns of names exempt from the coverage checks (``"*.rotary_emb.*"``).
        readback: read the engine's parameters back in its own layout at the end (default True).
        timeout_s: bound, in seconds, on each call to the workers (default 120).
        session_id: the session id (default: a fresh random one).
        copy: ``True`` (default): each added CUDA tensor is copied as it is added (one device copy),
            so the trainer may change, free or reuse it right after pushing. ``False``: the trainer
            promises to leave every added tensor untouched until the ``with`` block exits (its live
            parameters, no PEFT merge/unmerge or sharded gather in between); nothing is copied and
            the digests are taken at exit (:class:`~refit_verify.digest.incremental.HeldBatch`). A held tensor
            that changed anyway is reported, never passed.
        base: a delta refit (verl ``delta_sharded``, TRL delta sync, ``sparse_nccl``: a subset patched
            in place, whole tensors or sparse elements): the weight version it applies to. ``r.add``
            each patched tensor whole, as it is after the patch. Each worker proves "the state it
            closed at ``base`` + this patch = the state it holds now": the patched tensors compared
            with the trainer's, every other parameter and every other region of a parameter written
            in part unchanged since that close, that close at version ``base``, and (here) verified
            by this trainer. A delta is partial. Must be older than ``version``.

    Tensors ``r.add`` announced that no ``load_weights`` delivered (a worker extension writing
    parameters directly, NCCL or NIXL into parameter storage) are judged by what each engine holds
    where its layout map puts them (:mod:`refit_verify.boundary.layout`); a name the map lacks is
    reported not provable (a failure).

    A steady-state refit replays the plan of the last watched one on each worker (the loader tap
    off, every landed region read back: :mod:`refit_verify.boundary.plan`); after a refit of
    ``engine`` failed or was aborted in this process, its next session is watched again.

    Raises:
        RefitConfigError: a bad argument, or ``engine`` reaches no workers (only checked when verifying).
    """
    return RefitCheck(engine, version=version, mode=mode, partial=partial, allow=allow, readback=readback,
                      timeout_s=timeout_s, session_id=session_id, copy=copy, base=base)


def verify_state(engine: Any, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], *,
                 version: int | None = None, mode: VerifyMode | str | None = None, module: str = "model",
                 timeout_s: float = 120.0) -> list[VerificationReport]:
    """Check that ``engine`` holds exactly ``named_tensors``, through each worker's layout map.

    For a state reached out of band (a restore, a ModelExpress pull, weights written while no refit
    was open): nothing is pushed; every tensor is judged by what the engine holds where the layout
    map puts it (learned dry when the model never loaded it), every engine parameter no tensor covers
    is named unwritten, and a tensor the map lacks is not provable. A session of its own on every
    worker: it closes at ``version`` (order checked as for a refit), and its state is the base later
    delta refits apply to.

    Args:
        engine: as :func:`refit`.
        named_tensors: ``(HF name, tensor)`` pairs or a mapping of them: the full state expected.
        version: the weight version the engine should hold (int >= 0), or None.
        mode: ``off`` / ``log`` / ``enforce``; default ``REFIT_VERIFY``.
        module: ``"model"`` or ``"drafter"``.
        timeout_s: bound on each call to the workers (seconds).

    Returns:
        list[VerificationReport]: one per worker (empty when ``off``); differing regions in
        ``mismatched`` / ``engine_mismatched`` and named with parameter, HF name, slice and rank in
        ``problems``.

    Raises:
        RefitVerificationError: ``enforce`` and a worker's engine holds other bytes, or a name is not provable.
        RefitConfigError, RefitTimeoutError: as :func:`refit`.
    """
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    r = RefitCheck(engine, version=version, mode=mode, timeout_s=timeout_s, copy=True)
    r._state_only = True
    with r:
        for name, t in items:
            r.add(name, t, module)
    return r.reports
