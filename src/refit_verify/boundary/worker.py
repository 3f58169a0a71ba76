"""A worker's boundaries, its identity and the session in progress (:class:`WorkerBoundary`).

The design is described in :mod:`refit_verify.boundary`. The module stays whole past 500 lines: it
is one worker's session state machine (open, join, close, audits, certificate), whose steps share
its lock and its open session.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
import torch

from refit_verify.boundary import close_reads
from refit_verify.boundary.layout import read_regions
from refit_verify.boundary.model import ModelBoundary
from refit_verify.boundary.plan import replay_from_env
from refit_verify.boundary.record import ModuleSession, match_any
from refit_verify.boundary.regions import covered
from refit_verify.errors import RefitConfigError, RefitProtocolError
from refit_verify.manifest import (CLOSE_AUDIT, START_BYTES, AuditResult, Certificate, ExternalDigests, Producer, SessionManifest,
                                   Unsessioned, WorkerIdentity)

logger = logging.getLogger("refit_verify")

__all__ = ["ModelBoundary", "SessionDigests", "WorkerBoundary", "identity_of", "match_any"]

MAX_KEPT_MANIFESTS = 16


class _Open:
    """The session in progress on one worker."""

    def __init__(self, session_id: str, version: int | None, opened_by: str, producer: Producer | None, partial: bool,
                 allow: tuple[str, ...], readback: bool, explicit: bool) -> None:
        self.id, self.version, self.opened_by = session_id, version, opened_by
        self.producer, self.partial, self.allow, self.readback = producer, partial, allow, readback
        self.explicit = explicit
        self.depth = 1
        self.unsessioned: list[Unsessioned] = []
        self.stale: str | None = None
        self.misrouted: str | None = None
        self.errors: list[str] = []
        self.started = time.monotonic()
        self.open_s = 0.0  # host seconds of the open (SessionManifest.open_s)
        self.expected: tuple[dict[str, str | None], bool] | None = None  # the sender's digests of the next load_weights call
        self.kept: dict[str, str] = {}  # engine parameter -> why it still holds the previous version
        self.attributed: set[str] = set()  # refused names whose parameters are named in kept
        self.base: int | None = None  # a delta refit: the version it patches (SessionManifest.base)
        self.state = False  # a check of the state (verify_state): nothing is pushed
        self.base_session: tuple[str, int | None] | None = None  # (session, version) closed last on this worker at the open
        self.start: Any = None  # a first session: the engine state prepare read (its close audit's baseline when it replays)


MAX_WRITERS = 64
"""Sessions a parameter written in part is attributed to at most (beyond: not attributed, a failure
for a partial refit that leaves it, until a refit writes it whole)."""


class WorkerBoundary:
    """One worker's model boundaries, identity and session.

    Args:
        identity: the worker's :class:`~refit_verify.manifest.WorkerIdentity`.
        verifying: whether ``REFIT_VERIFY`` is ``log`` or ``enforce`` in this worker; when False
            every wrapper passes through and sessions record nothing.

    Thread safety: sessions are opened and closed under a lock; the loads themselves run on the
    worker's own thread, as vLLM runs them.
    """

    def __init__(self, identity: WorkerIdentity, verifying: bool = True) -> None:
        self.identity = identity
        self.verifying = verifying
        self.modules: dict[str, ModelBoundary] = {}
        self.open_session: _Open | None = None
        self.manifests: dict[str, SessionManifest] = {}
        self.last: SessionManifest | None = None
        self.max_version: int | None = None
        self.loading_context: str | None = None
        self.readback: Callable[[dict[str, ModuleSession], dict[str, ModelBoundary]], Any] | None = None
        self.snapshotter: Callable[..., Any] | None = None  # engine_state.snapshot (its arguments, sessions= too), set by the plugin
        self.auditor: Callable[..., Any] | None = None  # engine_state.audit
        self.baseline: Any = None  # EngineSnapshot left by the last closed session
        self.start: Any = None  # EngineSnapshot read by prepare: the first session's close audit when it replays
        self.pending_audits: list[Any] = []  # failed automatic audits since the last session
        self._replicated: dict[str, bool] = {}
        self._written_version: dict[str, int | None] = {}
        # label -> {session: the regions it wrote (None: not known)} whose writes its bytes are (one written whole
        # last; more when written in part since), and why a label's bytes are no session's (changed outside any
        # refit) until written whole
        self._basis: dict[str, dict[str, frozenset | None]] = {}
        self._taint: dict[str, str] = {}
        self._lock = threading.RLock()

    def attach(self, role: str, model: torch.nn.Module | None, default_loader: Callable | None,
               extra_params: Callable[[torch.nn.Module], Iterable[tuple[str, torch.Tensor]]] | None = None,
               refresh: bool = True) -> ModelBoundary | None:
        """Add (or refresh) the boundary of ``model`` under ``role``; idempotent.

        Args:
            extra_params: ``f(model) -> [(name, tensor)]`` of parameters a reload will swap in (vLLM's
                layerwise reload restores meta copies recorded at load time); their loaders are wrapped too.
            refresh: re-wrap the parameters of an already attached model (False when a session
                opens next: :meth:`open` wraps them anyway).
        """
        if model is None or not callable(getattr(model, "load_weights", None)):
            return None
        with self._lock:
            b = self.modules.get(role)
            if b is not None and b.model is not None and b.model is not model and not isinstance(model, torch.nn.Module):
                return b  # a proxy standing in for the attached model (SkyRL's _LoadWeightsProxy): keep the model's boundary
            if b is None or b.model is not model:
                b = self.modules[role] = ModelBoundary(self, model, role, default_loader, extra_params)
            elif not refresh:
                return b
            b.install()
            return b

    # -- sessions -----------------------------------------------------------------------------

    def open(self, session_id: str | None = None, *, version: int | None = None, opened_by: str = "rpc",
             producer: Producer | None = None, partial: bool = False, allow: Iterable[str] = (), readback: bool = True,
             explicit: bool = True, replay: bool = True, expect_producer: int | None = None, base: int | None = None,
             state: bool = False) -> str:
        """Open a session (or join the one open, for an implicit open); return its id.

        ``replay``: a module may replay the plan its last session left (:mod:`refit_verify.boundary.plan`;
        False: every load is watched by the loader tap and the plan is learned again). Replay needs
        the read-back and the engine-state snapshot, and ``REFIT_VERIFY_REPLAY`` not ``0``.

        ``expect_producer``: the trainer rank that must feed this worker (a receiver that dialled the
        endpoint of its own rank expects that rank); a ``producer`` of another rank is recorded in
        the manifest's ``misrouted`` (a problem of the report). None: any producer.

        ``base``: a delta refit (it patches some tensors in place, the rest must stay as they are):
        the weight version it applies to. The close checks that the last session closed here holds
        that version and that every parameter it writes in part kept its other regions
        (``SessionManifest.delta``); a delta is partial. ``state``: a check of what the engine holds
        (``refit_verify.verify_state``), nothing pushed: a name judged by the state whose regions hold
        other bytes differs, even when they hold what the last close left.

        Raises:
            RefitProtocolError: an explicit open while another explicit session is open (close it first),
                ``session_id`` names a session already closed here, or a bad argument.
        """
        if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
            raise RefitProtocolError(f"session version must be an int or None, got {version!r}")
        if base is not None and (isinstance(base, bool) or not isinstance(base, int)):
            raise RefitProtocolError(f"delta base must be an int or None, got {base!r}")
        partial = partial or base is not None
        with self._lock:
            cur = self.open_session
            if cur is not None:
                if session_id is not None and session_id == cur.id:
                    cur.depth += 1
                    return cur.id
                if not explicit or not cur.explicit:
                    cur.depth += 1
                    if not explicit:
                        cur.opened_by = cur.opened_by if opened_by in cur.opened_by else f"{cur.opened_by}+{opened_by}"
                        if producer is not None and cur.producer is None:
                            cur.producer = producer
                        cur.misrouted = cur.misrouted or self._misrouted(producer, expect_producer)
                        return cur.id
                    # an explicit open joins an implicit one: it takes the session over
                    cur.explicit, cur.id = True, session_id or cur.id
                    if version is not None:
                        cur.version, cur.stale = version, self._stale(version)
                    cur.partial, cur.allow, cur.readback = partial, tuple(allow), readback
                    cur.base, cur.state = base, state
                    cur.base_session = (self.last.session, self.last.version) if self.last is not None else None
                    if not replay:
                        for b in self.modules.values():
                            b.end_replay("the session was opened with replay=False (after a failed refit)")
                    return cur.id
                raise RefitProtocolError(f"worker rank {self.identity.rank}: session {cur.id!r} (opened by {cur.opened_by}) is "
                                         f"still open; close it before opening {session_id!r}")
            if session_id is not None and (session_id in self.manifests or any(session_id in w for w in self._basis.values())):
                raise RefitProtocolError(f"worker rank {self.identity.rank}: session id {session_id!r} names a session already "
                                         "closed on this worker; each refit needs an id of its own")
            t0 = time.perf_counter()
            sid = session_id or uuid.uuid4().hex[:16]
            s = _Open(sid, version, opened_by, producer, partial, tuple(allow), readback, explicit)
            s.stale = self._stale(version)
            s.misrouted = self._misrouted(producer, expect_producer)
            s.base, s.state = base, state
            s.base_session = (self.last.session, self.last.version) if self.last is not None else None
            derive = readback and self.readback is not None
            # the close audit must be able to see a write outside the plan: a snapshot at the close, and the
            # last close's (the first session: prepare's, the engine as it was started); the environment is
            # read before anything of the worker changes (a bad value raises)
            replay = (replay and derive and self.snapshotter is not None
                      and (self.baseline if self.last is not None else self.start) is not None and replay_from_env())
            for b in self.modules.values():
                rec = b.take_unsessioned()
                if rec is not None:
                    s.unsessioned.append(rec)
            if self.last is None and s.unsessioned:
                self._drop_start()  # loaded outside any session since prepare read it: not the state it was started with
            if self.last is None:
                s.start = self.start  # this session's baseline, whatever happens to the worker's meanwhile
                replay = replay and s.start is not None
            for b in self.modules.values():
                b.begin(derive=derive, replay=replay)
            self.open_session = s
            s.open_s = time.perf_counter() - t0
            return sid

    def _stale(self, version: int | None) -> str | None:
        """Why a session of weight ``version`` is out of order on this worker, or None.

        The one order check of every path (``refit``, ``push``, ``RefitSender``, the broadcast and
        vLLM's native API all open their sessions here): a versioned session must not be older than
        a versioned session already closed on this worker. The same version again is a repeat (TRL
        syncs again at the same ``global_step`` after a failed or interrupted sync), not out of
        order; its bytes are verified like any other. An unversioned session (None) is never out of
        order and leaves the order as it is.
        """
        if version is None or self.max_version is None or version >= self.max_version:
            return None
        return f"version {version} is older than version {self.max_version} already closed on this worker"

    def restart_versions(self, reason: str) -> int | None:
        """Forget the newest closed version, so that the next versions may be older (a trainer
        resumed from an earlier checkpoint into an engine that stayed up). Logged with ``reason``.

        Returns:
            int | None: the version forgotten (None: no versioned session had closed).

        Raises:
            RefitConfigError: ``reason`` is not a non-empty string.
            RefitProtocolError: a session is open on this worker (restart between refits).
        """
        if not isinstance(reason, str) or not reason.strip():
            raise RefitConfigError(f"restart_versions needs a reason (a non-empty string), got {reason!r}")
        with self._lock:
            if self.open_session is not None:
                raise RefitProtocolError(f"worker rank {self.identity.rank}: session {self.open_session.id!r} is open; "
                                         "restart the version order between refits")
            forgotten, self.max_version = self.max_version, None
        logger.warning("refit-verify: worker rank %s: version order restarted (newest closed was %s): %s",
                       self.identity.rank, forgotten, reason)
        return forgotten

    def _misrouted(self, producer: Producer | None, expect: int | None) -> str | None:
        """Why ``producer``'s payload must not feed this worker (it expects trainer rank ``expect``), or None."""
        if producer is None or expect is None or producer.rank == expect:
            return None
        w = self.identity
        return (f"worker rank {w.rank} (tp {w.tp}, pp {w.pp}) received the payload of producer rank {producer.rank} "
                f"({producer.device}); it must be fed by producer rank {expect}")

    def close(self, session_id: str | None = None, *, explicit: bool = True,
              expected: dict[str, dict[str, tuple[str, tuple[int, ...], str]]] | None = None) -> SessionManifest | None:
        """Close the session (an implicit close only leaves a joined one); return its manifest.

        ``expected``: ``{module: {name: (trainer's 32-hex, shape, dtype name)}}`` of every tensor the
        trainer announced; each one no ``load_weights`` of the session delivered (a direct write, a
        restore) is judged by what the engine holds where the module's layout map puts it
        (:meth:`ModelBoundary.judge_state`).

        Returns None when an implicit close left the session open (it was joined) or none is open.

        Raises:
            RefitProtocolError: ``session_id`` names another session than the one open.
        """
        with self._lock:
            s = self.open_session
            if s is None:
                return None
            if session_id is not None and session_id != s.id:
                raise RefitProtocolError(f"worker rank {self.identity.rank}: session {session_id!r} is not open (open: {s.id!r})")
            s.depth -= 1
            if s.depth > 0 and not (explicit and s.explicit):
                return None
            if not explicit and s.explicit:
                return None
            t0 = time.perf_counter()
            self.open_session = None
            sessions = {role: b.end() for role, b in self.modules.items()}
            for role, ms in sessions.items():  # writes under a tied parameter's other name count under its index name
                idx = self.modules[role].index(refresh=False)
                if idx is not None and idx.aliases:
                    ms.fold_aliases(idx.aliases)
            errors = list(s.errors)
            reads = close_reads.CloseReads()
            # announced, not delivered: judged by the engine state (layout map), after the snapshot read their regions
            todos = {role: todo for role, ms in sessions.items()
                     if (todo := {n: v for n, v in (expected or {}).get(role, {}).items()
                                  if n not in ms.delivered and n not in ms.replayed and n not in ms.refused and n not in ms.withheld})}
            maps = self._state_maps(sessions, todos, errors, reads)
            if s.base is not None:
                self._plan_delta(sessions, todos, reads)
            elif s.partial or s.allow:  # parameters such a refit writes in part are not failures: read in the state pass
                self._plan_rest(sessions, reads)
            written = self._note_written(s, sessions)
            previous = self.baseline
            if self.last is None and s.start is not None and any(ms.replayed for ms in sessions.values()):
                previous = s.start  # a first session that replayed a plan learned dry: compared with the state prepare read
            # read back when asked, and always when a delivered tensor is proven only where it landed
            reading = self.readback is not None and (s.readback or any(ms.derived for ms in sessions.values()))
            if reading:
                for role, ms in sessions.items():
                    idx = self.modules[role].index(refresh=False)
                    if idx is not None:
                        reads.plan_session(role, ms, idx.params)
            # the engine state first, in one pass: read-back takes a parameter written whole from its digest, and
            # the regions the close planned (fused blocks; a kept read-back program's) are read in the snapshot's
            # launch. The model indexes are checked once per close (snapshot, read-back and the manifests use them
            # as they are): by the snapshot, while the device reads the state (refresh=True)
            if self.snapshotter is None:
                self._refresh_indexes()
            else:
                try:
                    riding = {role: ms for role, ms in sessions.items() if role not in todos} if reading else None
                    self.baseline = self.snapshotter(self.modules, self.identity, s.id, s.version, dict(self._replicated),
                                                     dict(self._written_version), sessions=riding, refresh=True, reads=reads)
                except Exception as e:  # noqa: BLE001 - reported, never silent
                    logger.exception("refit-verify: engine-state snapshot failed on worker rank %s", self.identity.rank)
                    errors.append(f"engine-state snapshot failed: {type(e).__name__}: {e}"[:500])
                    self.baseline = None
                    self._refresh_indexes()  # a snapshot that failed may have checked some of them, or none
            judged: dict[str, dict] = {}
            for role, todo in todos.items():
                if role not in maps:
                    continue
                try:
                    judged[role] = self.modules[role].judge_state(sessions[role], todo, since_last=not s.state, reads=reads,
                                                                  m=maps[role])
                except Exception as e:  # noqa: BLE001 - reported, never silent: those names are not provable
                    logger.exception("refit-verify: judging by the engine state failed on worker rank %s", self.identity.rank)
                    errors.append(f"judging {len(todo)} names by the engine state failed: {type(e).__name__}: {e}"[:500])
            if todos:  # the parameters judging found written: recorded as a watched load's would have been
                written = self._note_written(s, sessions, restamp=written)
            known = {k: v.digest for k, v in self.baseline.params.items()} if self.baseline is not None else None
            engine = None
            if reading:
                try:
                    engine = self.readback(sessions, self.modules, known=known, reads=reads)
                except Exception as e:  # noqa: BLE001 - reported, never silent
                    logger.exception("refit-verify: read-back failed on worker rank %s", self.identity.rank)
                    errors.append(f"read-back failed: {type(e).__name__}: {e}"[:500])
            for role, ms in sessions.items():
                self.modules[role].learn(ms, read_back=engine is not None)
                prefix = "" if role == "model" else f"{role}:"
                states = engine.params if engine is not None else None
                self.modules[role].learn_layout(
                    ms, (lambda p, pre=prefix, st=states, w=ms.written: st is not None and p in w
                         and getattr(st.get(pre + p), "status", None) == "verified"),
                    f"session {s.id}")
            delta, proven = self._delta(s, sessions, judged, reads) if s.base is not None else ([], set())
            modules = {role: self.modules[role].manifest(ms, s.allow) for role, ms in sessions.items()}
            rest: dict[str, list[str]] = {}
            if s.base is None:  # the parameters written in part (``ModuleSession.in_part``, filled by the manifests)
                rest, whole = self._rest_changed(sessions, judged, reads)
                if s.partial:
                    proven = whole
            self._keep_regions(sessions, previous, judged)
            # written in part (``allow`` or not): their other regions hold earlier writes
            partly = {("" if role == "model" else f"{role}:") + n for role, ms in sessions.items() for n in ms.in_part} & written
            for role, mm in modules.items():  # parameters a delta or a partial refit wrote in part whose other regions it proved unchanged
                prefix = "" if role == "model" else f"{role}:"
                mm.unwritten = [u for u in mm.unwritten if prefix + u.split(" (", 1)[0] not in proven]
            errors += [e for ms in sessions.values() for e in ms.errors]
            regions = {("" if role == "model" else f"{role}:") + k: frozenset(v.items())
                       for role, ms in sessions.items() for k, v in ms.written.items()}
            touched = {role for role, ms in sessions.items() if ms.written or ms.delivered}
            unchanged, unchanged_by, tainted = self._audit_unwritten(previous, written, partly, s.id, regions,
                                                                     adopt=() if s.partial else tuple(s.allow), roles=touched,
                                                                     rest=rest)
            audits, self.pending_audits = self.pending_audits, []
            man = SessionManifest(session=s.id, version=s.version, opened_by=s.opened_by, worker=self.identity, modules=modules,
                                  producer=s.producer, unsessioned=s.unsessioned, stale=s.stale, engine=engine,
                                  partial=s.partial, errors=errors, audits=audits, unchanged=unchanged,
                                  unchanged_since=previous.session if unchanged else None, unchanged_by=unchanged_by, tainted=tainted,
                                  state_digest=self.baseline.state_digest() if self.baseline is not None else None,
                                  closed_at=time.time(),
                                  snapshot_s=self.baseline.digest_s if self.baseline is not None else 0.0, open_s=s.open_s,
                                  misrouted=s.misrouted, base=s.base,
                                  base_session=s.base_session[0] if s.base_session is not None else None, delta=delta,
                                  reads=reads.summary())
            # the order moves only with a session that wrote something: one that loaded nothing (aborted
            # before its first load) left the engine as it was and orders nothing after it
            if s.version is not None and written and (self.max_version is None or s.version > self.max_version):
                self.max_version = s.version
            self.manifests[s.id] = man
            while len(self.manifests) > MAX_KEPT_MANIFESTS:
                self.manifests.pop(next(iter(self.manifests)))
            self.last = man
            self._drop_start()  # (the first close's rest comparisons are done)
            man.close_s = time.perf_counter() - t0
            return man

    def _delta(self, s: _Open, sessions: dict[str, ModuleSession], read: dict[str, dict],
               reads: close_reads.CloseReads | None = None) -> tuple[list[str], set[str]]:
        """What keeps delta session ``s`` from proving "the base's state + this patch = the engine's
        state now", one sentence each; and the parameters it wrote in part whose other regions (the
        layout map's) it proved unchanged since the last close. Parameters it did not write at all
        are the close audit's (:meth:`_audit_unwritten`). The regions read go to ``read[role]``."""
        out: list[str] = []
        proven: set[str] = set()
        base, last = s.base, s.base_session
        if last is None:
            out.append(f"a delta on version {base}, but no session has closed on this worker: there is no verified state to patch")
        elif last[1] != base:
            out.append(f"a delta on version {base}, but the last session closed on this worker ({last[0]!r}) holds version {last[1]}")
        for label, total, got, n, changed, unknown in self._rests(sessions, read, reads):
            if changed:
                out.append(f"{label}: {', '.join(changed)} changed since the last close, and this delta did not announce them")
            if unknown:
                out.append(f"{label}: {', '.join(unknown)} were not read at the last close, so they are not proven unchanged")
            if got + n < total and not changed and not unknown:
                out.append(f"{label}: {total - got - n} of its elements are in no region of the layout map (padding?), so "
                           "they are not proven unchanged")
            if not (changed or unknown) and got + n >= total:
                proven.add(label)
        return out, proven

    def _rests(self, sessions: dict[str, ModuleSession], read: dict[str, dict], reads: close_reads.CloseReads | None,
               manifested: bool = False):
        """For each parameter a session wrote in part, ``(label, its elements, elements written, elements
        in the layout map's other regions, those that changed since the last close read them, those it
        did not read)`` (:meth:`ModelBoundary.unchanged_rest`); the regions read now go to ``read[role]``.
        ``manifested``: the sessions' manifests were made (their ``in_part`` lists those parameters)."""
        for role, ms in sessions.items():
            b = self.modules[role]
            prefix = "" if role == "model" else f"{role}:"
            for pname in (ms.in_part if manifested else ms.written):
                w = ms.written.get(pname)
                total = ms.param_numel.get(pname, 0)
                got = covered(w) if w else 0
                if w is None or got >= total:
                    continue
                n, changed, unknown, now = b.unchanged_rest(pname, w, reads)
                read.setdefault(role, {}).update(now)
                yield prefix + pname, total, got, n, changed, unknown

    def _plan_rest(self, sessions: dict[str, ModuleSession], reads: close_reads.CloseReads) -> None:
        """Plan, for the close of a partial refit or one with ``allow``, the layout map's regions in the
        parameters its session wrote in part, so the state pass reads them: those whose written regions
        hold fewer elements than the parameter (no union computed here: one written in part by
        overlapping writes is read after the pass); :meth:`_rest_changed` compares the regions it did
        not write with what the last close read."""
        for role, ms in sessions.items():
            b = self.modules[role]
            m, idx = b.layout, b.index(refresh=False)
            if m is None or idx is None or m.index() is not idx:
                continue
            part = {p for p, w in ms.written.items() if sum(w.values()) < ms.param_numel.get(p, 0)}
            if part:
                names = [n for n, rs in m.entries.items() if any(p in part for p, _g in rs)]
                reads.plan(role, close_reads.map_regions(m, names, idx.params))

    def _rest_changed(self, sessions: dict[str, ModuleSession], read: dict[str, dict],
                      reads: close_reads.CloseReads | None = None) -> tuple[dict[str, list[str]], set[str]]:
        """For a close: the parameters its session wrote in part whose other regions (the layout
        map's) changed since the last close read them, ``{label: [region descriptions]}``, and those
        whose other elements are all in such regions, found unchanged. The regions read go to
        ``read[role]`` (kept for the next close). Regions the last close did not read, and elements in
        no region of the map, are not compared (the report's ``unchecked`` names the parameter)."""
        out: dict[str, list[str]] = {}
        proven: set[str] = set()
        for label, total, got, n, changed, unknown in self._rests(sessions, read, reads, manifested=True):
            if changed:
                out[label] = changed
            elif not unknown and got + n >= total:
                proven.add(label)
        return out, proven

    def _state_maps(self, sessions: dict[str, ModuleSession], todos: dict[str, dict], errors: list[str],
                    reads: close_reads.CloseReads) -> dict[str, Any]:
        """The layout map of each module with names to judge by the state (``todos``), learned dry where
        it lacks them; their regions (and, for a delta, the map's other regions in the parameters it
        touches) planned for the close's state pass. A module whose map failed is left out (its
        names are said in ``errors``)."""
        maps: dict[str, Any] = {}
        for role, todo in todos.items():
            b = self.modules[role]
            try:
                m = maps[role] = b.state_map(sessions[role], todo)
            except Exception as e:  # noqa: BLE001 - reported, never silent: those names are not provable
                logger.exception("refit-verify: judging by the engine state failed on worker rank %s", self.identity.rank)
                errors.append(f"judging {len(todo)} names by the engine state failed: {type(e).__name__}: {e}"[:500])
                continue
            idx = b.index(refresh=False)
            if m is not None and idx is not None:
                reads.plan(role, close_reads.map_regions(m, todo, idx.params))
        return maps

    def _plan_delta(self, sessions: dict[str, ModuleSession], todos: dict[str, dict], reads: close_reads.CloseReads) -> None:
        """Plan, for a delta's close, the layout map's regions in every parameter it writes (loaded or
        judged by the state): :meth:`_delta` reads the ones it did not write."""
        for role, ms in sessions.items():
            b = self.modules[role]
            m, idx = b.layout, b.index(refresh=False)
            if m is None or idx is None or m.index() is not idx:
                continue
            names = [n for n, rs in m.entries.items() if any(p in ms.written for p, _g in rs)]
            touched = {p for n in todos.get(role, ()) for p, _g in m.entries.get(n, ())}
            names += [n for n, rs in m.entries.items() if any(p in touched for p, _g in rs)]
            reads.plan(role, close_reads.map_regions(m, dict.fromkeys(names), idx.params))

    def _note_written(self, s: _Open, sessions: dict[str, ModuleSession], restamp: set[str] | None = None) -> set[str]:
        """Record what the closing session ``s`` wrote (replicated, written version); return the labels
        written. ``restamp``: the labels found written before the snapshot: the parameters written since
        (judged by the state) get their records in the snapshot just taken updated."""
        written: set[str] = set()
        for role, ms in sessions.items():
            prefix = "" if role == "model" else f"{role}:"
            self._replicated.update({prefix + k: v for k, v in ms.replicated.items()})
            self._written_version.update({prefix + k: s.version for k in ms.written})
            written.update(prefix + k for k in ms.written)
        if restamp is not None and self.baseline is not None:
            for label in written - restamp:
                st = self.baseline.params.get(label)
                if st is not None:
                    st.replicated, st.written_version = bool(self._replicated.get(label, False)), self._written_version.get(label)
        return written

    def _keep_regions(self, sessions: dict[str, ModuleSession], previous: Any, judged: dict[str, dict]) -> None:
        """Keep what each layout-map region held at this close (:attr:`ModelBoundary.region_table`):
        the regions read now (read-back, judgements), and the earlier entries of parameters whose
        bytes the snapshot found unchanged since the last close."""
        now = self.baseline
        for role, b in self.modules.items():
            prefix = "" if role == "model" else f"{role}:"
            keep: dict = {}
            if previous is not None and now is not None and b.region_table:
                same = {n for n, st in now.params.items() if (p := previous.params.get(n)) is not None and p.digest == st.digest}
                keep = {r: h for r, h in b.region_table.items() if prefix + r[0] in same}
            ms = sessions.get(role)
            if ms is not None:
                keep.update(ms.region_hex)
            keep.update(judged.get(role, {}))
            b.region_table = keep

    def _audit_unwritten(self, previous: Any, written: set[str], partly: set[str], sid: str,
                         regions: dict[str, frozenset], adopt: tuple[str, ...] = (), roles: set[str] | None = None,
                         rest: dict[str, list[str]] | None = None) -> tuple[int, dict[str, list[str]], dict[str, list[str]]]:
        """Compare the parameters closing session ``sid`` did not write with the state the last session
        left (``previous``): a partial refit, or names exempt through ``allow``, must not make bytes that
        changed outside any load the new baseline unnoticed. What changed is reported with this
        session (an :class:`~refit_verify.manifest.AuditResult` with trigger :data:`CLOSE_AUDIT`);
        names an automatic audit already reported are left out. Then the labels' records move on: a
        label written whole is ``sid``'s alone; one written in part (``partly``, its ``regions``) adds
        ``sid`` to its writers and drops those whose regions later writes cover together; one
        that changed with no write is no session's until written whole (as is one written in part
        by more than :data:`MAX_WRITERS` sessions since). A label no session wrote holds what the
        engine was started with: reported as such (in the modules ``roles`` this session wrote to; a
        drafter no refit feeds keeps its own weights), unless ``sid`` is a full refit whose ``allow``
        patterns (``adopt``) exempt it, which then answers for it. ``rest``: labels written in part whose
        other regions changed outside any refit (:meth:`_rest_changed`), reported and kept as those.

        Returns:
            ``(unchanged, by session, tainted)``: the parameters found holding the bytes ``previous``
            recorded (empty placeholders, whose bytes live elsewhere, not counted; 0 when there is
            nothing to compare with); ``{session id: labels}`` of the parameters not written, or
            written in part, by the sessions that wrote their bytes; ``{why: labels}`` of those whose
            bytes changed outside any refit before, and (key :data:`~refit_verify.manifest.START_BYTES`)
            of those no session wrote.
        """
        now = self.baseline
        fresh: set[str] = set()  # not written and not compared: recorded, not reported by this session
        unchanged = 0
        if now is not None and previous is None and self.last is not None:
            # a session closed before, but its snapshot failed: nothing to compare with
            last = self.last
            fresh = {n for n in now.params if n not in written}
            if fresh:
                self.pending_audits.append(AuditResult(
                    worker=self.identity, since_session=last.session, since_version=last.version, changed=[], moved=[],
                    trigger=CLOSE_AUDIT, tensors=len(now.params),
                    problems=[f"the engine-state snapshot at the close of session {last.session!r} failed: the "
                              f"{len(fresh)} parameters this session did not write are not compared with what it left"]))
                why = f"not compared with what session {last.session!r} left (its engine-state snapshot failed)"
                self._taint.update(dict.fromkeys(fresh, why))
        elif now is not None and previous is not None:
            seen = {n for a in self.pending_audits for n in a.changed}
            compared = [(n, st) for n, st in now.params.items() if n not in written and n in previous.params]
            differ = [n for n, st in compared if previous.params[n].digest != st.digest]
            changed = [n for n in differ if n not in seen]
            if changed:
                self.pending_audits.append(AuditResult(worker=self.identity, since_session=previous.session,
                                                       since_version=previous.version, changed=changed, moved=[],
                                                       trigger=CLOSE_AUDIT, tensors=len(now.params)))
            unchanged = sum(1 for n, st in compared if 0 not in st.shape and previous.params[n].digest == st.digest)
            fresh = set(differ)
            self._taint.update(dict.fromkeys(differ, f"changed outside any refit (found at the close of session {sid!r})"))
        if rest:
            seen = {n for a in self.pending_audits for n in a.changed}
            changed = [n for n in rest if n not in seen]
            since = previous if previous is not None else self.last
            if changed:
                self.pending_audits.append(AuditResult(
                    worker=self.identity, since_session=getattr(since, "session", None),
                    since_version=getattr(since, "version", None), changed=changed,
                    moved=[], trigger=CLOSE_AUDIT, tensors=len(now.params) if now is not None else 0,
                    problems=[f"{n}: {', '.join(rest[n])} changed since "
                              f"{'the last close' if getattr(since, 'session', None) is not None else 'the engine started'}, "
                              "and this refit did not write them" for n in changed]))
            fresh |= set(rest)
            self._taint.update(dict.fromkeys(rest, f"changed outside any refit (found at the close of session {sid!r})"))
        for n in written:
            key = regions.get(n) or None
            if n not in partly:
                self._basis[n] = {sid: key}
                self._taint.pop(n, None)
                continue
            kept = dict(self._basis.get(n, {}))
            kept.pop(sid, None)
            kept[sid] = key
            later: frozenset = frozenset()  # the regions written after each writer: one they cover is dropped
            for w in reversed(list(kept)):
                k = kept[w]
                if w != sid and k and later and k <= later:
                    del kept[w]
                elif k:
                    later = later | k
            if len(kept) > MAX_WRITERS:
                kept = {}
                self._taint[n] = f"written in part by more than {MAX_WRITERS} refits since last written whole (not attributed)"
            self._basis[n] = kept
        by: dict[str, list[str]] = {}
        tainted: dict[str, list[str]] = {}
        labels = now.params if now is not None else ()
        for n in labels:
            if (n in written and n not in partly) or n in fresh:
                continue
            for w in sorted(self._basis.get(n, ())):
                if w != sid:  # (written in part: the writers of its other regions)
                    by.setdefault(w, []).append(n)
            if (why := self._taint.get(n)) is not None:
                tainted.setdefault(why, []).append(n)
            elif n not in self._basis:
                role, sep, rest = n.partition(":")
                role, rest = (role, rest) if sep and role in self.modules else ("model", n)
                if adopt and match_any(rest, adopt):
                    self._basis[n] = {sid: None}  # exempt by a full refit: it answers for what it left there
                elif roles is None or role in roles:
                    tainted.setdefault(START_BYTES, []).append(n)
        return unchanged, by, tainted

    def abandon(self, session_id: str, why: str) -> None:
        """End an implicit session whose closing call never came (its manifest records ``why``)."""
        with self._lock:
            s = self.open_session
            if s is None or s.id != session_id:
                return
            s.errors.append(f"session abandoned: {why}")
            if s.explicit:
                s.depth = max(1, s.depth - 1)
                return
            s.depth = 1
            self.close(session_id, explicit=False)

    def expect(self, digests: dict[str, str | None], enforce: bool) -> None:
        """Hand the next ``load_weights`` call of the open session the sender's digests of its tensors:
        it checks them before loading (and in ``enforce`` refuses what differs)."""
        with self._lock:
            if self.open_session is not None:
                self.open_session.expected = (dict(digests), bool(enforce))

    def take_expected(self) -> tuple[dict[str, str | None], bool] | None:
        """The digests :meth:`expect` left for this call (taken once), or None."""
        s = self.open_session
        if s is None or s.expected is None:  # the common case, read without the lock: nothing to take
            return None
        with self._lock:
            s = self.open_session
            if s is None or s.expected is None:
                return None
            out, s.expected = s.expected, None
            return out

    def refused_names(self, role: str = "model") -> list[str]:
        """Names the open session refused before loading, in module ``role``."""
        b = self.modules.get(role)
        return list(b.session.refused) if b is not None and b.session is not None else []

    def note_kept(self, kept: dict[str, str], withheld: dict[str, str] | None = None, attributed: Iterable[str] = (),
                  role: str = "model") -> None:
        """Record, in the open session, parameters that still hold the previous version (``kept``:
        ``{parameter: why}``), delivered names that never landed with them (``withheld``: ``{name:
        why}``, left out of the manifest's digests) and the refused names those account for."""
        with self._lock:
            s = self.open_session
            if s is None:
                return
            s.kept.update(kept)
            s.attributed.update(attributed)
            b = self.modules.get(role)
            if b is not None and b.session is not None:
                if withheld:
                    b.session.withhold(withheld)
                if kept:  # names replayed into a put-back layer (their tensors were not watched)
                    b.session.withhold_kept(kept)

    def outcome(self, closing: bool = False) -> tuple[dict[str, str], list[str], dict[str, str]]:
        """What the open session did to the engine: ``(rejected, landed, kept)``.

        ``rejected``: ``{delivered name: why}`` refused before loading or withheld; ``landed``:
        parameters written (drafter ones prefixed ``"drafter:"``); ``kept``: ``{parameter: why}``
        of what still holds the previous version (a refused name whose parameters are not known
        is listed under its own name). ``closing``: nothing more is loaded in this session (it is
        closed or abandoned next), so a session that replayed its whole plan takes the plan's
        records as a whole (:func:`refit_verify.boundary.plan.expand`), as the close would."""
        with self._lock:
            s = self.open_session
            rejected: dict[str, str] = {}
            landed: list[str] = []
            kept = dict(s.kept) if s is not None else {}
            for role, b in self.modules.items():
                ms = b.session
                if ms is None:
                    continue
                ms.expand(whole=closing)
                prefix = "" if role == "model" else f"{role}:"
                for n, (_h, why) in ms.refused.items():
                    rejected[prefix + n] = why
                    if s is not None and n not in s.attributed:
                        kept.setdefault(prefix + n, f"not loaded: {why}")
                for n, why in ms.withheld.items():
                    rejected.setdefault(prefix + n, why)
                landed += [prefix + p for p in ms.written]
            return rejected, landed, kept

    def note_error(self, message: str) -> None:
        """Record a worker-side error in the open session (reported in its manifest)."""
        with self._lock:
            if self.open_session is not None:
                self.open_session.errors.append(message[:500])

    def snapshot(self) -> tuple[dict[str, str], int, int, float]:
        """Digests so far of the open session, without closing it: (digests, calls, tensors, digest seconds)."""
        with self._lock:
            digests: dict[str, str] = {}
            calls = tensors = 0
            secs = 0.0
            for b in self.modules.values():
                ms = b.session
                if ms is None:
                    continue
                ms.expand()
                digests.update(ms.digests())
                digests.update(ms.landed_now())  # tensors left to read-back: where they landed, as of now
                calls, tensors, secs = calls + ms.calls, tensors + ms.tensors, secs + ms.digest_s
            return digests, calls, tensors, secs

    def prepare(self, timeout_s: float = 5.0, specs: dict[str, dict[str, tuple[tuple[int, ...], str]]] | None = None) -> bool:
        """Build now, before any refit, what a session's close would otherwise build at the first
        refit and keep after it: each model's index (:meth:`ModelBoundary.index`) and the engine-state
        kept set, read once (the snapshot's :class:`~refit_verify.digest.kept.DigestSet`, planned and
        checked once per index: :func:`refit_verify.engine.state.snapshot`). The snapshot read here
        is kept as :attr:`start`: no audit or certificate compares with it, only the close of a first
        session that replays a plan learned ahead (its close audit: what changed since, outside the
        plan's writes, is reported; the session keeps the reference it opened with), and it is dropped
        at the first close, or at the first open after a load outside any session (or when the engine
        discards its weights: :meth:`discarded`). With such a plan, the layout map's regions inside
        parameters are read too (``ModelBoundary.region_start``): a partial first session compares the
        regions it did not write with them, as later ones compare with the last close's.

        ``specs``: ``{role: {name: (shape, dtype name)}}``, the tensors a refit of that module is expected
        to push: the loaders' placements for them are learned ahead
        (:meth:`ModelBoundary.learn_ahead <refit_verify.boundary.model.ModelBoundary.learn_ahead>`; a name
        pushed otherwise is learned at its refit, as without them), and the regions inside parameters
        that such a refit's read-back reads are planned for the snapshot here, so the close's one kept
        set over the state and those regions is built now. It is a plan of what to read: the first
        close reads every byte again, and one whose session wrote other regions plans and builds its
        own (``engine.state._extra_launch``: the set is kept per plan).

        Returns False (nothing done) when a session is open or has closed (its close built them),
        or the worker's lock was not free within ``timeout_s``. Raises what the snapshot raises.
        """
        if not self._lock.acquire(timeout=timeout_s):
            return False
        try:
            if self.open_session is not None or self.last is not None or not self.modules:
                return False
            reads = close_reads.CloseReads()
            for role, sp in (specs or {}).items():
                b = self.modules.get(role)
                if b is not None and sp and self.verifying:
                    reads.plan(role, b.learn_ahead(sp)[2])
            if self.snapshotter is None:
                self._refresh_indexes()
            else:  # as the close calls it (indexes checked inside, the state and planned regions read through one kept set)
                self.start = self.snapshotter(self.modules, self.identity, None, None, {}, {}, refresh=True, reads=reads)
                self._rehearse()
                self._remember_regions()
            return True
        finally:
            self._lock.release()

    def _drop_start(self) -> None:
        """Forget what prepare read at engine start (:attr:`start`, each module's ``region_start``)."""
        self.start = None
        for b in self.modules.values():
            b.region_start = {}

    def _remember_regions(self) -> None:
        """For modules with a plan and a layout map learned ahead, read the map's regions inside
        parameters now (``ModelBoundary.region_start``): what a partial first session that replays
        compares the regions it did not write with (:meth:`ModelBoundary.unchanged_rest`)."""
        for b in self.modules.values():
            m, idx = b.layout, b.index(refresh=False)
            if b.plan is None or m is None or idx is None or m.index() is not idx:
                continue
            try:
                b.region_start = read_regions(idx.params, close_reads.map_regions(m, list(m.entries), idx.params))
            except Exception:  # noqa: BLE001 - not compared then (the report's unchecked names them), as without it
                logger.warning("refit-verify: reading the layout map's regions at engine start failed", exc_info=True)
                b.region_start = {}

    def _rehearse(self) -> None:
        """For modules with a plan (learned ahead), build what the close of a session replaying it
        whole keeps for the next one: its read-back program (run once: the comparisons of a scratch
        record, dropped), then the snapshot's one launch over the state and the program's regions,
        run twice (a kept plan's direct launches are checked at its second run). The state read
        last is :attr:`start`. A failure leaves the first close to build them."""
        def rehearsals() -> dict[str, ModuleSession]:  # fresh each time: a read-back fills in its record
            return {role: ms for role, b in self.modules.items() if (ms := b.rehearsal()) is not None}

        first = rehearsals() if self.readback is not None and self.start is not None else {}
        if not first:
            return
        try:
            self.readback(first, self.modules, known={k: v.digest for k, v in self.start.params.items()})
            for _ in range(2):
                self.start = self.snapshotter(self.modules, self.identity, None, None, {}, {}, sessions=rehearsals(),
                                              refresh=True)
        except Exception:  # noqa: BLE001 - only work done ahead: the first close does it instead
            logger.warning("refit-verify: building the first close's read-back program ahead failed", exc_info=True)
        finally:
            for b in self.modules.values():
                idx = b.index(refresh=False)
                kept = idx.kept.get("read_back") if idx is not None else None
                if kept is not None:
                    kept[1].pre = None  # the scratch record's digests: no close takes them

    def own_seconds(self) -> float:
        """Host seconds this worker's boundaries spent in their own code during loads, so far (monotonic;
        :meth:`ModelBoundary.own_seconds <refit_verify.boundary.model.ModelBoundary.own_seconds>`)."""
        return sum(b.own_seconds() for b in list(self.modules.values()))

    def _refresh_indexes(self) -> None:
        for b in self.modules.values():
            b.index()

    def state(self) -> Any:
        """Digest the engine state now (every parameter and persistent buffer, storage pointers)."""
        self._refresh_indexes()
        last = self.last
        return self.snapshotter(self.modules, self.identity, last.session if last else None, last.version if last else None,
                                dict(self._replicated), dict(self._written_version))

    def audit(self, trigger: str = "rpc") -> Any:
        """Re-digest the engine state and compare with the state the last session left.

        Returns:
            AuditResult | None: None when no session has closed on this worker yet (nothing to audit
            against). An automatic audit (``trigger`` other than ``"rpc"``) that fails outside a
            session is kept and reported with the next session's manifest.
        """
        with self._lock:
            if self.snapshotter is None or self.auditor is None:
                return None
            if self.baseline is None:
                last = self.last
                if last is None:
                    return None
                return AuditResult(worker=self.identity, since_session=last.session, since_version=last.version, changed=[],
                                   moved=[], trigger=trigger, problems=["the engine-state snapshot at that session's close "
                                                                        "failed: there is nothing to audit against"])
            res = self.auditor(self.baseline, self.state(), trigger)
            last = self.last
            if trigger == "rpc" and last is not None and last.errors:  # (automatic ones: the next refit rewrites it)
                res = msgspec.structs.replace(res, problems=[*res.problems, (
                    f"its baseline is the state session {last.session!r} left, which recorded errors ({last.errors[0]})"
                    f"{f' and {len(last.errors) - 1} more' if len(last.errors) > 1 else ''}: it is not verified")[:1000]])
            if trigger != "rpc" and not res.ok and self.open_session is None:
                logger.warning("refit-verify: %s", res.describe())
                self.pending_audits.append(res)
            return res

    def discarded(self, why: str) -> Any:
        """After the engine discarded its weights on purpose (``why``: vLLM's sleep at level 2 frees them,
        and their memory holds nothing meaningful after the wake until they are written again): the
        engine state is compared with the last close's as after any wake, and what changed is kept as
        changed outside any refit (until written whole: a refit leaving it fails, as do audits and
        certificates meanwhile), not as a failed audit the next refit reports.

        Returns:
            AuditResult | None: the comparison (None: no session has closed here, or no baseline).
        """
        with self._lock:
            self._drop_start()  # not what the engine holds now: the first session replays nothing
            if self.snapshotter is None or self.auditor is None or self.baseline is None:
                return None
            res = self.auditor(self.baseline, self.state(), "wake_up")
            if res.changed:
                self._taint.update(dict.fromkeys(res.changed, f"discarded by {why}, not written since"))
                logger.info("refit-verify: %d parameters discarded by %s: the next refit must write them", len(res.changed), why)
            return res

    def certificate(self) -> Certificate:
        """Which version this worker holds and whether its engine still holds what the last close left.

        Re-digests the engine state now (as :meth:`audit`, with no side effect) and compares it with
        the state the last session's close left. The trainer's verdict is not known here
        (``verified`` None): :func:`refit_verify.certificate` adds it.

        Raises:
            RefitInputError: a tensor of the engine cannot be digested (as :meth:`state`).
        """
        with self._lock:
            last, base = self.last, self.baseline
            problems: list[str] = []
            now = self.state() if self.snapshotter is not None and self.modules else None
            if last is None:
                problems.append("no refit session has closed on this worker: it holds the weights it was started with, "
                                "never verified")
            elif base is None or last.state_digest is None:
                problems.append(f"the engine-state snapshot at the close of session {last.session!r} failed: there is "
                                "nothing to compare the engine with")
            elif now is None:
                problems.append("the engine state cannot be read on this worker")
            else:
                res = self.auditor(base, now, "certificate") if self.auditor is not None else None
                if res is not None and not res.ok:
                    problems.append(f"the engine's state changed after session {last.session!r} closed ({res.describe()})")
            if last is not None and last.stale:
                problems.append(f"the last session closed on this worker, {last.session!r}, was out of order ({last.stale})")
            if self.open_session is not None:
                problems.append(f"refit session {self.open_session.id!r} is open: the engine is being refitted")
            problems += [a.describe() for a in self.pending_audits]
            return Certificate(worker=self.identity, session=last.session if last else None, version=last.version if last else None,
                               closed_at=last.closed_at or None if last else None, state_digest=last.state_digest if last else None,
                               current_digest=now.state_digest() if now is not None else None, current=not problems,
                               problems=problems, unseen=now.unseen if now is not None else [])

    def layout_for(self, role: str, specs: dict[str, tuple[tuple[int, ...], str]]) -> list[str]:
        """Learn module ``role``'s layout map for ``specs`` (``{name: (shape, dtype name)}``) where it
        lacks them (:meth:`ModelBoundary.layout_for`, dry); return what was learned, one sentence each.

        Raises:
            RefitProtocolError: no module ``role``, or a session is open (its loads would be recorded).
        """
        with self._lock:
            b = self.modules.get(role)
            if b is None:
                raise RefitProtocolError(f"worker rank {self.identity.rank} has no module {role!r}")
            if self.open_session is not None and specs:
                raise RefitProtocolError(f"worker rank {self.identity.rank}: session {self.open_session.id!r} is open; "
                                         "learn the layout before or after a refit")
            return b.layout_for(specs)[1]

    def fail_open(self, session_id: str, why: str) -> bool:
        """Record ``why`` as an error of open session ``session_id`` (its manifest fails whoever compares
        it); False when that session is not the one open."""
        with self._lock:
            if self.current_id() != session_id:
                return False
            self.note_error(why)
            return True

    def current_id(self) -> str | None:
        s = self.open_session
        return s.id if s is not None else None


class SessionDigests(ExternalDigests):
    """A transport receiver's digests taken at a worker's model boundary (an implicit session).

    ``expect_producer``: the trainer rank that must feed this worker (None: any); see
    :meth:`WorkerBoundary.open`.

    :meth:`begin` opens a session named after the refit (joining one the trainer opened
    explicitly); :meth:`expect` hands the next ``load_weights`` call the sender's digests (verify
    before load); :meth:`finish` closes it and returns its digests and manifest (the manifest is
    None when the session was joined: the explicit opener closes it); :meth:`fail` abandons it.

    Attributes:
        before_close: ``f(failed: bool)`` run before the session closes (e.g. finalize vLLM's
            layerwise reload, putting back layers that cannot land whole).
        rejected, landed, kept: the session's outcome (:meth:`WorkerBoundary.outcome`), set by
            :meth:`finish` / :meth:`fail`.
        open_s, settle_s, close_s: wall seconds of :meth:`begin` (the session's open), of
            ``before_close`` (vLLM's finalize: not refit-verify's work) and of the close (read-back,
            engine-state snapshot, manifest), set by :meth:`begin` and :meth:`finish`.
    """

    def __init__(self, wb: WorkerBoundary, opened_by: str, expect_producer: int | None = None) -> None:
        self.wb, self.opened_by, self.expect_producer = wb, opened_by, expect_producer
        self.sid: str | None = None
        self.before_close: Callable[..., None] | None = None
        self.rejected: dict[str, str] = {}
        self.landed: list[str] = []
        self.kept: dict[str, str] = {}
        self.open_s = self.settle_s = self.close_s = 0.0

    def begin(self, refit_id: str, producer: Producer | None, version: int | None = None) -> None:
        """Open (or join) the session of refit ``refit_id``; ``version``: the sender's weight version
        (None: unversioned), checked for order by :meth:`WorkerBoundary.open`."""
        t0 = time.perf_counter()
        self.sid = self.wb.open(refit_id, version=version, opened_by=self.opened_by, producer=producer, explicit=False,
                                expect_producer=self.expect_producer)
        self.open_s = time.perf_counter() - t0

    def expect(self, digests: dict[str, str | None], enforce: bool) -> None:
        """The sender's digests of the tensors the next ``load_weights`` call gets (checked first)."""
        self.wb.expect(digests, enforce)

    def _settle(self, failed: bool) -> None:
        t0 = time.perf_counter()
        if self.before_close is not None:
            try:
                self.before_close(failed=failed)
            except Exception as e:  # recorded in the session; the refit's Done still goes out
                logger.exception("refit-verify: finalizing the load failed")
                self.wb.note_error(f"finalizing the load failed: {type(e).__name__}: {e}")
        t1 = time.perf_counter()
        self.settle_s = t1 - t0
        if self.wb.current_id() == self.sid:
            self.rejected, self.landed, self.kept = self.wb.outcome(closing=True)
        self.close_s = time.perf_counter() - t1  # the outcome is the close's first step

    def finish(self) -> tuple[dict[str, str], SessionManifest | None]:
        if self.sid is None:
            return {}, None
        self._settle(failed=False)
        t0 = time.perf_counter()
        man = self.wb.close(self.sid, explicit=False)
        self.close_s += time.perf_counter() - t0
        if man is None:
            return self.wb.snapshot()[0], None
        return man.digests(), man

    def fail(self, why: str) -> None:
        if self.sid is not None:
            self._settle(failed=True)
            self.wb.abandon(self.sid, f"{self.opened_by} refit failed: {why}"[:500])


def identity_of(rank: int = 0, dp: int = 0, tp: int = 0, pp: int = 0, device: Any = "cpu") -> WorkerIdentity:
    """Build a :class:`WorkerIdentity` for this process."""
    return WorkerIdentity(rank=int(rank), dp=int(dp), tp=int(tp), pp=int(pp), device=str(device), pid=os.getpid())
