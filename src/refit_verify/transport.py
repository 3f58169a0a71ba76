"""Refit transport: a ZMQ REQ/REP pair streaming tensors through double-buffered staging memory.

The sender (trainer side) binds a REQ socket, agrees the verification mode with the receiver
(``Hello`` / ``Welcome``), packs tensors in logical byte order into two ping-pong staging buffers at
aligned offsets, and sends one ``Buffer`` message per filled buffer; the receiver (vLLM worker side)
connects a REP socket, validates every entry, views it in place, digests it (when the refit
verifies), hands the batch to ``load`` and acknowledges. After ``Complete`` the receiver returns its
manifest in ``Done`` and the sender compares it with its own. A sender-side exception sends
``Abort`` so the receiver stops at once; every wait on either side is bounded.

Layout, message sequence and invariants follow NeMo-RL's colocated ZMQ + CUDA-IPC refit; see
``docs/protocol.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypedDict

import torch
import zmq

from refit_verify import staging as _staging
from refit_verify.config import RefitConfig, VerifyMode
from refit_verify.digest import DigestBatch, dtype_name, logical_bytes
from refit_verify.errors import RefitAbortedError, RefitConfigError, RefitProtocolError, RefitReceiveError, RefitTimeoutError
from refit_verify.manifest import ExternalDigests, Producer
from refit_verify.report import VerificationReport, act_on, compare_manifests
from refit_verify.wire import (
    ABORT_SEQ,
    MAX_ALIGNMENT,
    MAX_ENTRIES_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_NAME_BYTES,
    MIN_ALIGNMENT,
    PROTOCOL_VERSION,
    Abort,
    Ack,
    Buffer,
    Complete,
    Done,
    Entry,
    Hello,
    Reject,
    Welcome,
    decode_reply,
    decode_request,
    encode,
    torch_dtype,
)

__all__ = ["RefitSender", "RefitReceiver", "RefitStats", "ReceiveResult", "Batch", "LoadFn", "ABORT_WAIT_S"]

logger = logging.getLogger("refit_verify")

Batch = list[tuple[str, torch.Tensor]]
"""What ``load`` receives: ``(wire name, tensor view of the staging buffer)`` in message order."""

LoadFn = Callable[[Batch], None]

ABORT_WAIT_S = 5.0
"""After sending ``Abort``, the sender waits at most ``min(timeout_s, ABORT_WAIT_S)`` seconds for
its acknowledgement (none after a timeout or a disconnect: the receiver is gone or stuck)."""
LAST_WORDS_S = 0.25
"""A peer's last message (Done, Complete) can be queued just behind the monitor's disconnect event:
before declaring a peer gone, the socket gets this long (seconds) to show it."""
RECONNECT_IVL_MS = 5
"""The receiver's retry interval (ms) while the sender's endpoint is not bound yet (ZMQ's default,
100 ms, added up to 100 ms to a refit whose worker connected before the trainer bound)."""

_MAX_ERROR_CHARS = 8192
_MAX_REASON_CHARS = 1000
_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin
_MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _entry_cost(name: str, dtype: str, ndim: int) -> int:
    """Upper estimate of an Entry's msgpack size, bytes."""
    return len(name.encode()) + len(dtype) + 9 * ndim + 32


def _ms(seconds: float) -> int:
    return max(1, int(math.ceil(seconds * 1000)))


def _close_zmq(sock: zmq.Socket, watch: _PeerWatch | None, ctx: zmq.Context, private_dir: str | None) -> None:
    try:
        if watch is not None:
            watch.close(sock)
        sock.close(linger=0)
    finally:
        ctx.term()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ socket security


def _ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint (``None`` for other transports and abstract sockets)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if path.startswith("@") or path == "*" else path


def _check_private_dir(endpoint: str, role: str) -> None:
    """Refuse an ``ipc://`` endpoint that a stranger could plant or replace.

    The socket's directory must exist, be a real directory owned by this user (or root) and not be
    writable by group or others; an existing socket file must be a socket owned by this user (or
    root). A directory that others can enter is accepted with a warning (they still cannot replace
    the socket, and the peer's uid is checked on connection). Other transports are not checked.

    Raises:
        RefitConfigError: the endpoint's directory or socket file fails these checks.
    """
    path = _ipc_path(endpoint)
    if path is None:
        if endpoint.startswith("ipc://"):
            logger.warning("refit %s endpoint %s is an abstract or wildcard ipc:// name: no file-permission protection "
                           "(peer uids are still checked)", role, endpoint)
        else:
            logger.warning("refit %s endpoint %s is not an ipc:// path: no file-permission protection, and peer "
                           "credentials cannot be checked", role, endpoint)
        return
    d = os.path.dirname(os.path.abspath(path))
    me = os.geteuid()
    try:
        st = os.lstat(d)
    except FileNotFoundError:
        raise RefitConfigError(f"refit {role}: endpoint directory {d} does not exist (the sender creates it and binds "
                               "first; pass RefitSender.endpoint)") from None
    if not stat.S_ISDIR(st.st_mode):
        raise RefitConfigError(f"refit {role}: endpoint directory {d} is not a directory (a link?)")
    if st.st_uid not in (me, 0) or st.st_mode & 0o022:
        raise RefitConfigError(
            f"refit {role}: endpoint directory {d} (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}) is not private: "
            f"it must be owned by uid {me} and not writable by group or others (the default endpoint lives in a "
            "0700 directory with a random name)")
    if st.st_mode & 0o077:
        logger.warning("refit %s: endpoint directory %s has mode %o; 0700 keeps other users from even reaching the socket",
                       role, d, stat.S_IMODE(st.st_mode))
    try:
        sst = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(sst.st_mode) or sst.st_uid not in (me, 0):
        raise RefitConfigError(f"refit {role}: {path} is not a socket owned by uid {me} (uid {sst.st_uid}, mode {sst.st_mode:o})")


