"""Refit transport: a ZMQ REQ/REP pair streaming tensors through double-buffered staging memory.

The sender (trainer side) binds a REQ socket, packs tensors in logical byte order into two
ping-pong staging buffers at aligned offsets, and sends one ``Buffer`` message per filled buffer;
the receiver (vLLM worker side) connects a REP socket, views each entry in place, digests it
(when the refit verifies), hands the batch to ``load`` and acknowledges. After ``Complete`` the
receiver returns its manifest in ``Done`` and the sender compares it with its own.

Layout, message sequence and invariants follow NeMo-RL's colocated ZMQ + CUDA-IPC refit; see
``docs/protocol.md``.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
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
from refit_verify.errors import RefitConfigError, RefitProtocolError, RefitTimeoutError
from refit_verify.report import VerificationReport, act_on, compare_manifests
from refit_verify.wire import (
    MAX_ENTRIES_BYTES,
    MAX_MESSAGE_BYTES,
    MAX_NAME_BYTES,
    PROTOCOL_VERSION,
    Ack,
    Buffer,
    Complete,
    Done,
    Entry,
    Hello,
    Reject,
    decode_reply,
    decode_request,
    encode,
    torch_dtype,
)

__all__ = ["RefitSender", "RefitReceiver", "RefitStats", "ReceiveResult", "Batch", "LoadFn"]

logger = logging.getLogger("refit_verify")

Batch = list[tuple[str, torch.Tensor]]
"""What ``load`` receives: ``(wire name, tensor view of the staging buffer)`` in message order."""

LoadFn = Callable[[Batch], None]

_MAX_ERROR_CHARS = 8192
_IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; keep a margin


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _entry_cost(name: str, dtype: str, ndim: int) -> int:
    """Upper estimate of an Entry's msgpack size, bytes."""
    return len(name.encode()) + len(dtype) + 9 * ndim + 32


def _ms(seconds: float) -> int:
    return max(1, int(math.ceil(seconds * 1000)))


def _close_zmq(sock: zmq.Socket, ctx: zmq.Context, private_dir: str | None) -> None:
    try:
        sock.close(linger=0)
    finally:
        ctx.term()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)


