"""The trainer side of the staged transport: :class:`RefitSender` (a ZMQ REQ socket that binds).

One refit: ``Hello`` (mode agreement), then the :class:`~refit_verify.stream.pack.Packer` fills two
ping-pong staging buffers and this module sends one ``Buffer`` per filled buffer in strict REQ/REP
lockstep (the next group is packed while the receiver reads this one), ``Complete``, and the
verdict on the receiver's ``Done``. The state of one refit is a :class:`SendState`.
See ``docs/protocol.md``.

The module stays whole: it is one class around one REQ socket, whose sends, waits, retries and
errors all share that socket's peer watch and the refit's progress.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import weakref
from collections.abc import Iterable

import torch
import zmq

from refit_verify import verdicts
from refit_verify.compare import receiver_report, wrote_wrong
from refit_verify.config import RefitConfig, VerifyMode, act_on, check_version
from refit_verify.digest.batch import DigestBatch
from refit_verify.errors import RefitConfigError, RefitProtocolError, RefitReceiveError, RefitTimeoutError
from refit_verify.report import VerificationReport
from refit_verify.stream.items import MAX_ERROR_CHARS, StreamStats
from refit_verify.stream.pack import Packer
from refit_verify.transport import staging as _staging
from refit_verify.transport.guard import LAST_WORDS_S, EndpointLock, PeerWatch, bind_exclusive, check_private_dir, close_zmq, ms, private_endpoint
from refit_verify.transport.send_state import PackedCounts, Progress, SendState
from refit_verify.wire.fields import MAX_MESSAGE_BYTES, Entry, encode
from refit_verify.wire.staged import (
    ABORT_SEQ,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Buffer,
    CheckedDone,
    Complete,
    DigestBuffer,
    Done,
    Hello,
    Reject,
    Welcome,
    decode_reply,
)

__all__ = ["ABORT_WAIT_S", "HELLO_RETRY_S", "RefitSender", "RefitStats"]

logger = logging.getLogger("refit_verify")

ABORT_WAIT_S = 5.0
"""After sending ``Abort``, the sender waits at most ``min(timeout_s, ABORT_WAIT_S)`` seconds for
its acknowledgement (none after a timeout or a disconnect: the receiver is gone or stuck)."""

HELLO_RETRY_S = 0.2
"""Seconds after which an unanswered ``Hello`` is sent again; the interval doubles up to
:data:`HELLO_RETRY_MAX_S`. libzmq can lose a request sent while a closing peer's connection is
being torn down (a sender reused while its receiver is re-created for every refit): the receiver
answers a repeated ``Hello`` of its refit again, and ``REQ_CORRELATE`` drops the answers to the
earlier copies. Only ``Hello`` is repeated (no ``Buffer`` can have been read yet)."""
HELLO_RETRY_MAX_S = 2.0

SECOND_PEER_GRACE_S = 0.5
"""When a refit starts with two connections up, the older one may be the previous receiver still
closing: it gets this long (seconds) to go before the sender names two receivers on one endpoint."""


class RefitStats(StreamStats):
    """Numbers of the sender's last refit (a plain dict: ``sender.last_stats["digest_s"]``).

    Keys: those of :class:`~refit_verify.stream.items.StreamStats` (``refit_id``, ``mode`` — ``"off"``
    when a ``log`` sender met a receiver that cannot verify —, ``tensors``, ``bytes``, ``digest_s``,
    ``wall_s`` from ``Hello`` to ``Done``, ``receiver_digest_s`` from ``Done``), ``buffers``:
    ``Buffer`` messages sent (oversized tensors included), and ``hello_sent``: ``Hello`` messages
    sent (more than 1 when an unanswered one was sent again, :data:`HELLO_RETRY_S`); ``stage_s``:
    seconds spent, after ``Hello`` and before its ``Welcome`` was taken, allocating the first staging
    buffer and touching its pages (:meth:`SendState.stage_ahead
    <refit_verify.transport.send_state.SendState.stage_ahead>`; transport, not digest work); ``welcome_s``:
    seconds from ``Hello`` to its ``Welcome`` taken, as the first group is posted (the first group's
    staging, digests and packing included); ``digest_before_welcome_s``: of ``digest_s``, the seconds
    spent before the ``Welcome`` was taken when it had not arrived by then (run while the receiver
    read ``Hello`` and answered it, off the refit's critical path; 0.0 when it was already waiting,
    since how long it waited is not known).
    """

    buffers: int
    hello_sent: int
    stage_s: float
    welcome_s: float
    digest_before_welcome_s: float


class RefitSender:
    """Trainer side of a refit channel: binds a REQ socket and streams tensors.

    Args:
        config: channel options (mode, staging budget ``buffer_bytes``, ``alignment``,
            ``timeout_s``); default :class:`RefitConfig` (mode from ``REFIT_VERIFY``).
        device: staging device (``"cpu"`` → POSIX shared memory, ``"cuda:i"`` → CUDA IPC); default:
            the device of the first tensor of each refit (CUDA tensor → its GPU, else CPU).
        endpoint: ZMQ endpoint to bind; default ``ipc://<private dir>/refit.sock`` where the
            directory is created by ``tempfile.mkdtemp`` (mode 0700, a name with 64 random bits plus
            mkdtemp's own suffix) and removed by :meth:`close`. An explicit ``ipc://`` endpoint must
            lie in a directory owned by this user and not writable by group or others, and must not
            be bound by another sender.
        rank: the vLLM worker rank this sender serves (one sender per worker, e.g. per GPU with
            tensor parallelism); carried into every report so a mismatch names the worker.

    Attributes:
        last_stats (RefitStats | None): a dict with the numbers of the last refit that got its
            ``Done`` (set before the verdict is applied, so also after a verification error).

    Two staging buffers of ``buffer_bytes // 2`` bytes each are used alternately; a tensor whose
    aligned size exceeds that goes alone in a dedicated buffer of its exact aligned size.

    Each new connection is checked with ``SO_PEERCRED`` where the platform allows: a peer of another
    uid (root excepted) is logged and cut off. A refit sends ``Abort`` to the receiver when it fails on
    this side, and fails fast (``RefitTimeoutError``, reason ``"receiver disconnected"``) when the
    receiver's connection drops while a reply is awaited.

    Raises:
        RefitConfigError: a bad ``config``; an explicit ``ipc://`` endpoint in a non-private
            directory; an endpoint already bound by another sender (or another program), named in
            the message: a second sender is refused, never allowed to take the first one's socket.
    """

    def __init__(self, *, config: RefitConfig | None = None, device: str | torch.device | None = None, endpoint: str | None = None,
                 rank: int | None = None) -> None:
        self.rank = rank
        self.config = config if config is not None else RefitConfig()
        if not isinstance(self.config, RefitConfig):
            raise RefitConfigError(f"config must be a RefitConfig, got {type(self.config).__name__}")
        self.device = None if device is None else _staging._as_device(device)
        self.last_stats: RefitStats | None = None
        self._private_dir: str | None = None
        if endpoint is None:
            endpoint, self._private_dir = private_endpoint()
        check_private_dir(endpoint, "sender")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._watch: PeerWatch | None = None
        lock: EndpointLock | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.RCVTIMEO, ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # After a timed-out wait or an Abort the socket may send again; late replies to old
            # requests are dropped.
            self._sock.setsockopt(zmq.REQ_RELAXED, 1)
            self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
            self._watch = PeerWatch(self._sock, endpoint, "sender")
            self._endpoint, lock = bind_exclusive(self._sock, endpoint)
            self._watch.endpoint = self._endpoint
        except BaseException:
            close_zmq(self._sock, self._watch, self._ctx, self._private_dir, lock)
            raise
        self._finalizer = weakref.finalize(self, close_zmq, self._sock, self._watch, self._ctx, self._private_dir, lock)
        self._progress = Progress()
        self._mark = 0
        self._carriers: set[int] = set()  # connections up when the outstanding request left (REQ: the one it went to)
        self._peer_gave_up = False
        self._last_hello: bytes | None = None
        self._last_reply_t: float | None = None
        self._busy = threading.Lock()  # one refit at a time
        self._busy_thread: str | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.mon, zmq.POLLIN)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The bound endpoint, to hand to :class:`RefitReceiver` (e.g. ``ipc:///tmp/refit-verify-x/refit.sock``)."""
        return self._endpoint

    def close(self) -> None:
        """Close the socket, release the endpoint and remove the private directory. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RefitSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the wire (override points for tests) -----------------------------------------------

    def _exchange(self, msg: Hello | Buffer | Complete, staging: torch.Tensor | None = None) -> Done | None:
        """Send one request. Every request of a refit except ``Abort`` goes through here, after the
        sender has digested and packed everything the message references.

        Args:
            msg: the request.
            staging: for a ``Buffer``, the whole 1-D uint8 staging tensor it references (its bytes
                are what the receiver will read); ``None`` otherwise.

        Returns:
            Done | None: for ``Complete``, the receiver's ``Done`` (awaited here, at most
            ``timeout_s``). For ``Hello`` and ``Buffer``, ``None``: their reply (``Welcome``,
            ``Ack``) is collected by the sender later (strict lockstep), so that the next group is
            packed while the receiver reads this one (double buffering).

        On CUDA the staging device's current stream is synchronised before the handle leaves.
        A test subclass may corrupt ``staging`` or replace ``msg`` (``msgspec.structs.replace``)
        before calling ``super()._exchange`` (see ``tests/support/faults.py``).

        Raises:
            RefitTimeoutError: the message could not be queued, or ``Done`` did not arrive, within
                ``timeout_s`` (receiver absent, silent or disconnected).
            RefitProtocolError: the reply to ``Complete`` is a ``Reject``, undecodable or not ``Done``.
        """
        if staging is not None:
            _staging.synchronize(staging.device)
        self._send(msg)
        if isinstance(msg, Complete):
            return self._take_reply(Done)
        return None

    def _send(self, msg: Hello | Buffer | Complete) -> None:
        """Queue one request (at most ``timeout_s``), after checking that one receiver is connected."""
        data = encode(msg)
        w = self._watch
        w.drain()
        hello = isinstance(msg, Hello)
        self._one_receiver(grace=SECOND_PEER_GRACE_S if hello else 0.0)
        if not hello and self._carrier_dropped() and not w.established():  # sending would wait for a peer that is gone
            raise self._timeout(f"could not send {type(msg).__name__}: the receiver that answered the last request "
                                "disconnected and none is connected", "receiver disconnected")
        if hello:
            self._last_hello = data
        self._carriers = w.established_serials()
        self._mark = w.disconnects
        try:
            self._sock.send(data, copy=False)
        except zmq.Again:
            if hello:
                raise self._timeout(f"could not send Hello within {self.config.timeout_s:g} s", "receiver never connected",
                                    "is a RefitReceiver connected to this endpoint? In vLLM: is the refit_verify plugin loaded "
                                    "in the workers (VLLM_PLUGINS) and refit_verify_receive called?") from None
            raise self._timeout(f"could not send {type(msg).__name__} within {self.config.timeout_s:g} s", "receiver went silent") from None
        if hello:
            self._progress.hello_sent += 1
        if not self._carriers:  # the send waited for a peer to appear: that one took it
            w.drain()
            self._carriers = w.established_serials()

    def _one_receiver(self, grace: float) -> None:
        """Raise when more than one receiver is connected (REQ would deal requests out in turn).

        ``grace``: seconds a second connection may take to close first (a previous receiver that
        is still closing when the next refit starts).

        Raises:
            RefitProtocolError: two or more receivers connected, naming their pids.
        """
        w = self._watch
        deadline = time.monotonic() + grace
        while len(w.established()) > 1 and (remaining := deadline - time.monotonic()) > 0:
            w.mon.poll(ms(remaining))
            w.drain()
        peers = w.established()
        if len(peers) <= 1:
            return
        p = self._progress
        self._peer_gave_up = True  # no Abort: it would go to either of them
        who = ", ".join(w.peer_label(fd) for fd in sorted(peers))
        stage = "before Hello" if not p.hello_sent else f"during the refit ({p.buffers_sent} buffers sent)"
        raise RefitProtocolError(
            f"refit {p.refit_id} on {self._endpoint}: {len(peers)} receivers are connected to this one endpoint ({who}) "
            f"{stage}: a REQ socket deals requests out to them in turn, so neither would see the whole refit. One "
            "endpoint serves one receiver: close the other one, or give each its own sender and endpoint (tensor "
            "parallelism: {rank} in the path). Connections: " + w.last_seen(),
            progress=p.as_dict(side="sender", reason="two receivers", connections=w.last_seen(), endpoint=self._endpoint))

    def _carrier_dropped(self) -> bool:
        """Whether the connection the outstanding request went to has closed (its reply is lost with it)."""
        w = self._watch
        return w.disconnects > self._mark and (not self._carriers or bool(self._carriers & w.closed))

    def _take_reply(self, expect: type, seq: int | None = None) -> Welcome | Ack | Done:
        """Wait (at most ``timeout_s``) for the reply to the outstanding request and check it.

        While waiting for ``Welcome``, ``Hello`` is sent again after :data:`HELLO_RETRY_S` (doubling)
        and at once when the connection it went to closes and another receiver is connected (a
        receiver of an earlier refit may still have been closing when ``Hello`` left); a receiver
        answers a repeated ``Hello`` of its refit again. A reply to an earlier copy is dropped by
        ``REQ_CORRELATE`` (a readable socket with nothing to read: the wait goes on).

        Raises:
            RefitTimeoutError: no reply in time (``"receiver went silent"``, or ``"receiver
                disconnected"`` / ``"receiver never connected"`` for ``Welcome`` when no receiver
                was left to answer), or the connection that carried a ``Buffer`` / ``Complete``
                closed (``"receiver disconnected"``, naming a new connection if one came up).
            RefitProtocolError: a ``Reject``, an undecodable reply, a reply of the wrong type or
                sequence number, or two receivers on the endpoint.
        """
        p = self._progress
        p.waiting_for = f"{expect.__name__}" + (f"(seq={seq})" if seq is not None else "")
        w = self._watch
        now = time.monotonic()
        deadline = now + self.config.timeout_s
        retry = HELLO_RETRY_S
        next_retry = now + retry if expect is Welcome else float("inf")
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining <= 0:
                raise self._no_reply(expect)
            ready = dict(self._poller.poll(ms(min(remaining, max(next_retry - now, 0.001)))))
            w.drain()
            if self._sock in ready:
                try:
                    data = self._sock.recv(copy=False, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:  # a late reply to an earlier request, dropped by REQ_CORRELATE
                    continue
            dropped = self._carrier_dropped()
            if expect is Welcome:
                if (dropped or time.monotonic() >= next_retry) and w.established():
                    self._one_receiver(grace=SECOND_PEER_GRACE_S)
                    if dropped:
                        logger.info("refit %s: the connection Hello went to closed; sending Hello again", p.refit_id)
                    try:
                        self._sock.send(self._last_hello, flags=zmq.NOBLOCK)
                        p.hello_sent += 1
                    except zmq.ZMQError:
                        pass
                    self._carriers, self._mark = w.established_serials(), w.disconnects
                    retry = min(2 * retry, HELLO_RETRY_MAX_S)
                    next_retry = time.monotonic() + retry
                elif time.monotonic() >= next_retry:
                    next_retry = time.monotonic() + retry  # nobody to send it to: wait for a receiver
                continue
            if dropped:
                if self._sock.poll(ms(LAST_WORDS_S)):
                    try:
                        data = self._sock.recv(copy=False, flags=zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        pass
                w.drain()
                up = w.established()
                extra = (f" (a new connection from {w.peer_label(up[0])} came up meanwhile: the receiver reconnected or "
                         "another one connected; a request is answered only on the connection it went out on)") if up else ""
                raise self._timeout(f"the receiver's connection closed while waiting for {p.waiting_for}{extra}", "receiver disconnected")
        reply = decode_reply(data.buffer)
        self._last_reply_t = time.monotonic()
        p.last_reply = type(reply).__name__ + (f"(seq={reply.seq})" if isinstance(reply, Ack) else "")
        p.waiting_for = ""
        if isinstance(reply, Reject):
            self._peer_gave_up = True  # a receiver that rejects has stopped: no Abort needed
            hint = ""
            if expect is Welcome:
                hint = (f" (this sender speaks refit-verify protocol {PROTOCOL_VERSION}; a receiver that cannot decode "
                        "Hello may run an older refit-verify)")
            raise RefitProtocolError(f"receiver on {self._endpoint} rejected refit {p.refit_id}: {reply.reason}{hint}", progress=p.as_dict())
        if not isinstance(reply, expect) or (seq is not None and reply.seq != seq):
            raise RefitProtocolError(f"expected {expect.__name__}" + (f"(seq={seq})" if seq is not None else "") + f", got {reply!r}"[:500], progress=p.as_dict())
        return reply

    def _no_reply(self, expect: type) -> RefitTimeoutError:
        """The timeout error of a reply wait, naming what the sender saw of its receiver."""
        p, w = self._progress, self._watch
        t = self.config.timeout_s
        up = w.established()
        if expect is Welcome:
            if up:
                return self._timeout(f"no Welcome within {t:g} s: {w.peer_label(up[0])} is connected but did not answer Hello "
                                     f"(sent {p.hello_sent} times)", "receiver went silent")
            if w.disconnects > 0 and w.events and w.events[-1][1] == "disconnected":
                return self._timeout(f"no Welcome within {t:g} s: the receiver that took Hello disconnected and no receiver "
                                     "connected after it", "receiver disconnected")
            return self._timeout(f"no Welcome within {t:g} s: no receiver is connected", "receiver never connected")
        who = f"{w.peer_label(up[0])} is connected but " if up else ""
        return self._timeout(f"no {p.waiting_for} reply within {t:g} s: {who}did not answer (busy loading, or hung)", "receiver went silent")

    def _timeout(self, what: str, reason: str, hint: str = "") -> RefitTimeoutError:
        p = self._progress.as_dict(side="sender", silent="receiver", endpoint=self._endpoint, timeout_s=self.config.timeout_s, reason=reason,
                                   connections=self._watch.last_seen())
        ago = f" {time.monotonic() - self._last_reply_t:.2f} s ago" if self._last_reply_t is not None and p["last_reply"] else ""
        return RefitTimeoutError(
            f"refit {p['refit_id']} on {self._endpoint}: {what}; {reason} "
            f"(buffers acked {p['buffers_acked']}/{p['buffers_sent']}, tensors acked {p['tensors_acked']} of "
            f"{p['tensors_sent']} sent, last acked {p['last_acked_name']!r}, last packed {p['last_name']!r}; last reply "
            f"{p['last_reply'] or 'none'}{ago}; connections: {p['connections']}); "
            "staging memory released" + (f". {hint}" if hint else ""),
            p,
        )

    def _abort(self, exc: BaseException) -> None:
        """Tell the receiver this refit is over (``Abort``), so it stops at once. Bounded, never raises."""
        p = self._progress
        if self._peer_gave_up:
            return
        reason = f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
        try:
            self._sock.send(encode(Abort(reason=reason)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            logger.debug("refit %s: could not send Abort (%s)", p.refit_id, e)
            return
        if isinstance(exc, RefitTimeoutError) or not isinstance(exc, Exception):
            return  # receiver gone or stuck, or an interrupt: do not wait again
        deadline = time.monotonic() + min(self.config.timeout_s, ABORT_WAIT_S)
        mark = self._watch.disconnects
        while (remaining := deadline - time.monotonic()) > 0:
            ready = dict(self._poller.poll(ms(remaining)))
            self._watch.drain()
            if self._sock in ready:
                try:
                    reply = decode_reply(self._sock.recv(flags=zmq.NOBLOCK))
                except (zmq.ZMQError, RefitProtocolError):
                    return
                if isinstance(reply, Ack) and reply.seq == ABORT_SEQ:
                    logger.info("refit %s: receiver acknowledged Abort", p.refit_id)
                return
            if self._watch.disconnects > mark and not self._watch.live:
                return
        logger.info("refit %s: no acknowledgement of Abort within %.3g s", p.refit_id, min(self.config.timeout_s, ABORT_WAIT_S))

    def _agree(self, requested: VerifyMode, welcome: Welcome) -> VerifyMode:
        """Turn the receiver's ``Welcome`` into the mode of this refit, or raise."""
        p = self._progress
        if welcome.protocol != PROTOCOL_VERSION:
            raise RefitProtocolError(f"receiver on {self._endpoint} speaks protocol {welcome.protocol}, sender {PROTOCOL_VERSION}", progress=p.as_dict())
        try:
            got = VerifyMode.parse(welcome.mode, source="Welcome.mode")
        except RefitConfigError as e:
            raise RefitProtocolError(str(e), progress=p.as_dict()) from None
        if got is requested:
            return got
        if got.verifies:
            raise RefitProtocolError(f"refit {p.refit_id}: the sender asked for mode {requested.value}, the receiver answered {got.value}", progress=p.as_dict())
        why = welcome.reason or "no reason given"
        if requested is VerifyMode.ENFORCE:
            raise RefitProtocolError(
                f"refit {p.refit_id}: mode agreement failed at the handshake: the sender runs enforce but the receiver on "
                f"{self._endpoint} cannot verify ({why}); refusing an unverified refit", progress=p.as_dict())
        logger.warning("refit %s runs UNVERIFIED: the sender's mode is log but the receiver on %s cannot verify (%s)",
                       p.refit_id, self._endpoint, why)
        return VerifyMode.OFF

    # -- sequencing (strict REQ/REP lockstep: at most one request outstanding) --------------------

    def _take_welcome(self, st: SendState) -> None:
        early = not self._sock.poll(0)  # not arrived yet: what was done since Hello ran while the receiver answered it
        welcome = self._take_reply(Welcome)
        st.welcome_pending = False
        st.welcome_s = time.perf_counter() - st.hello_t
        packer = st.progress.packer
        st.before_welcome_s = packer.digest_s if early and packer is not None else 0.0
        st.mode = self._agree(st.requested, welcome)
        st.progress.mode = st.mode.value
        if st.requested.verifies and not st.mode.verifies and packer is not None:
            packer.stop_digests()  # log, and the receiver cannot verify: no more digest work for this refit

    def _settle(self, st: SendState) -> None:
        """Take every reply due: the ``Welcome`` (taken as the first group is posted), then the outstanding ``Ack``."""
        p = st.progress
        if st.welcome_pending:
            self._take_welcome(st)
        if st.outstanding is not None:
            self._take_reply(Ack, st.outstanding)
            n, last = st.in_flight.pop(st.outstanding)
            p.buffers_acked += 1
            p.tensors_acked += n
            p.last_acked_name = last or p.last_acked_name
            st.outstanding = None

    def _post(self, st: SendState, buf: _staging.StagingBuffer, entries: list[Entry], used: int) -> None:
        """Send one ``Buffer`` once the previous one's ``Ack`` freed the other staging buffer."""
        self._settle(st)
        seq = st.next_seq
        kind = DigestBuffer if st.mode.verifies else Buffer  # off: the protocol-2 message, no digests
        if not st.mode.verifies and st.requested.verifies:  # log, and the receiver cannot verify: the plain wire
            entries = [Entry(name=e.name, dtype=e.dtype, shape=e.shape, offset=e.offset, nbytes=e.nbytes) for e in entries]
        self._exchange(kind(seq=seq, handle=buf.handle(), entries=entries, used_bytes=used), buf.tensor)
        st.outstanding = seq
        st.in_flight[seq] = (len(entries), entries[-1].name if entries else None)
        st.next_seq += 1
        p = st.progress
        p.buffers_sent += 1
        p.tensors_sent += len(entries)
        p.bytes_sent += sum(e.nbytes for e in entries)

    # -- the refit ---------------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None) -> VerificationReport | None:
        """Run one refit: stream every ``(name, tensor)`` to the receiver and verify.

        Args:
            named_tensors: wire names (unique, 1..4096 characters) and dense tensors of any dtype,
                shape (0-dim and 0-element included), strides and device. Consumed once, lazily.
            version: the weight version (the trainer's step, an int >= 0), carried in ``Hello``: a
                vLLM worker records it in its session and reports a version not newer than one it
                already closed as stale (a ``problems`` entry: the report fails). None: unversioned.

        Returns:
            VerificationReport | None: the comparison of both manifests; ``None`` when the refit ran
            unverified (mode ``off``, or mode ``log`` with a receiver that cannot verify — logged as a
            WARNING). In ``log`` mode a failed report is logged (WARNING on ``refit_verify``) and
            returned.

        Raises:
            RefitVerificationError: ``enforce`` mode and the manifests differ, or the receiver
                rejected entries (``report.affected`` names every affected parameter).
            RefitReceiveError: the receiver reported an error in ``Done`` (``load`` raised; in ``off``
                mode also rejected entries or a count mismatch); ``.report`` holds the report when
                one was made.
            RefitTimeoutError: the receiver did not take a message or reply within ``timeout_s``, or
                its connection dropped; ``.progress`` tells how far the refit got.
            RefitProtocolError: mode agreement failed (``enforce`` and a receiver that cannot
                verify), the receiver rejected a message, or replied out of protocol; two receivers
                are connected to the endpoint; another thread's ``send`` on this sender is in
                progress (a concurrent send: raised at once, the running refit goes on).
            RefitInputError (a ``TypeError`` and a ``ValueError``): an item that is not a ``(name, tensor)``
                pair, a bad name, a name given twice, or a tensor the digest cannot read.
            RefitConfigError: ``version`` is neither None nor an int >= 0 (before anything is sent).

        Any exception raised after ``Hello`` went out (these, the iterator's own, an interrupt)
        first sends ``Abort`` so the receiver stops at once; the staging memory is freed in every case.
        """
        version = check_version(version)
        if not self._busy.acquire(blocking=False):
            p = self._progress
            raise RefitProtocolError(
                f"concurrent send on one RefitSender ({self._endpoint}): refit {p.refit_id} is in progress in thread "
                f"{self._busy_thread!r} ({p.buffers_sent} buffers sent, {p.buffers_acked} acknowledged, waiting for "
                f"{p.waiting_for or 'nothing'}); a sender runs one refit at a time: wait for it to return, or give each "
                "concurrent refit its own sender and endpoint", progress=p.as_dict(side="sender", reason="concurrent send"))
        try:
            self._busy_thread = threading.current_thread().name
            return self._send_refit(named_tensors, version)
        finally:
            self._busy_thread = None
            self._busy.release()

    def _send_refit(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None) -> VerificationReport | None:
        cfg = self.config
        refit_id = uuid.uuid4().hex
        self._progress = p = Progress(refit_id=refit_id, mode=cfg.mode.value)
        st = SendState(send=self._post, settle=self._settle, requested=cfg.mode, mode=cfg.mode, progress=p, capacity=cfg.buffer_bytes // 2, device=self.device)
        t_start = time.perf_counter()
        self._sock.setsockopt(zmq.SNDTIMEO, ms(cfg.timeout_s))  # the config may have been replaced since the last refit
        self._watch.drain()
        self._peer_gave_up = False
        self._last_reply_t = None
        packer: Packer | None = None
        try:
            st.hello_sent = True
            self._exchange(Hello(protocol=PROTOCOL_VERSION, refit_id=refit_id, mode=st.requested.value, alignment=cfg.alignment,
                                 producer_rank=self.rank, producer_device=None if self.device is None else str(self.device),
                                 version=version), None)
            st.welcome_pending, st.hello_t = True, time.perf_counter()
            # The Welcome is taken lazily, as the first group is posted: the first group is staged, digested and packed
            # while the receiver reads Hello and answers it. Nothing is sent before it; a mode the receiver cannot agree
            # to raises there (enforce), or turns the refit into off (log: the digests made are not sent).
            if st.requested.verifies and isinstance(named_tensors, (list, tuple)):
                st.stage_ahead(named_tensors, cfg.alignment)
            # verifying: each entry carries its digest, so the receiver checks every tensor before loading it
            packer = p.packer = Packer(st, capacity=st.capacity, alignment=cfg.alignment,
                                       digests=DigestBatch() if st.requested.verifies else None, digests_ahead=st.requested.verifies)
            if isinstance(named_tensors, (list, tuple)):
                packer.digest_first(named_tensors)  # the first group's digests now, the rest's once it is sent (two synchronisations per refit)
            packer.add_all(named_tensors)
            self._settle(st)
            sender_manifest = packer.manifest()
            st.free_pool()  # both staging buffers are acknowledged: free them before waiting on the receiver
            self._peer_gave_up = True  # after Complete the receiver reads nothing more of this refit
            if packer.tensors == 0:
                logger.warning("refit %s carries no tensors (an exhausted iterator?): nothing to verify", refit_id)
            done = self._exchange(Complete(n_tensors=packer.tensors), None)
            if not isinstance(done, Done):  # an override must hand back what super() returned
                raise RefitProtocolError(f"refit {refit_id}: no Done reply to Complete", progress=p.as_dict())
        except BaseException as e:
            if st.hello_sent:
                self._abort(e)
                # the worker's session of this transfer (the implicit one is named after the refit) may hold part of
                # it: never a baseline an audit, an empty partial refit or a certificate vouches for
                verdicts.record(refit_id, False, f"its refit failed before the verdict ({type(e).__name__})")
            if packer is not None:
                packer.release()  # queued fused copies hold views of the staging buffers freed below
            raise
        finally:
            st.free_pool()
            if packer is not None:  # the counts stay readable; the packer (and through it this sender) is let go
                p.packer = PackedCounts(packer.tensors, packer.last_name, packer.digest_s)
        self.last_stats = RefitStats(
            refit_id=refit_id, mode=st.mode.value, tensors=packer.tensors, bytes=p.bytes_sent, buffers=p.buffers_sent, hello_sent=p.hello_sent,
            stage_s=st.stage_s, welcome_s=st.welcome_s, digest_before_welcome_s=st.before_welcome_s, digest_s=packer.digest_s, digest_shadow_s=packer.digest_shadow_s, wall_s=time.perf_counter() - t_start, receiver_digest_s=float(done.digest_s),
        )
        return self._verdict(st.mode, sender_manifest, done, version)

    def _verdict(self, mode: VerifyMode, sender_manifest: dict[str, str] | None, done: Done,
                 version: int | None = None) -> VerificationReport | None:
        p = self._progress
        rid = p.refit_id
        rejected = dict(done.rejected or {})
        if not mode.verifies:
            if done.manifest is not None:
                raise RefitProtocolError(f"refit {rid}: mode is off but the receiver returned a manifest", progress=p.as_dict())
            problems = []
            if rejected:
                problems.append(f"{len(rejected)} entries rejected: " + "; ".join(f"{k} ({v})" for k, v in list(rejected.items())[:20]))
            if done.error is not None:
                problems.append(done.error)
            if problems:
                raise RefitReceiveError(f"refit {rid}: receiver reported: " + "; ".join(problems), progress=p.as_dict())
            return None
        if done.manifest is None:
            raise RefitProtocolError(f"refit {rid}: mode is {mode.value} but the receiver returned no manifest", progress=p.as_dict())
        checked = isinstance(done, CheckedDone)
        report = receiver_report(sender_manifest, done.manifest, done.session, refit_id=rid, rejected=rejected, error=done.error,
                                 rank=self.rank, producer_rank=self.rank, landed=done.landed if checked else None,
                                 kept=done.kept if checked else None, version=version)
        # the worker's session: the one this transfer joined, else the implicit one named after the refit
        bad = (wrote_wrong({"model": sender_manifest or {}}, done.session, report, producer_rank=self.rank)
               if not report.ok and done.session is not None and done.error is None else None)
        verdicts.record(getattr(done.session, "session", None) or rid, report.ok, bad=None if bad is None else frozenset(bad))
        report = act_on(report, mode)  # enforce: raises RefitVerificationError when not ok
        if done.error is not None:
            raise RefitReceiveError(f"refit {rid}: receiver reported: {done.error}", report=report, progress=p.as_dict())
        return report