def _peer_cred(fd: int) -> tuple[int, int] | None:
    """``(pid, uid)`` of the peer of the Unix socket ``fd`` (SO_PEERCRED), or ``None`` where the
    platform or the socket does not allow it. ``fd`` belongs to ZMQ's I/O thread: it is duplicated,
    never closed here."""
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        s = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None
    try:
        if s.family != socket.AF_UNIX:
            return None
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
        return pid, uid
    except OSError:
        return None
    finally:
        s.close()


def _shutdown_fd(fd: int) -> None:
    """Shut the connection on ``fd`` down (ZMQ then drops that peer); the fd itself stays ZMQ's."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def checked_item(item: tuple[str, torch.Tensor], seen: set[str]) -> tuple[str, torch.Tensor]:
    """Validate one ``(name, tensor)`` of a refit stream and record its name in ``seen``.

    Raises:
        ValueError: the name is not a str of 1..MAX_NAME_BYTES characters, or was given before.
        TypeError: the tensor is not a ``torch.Tensor``.
    """
    name, t = item
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_BYTES:
        raise ValueError(f"tensor names must be str of 1..{MAX_NAME_BYTES} characters, got {name!r:.100}")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if name in seen:
        raise ValueError(f"{name}: given twice in one refit (wire names must be unique)")
    seen.add(name)
    return name, t


class _PeerWatch:
    """Follows a ZMQ socket's connections through its monitor socket.

    * Each new connection of an ``ipc://`` socket is checked with ``SO_PEERCRED`` (Linux): a peer
      whose uid is neither this process's effective uid nor root is logged, its connection shut down,
      and recorded in ``strangers``.
    * Failed ZMTP handshakes (a non-ZMQ client, garbage, a pickle, a foreign mechanism) and
      connections dropped before their handshake completed (e.g. an oversized first frame, which
      libzmq refuses against ``MAXMSGSIZE`` without allocating it) are logged as rejected connections.
    * ``live`` holds the fds of connections; ``disconnects`` counts disconnections of peers that
      completed their handshake, so a wait can tell that its peer went away. (Handshake results
      carry no fd; they are matched to connections in arrival order, which only affects logging.)

    ZMQ's own ``ZMQ_IPC_FILTER_UID`` is not used: it is deprecated, absent from many libzmq builds, and
    in libzmq 4.3.5 (pyzmq 27) it refused even the allowed uid in our tests.
    """

    def __init__(self, sock: zmq.Socket, endpoint: str, role: str) -> None:
        self.endpoint = endpoint
        self.role = role
        self.check_uid = endpoint.startswith("ipc://")
        self.allowed_uids = {os.geteuid(), 0}
        self.live: set[int] = set()
        self.disconnects = 0
        self.strangers: list[tuple[int, int]] = []
        self.rejected_handshakes = 0
        self._awaiting: list[int] = []  # connections whose ZMTP handshake has not completed
        self._failed: set[int] = set()
        self.mon = sock.get_monitor_socket(_MONITOR_EVENTS)

    def close(self, sock: zmq.Socket) -> None:
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)

    def drain(self) -> None:
        """Handle every pending monitor event (never blocks)."""
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                frames = self.mon.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # Again: nothing pending
                return
            ev = parse_monitor_message(frames)
            kind, value = int(ev["event"]), int(ev["value"])
            if kind in (zmq.EVENT_ACCEPTED, zmq.EVENT_CONNECTED):
                self._on_connection(value)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                if self._awaiting:
                    self._awaiting.pop(0)
            elif kind == zmq.EVENT_DISCONNECTED:
                if value in self._awaiting:  # never completed the ZMTP handshake: never a peer
                    self._awaiting.remove(value)
                    self.live.discard(value)
                    if value in self._failed:
                        self._failed.discard(value)
                    else:
                        self.rejected_handshakes += 1
                        logger.warning("refit %s on %s rejected a connection: it closed or was dropped before completing the "
                                       "ZMTP handshake (not a ZMQ peer of this protocol, or an invalid or oversized first frame)",
                                       self.role, self.endpoint)
                elif value in self.live:
                    self.live.discard(value)
                    self.disconnects += 1
                    logger.debug("refit %s on %s: a peer disconnected", self.role, self.endpoint)
            else:  # handshake failed
                self.rejected_handshakes += 1
                if self._awaiting:
                    self._failed.add(self._awaiting[0])
                logger.warning("refit %s on %s rejected a connection: ZMTP handshake failed (event %d): not a ZMQ peer "
                               "of this protocol (garbage, a pickle, a foreign mechanism); connection dropped",
                               self.role, self.endpoint, kind)

    def _on_connection(self, fd: int) -> None:
        if self.check_uid:
            cred = _peer_cred(fd)
            if cred is not None and cred[1] not in self.allowed_uids:
                pid, uid = cred
                self.strangers.append((pid, uid))
                logger.error("refit %s on %s rejected a connection from pid %d uid %d: only uid %d (or root) may connect",
                             self.role, self.endpoint, pid, uid, os.geteuid())
                _shutdown_fd(fd)
                return
        self.live.add(fd)
        self._awaiting.append(fd)


# ------------------------------------------------------------------------------ results


class RefitStats(TypedDict):
    """Numbers of the sender's last refit (a plain dict: ``sender.last_stats["digest_s"]``).

    Keys:
        refit_id: id carried by ``Hello`` (32 hex).
        mode: the mode agreed at the handshake (``"off"`` when a ``log`` sender met a receiver that
            cannot verify).
        tensors: tensors sent. bytes: their exact bytes (padding excluded).
        buffers: ``Buffer`` messages sent (oversized tensors included).
        digest_s: seconds the sender spent in digest code (0.0 in ``off`` mode); on CUDA this
            includes waiting for earlier queued work at the synchronisation points.
        wall_s: seconds from ``Hello`` to ``Done``.
        receiver_digest_s: the receiver's digest seconds, from ``Done``.
    """

    refit_id: str
    mode: str
    tensors: int
    bytes: int
    buffers: int
    digest_s: float
    wall_s: float
    receiver_digest_s: float


@dataclass
class ReceiveResult:
    """Outcome of one :meth:`RefitReceiver.receive`.

    Attributes:
        manifest: ``{name: 32-hex digest}`` of every accepted staged slice (``None`` when the agreed
            mode is ``off``).
        tensors: entries accepted. bytes: their exact bytes. digest_s: seconds in digest code.
        buffers: ``Buffer`` messages handled.
        refit_id: the sender's refit id. mode: the agreed mode.
        error: errors recorded during the refit that name no entry (also sent in ``Done``), or ``None``.
        rejected: ``{name: reason}`` of refused entries (also sent in ``Done``).
    """

    manifest: dict[str, str] | None
    tensors: int
    bytes: int
    digest_s: float
    buffers: int
    refit_id: str = ""
    mode: VerifyMode = VerifyMode.OFF
    error: str | None = None
    rejected: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.rejected


@dataclass
class _Progress:
    refit_id: str = ""
    mode: str = ""
    buffers_sent: int = 0
    buffers_acked: int = 0
    tensors_sent: int = 0
    tensors_acked: int = 0
    tensors_packed: int = 0
    bytes_sent: int = 0
    last_name: str | None = None
    last_acked_name: str | None = None
    waiting_for: str = ""

    def as_dict(self, **extra: object) -> dict:
        d = dict(self.__dict__)
        d.update(extra)
        return d


# ------------------------------------------------------------------------------ sender


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
            lie in a directory owned by this user and not writable by group or others.
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
        RefitConfigError: a bad ``config`` or an explicit ``ipc://`` endpoint in a non-private directory.
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
            prefix = f"refit-verify-{secrets.token_hex(8)}-"
            d = tempfile.mkdtemp(prefix=prefix)
            if len(d) > _IPC_PATH_MAX - len("/refit.sock"):
                os.rmdir(d)
                d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
            os.chmod(d, 0o700)
            self._private_dir = d
            endpoint = f"ipc://{d}/refit.sock"
        _check_private_dir(endpoint, "sender")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        self._watch: _PeerWatch | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.RCVTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # After a timed-out wait or an Abort the socket may send again; late replies to old
            # requests are dropped.
            self._sock.setsockopt(zmq.REQ_RELAXED, 1)
            self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
            self._watch = _PeerWatch(self._sock, endpoint, "sender")
            self._sock.bind(endpoint)
            self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._watch.endpoint = self._endpoint
        except BaseException:
            _close_zmq(self._sock, self._watch, self._ctx, self._private_dir)
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, self._sock, self._watch, self._ctx, self._private_dir)
        self._progress = _Progress()
        self._mark = 0
        self._peer_gave_up = False
        self._last_hello: bytes | None = None
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.mon, zmq.POLLIN)

    # -- lifecycle -----------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The bound endpoint, to hand to :class:`RefitReceiver` (e.g. ``ipc:///tmp/refit-verify-x/refit.sock``)."""
        return self._endpoint

    def close(self) -> None:
        """Close the socket and remove the private directory. Idempotent."""
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
        before calling ``super()._exchange`` (see ``tests/faults.py``).

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
        data = encode(msg)
        if isinstance(msg, Hello):
            self._last_hello = data
        self._watch.drain()
        self._mark = self._watch.disconnects
        try:
            self._sock.send(data, copy=False)
        except zmq.Again:
            if isinstance(msg, Hello):
                raise self._timeout(f"could not send Hello within {self.config.timeout_s:g} s", "receiver never connected",
                                    "is a RefitReceiver connected to this endpoint? In vLLM: is the refit_verify plugin loaded "
                                    "in the workers (VLLM_PLUGINS) and refit_verify_receive called?") from None
            raise self._timeout(f"could not send {type(msg).__name__} within {self.config.timeout_s:g} s", "receiver went silent") from None

    def _take_reply(self, expect: type, seq: int | None = None) -> Welcome | Ack | Done:
        """Wait (at most ``timeout_s``) for the reply to the outstanding request and check it.

        While waiting for ``Welcome``, a disconnection of another connection re-sends ``Hello`` once
        (a receiver of an earlier refit may still have been closing when ``Hello`` left; a receiver
        answers a repeated ``Hello`` of the same refit again).

        Raises:
            RefitTimeoutError: no reply in time, or the receiver's connection dropped (and no other is
                left). RefitProtocolError: a ``Reject``, an undecodable reply, or a reply of the wrong
                type or sequence number.
        """
        p = self._progress
        p.waiting_for = f"{expect.__name__}" + (f"(seq={seq})" if seq is not None else "")
        deadline = time.monotonic() + self.config.timeout_s
        mark = self._mark
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(f"no {p.waiting_for} reply within {self.config.timeout_s:g} s", "receiver went silent")
            ready = dict(self._poller.poll(_ms(remaining)))
            self._watch.drain()
            if self._sock in ready:
                break
            if self._watch.disconnects > mark:
                if not self._watch.live:
                    if self._sock.poll(_ms(LAST_WORDS_S)):
                        break
                    raise self._timeout(f"the receiver's connection closed while waiting for {p.waiting_for}", "receiver disconnected")
                if expect is Welcome and self._last_hello is not None:
                    logger.info("refit %s: a connection closed while Hello was outstanding; sending Hello again", p.refit_id)
                    mark = self._watch.disconnects
                    try:
                        self._sock.send(self._last_hello, flags=zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        try:
            data = self._sock.recv(copy=False, flags=zmq.NOBLOCK)
        except zmq.Again:  # pragma: no cover - readable a moment ago
            raise self._timeout(f"no {p.waiting_for} reply within {self.config.timeout_s:g} s", "receiver went silent") from None
        reply = decode_reply(data.buffer)
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

    def _timeout(self, what: str, reason: str, hint: str = "") -> RefitTimeoutError:
        p = self._progress.as_dict(side="sender", silent="receiver", endpoint=self._endpoint, timeout_s=self.config.timeout_s, reason=reason)
        return RefitTimeoutError(
            f"refit {p['refit_id']} on {self._endpoint}: {what}; {reason} "
            f"(buffers acked {p['buffers_acked']}/{p['buffers_sent']}, tensors acked {p['tensors_acked']} of "
            f"{p['tensors_sent']} sent, last acked {p['last_acked_name']!r}, last packed {p['last_name']!r}); "
            "staging memory released" + (f". {hint}" if hint else ""),
            p,
        )

    def _abort(self, exc: BaseException) -> None:
        """Tell the receiver this refit is over (``Abort``), so it stops at once. Bounded, never raises."""
        p = self._progress
        if self._peer_gave_up:
            return
        reason = f"{type(exc).__name__}: {exc}"[:_MAX_ERROR_CHARS]
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
            ready = dict(self._poller.poll(_ms(remaining)))
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

    # -- the refit ---------------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> VerificationReport | None:
        """Run one refit: stream every ``(name, tensor)`` to the receiver and verify.

        Args:
            named_tensors: wire names (unique, 1..4096 characters) and dense tensors of any dtype,
                shape (0-dim and 0-element included), strides and device. Consumed once, lazily.

        Returns:
            VerificationReport | None: the comparison of both manifests; ``None`` when the refit ran
            unverified (mode ``off``, or mode ``log`` with a receiver that cannot verify — logged as a
            WARNING). In ``log`` mode a failed report is logged (WARNING on ``refit_verify``) and
            returned.

        Raises:
            RefitVerificationError: ``enforce`` mode and the manifests differ, or the receiver
                rejected entries (``report.affected`` names every affected parameter).
            RefitTimeoutError: the receiver did not take a message or reply within ``timeout_s``, or
                its connection dropped; ``.progress`` tells how far the refit got.
            RefitProtocolError: mode agreement failed (``enforce`` and a receiver that cannot
                verify), the receiver rejected a message, reported an error in ``Done`` (``load``
                raised; in ``off`` mode also rejected entries or a count mismatch), or replied out of
                protocol.
            TypeError / ValueError: a bad name, a name given twice, or a bad tensor.

        Any exception raised after ``Hello`` went out (these, the iterator's own, an interrupt)
        first sends ``Abort`` so the receiver stops at once; the staging memory is freed in every case.
        """
        cfg = self.config
        requested = cfg.mode
        align = cfg.alignment
        half = cfg.buffer_bytes // 2
        refit_id = uuid.uuid4().hex
        p = self._progress = _Progress(refit_id=refit_id, mode=requested.value)
        digest_s = 0.0
        cuda_digests_pending = False
        device = self.device
        pool: list[_staging.StagingBuffer | None] = [None, None]
        dedicated: _staging.StagingBuffer | None = None
        t_start = time.perf_counter()
        self._watch.drain()
        self._peer_gave_up = False

        # Sequencing state (strict REQ/REP lockstep: at most one request outstanding).
        outstanding: int | None = None  # seq of the unanswered Buffer; None: nothing outstanding
        welcome_pending = False
        in_flight: dict[int, tuple[int, str | None]] = {}
        next_seq = 0
        cur = 0
        entries: list[Entry] = []
        used = 0
        est = 0
        mode = requested
        batch: DigestBatch | None = None
        names: set[str] = set()
        hello_sent = False

        def take_welcome() -> None:
            nonlocal welcome_pending, mode, batch
            welcome = self._take_reply(Welcome)
            welcome_pending = False
            mode = self._agree(requested, welcome)
            p.mode = mode.value
            if not mode.verifies:
                batch = None

        def settle() -> None:
            nonlocal outstanding
            if welcome_pending:
                take_welcome()
            if outstanding is not None:
                self._take_reply(Ack, outstanding)
                n, last = in_flight.pop(outstanding)
                p.buffers_acked += 1
                p.tensors_acked += n
                p.last_acked_name = last or p.last_acked_name
                outstanding = None

        def finish_digests() -> None:
            nonlocal digest_s, cuda_digests_pending
            if cuda_digests_pending and batch is not None:
                t0 = time.perf_counter()
                batch.launch()  # async; the stream sync before the handle leaves orders it
                digest_s += time.perf_counter() - t0
            cuda_digests_pending = False

        def post_buffer(buf: _staging.StagingBuffer, ents: list[Entry], used_bytes: int) -> None:
            nonlocal outstanding, next_seq
            finish_digests()  # bounds digest temporaries to one group; syncs on CUDA
            settle()  # the previous request's Ack frees the other buffer
            msg = Buffer(seq=next_seq, handle=buf.handle(), entries=ents, used_bytes=used_bytes)
            self._exchange(msg, buf.tensor)
            outstanding = next_seq
            in_flight[next_seq] = (len(ents), ents[-1].name if ents else None)
            next_seq += 1
            p.buffers_sent += 1
            p.tensors_sent += len(ents)
            p.bytes_sent += sum(e.nbytes for e in ents)

        def flush() -> None:
            nonlocal cur, entries, used, est
            if entries:
                post_buffer(pool[cur], entries, used)
                cur ^= 1
            entries, used, est = [], 0, 0

        try:
            hello_sent = True
            self._exchange(Hello(protocol=PROTOCOL_VERSION, refit_id=refit_id, mode=requested.value, alignment=align,
                                 producer_rank=self.rank, producer_device=None if self.device is None else str(self.device)), None)
            welcome_pending = True
            if requested.verifies:
                take_welcome()  # agree before any digest work (one round trip)
            # In off mode the Welcome is taken lazily, while the first group is packed.
            if mode.verifies:
                batch = DigestBatch()
            n_tensors = 0
            for item in named_tensors:
                name, t = checked_item(item, names)
                if device is None:
                    device = t.device if t.is_cuda else torch.device("cpu")
                p.last_name = name
                if batch is not None:
                    t0 = time.perf_counter()
                    batch.add(name, t)  # before packing: covers pack, transport and slicing
                    digest_s += time.perf_counter() - t0
                    cuda_digests_pending |= t.is_cuda
                u8 = logical_bytes(t)
                n = u8.numel()
                a = _round_up(n, align)
                dt = dtype_name(t.dtype)
                shape = list(t.shape)
                cost = _entry_cost(name, dt, t.dim())
                if a > half:
                    # Oversized: alone in a dedicated buffer of the exact aligned size (packed while
                    # the flushed group is in flight), sent alone, Ack taken at once, then freed.
                    flush()
                    dedicated = _staging.allocate(a, device)
                    dedicated.tensor[:n].copy_(u8, non_blocking=dedicated.tensor.is_cuda)
                    del u8
                    post_buffer(dedicated, [Entry(name=name, dtype=dt, shape=shape, offset=0, nbytes=n)], a)
                    settle()
                    dedicated.close()
                    dedicated = None
                    p.tensors_packed += 1
                    n_tensors += 1
                    continue
                if used + a > half or est + cost > MAX_ENTRIES_BYTES:
                    flush()
                if pool[cur] is None:
                    pool[cur] = _staging.allocate(half, device)
                if n:
                    dst = pool[cur].tensor[used : used + n]
                    dst.copy_(u8, non_blocking=dst.is_cuda)
                    del dst
                del u8
                entries.append(Entry(name=name, dtype=dt, shape=shape, offset=used, nbytes=n))
                used += a
                est += cost
                p.tensors_packed += 1
                n_tensors += 1
            flush()
            settle()
            sender_manifest: dict[str, str] | None = None
            if batch is not None:
                t0 = time.perf_counter()
                sender_manifest = batch.hexdigests()
                digest_s += time.perf_counter() - t0
            # Both staging buffers are acknowledged: free them before waiting on the receiver.
            for i, b in enumerate(pool):
                if b is not None:
                    b.close()
                    pool[i] = None
            self._peer_gave_up = True  # after Complete the receiver reads nothing more of this refit
            if n_tensors == 0:
                logger.warning("refit %s carries no tensors (an exhausted iterator?): nothing to verify", refit_id)
            done = self._exchange(Complete(n_tensors=n_tensors), None)
            if not isinstance(done, Done):  # an override must hand back what super() returned
                raise RefitProtocolError(f"refit {refit_id}: no Done reply to Complete", progress=p.as_dict())
        except BaseException as e:
            if hello_sent:
                self._abort(e)
            raise
        finally:
            for b in (*pool, dedicated):
                if b is not None:
                    b.close()
        wall_s = time.perf_counter() - t_start
        self.last_stats = RefitStats(
            refit_id=refit_id, mode=mode.value, tensors=n_tensors, bytes=p.bytes_sent, buffers=p.buffers_sent,
            digest_s=digest_s, wall_s=wall_s, receiver_digest_s=float(done.digest_s),
        )
        return self._verdict(mode, sender_manifest, done)

    def _verdict(self, mode: VerifyMode, sender_manifest: dict[str, str] | None, done: Done) -> VerificationReport | None:
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
        if done.session is not None:  # digested at the worker's model boundary: coverage, identity, read-back too
            from refit_verify.check import compare_session

            base = compare_session({"model": sender_manifest or {}}, done.session, session=rid, producer_rank=self.rank)
            report = dataclasses.replace(base, rejected=rejected, receiver_error=done.error,
                                         rank=self.rank if self.rank is not None else base.rank)
        else:
            report = compare_manifests(sender_manifest, done.manifest, rejected=rejected, receiver_error=done.error, rank=self.rank)
        report = act_on(report, mode)  # enforce: raises RefitVerificationError when not ok
        if done.error is not None:
            raise RefitReceiveError(f"refit {rid}: receiver reported: {done.error}", report=report, progress=p.as_dict())
        return report


# ------------------------------------------------------------------------------ receiver


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

    The connected peer's uid is checked with ``SO_PEERCRED`` where the platform allows; a peer of
    another uid (root excepted) ends the refit with ``RefitProtocolError``.

    Raises:
        RefitConfigError: a bad ``config`` or an ``ipc://`` endpoint in a non-private directory.
    """

    def __init__(self, endpoint: str, *, config: RefitConfig | None = None, device: str | torch.device | int | None = None,
                 verify: bool = True) -> None:
        self.config = config if config is not None else RefitConfig()
        if not isinstance(self.config, RefitConfig):
            raise RefitConfigError(f"config must be a RefitConfig, got {type(self.config).__name__}")
        if not isinstance(endpoint, str) or not endpoint:
            raise RefitConfigError(f"endpoint must be a non-empty string, got {endpoint!r}")
        if not isinstance(verify, bool):
            raise RefitConfigError(f"verify must be True or False, got {verify!r}")
        self.endpoint = endpoint
        self.device = device
        self.verify = verify
        self._capability: tuple[bool, str | None] | None = None
        _check_private_dir(endpoint, "receiver")
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._watch: _PeerWatch | None = None
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 10 * RECONNECT_IVL_MS)
            self._watch = _PeerWatch(self._sock, endpoint, "receiver")
            self._sock.connect(endpoint)
        except BaseException:
            _close_zmq(self._sock, self._watch, self._ctx, None)
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, self._sock, self._watch, self._ctx, None)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._watch.mon, zmq.POLLIN)

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
            return False, "verification is disabled on this receiver (RefitReceiver(verify=False))"
        if self._capability is None:
            try:
                from refit_verify import digest as _digest  # noqa: F401

                dev = self.device
                if torch.cuda.is_available() and (dev is None or isinstance(dev, int) or _staging._as_device(dev).type == "cuda"):
                    from refit_verify.kernels import digest as _kd  # noqa: F401
                self._capability = (True, None)
            except Exception as e:  # noqa: BLE001 - any import failure means: cannot verify
                self._capability = (False, f"digest code unavailable in this process: {type(e).__name__}: {e}")
        return self._capability

    # -- wire --------------------------------------------------------------------------------

    def _recv(self, timeout_s: float, progress: dict, *, in_refit: bool):
        """Wait at most ``timeout_s`` for a request; decode it or reject it and raise.

        During a refit (``in_refit``), a dropped connection to the sender ends the wait at once.
        """
        deadline = time.monotonic() + timeout_s
        mark = self._watch.disconnects
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._timeout(f"no message within {timeout_s:g} s while {progress['stage']}", "sender went silent", progress, timeout_s)
            ready = dict(self._poller.poll(_ms(remaining)))
            self._watch.drain()
            if self._watch.strangers:
                pid, uid = self._watch.strangers.pop()
                self._watch.strangers.clear()
                raise RefitProtocolError(f"receiver on {self.endpoint}: the peer (pid {pid}) runs as uid {uid}, not {os.geteuid()}: "
                                         "refusing to take weights from another user", progress=progress)
            if self._sock in ready:
                break
            if in_refit and self._watch.disconnects > mark and not self._watch.live:
                if self._sock.poll(_ms(LAST_WORDS_S)):
                    break
                raise self._timeout(f"the sender's connection closed while {progress['stage']} (timeout {timeout_s:g} s)", "sender disconnected", progress, timeout_s)
        data = self._sock.recv(copy=False)
        try:
            return decode_request(data.buffer)
        except RefitProtocolError as e:
            self._reject(str(e))
            raise

    def _timeout(self, what: str, reason: str, progress: dict, timeout_s: float) -> RefitTimeoutError:
        p = dict(progress, timeout_s=timeout_s, reason=reason, silent="sender", endpoint=self.endpoint)
        digested = " and digested" if p.get("mode") not in (None, "off") else ""
        return RefitTimeoutError(
            f"receiver on {self.endpoint}: {what}; {reason} (refit {p['refit_id']}: {p['buffers']} buffers, {p['tensors']} "
            f"tensors received{digested}, last {p['last_name']!r}); staging memory released", p)

    def _reply(self, msg: Welcome | Ack | Done | Reject) -> None:
        try:
            self._sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise RefitTimeoutError(f"receiver on {self.endpoint}: could not reply within {self.config.timeout_s:g} s",
                                    {"reason": "sender went away", "silent": "sender", "side": "receiver"}) from None

    def _reject(self, reason: str) -> None:
        logger.error("refit receiver on %s rejects a message: %s", self.endpoint, reason)
        self._reply(Reject(reason=reason[:_MAX_ERROR_CHARS]))

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
                boundary of a vLLM worker (:class:`refit_verify.boundary.SessionDigests`), whose
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
        hello = self._recv(cfg.connect_timeout_s, progress, in_refit=False)
        if not isinstance(hello, Hello):
            self._reject(f"expected Hello, got {type(hello).__name__}")
            raise RefitProtocolError(f"expected Hello, got {type(hello).__name__}")
        mode = self._welcome(hello)

        verify = mode.verifies
        external = digests if verify else None
        state = _ReceiveState(mode=mode, refit_id=hello.refit_id, alignment=hello.alignment,
                              batch=DigestBatch() if verify and external is None else None, external=external)
        progress.update(refit_id=hello.refit_id, mode=mode.value, stage="waiting for Buffer 0 or Complete")
        if external is not None:
            producer = None if hello.producer_rank is None else Producer(rank=hello.producer_rank, device=hello.producer_device or "cpu")
            external.begin(hello.refit_id, producer)
        try:
            return self._receive_loop(state, progress, load)
        except BaseException as e:
            if external is not None:
                external.fail(f"{type(e).__name__}: {e}")
            raise

    def _receive_loop(self, state: _ReceiveState, progress: dict, load: LoadFn) -> ReceiveResult:
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
                finally:
                    state.expected_seq = max(state.expected_seq, msg.seq) + 1
                    state.buffers += 1
                    progress.update(buffers=state.buffers, tensors=state.tensors, last_name=state.last_name,
                                    stage=f"waiting for Buffer {state.expected_seq} or Complete")
                    self._reply(Ack(seq=msg.seq))
            elif isinstance(msg, Complete):
                return self._complete(msg, state)
            elif isinstance(msg, Abort):
                self._reply(Ack(seq=ABORT_SEQ))
                logger.error("refit %s aborted by the sender after %d buffers, %d tensors: %s", state.refit_id, state.buffers, state.tensors, msg.reason)
                raise RefitAbortedError(
                    f"receiver on {self.endpoint}: refit {state.refit_id} aborted by the sender after {state.buffers} buffers, "
                    f"{state.tensors} tensors (last {state.last_name!r}): {msg.reason}", msg.reason, dict(progress, reason="sender aborted"))
            elif isinstance(msg, Hello) and msg.refit_id == state.refit_id and state.buffers == 0:
                self._welcome(msg)  # the sender re-sent Hello (a stale connection closed meanwhile)
            else:
                what = f"{type(msg).__name__}" + (f" of refit {msg.refit_id}" if isinstance(msg, Hello) else "")
                self._reject(f"unexpected {what} during refit {state.refit_id}")
                raise RefitProtocolError(f"unexpected {what} during refit {state.refit_id}", progress=progress)

    def _complete(self, msg: Complete, state: _ReceiveState) -> ReceiveResult:
        got = state.entries_received
        if msg.n_tensors != got:
            text = f"sender sent {msg.n_tensors} tensors, receiver got {got} entries ({state.tensors} accepted)"
            if state.mode.verifies:
                logger.warning("refit %s: %s; the manifests name the difference", state.refit_id, text)
            else:
                state.errors.append(text)
        manifest = None
        session = None
        if state.batch is not None or state.external is not None:
            t0 = time.perf_counter()
            try:
                if state.external is not None:
                    got, session = state.external.finish()
                else:
                    got = state.batch.hexdigests()
                manifest = {k: v for k, v in got.items() if k not in state.rejected}
            except Exception as e:  # Done must still go out
                logger.exception("refit %s: finishing digests failed", state.refit_id)
                state.errors.append(f"digest: {type(e).__name__}: {e}")
                manifest = manifest if manifest is not None else {}
            state.digest_s += time.perf_counter() - t0
        error = "; ".join(state.errors)[:_MAX_ERROR_CHARS] if state.errors else None
        rejected = dict(state.rejected) or None
        self._reply(Done(manifest=manifest, error=error, rejected=rejected, tensors=state.tensors, bytes=state.bytes,
                         digest_s=state.digest_s, session=session))
        if error:
            logger.error("refit %s finished with errors: %s", state.refit_id, error)
        if rejected:
            logger.error("refit %s: %d entries rejected: %s", state.refit_id, len(rejected),
                         "; ".join(f"{k} ({v})" for k, v in list(rejected.items())[:20]))
        return ReceiveResult(manifest=manifest, tensors=state.tensors, bytes=state.bytes, digest_s=state.digest_s,
                             buffers=state.buffers, refit_id=state.refit_id, mode=state.mode, error=error,
                             rejected=dict(state.rejected))

    def _handle_buffer(self, msg: Buffer, state: _ReceiveState, load: LoadFn) -> None:
        align = state.alignment

        def reject(name: str, reason: str) -> None:
            state.rejected.setdefault(name, reason[:_MAX_REASON_CHARS])

        if msg.seq != state.expected_seq:
            for e in msg.entries:
                reject(e.name, f"buffer seq {msg.seq}, expected {state.expected_seq}")
            state.seen.update(e.name for e in msg.entries)
            state.entries_received += len(msg.entries)
            self._open_and_release(msg)
            return
        # Validate every entry before touching memory. An entry is accepted when its dtype is real,
        # nbytes == numel × itemsize, its offset is aligned and past the slot of the previously
        # accepted entry, its aligned slot ends within used_bytes, and its name is new in this refit;
        # otherwise it alone is rejected (named in Done), and the others load.
        layout: list[tuple[str, torch.dtype, list[int], int, int]] = []
        end = 0
        for e in msg.entries:
            why = None
            try:
                dtype = torch_dtype(e.dtype)
            except RefitProtocolError as err:
                dtype, why = None, str(err)
            if why is None:
                numel = math.prod(e.shape)
                slot = _round_up(e.nbytes, align)
                if e.nbytes != numel * dtype.itemsize:
                    why = f"nbytes {e.nbytes} != numel {numel} × itemsize {dtype.itemsize} ({e.dtype}{e.shape})"
                elif e.offset % align:
                    why = f"offset {e.offset} is not a multiple of the alignment {align}"
                elif e.offset < end:
                    why = f"offset {e.offset} overlaps the previous entry's slot (which ends at {end})"
                elif e.offset + slot > msg.used_bytes:
                    why = f"slot [{e.offset}, {e.offset + slot}) extends past used_bytes {msg.used_bytes}"
            if e.name in state.seen:
                # A name given twice is ambiguous: both copies are refused (the earlier one, already
                # loaded, is dropped from the manifest), whatever else is wrong with this entry.
                why = "sent twice in one refit"
            state.seen.add(e.name)
            state.entries_received += 1
            if why is not None:
                if why == "sent twice in one refit":
                    state.rejected[e.name] = why
                else:
                    reject(e.name, why)
                continue
            layout.append((e.name, dtype, e.shape, e.offset, e.nbytes))
            end = e.offset + slot
        if not layout:
            self._open_and_release(msg)
            return
        try:
            buf = _staging.open_handle(msg.handle, self.device)
        except Exception as err:  # noqa: BLE001 - every entry of the buffer is unreadable
            for name, *_ in layout:
                reject(name, f"buffer {msg.seq} cannot be opened: {type(err).__name__}: {err}")
            return
        views: Batch = []
        try:
            if msg.used_bytes > buf.numel():
                for name, *_ in layout:
                    reject(name, f"buffer {msg.seq}: used_bytes {msg.used_bytes} > buffer size {buf.numel()}")
                return
            for name, dtype, shape, o, nb in layout:
                views.append((name, buf[o : o + nb].view(dtype).view(shape)))
            state.tensors += len(views)
            state.bytes += sum(nb for *_, nb in layout)
            state.last_name = layout[-1][0]
            if state.batch is not None:
                t0 = time.perf_counter()
                for name, v in views:
                    state.batch.add(name, v)
                if buf.is_cuda:
                    # queued before load on this stream; release() synchronises before the Ack
                    state.batch.launch()
                state.digest_s += time.perf_counter() - t0
            load(views)
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


@dataclass
class _ReceiveState:
    mode: VerifyMode
    refit_id: str
    alignment: int
    batch: DigestBatch | None
    external: ExternalDigests | None = None
    expected_seq: int = 0
    buffers: int = 0
    tensors: int = 0
    bytes: int = 0
    digest_s: float = 0.0
    last_name: str | None = None
    entries_received: int = 0
    seen: set[str] = field(default_factory=set)
    rejected: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
