"""The vLLM-worker side of the staged transport: :class:`RefitReceiver` (a ZMQ REP socket that connects).

One refit: answer ``Hello`` with the agreed mode (``Welcome``), then per ``Buffer`` validate its
entries (:class:`~refit_verify.stream.unpack.EntryChecker`), map the staging memory, view, digest, ``load``
and acknowledge; on ``Complete`` answer ``Done`` with the manifest. The state of one refit is a
:class:`~refit_verify.stream.unpack.ReceiveState`. See ``docs/protocol.md``.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from dataclasses import dataclass, field

import torch
import zmq

from refit_verify.config import RefitConfig, VerifyMode
from refit_verify.errors import RefitAbortedError, RefitConfigError, RefitProtocolError, RefitTimeoutError
from refit_verify.manifest import ExternalDigests, Producer
from refit_verify.stream.items import MAX_ERROR_CHARS, Batch, LoadFn, StreamResult
from refit_verify.stream.unpack import ReceiveState, view_slots
from refit_verify.transport import staging as _staging
from refit_verify.transport.guard import LAST_WORDS_S, PeerWatch, check_private_dir, close_zmq, ms
from refit_verify.wire.fields import MAX_ALIGNMENT, MAX_MESSAGE_BYTES, MIN_ALIGNMENT, encode
from refit_verify.wire.staged import (
    ABORT_SEQ,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Buffer,
    CheckedDone,
    Complete,
    Done,
    Hello,
    Reject,
    Welcome,
    decode_request,
)

__all__ = ["RECONNECT_IVL_MS", "ReceiveResult", "RefitReceiver"]

logger = logging.getLogger("refit_verify")

RECONNECT_IVL_MS = 5
"""The receiver's retry interval (ms) while the sender's endpoint is not bound yet (ZMQ's default,
100 ms, added up to 100 ms to a refit whose worker connected before the trainer bound)."""


@dataclass(kw_only=True)
class ReceiveResult(StreamResult):
    """Outcome of one :meth:`RefitReceiver.receive`: the fields of
    :class:`~refit_verify.stream.items.StreamResult` (``manifest``, ``tensors``, ``bytes``, ``digest_s``,
    ``refit_id``, ``mode``, ``error``, ``rejected``, ``.ok``), ``buffers``: ``Buffer`` messages handled,
    and, for a verifying refit, ``landed`` (what was loaded) and ``kept`` (``{name: why}`` of what still
    holds the previous version: refused before loading)."""

    buffers: int = 0
    landed: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


class RefitReceiver:
    """vLLM-worker side of a refit channel: connects a REP socket and loads what arrives.

    Args:
        endpoint: the sender's :attr:`RefitSender.endpoint`. An ``ipc://`` endpoint must lie in an
            existing directory owned by this user (or root) and not writable by group or others.
        config: ``timeout_s`` (bound between messages of a refit) and ``connect_timeout_s`` (bound on
            waiting for ``Hello``); ``mode`` and ``alignment`` are not used: each refit follows the
            mode agreed at its handshake and the sender's alignment.
        device: the receiver's device; its CUDA index is used to rebuild CUDA IPC handles
            (default: the current CUDA device). Ignored for shared-memory buffers.
        verify: ``False`` builds a receiver that never digests: a sender in ``enforce`` mode then
            fails at the handshake, one in ``log`` mode runs unverified with a warning.
        why_not: with ``verify=False``, why this receiver does not verify (its ``Welcome.reason``; a vLLM
            worker that does not verify says its ``REFIT_VERIFY`` or why its model cannot be found).

    The connected peer's uid is checked with ``SO_PEERCRED`` where the platform allows; a peer of
    another uid (root excepted) ends the refit with ``RefitProtocolError``.

    Raises:
        RefitConfigError: a bad ``config``, ``why_not`` with ``verify=True``, or an ``ipc://`` endpoint in a
            non-private directory.
    """

    def __init__(self, endpoint: str, *, config: RefitConfig | None = None, device: str | torch.device | int | None = None,
                 verify: bool = True, why_not: str | None = None) -> None:
        self.config = config if config is not None else RefitConfig()
        if not isinstance(self.config, RefitConfig):
            raise RefitConfigError(f"config must be a RefitConfig, got {type(self.config).__name__}")
        if not isinstance(endpoint, str) or not endpoint:
            raise RefitConfigError(f"endpoint must be a non-empty string, got {endpoint!r}")
        if not isinstance(verify, bool):
            raise RefitConfigError(f"verify must be True or False, got {verify!r}")
        if why_not is not None and (not isinstance(why_not, str) or not why_not or verify):
            raise RefitConfigError(f"why_not must be a non-empty string, and only with verify=False; got {why_not!r}")
        self.endpoint = endpoint
        self.device = device
        self.verify = verify
        self.why_not = why_not
        self._capability: tuple[bool, str | None] | None = None
        check_private_dir(endpoint, "receiver")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._watch: PeerWatch | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.RCVTIMEO, ms(max(self.config.timeout_s, self.config.connect_timeout_s)))  # a backstop: reads never block
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 10 * RECONNECT_IVL_MS)
            self._watch = PeerWatch(self._sock, endpoint, "receiver")
            self._sock.connect(endpoint)
        except BaseException:
            close_zmq(self._sock, self._watch, self._ctx, None)
            raise
        # the last reply (Done) may still be queued at close: it gets LAST_WORDS_S to leave
        self._finalizer = weakref.finalize(self, close_zmq, self._sock, self._watch, self._ctx, None, None, LAST_WORDS_S)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.mon, zmq.POLLIN)
        self._last_msg: tuple[float, str] | None = None
        self.spurious_wakeups = 0  # polls that reported a request libzmq then discarded (see _recv)

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RefitReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- capability --------------------------------------------------------------------------

    def _can_verify(self) -> tuple[bool, str | None]:
        """Whether this receiver can digest staged slices, and why not."""
        if not self.verify:
            return False, self.why_not or "verification is disabled on this receiver (RefitReceiver(verify=False))"
        if self._capability is None:
            try:
                from refit_verify.digest import batch as _digest  # noqa: F401

                dev = self.device
                if torch.cuda.is_available() and (dev is None or isinstance(dev, int) or _staging._as_device(dev).type == "cuda"):
                    from refit_verify.digest.kernels import launch as _kd  # noqa: F401
                self._capability = (True, None)
            except Exception as e:  # noqa: BLE001 - any import failure means: cannot verify
                self._capability = (False, f"digest code unavailable in this process: {type(e).__name__}: {e}")
        return self._capability

    # -- wire --------------------------------------------------------------------------------

    def _recv(self, timeout_s: float, progress: dict, *, in_refit: bool, deadline: float | None = None):
        """Wait at most ``timeout_s`` for a request; decode it or reject it and raise.

        Never blocks past the bound: the socket is read only without blocking, after a poll, and a
        readable socket with nothing to read (libzmq's REP discards a request that lost its
        envelope while the sender's previous connection was torn down) only continues the wait.
        During a refit (``in_refit``), a dropped connection to the sender ends the wait at once.
        """
        deadline = time.monotonic() + timeout_s if deadline is None else deadline
        mark = self._watch.disconnects
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._silent(timeout_s, progress, in_refit)
            ready = dict(self._poller.poll(ms(remaining)))
            self._watch.drain()
            if self._watch.strangers:
                pid, uid = self._watch.strangers.pop()
                self._watch.strangers.clear()
                raise RefitProtocolError(f"receiver on {self.endpoint}: the peer (pid {pid}) runs as uid {uid}, not {os.geteuid()}: "
                                         "refusing to take weights from another user", progress=progress)
            data = None
            if self._sock in ready:
                data = self._read()
            elif in_refit and self._watch.disconnects > mark and not self._watch.live:
                if self._sock.poll(ms(LAST_WORDS_S)):
                    data = self._read()
                if data is None:
                    raise self._timeout(f"the sender's connection closed while {progress['stage']} (timeout {timeout_s:g} s)",
                                        "sender disconnected", progress, timeout_s)
            if data is None:
                continue
            try:
                msg = decode_request(data.buffer)
            except RefitProtocolError as e:
                self._reject(str(e))
                raise
            self._last_msg = (time.monotonic(), _describe(msg))
            return msg

    def _read(self):
        """One request without blocking, or ``None`` when the socket had nothing after all."""
        try:
            return self._sock.recv(copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:
            self.spurious_wakeups += 1
            return None

    def _silent(self, timeout_s: float, progress: dict, in_refit: bool) -> RefitTimeoutError:
        """The timeout of a wait for a request, naming what this receiver saw."""
        up = self._watch.established()
        if in_refit:
            return self._timeout(f"no message within {timeout_s:g} s while {progress['stage']}", "sender went silent", progress, timeout_s)
        if not up:
            return self._timeout(f"no Hello within {timeout_s:g} s: no sender is connected to this endpoint", "sender never connected",
                                 progress, timeout_s)
        return self._timeout(f"no Hello within {timeout_s:g} s: the sender is connected but sent no Hello (idle, or serving another "
                             "receiver on this endpoint)", "sender went silent", progress, timeout_s)

    def _timeout(self, what: str, reason: str, progress: dict, timeout_s: float) -> RefitTimeoutError:
        p = dict(progress, timeout_s=timeout_s, reason=reason, silent="sender", endpoint=self.endpoint, last_seen=self._last_seen(),
                 connections=self._watch.last_seen())
        digested = " and digested" if p.get("mode") not in (None, "off") else ""
        return RefitTimeoutError(
            f"receiver on {self.endpoint}: {what}; {reason} (refit {p['refit_id']}: {p['buffers']} buffers, {p['tensors']} "
            f"tensors received{digested}, last {p['last_name']!r}; last message {p['last_seen']}; connections: "
            f"{p['connections']}); staging memory released", p)

    def _last_seen(self) -> str:
        if self._last_msg is None:
            return "none"
        t, what = self._last_msg
        return f"{what} {time.monotonic() - t:.2f} s ago"

    def _reply(self, msg: Welcome | Ack | Done | Reject) -> None:
        try:
            self._sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise RefitTimeoutError(f"receiver on {self.endpoint}: could not reply within {self.config.timeout_s:g} s",
                                    {"reason": "sender went away", "silent": "sender", "side": "receiver"}) from None

    def _reject(self, reason: str) -> None:
        logger.error("refit receiver on %s rejects a message: %s", self.endpoint, reason)
        self._reply(Reject(reason=reason[:MAX_ERROR_CHARS]))

    def _welcome(self, hello: Hello) -> VerifyMode:
        """Validate ``Hello`` (reject and raise if bad) and reply ``Welcome``; return the agreed mode."""
        if hello.protocol != PROTOCOL_VERSION:
            self._reject(f"protocol {hello.protocol} not supported (receiver speaks {PROTOCOL_VERSION})")
            raise RefitProtocolError(f"sender speaks protocol {hello.protocol}, receiver {PROTOCOL_VERSION}")
        try:
            requested = VerifyMode.parse(hello.mode, source="Hello.mode")
        except RefitConfigError as e:
            self._reject(str(e))
            raise RefitProtocolError(str(e)) from None
        if hello.alignment & (hello.alignment - 1) or not MIN_ALIGNMENT <= hello.alignment <= MAX_ALIGNMENT:
            self._reject(f"alignment {hello.alignment} is not a power of two in {MIN_ALIGNMENT}..{MAX_ALIGNMENT}")
            raise RefitProtocolError(f"bad alignment {hello.alignment} in Hello")
        agreed, reason = requested, None
        if requested.verifies:
            ok, why = self._can_verify()
            if not ok:
                agreed, reason = VerifyMode.OFF, why
                logger.warning("refit %s: the sender asked for %s but this receiver cannot verify (%s); answering off",
                               hello.refit_id, requested.value, why)
        self._reply(Welcome(protocol=PROTOCOL_VERSION, mode=agreed.value, reason=reason))
        return agreed

    # -- the refit ---------------------------------------------------------------------------

    def receive(self, load: LoadFn, *, digests: ExternalDigests | None = None) -> ReceiveResult:
        """Handle one refit, from ``Hello`` to ``Done``.

        Args:
            load: called once per ``Buffer`` with ``[(name, view)]`` of its accepted entries; each
                view is a tensor of the wire dtype and shape aliasing the staging memory (on the
                staging device). ``load`` must copy what it keeps: the memory is reused after this
                call returns. Exceptions from ``load`` are recorded and reported in ``Done`` (the
                refit continues).
            digests: where the digests of a verifying refit are taken instead of here: the model
                boundary of a vLLM worker (:class:`refit_verify.boundary.worker.SessionDigests`), whose
                ``load`` ends in ``model.load_weights``. Default: this receiver digests each staged
                slice before ``load``.

        Returns:
            ReceiveResult: the manifest (if the refit verifies), counts, rejected entries and
            recorded errors.

        Raises:
            RefitTimeoutError: no ``Hello`` within ``connect_timeout_s``, no next message within
                ``timeout_s``, or the sender's connection dropped mid-refit; ``.progress`` tells how
                far the refit got.
            RefitAbortedError: the sender sent ``Abort`` (its reason is in the message).
            RefitProtocolError: an undecodable or out-of-order request, a wrong protocol version, an
                unknown mode, or a peer of another uid (a ``Reject`` was sent back first where a
                reply was due).

        No staging memory stays mapped when this returns or raises.
        """
        cfg = self.config
        progress = {"side": "receiver", "stage": "waiting for Hello", "refit_id": None, "mode": None,
                    "buffers": 0, "tensors": 0, "last_name": None}
        deadline = time.monotonic() + cfg.connect_timeout_s
        while True:
            hello = self._recv(cfg.connect_timeout_s, progress, in_refit=False, deadline=deadline)
            if isinstance(hello, Hello):
                break
            if isinstance(hello, Abort):  # the tail of an earlier refit this receiver never saw (its sender gave up on it)
                logger.info("refit receiver on %s: an Abort of a refit it never saw arrived while waiting for Hello (%s); "
                            "still waiting", self.endpoint, hello.reason[:200])
                self._reply(Ack(seq=ABORT_SEQ))
                continue
            why = (f"expected Hello, got {_describe(hello)}: this receiver saw no Hello of that refit (another receiver on the "
                   "same endpoint took it, or the sender lost its receiver mid-refit and went on with this one)")
            self._reject(why)
            raise RefitProtocolError(f"receiver on {self.endpoint}: {why}; connections: {self._watch.last_seen()}",
                                     progress=dict(progress, reason="no Hello", last_seen=self._last_seen()))
        mode = self._welcome(hello)
        state = ReceiveState.start(mode, hello.refit_id, hello.alignment, digests)
        progress.update(refit_id=hello.refit_id, mode=mode.value, stage="waiting for Buffer 0 or Complete")
        if state.external is not None:
            producer = None if hello.producer_rank is None else Producer(rank=hello.producer_rank, device=hello.producer_device or "cpu")
            state.external.begin(hello.refit_id, producer, hello.version)
        try:
            return self._receive_loop(state, progress, load)
        except BaseException as e:
            if state.external is not None:
                state.external.fail(f"{type(e).__name__}: {e}")
            raise

    def _receive_loop(self, state: ReceiveState, progress: dict, load: LoadFn) -> ReceiveResult:
        cfg = self.config
        while True:
            msg = self._recv(cfg.timeout_s, progress, in_refit=True)
            if isinstance(msg, Buffer):
                try:
                    self._handle_buffer(msg, state, load)
                except Exception as e:  # recorded for Done; the Ack goes out regardless
                    logger.exception("refit %s: buffer %d failed", state.refit_id, msg.seq)
                    names = [en.name for en in msg.entries]
                    state.errors.append(f"buffer {msg.seq} ({len(names)} entries, {names[0] if names else '-'} … "
                                        f"{names[-1] if names else '-'}): {type(e).__name__}: {e}")
                # (an interrupt, a thread's death: no Ack — it would claim the buffer was read; the sender
                # sees the connection close instead)
                state.groups += 1
                progress.update(buffers=state.groups, tensors=state.tensors, last_name=state.last_name,
                                stage=f"waiting for Buffer {state.checker.expected_seq} or Complete")
                self._reply(Ack(seq=msg.seq))
            elif isinstance(msg, Complete):
                manifest, session, error = state.finish(msg.n_tensors)
                rejected = state.all_rejected()
                fields = dict(manifest=manifest, error=error, rejected=rejected or None, tensors=state.tensors, bytes=state.bytes,
                              digest_s=state.digest_s, session=session)
                if state.mode.verifies:  # what the engine holds now travels back with the verdict
                    self._reply(CheckedDone(**fields, landed=list(state.landed), kept=dict(state.kept)))
                else:
                    self._reply(Done(**fields))
                return ReceiveResult(manifest=manifest, tensors=state.tensors, bytes=state.bytes, digest_s=state.digest_s,
                                     buffers=state.groups, refit_id=state.refit_id, mode=state.mode, error=error, rejected=rejected,
                                     landed=list(state.landed), kept=dict(state.kept))
            elif isinstance(msg, Abort):
                self._reply(Ack(seq=ABORT_SEQ))
                logger.error("refit %s aborted by the sender after %d buffers, %d tensors: %s", state.refit_id, state.groups, state.tensors, msg.reason)
                raise RefitAbortedError(
                    f"receiver on {self.endpoint}: refit {state.refit_id} aborted by the sender after {state.groups} buffers, "
                    f"{state.tensors} tensors (last {state.last_name!r}): {msg.reason}", msg.reason, dict(progress, reason="sender aborted"))
            elif isinstance(msg, Hello) and msg.refit_id == state.refit_id and state.groups == 0:
                self._welcome(msg)  # the sender re-sent Hello (a stale connection closed meanwhile)
            else:
                if isinstance(msg, Hello) and msg.refit_id != state.refit_id:
                    why = (f"refit id mismatch: Hello of refit {msg.refit_id} arrived during refit {state.refit_id} (after "
                           f"{state.groups} buffers, last {state.last_name!r}): the sender gave up on {state.refit_id} and "
                           "started another refit, or a second sender shares this endpoint")
                else:
                    why = f"unexpected {_describe(msg)} during refit {state.refit_id} (after {state.groups} buffers)"
                self._reject(why)
                raise RefitProtocolError(f"receiver on {self.endpoint}: {why}", progress=dict(progress, reason=why.split(":")[0],
                                                                                          last_seen=self._last_seen()))

    def _handle_buffer(self, msg: Buffer, state: ReceiveState, load: LoadFn) -> None:
        """Validate, map, view, digest and ``load`` one ``Buffer`` (override point for tests).

        Every entry is validated before any memory is touched (``docs/protocol.md``, receiver
        step 2); a refused entry alone is recorded (``Done.rejected``), the others load.
        """
        slots = state.checker.check(msg.seq, msg.entries, msg.used_bytes)
        if not slots:
            self._open_and_release(msg)
            return
        try:
            buf = _staging.open_handle(msg.handle, self.device)
        except Exception as err:  # noqa: BLE001 - every entry of the buffer is unreadable
            for s in slots:
                state.checker.reject(s.name, f"buffer {msg.seq} cannot be opened: {type(err).__name__}: {err}")
            return
        views: Batch = []
        try:
            if msg.used_bytes > buf.numel():
                for s in slots:
                    state.checker.reject(s.name, f"buffer {msg.seq}: used_bytes {msg.used_bytes} > buffer size {buf.numel()}")
                return
            views = view_slots(buf, slots)
            # verifying (protocol 3): each view is checked against the digest that came with it
            # before load; a Buffer without digests in a verifying refit has none to check against.
            # CUDA digests of the unchecked path are only launched: release() synchronises before the Ack
            expected = {sl.name: sl.digest for sl in slots} if state.mode.verifies else None
            state.deliver(views, load, sync_cuda=False, expected=expected)
        finally:
            _staging.release(buf)  # queued reads of the buffer are finished before the Ack
            views.clear()
            del buf

    def _open_and_release(self, msg: Buffer) -> None:
        """Open and release a buffer none of whose entries is read: a CUDA IPC export carries one
        slot of torch's IPC reference counter that only an open gives back."""
        try:
            buf = _staging.open_handle(msg.handle, self.device)
        except Exception:  # noqa: BLE001 - nothing to read anyway
            return
        _staging.release(buf)
        del buf


def _describe(msg) -> str:
    """``"Buffer(seq=3)"``, ``"Hello(refit 1a2b…)"``: what a request was, for error messages."""
    if isinstance(msg, Buffer):
        return f"Buffer(seq={msg.seq})"
    if isinstance(msg, Hello):
        return f"Hello(refit {msg.refit_id})"
    return type(msg).__name__
