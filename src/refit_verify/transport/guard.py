"""The socket guard of the staged transport: private endpoints, exclusive binds, peer checks.

* :func:`private_endpoint` makes the sender's default ``ipc://`` endpoint in a fresh 0700
  directory; :func:`check_private_dir` refuses explicit ``ipc://`` endpoints a stranger could plant
  or replace (both sides).
* :func:`bind_exclusive` binds the sender's socket and refuses an endpoint that is already taken
  (:class:`~refit_verify.errors.RefitConfigError` naming it): a second sender on the same ``ipc://``
  path (libzmq would silently unlink the first one's socket file and take its place), a ``tcp://``
  port in use, an abstract ``ipc://@name`` in use. The ``ipc://`` path is held with an advisory lock
  (``<path>.lock``, ``flock``) for the sender's lifetime, so two senders starting at the same
  instant cannot both bind; a stale socket file left by a dead sender is taken over.
* :class:`PeerWatch` follows a socket's connections through its ZMQ monitor: peer uid checks
  (``SO_PEERCRED``), rejected handshakes, disconnections.

See ``docs/protocol.md`` (Roles and sockets, Security).
"""

from __future__ import annotations

import collections
import fcntl
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

import zmq
from zmq.utils.monitor import parse_monitor_message

from refit_verify.errors import RefitConfigError

__all__ = ["LAST_WORDS_S", "EndpointLock", "PeerWatch", "bind_exclusive", "check_private_dir", "close_zmq", "ms", "peer_cred", "private_endpoint"]

logger = logging.getLogger("refit_verify")

LAST_WORDS_S = 0.25
"""A peer's last message (Done, Complete) can be queued just behind the monitor's disconnect event:
before declaring a peer gone, the socket gets this long (seconds) to show it."""

IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin
_MONITOR_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
                   | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                   | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def ms(seconds: float) -> int:
    """``seconds`` as whole milliseconds, at least 1 (ZMQ timeouts)."""
    return max(1, int(math.ceil(seconds * 1000)))


def close_zmq(sock: zmq.Socket, watch: PeerWatch | None, ctx: zmq.Context, private_dir: str | None,
              lock: EndpointLock | None = None, linger_s: float = 0.0) -> None:
    """Close ``sock`` (and its monitor), terminate ``ctx``, then release ``lock`` and remove ``private_dir``.

    ``linger_s``: how long (seconds) messages still queued on ``sock`` may take to leave before they
    are dropped (a receiver's last ``Done``: closed right after it is queued, with no linger it can be
    discarded before the I/O thread writes it, and the sender sees the connection close instead).
    """
    try:
        if watch is not None:
            watch.close(sock)
        sock.close(linger=ms(linger_s) if linger_s > 0 else 0)
    finally:
        ctx.term()  # waits for the I/O thread: an ipc:// socket file is unlinked before the lock goes
        if lock is not None:
            lock.release()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ endpoints