class RefitStats(TypedDict):
    """Numbers of the sender's last refit (a plain dict: ``sender.last_stats["digest_s"]``).

    Keys:
        refit_id: id carried by ``Hello`` (32 hex).
        tensors: tensors sent. bytes: their exact bytes (padding excluded).
        buffers: ``Buffer`` messages sent (oversized tensors included).
        digest_s: seconds the sender spent in digest code (0.0 in ``off`` mode); on CUDA this
            includes waiting for earlier queued work at the synchronisation points.
        wall_s: seconds from ``Hello`` to ``Done``.
        receiver_digest_s: the receiver's digest seconds, from ``Done``.
    """

    refit_id: str
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
        manifest: ``{name: 32-hex digest}`` of every staged slice (``None`` when the sender's mode
            is ``off``).
        tensors: entries received. bytes: their exact bytes. digest_s: seconds in digest code.
        buffers: ``Buffer`` messages handled.
        refit_id: the sender's refit id. mode: the sender's mode.
        error: errors recorded during the refit (also sent in ``Done``), or ``None``.
    """

    manifest: dict[str, str] | None
    tensors: int
    bytes: int
    digest_s: float
    buffers: int
    refit_id: str = ""
    mode: VerifyMode = VerifyMode.OFF
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Progress:
    refit_id: str = ""
    buffers_sent: int = 0
    buffers_acked: int = 0
    tensors_sent: int = 0
    tensors_packed: int = 0
    bytes_sent: int = 0
    last_name: str | None = None
    waiting_for: str = ""

    def as_dict(self, **extra: object) -> dict:
        d = dict(self.__dict__)
        d.update(extra)
        return d


class RefitSender:
    """Trainer side of a refit channel: binds a REQ socket and streams tensors.

    Args:
        config: channel options (mode, staging budget ``buffer_bytes``, ``alignment``,
            ``timeout_s``); default :class:`RefitConfig` (mode from ``REFIT_VERIFY``).
        device: staging device (``"cpu"`` → POSIX shared memory, ``"cuda:i"`` → CUDA IPC); default:
            the device of the first tensor of each refit (CUDA tensor → its GPU, else CPU).
        endpoint: ZMQ endpoint to bind; default ``ipc://<private dir>/refit.sock`` where the
            directory is created by ``tempfile.mkdtemp`` (mode 0700, random name) and removed by
            :meth:`close`.

    Attributes:
        last_stats (RefitStats | None): a dict with the numbers of the last refit that got its
            ``Done`` (set before the verdict is applied, so also after a verification error).

    Two staging buffers of ``buffer_bytes // 2`` bytes each are used alternately; a tensor whose
    aligned size exceeds that goes alone in a dedicated buffer of its exact aligned size.
    """

    def __init__(self, *, config: RefitConfig | None = None, device: str | torch.device | None = None, endpoint: str | None = None) -> None:
        self.config = config if config is not None else RefitConfig()
        if self.config.alignment & (self.config.alignment - 1) or self.config.alignment < 16:
            raise RefitConfigError(f"alignment={self.config.alignment} must be a power of two >= 16")
        self.device = None if device is None else _staging._as_device(device)
        self.last_stats: RefitStats | None = None
        self._private_dir: str | None = None
        if endpoint is None:
            d = tempfile.mkdtemp(prefix="refit-verify-")
            if len(d) > _IPC_PATH_MAX - len("/refit.sock"):
                os.rmdir(d)
                d = tempfile.mkdtemp(prefix="refit-verify-", dir="/tmp")
            os.chmod(d, 0o700)
            self._private_dir = d
            endpoint = f"ipc://{d}/refit.sock"
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REQ)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.RCVTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            # After a timed-out wait the socket may send again; late replies to old requests are dropped.
            self._sock.setsockopt(zmq.REQ_RELAXED, 1)
            self._sock.setsockopt(zmq.REQ_CORRELATE, 1)
            self._sock.bind(endpoint)
            self._endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except BaseException:
            _close_zmq(self._sock, self._ctx, self._private_dir)
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, self._sock, self._ctx, self._private_dir)
        self._progress = _Progress()

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
        """Send one request. Every request of a refit goes through here, after the sender has
        digested and packed everything the message references.

        Args:
            msg: the request.
            staging: for a ``Buffer``, the whole 1-D uint8 staging tensor it references (its bytes
                are what the receiver will read); ``None`` otherwise.

        Returns:
            Done | None: for ``Complete``, the receiver's ``Done`` (awaited here, at most
            ``timeout_s``). For ``Hello`` and ``Buffer``, ``None``: their ``Ack`` is collected by the
            sender just before its next request (strict lockstep), so that the next group is packed
            while the receiver reads this one (double buffering).

        On CUDA the staging device's current stream is synchronised before the handle leaves.
        A test subclass may corrupt ``staging`` or replace ``msg`` (``msgspec.structs.replace``)
        before calling ``super()._exchange``.

        Raises:
            RefitTimeoutError: the message could not be queued, or ``Done`` did not arrive, within
                ``timeout_s`` (receiver absent or silent).
            RefitProtocolError: the reply to ``Complete`` is a ``Reject``, undecodable or not ``Done``.
        """
        if staging is not None:
            _staging.synchronize(staging.device)
        try:
            self._sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise self._timeout(f"could not send {type(msg).__name__}") from None
        if isinstance(msg, Complete):
            return self._take_reply(Done)
        return None

    def _take_reply(self, expect: type, seq: int | None = None) -> Ack | Done:
        """Wait (at most ``timeout_s``) for the reply to the outstanding request and check it.

        Raises:
            RefitTimeoutError: no reply in time. RefitProtocolError: a ``Reject``, an undecodable
                reply, or a reply of the wrong type or sequence number.
        """
        self._progress.waiting_for = f"{expect.__name__}" + (f"(seq={seq})" if seq is not None else "")
        try:
            data = self._sock.recv(copy=False)
        except zmq.Again:
            raise self._timeout(f"no {self._progress.waiting_for} reply") from None
        reply = decode_reply(data.buffer)
        self._progress.waiting_for = ""
        if isinstance(reply, Reject):
            raise RefitProtocolError(f"receiver rejected refit {self._progress.refit_id}: {reply.reason}")
        if not isinstance(reply, expect) or (seq is not None and reply.seq != seq):
            raise RefitProtocolError(f"expected {expect.__name__}" + (f"(seq={seq})" if seq is not None else "") + f", got {reply!r}"[:500])
        return reply

    def _timeout(self, what: str) -> RefitTimeoutError:
        p = self._progress.as_dict(endpoint=self._endpoint, timeout_s=self.config.timeout_s, reason="receiver went silent")
        return RefitTimeoutError(
            f"refit {p['refit_id']}: {what} within {self.config.timeout_s:g} s on {self._endpoint}; receiver went silent "
            f"(buffers acked {p['buffers_acked']}/{p['buffers_sent']}, tensors sent {p['tensors_sent']}, last {p['last_name']!r})",
            p,
        )

    # -- the refit ---------------------------------------------------------------------------

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> VerificationReport | None:
        """Run one refit: stream every ``(name, tensor)`` to the receiver and verify.

        Args:
            named_tensors: wire names (unique, 1..4096 characters) and dense tensors of any dtype,
                shape (0-dim and 0-element included), strides and device. Consumed once, lazily.

        Returns:
            VerificationReport | None: the comparison of both manifests (``None`` in ``off`` mode).
            In ``log`` mode a failed report is logged (WARNING on ``refit_verify``) and returned.

        Raises:
            RefitVerificationError: ``enforce`` mode and the manifests differ.
            RefitTimeoutError: the receiver did not take a message or reply within ``timeout_s``;
                ``.progress`` tells how far the refit got.
            RefitProtocolError: the receiver rejected a message, reported an error in ``Done``
                (bad layout, failed ``load``, count mismatch), or replied out of protocol.
            TypeError / ValueError: a bad name or tensor (the receiver then times out).
        """
        cfg = self.config
        mode = cfg.mode
        verify = mode.verifies
        align = cfg.alignment
        half = cfg.buffer_bytes // 2
        refit_id = uuid.uuid4().hex
        p = self._progress = _Progress(refit_id=refit_id)
        batch = DigestBatch() if verify else None
        digest_s = 0.0
        cuda_digests_pending = False
        device = self.device
        pool: list[_staging.StagingBuffer | None] = [None, None]
        dedicated: _staging.StagingBuffer | None = None
        t_start = time.perf_counter()

        # Sequencing state (strict REQ/REP lockstep: at most one request outstanding).
        outstanding: int | None = None  # seq of the unanswered request (-1: Hello)
        next_seq = 0
        cur = 0
        entries: list[Entry] = []
        used = 0
        est = 0

        def settle() -> None:
            nonlocal outstanding
            if outstanding is not None:
                self._take_reply(Ack, outstanding)
                if outstanding >= 0:
                    p.buffers_acked += 1
                outstanding = None

        def finish_digests() -> None:
            nonlocal digest_s, cuda_digests_pending
            if cuda_digests_pending:
                t0 = time.perf_counter()
                batch.hexdigests()
                digest_s += time.perf_counter() - t0
                cuda_digests_pending = False

        def post_buffer(buf: _staging.StagingBuffer, ents: list[Entry], used_bytes: int) -> None:
            nonlocal outstanding, next_seq
            finish_digests()  # bounds digest temporaries to one group; syncs on CUDA
            settle()  # the previous request's Ack frees the other buffer
            msg = Buffer(seq=next_seq, handle=buf.handle(), entries=ents, used_bytes=used_bytes)
            self._exchange(msg, buf.tensor)
            outstanding = next_seq
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
            self._exchange(Hello(protocol=PROTOCOL_VERSION, refit_id=refit_id, mode=mode.value), None)
            outstanding = -1  # its Ack is taken lazily, while the first group is packed
            n_tensors = 0
            for item in named_tensors:
                name, t = item
                if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_BYTES:
                    raise ValueError(f"tensor names must be str of 1..{MAX_NAME_BYTES} characters, got {name!r:.100}")
                if not isinstance(t, torch.Tensor):
                    raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
                if device is None:
                    device = t.device if t.is_cuda else torch.device("cpu")
                p.last_name = name
                if verify:
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
            if verify:
                t0 = time.perf_counter()
                sender_manifest = batch.hexdigests()
                digest_s += time.perf_counter() - t0
            # Both staging buffers are acknowledged: free them before waiting on the receiver.
            for i, b in enumerate(pool):
                if b is not None:
                    b.close()
                    pool[i] = None
            done = self._exchange(Complete(n_tensors=n_tensors), None)
            if not isinstance(done, Done):  # an override must hand back what super() returned
                raise RefitProtocolError(f"refit {refit_id}: no Done reply to Complete")
        finally:
            for b in (*pool, dedicated):
                if b is not None:
                    b.close()
        wall_s = time.perf_counter() - t_start
        self.last_stats = RefitStats(
            refit_id=refit_id, tensors=n_tensors, bytes=p.bytes_sent, buffers=p.buffers_sent,
            digest_s=digest_s, wall_s=wall_s, receiver_digest_s=float(done.digest_s),
        )
        if done.error is not None:
            raise RefitProtocolError(f"refit {refit_id}: receiver reported: {done.error}")
        if not verify:
            if done.manifest is not None:
                raise RefitProtocolError(f"refit {refit_id}: mode is off but the receiver returned a manifest")
            return None
        if done.manifest is None:
            raise RefitProtocolError(f"refit {refit_id}: mode is {mode.value} but the receiver returned no manifest")
        report = compare_manifests(sender_manifest, done.manifest)
        return act_on(report, mode)


class RefitReceiver:
    """vLLM-worker side of a refit channel: connects a REP socket and loads what arrives.

    Args:
        endpoint: the sender's :attr:`RefitSender.endpoint`.
        config: ``alignment`` (must equal the sender's), ``timeout_s`` (bound between messages)
            and ``connect_timeout_s`` (bound on waiting for ``Hello``); ``mode`` is not used: each
            refit follows the mode announced in its ``Hello``.
        device: the receiver's device; its CUDA index is used to rebuild CUDA IPC handles
            (default: the current CUDA device). Ignored for shared-memory buffers.
    """

    def __init__(self, endpoint: str, *, config: RefitConfig | None = None, device: str | torch.device | int | None = None) -> None:
        self.config = config if config is not None else RefitConfig()
        self.endpoint = endpoint
        self.device = device
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        try:
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDTIMEO, _ms(self.config.timeout_s))
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            self._sock.connect(endpoint)
        except BaseException:
            _close_zmq(self._sock, self._ctx, None)
            raise
        self._finalizer = weakref.finalize(self, _close_zmq, self._sock, self._ctx, None)

    def close(self) -> None:
        """Close the socket. Idempotent."""
        self._finalizer()

    def __enter__(self) -> RefitReceiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- wire --------------------------------------------------------------------------------

    def _recv(self, timeout_s: float, progress: dict):
        """Wait at most ``timeout_s`` for a request; decode it or reject it and raise."""
        if not self._sock.poll(_ms(timeout_s), zmq.POLLIN):
            raise RefitTimeoutError(
                f"receiver on {self.endpoint}: no message within {timeout_s:g} s while {progress['stage']}; sender went silent",
                dict(progress, timeout_s=timeout_s, reason="sender went silent"),
            )
        data = self._sock.recv(copy=False)
        try:
            return decode_request(data.buffer)
        except RefitProtocolError as e:
            self._reject(str(e))
            raise

    def _reply(self, msg: Ack | Done | Reject) -> None:
        try:
            self._sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise RefitTimeoutError(f"receiver on {self.endpoint}: could not reply within {self.config.timeout_s:g} s",
                                    {"reason": "sender went away"}) from None

    def _reject(self, reason: str) -> None:
        logger.error("refit receiver on %s rejects a message: %s", self.endpoint, reason)
        self._reply(Reject(reason=reason[:_MAX_ERROR_CHARS]))

    # -- the refit ---------------------------------------------------------------------------

    def receive(self, load: LoadFn) -> ReceiveResult:
        """Handle one refit, from ``Hello`` to ``Done``.

        Args:
            load: called once per ``Buffer`` with ``[(name, view)]``; each view is a tensor of the
                wire dtype and shape aliasing the staging memory (on the staging device). ``load``
                must copy what it keeps: the memory is reused after this call returns. Exceptions
                from ``load`` are recorded and reported in ``Done`` (the refit continues).

        Returns:
            ReceiveResult: the manifest (if the sender verifies), counts and recorded errors.

        Raises:
            RefitTimeoutError: no ``Hello`` within ``connect_timeout_s`` or no next message within
                ``timeout_s``; ``.progress`` tells how far the refit got.
            RefitProtocolError: an undecodable or out-of-order request, a wrong protocol version or
                an unknown mode (a ``Reject`` was sent back first).
        """
        cfg = self.config
        progress = {"side": "receiver", "stage": "waiting for Hello", "refit_id": None, "buffers": 0, "tensors": 0, "last_name": None}
        hello = self._recv(cfg.connect_timeout_s, progress)
        if not isinstance(hello, Hello):
            self._reject(f"expected Hello, got {type(hello).__name__}")
            raise RefitProtocolError(f"expected Hello, got {type(hello).__name__}")
        if hello.protocol != PROTOCOL_VERSION:
            self._reject(f"protocol {hello.protocol} not supported (receiver speaks {PROTOCOL_VERSION})")
            raise RefitProtocolError(f"sender speaks protocol {hello.protocol}, receiver {PROTOCOL_VERSION}")
        try:
            mode = VerifyMode.parse(hello.mode, source="Hello.mode")
        except RefitConfigError as e:
            self._reject(str(e))
            raise RefitProtocolError(str(e)) from None
        self._reply(Ack(seq=-1))

        verify = mode.verifies
        state = _ReceiveState(mode=mode, refit_id=hello.refit_id, batch=DigestBatch() if verify else None)
        progress.update(refit_id=hello.refit_id, stage="waiting for Buffer 0 or Complete")
        while True:
            msg = self._recv(cfg.timeout_s, progress)
            if isinstance(msg, Buffer):
                try:
                    self._handle_buffer(msg, state, load)
                except Exception as e:  # recorded for Done; the Ack goes out regardless
                    logger.exception("refit %s: buffer %d failed", state.refit_id, msg.seq)
                    state.errors.append(f"buffer {msg.seq}: {type(e).__name__}: {e}")
                finally:
                    state.expected_seq = max(state.expected_seq, msg.seq) + 1
                    state.buffers += 1
                    progress.update(buffers=state.buffers, tensors=state.tensors, last_name=state.last_name,
                                    stage=f"waiting for Buffer {state.expected_seq} or Complete")
                    self._reply(Ack(seq=msg.seq))
            elif isinstance(msg, Complete):
                if msg.n_tensors != state.tensors:
                    state.errors.append(f"sender sent {msg.n_tensors} tensors, receiver got {state.tensors}")
                manifest = None
                if verify:
                    t0 = time.perf_counter()
                    try:
                        manifest = state.batch.hexdigests()
                    except Exception as e:  # Done must still go out
                        logger.exception("refit %s: finishing digests failed", state.refit_id)
                        state.errors.append(f"digest: {type(e).__name__}: {e}")
                    state.digest_s += time.perf_counter() - t0
                error = "; ".join(state.errors)[:_MAX_ERROR_CHARS] if state.errors else None
                self._reply(Done(manifest=manifest, error=error, tensors=state.tensors, bytes=state.bytes, digest_s=state.digest_s))
                if error:
                    logger.error("refit %s finished with errors: %s", state.refit_id, error)
                return ReceiveResult(manifest=manifest, tensors=state.tensors, bytes=state.bytes, digest_s=state.digest_s,
                                     buffers=state.buffers, refit_id=state.refit_id, mode=mode, error=error)
            else:
                self._reject(f"unexpected {type(msg).__name__} during refit {state.refit_id}")
                raise RefitProtocolError(f"unexpected {type(msg).__name__} during refit {state.refit_id}")

    def _handle_buffer(self, msg: Buffer, state: _ReceiveState, load: LoadFn) -> None:
        align = self.config.alignment
        if msg.seq != state.expected_seq:
            raise RefitProtocolError(f"Buffer seq {msg.seq}, expected {state.expected_seq}")
        # Validate the whole layout before touching memory: offsets are re-derived from the
        # entries (ascending, aligned, no gaps) and must end exactly at used_bytes.
        layout: list[tuple[str, torch.dtype, list[int], int, int]] = []
        off = 0
        for e in msg.entries:
            dtype = torch_dtype(e.dtype)
            numel = math.prod(e.shape)
            if e.nbytes != numel * dtype.itemsize:
                raise RefitProtocolError(f"{e.name}: nbytes {e.nbytes} != numel {numel} × itemsize {dtype.itemsize} ({e.dtype}{e.shape})")
            if e.offset != off:
                raise RefitProtocolError(f"{e.name}: offset {e.offset}, expected {off} (alignment {align})")
            if e.name in state.seen:
                raise RefitProtocolError(f"{e.name}: sent twice in one refit")
            layout.append((e.name, dtype, e.shape, e.offset, e.nbytes))
            off += _round_up(e.nbytes, align)
        if off != msg.used_bytes:
            raise RefitProtocolError(f"entries end at {off} bytes, used_bytes is {msg.used_bytes} (alignment {align})")
        buf = _staging.open_handle(msg.handle, self.device)
        views: Batch = []
        try:
            if msg.used_bytes > buf.numel():
                raise RefitProtocolError(f"used_bytes {msg.used_bytes} > buffer size {buf.numel()}")
            for name, dtype, shape, o, nb in layout:
                views.append((name, buf[o : o + nb].view(dtype).view(shape)))
            state.seen.update(name for name, *_ in layout)
            state.tensors += len(views)
            state.bytes += sum(nb for *_, nb in layout)
            state.last_name = layout[-1][0] if layout else state.last_name
            if state.batch is not None:
                t0 = time.perf_counter()
                for name, v in views:
                    state.batch.add(name, v)
                if buf.is_cuda:
                    state.batch.hexdigests()  # finish reading the slices before load can touch them
                state.digest_s += time.perf_counter() - t0
            load(views)
        finally:
            _staging.release(buf)  # queued reads of the buffer are finished before the Ack
            views.clear()
            del buf


@dataclass
class _ReceiveState:
    mode: VerifyMode
    refit_id: str
    batch: DigestBatch | None
    expected_seq: int = 0
    buffers: int = 0
    tensors: int = 0
    bytes: int = 0
    digest_s: float = 0.0
    last_name: str | None = None
    seen: set[str] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