def ipc_path(endpoint: str) -> str | None:
    """The filesystem path of an ``ipc://`` endpoint (``None`` for other transports and abstract sockets)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if path.startswith("@") or path == "*" else path


def private_endpoint() -> tuple[str, str]:
    """Make a fresh private directory; return ``(endpoint, directory)``.

    The directory comes from ``tempfile.mkdtemp`` (mode 0700, 64 random bits in its name plus
    mkdtemp's own suffix), under ``/tmp`` when the default temporary directory makes the socket
    path too long for ``sun_path``.
    """
    prefix = f"refit-verify-{secrets.token_hex(8)}-"
    d = tempfile.mkdtemp(prefix=prefix)
    if len(d) > IPC_PATH_MAX - len("/refit.sock"):
        os.rmdir(d)
        d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o700)
    return f"ipc://{d}/refit.sock", d


def check_private_dir(endpoint: str, role: str) -> None:
    """Refuse an ``ipc://`` endpoint that a stranger could plant or replace.

    The socket's directory must exist, be a real directory owned by this user (or root) and not be
    writable by group or others; an existing socket file must be a socket owned by this user (or
    root). A directory that others can enter is accepted with a warning (they still cannot replace
    the socket, and the peer's uid is checked on connection). Other transports are not checked.

    Raises:
        RefitConfigError: the endpoint's directory or socket file fails these checks.
    """
    path = ipc_path(endpoint)
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


class EndpointLock:
    """An exclusive advisory lock (``flock``) on ``<ipc path>.lock``, held while a sender is bound.

    Taking it retries when the lock file it opened was replaced meanwhile (a previous holder
    unlinks the file on release), so two processes can never both hold it.

    Raises:
        RefitConfigError: another sender (this process or another) holds it.
    """

    def __init__(self, endpoint: str, path: str) -> None:
        self.socket_path = path
        self.bound = False  # set once our socket is bound: only then is the socket file ours to unlink
        self.path = path + ".lock"
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise RefitConfigError(f"refit sender: cannot lock endpoint {endpoint} ({self.path}: {e})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise RefitConfigError(f"refit sender: endpoint {endpoint} is already bound by another RefitSender (lock "
                                       f"{self.path} held); refusing to take its socket over. Give each sender its own "
                                       "endpoint (the default is a fresh private one; with tensor parallelism put {rank} "
                                       "in the path)") from None
            except BaseException:
                os.close(fd)
                raise
            try:
                same = os.stat(self.path, follow_symlinks=False)
                mine = os.fstat(fd)
                if (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino):
                    self._fd: int | None = fd
                    return
            except FileNotFoundError:
                pass
            os.close(fd)  # the file was unlinked or replaced under us: lock the current one

    def release(self) -> None:
        """Unlink the socket file (libzmq leaves it behind; no other sender can have bound it while
        the lock is held), then the lock file, and drop the lock. Idempotent."""
        if self._fd is None:
            return
        try:
            if self.bound and stat.S_ISSOCK(os.lstat(self.socket_path).st_mode):
                os.unlink(self.socket_path)
        except OSError:
            pass
        try:
            os.unlink(self.path)
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _listening(path: str) -> bool:
    """Whether a process listens on the Unix socket file ``path`` (a stale file of a dead one: no)."""
    try:
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:  # busy (backlog full, timeout): someone is there
        return True
    finally:
        s.close()


def bind_exclusive(sock: zmq.Socket, endpoint: str) -> tuple[str, EndpointLock | None]:
    """Bind ``sock`` to ``endpoint`` unless another socket holds it; return ``(bound endpoint, lock)``.

    Raises:
        RefitConfigError: the endpoint is bound by another sender (the ``ipc://`` lock is held, or
            a process listens on the socket file), the address is in use (``tcp://``, abstract
            ``ipc://@``), or ZMQ cannot bind it; the message names the endpoint.
    """
    path = ipc_path(endpoint)
    lock = EndpointLock(endpoint, path) if path is not None else None
    try:
        if path is not None and _listening(path):
            raise RefitConfigError(f"refit sender: endpoint {endpoint} is in use: a process listens on {path}; refusing "
                                   "to take its socket over")
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            if e.errno == zmq.EADDRINUSE:
                raise RefitConfigError(f"refit sender: endpoint {endpoint} is already in use (another sender, or another "
                                       "program, is bound to it)") from None
            raise RefitConfigError(f"refit sender: cannot bind endpoint {endpoint}: {e}") from None
        if lock is not None:
            lock.bound = True
        return sock.getsockopt_string(zmq.LAST_ENDPOINT), lock
    except BaseException:
        if lock is not None:
            lock.release()
        raise


# ------------------------------------------------------------------------------ peers


def peer_cred(fd: int) -> tuple[int, int] | None:
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


class PeerWatch:
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
        self.pids: dict[int, int | None] = {}  # fd -> the peer's pid (SO_PEERCRED; None where unknown)
        self.serials: dict[int, int] = {}  # fd -> serial number of the connection on it (fds are reused; serials never)
        self.closed: set[int] = set()  # serials of connections that completed their handshake, then closed
        self._serial = 0
        self.gone: dict[int, int | None] = {}  # fd -> pid of connections that completed their handshake, then closed
        self.events: collections.deque[tuple[float, str, int | None]] = collections.deque(maxlen=16)  # (monotonic, what, pid)
        self._awaiting: list[int] = []  # connections whose ZMTP handshake has not completed
        self._failed: set[int] = set()
        self.mon = sock.get_monitor_socket(_MONITOR_EVENTS)

    def established(self) -> list[int]:
        """fds of the connections whose ZMTP handshake completed (peers that can carry a message)."""
        return [fd for fd in self.live if fd not in self._awaiting]

    def established_serials(self) -> set[int]:
        """Serial numbers of the established connections (stable across fd reuse)."""
        return {self.serials[fd] for fd in self.established() if fd in self.serials}

    def peer_label(self, fd: int) -> str:
        """``"pid 123"`` of the peer on ``fd`` (``"a peer"`` where its pid is unknown, e.g. ``tcp://``)."""
        pid = self.pids.get(fd, self.gone.get(fd))
        return f"pid {pid}" if pid is not None else "a peer"

    def last_seen(self, limit: int = 4) -> str:
        """The latest connection events, newest last (``"pid 12 connected 0.31 s ago; pid 9 disconnected 0.02 s ago"``)."""
        now = time.monotonic()
        if not self.events:
            return "no connection seen"
        return "; ".join(f"{'pid ' + str(pid) if pid is not None else 'a peer'} {what} {now - t:.2f} s ago"
                         for t, what, pid in list(self.events)[-limit:])

    def close(self, sock: zmq.Socket) -> None:
        """Stop monitoring ``sock`` and close the monitor socket."""
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(linger=0)

    def drain(self) -> None:
        """Handle every pending monitor event (never blocks)."""
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
                    fd = self._awaiting.pop(0)
                    self.events.append((time.monotonic(), "connected", self.pids.get(fd)))
            elif kind == zmq.EVENT_DISCONNECTED:
                if value in self._awaiting:  # never completed the ZMTP handshake: never a peer
                    self._awaiting.remove(value)
                    self.live.discard(value)
                    self.pids.pop(value, None)
                    self.serials.pop(value, None)
                    if value in self._failed:
                        self._failed.discard(value)  # already logged as a failed handshake
                    else:
                        logger.warning("refit %s on %s rejected a connection: it closed or was dropped before completing the "
                                       "ZMTP handshake (not a ZMQ peer of this protocol, or an invalid or oversized first frame)",
                                       self.role, self.endpoint)
                elif value in self.live:
                    self.live.discard(value)
                    self.disconnects += 1
                    pid = self.pids.pop(value, None)
                    self.gone[value] = pid
                    serial = self.serials.pop(value, None)
                    if serial is not None:
                        self.closed.add(serial)
                    if len(self.gone) > 64:
                        self.gone.pop(next(iter(self.gone)))
                    self.events.append((time.monotonic(), "disconnected", pid))
                    logger.debug("refit %s on %s: a peer disconnected", self.role, self.endpoint)
            else:  # handshake failed
                if self._awaiting:
                    self._failed.add(self._awaiting[0])
                logger.warning("refit %s on %s rejected a connection: ZMTP handshake failed (event %d): not a ZMQ peer "
                               "of this protocol (garbage, a pickle, a foreign mechanism); connection dropped",
                               self.role, self.endpoint, kind)

    def _on_connection(self, fd: int) -> None:
        cred = peer_cred(fd) if self.check_uid else None
        self.pids[fd] = cred[0] if cred is not None else None
        if self.check_uid:
            if cred is not None and cred[1] not in self.allowed_uids:
                self.pids.pop(fd, None)
                pid, uid = cred
                self.strangers.append((pid, uid))
                logger.error("refit %s on %s rejected a connection from pid %d uid %d: only uid %d (or root) may connect",
                             self.role, self.endpoint, pid, uid, os.geteuid())
                _shutdown_fd(fd)
                return
        self._serial += 1
        self.serials[fd] = self._serial
        self.live.add(fd)
        self._awaiting.append(fd)
