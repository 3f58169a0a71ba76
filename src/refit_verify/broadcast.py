"""Verified weight broadcast over a ``torch.distributed`` group (non-colocated refits).

Non-colocated RL setups do not share IPC buffers: the trainer's sender rank broadcasts each
tensor (or a packed bucket of tensors) to the inference workers over a process group (NCCL on
GPUs, gloo on CPUs). This module is that path, verified end to end:

* the sender (:class:`BroadcastSender`, on rank ``src``) broadcasts a header with its **mode**
  first; receivers verify iff it is not ``off`` (one mode for the whole refit, chosen by the
  sender, as in the colocated transport);
* the sender digests each tensor **before** packing it (covers the cast, pack, broadcast and
  slicing), then broadcasts per bucket one metadata object (``broadcast_object_list``: names,
  dtypes, shapes, offsets) followed by the bucket's bytes (``broadcast``);
* each receiver (:func:`receive_broadcast` / :class:`BroadcastReceiver`) slices the bucket into
  views of the wire dtype and shape, digests each view **before** calling ``load`` (before
  ``model.load_weights``, renames, fusion or quantisation), and records ``load`` errors;
* after the last bucket every receiver's manifest comes back to the sender in one
  ``gather_object``; the sender compares it with its own manifest per receiving rank
  (:func:`refit_verify.compare_manifests` with ``rank=``) and applies the mode with
  :func:`refit_verify.report.act_on`: ``log`` warns per failing rank and returns every report,
  ``enforce`` raises :class:`BroadcastVerificationError` (a :class:`RefitVerificationError`)
  carrying **all** ranks' reports, so a clean rank is reported clean next to a failing one.

Ranks are **group-local**: ``src`` and the rank labels in reports are ranks within ``group``
(``group.rank()``), and every collective addresses them with ``group_src=`` / ``group_dst=``. With
``group=None`` (the default world) they equal global ranks. So the path also runs on process groups
that are not registered in torch's global maps, such as the trainer-worker groups made by vLLM's
``stateless_init_torch_distributed_process_group`` (:func:`refit_verify.vllm_plugin.broadcast_group`);
see :func:`_collective` for what torch gets wrong on such groups and how it is worked around.

Bounded waits: every wait is a ``torch.distributed`` collective, bounded by the process group's
``timeout`` (``init_process_group(..., timeout=timedelta(...))`` or ``new_group(timeout=...)``);
``RefitConfig.timeout_s`` cannot shorten it. A gloo timeout or a dropped peer surfaces as
:class:`~refit_verify.errors.RefitTimeoutError` with the progress made. With NCCL, set
``TORCH_NCCL_ASYNC_ERROR_HANDLING=1`` (the default in recent torch) so the watchdog turns a stuck
collective into an error instead of a hang; NCCL object collectives also need
``torch.cuda.set_device(local_rank)`` on every rank before the refit.

Source: ``docs/scale.md``; the digest is ``docs/digest-spec.md``.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch

from refit_verify.config import RefitConfig, VerifyMode
from refit_verify.digest import DigestBatch, dtype_name, logical_bytes
from refit_verify.errors import (BroadcastVerificationError, RefitAbortedError, RefitConfigError, RefitProtocolError,
                                 RefitTimeoutError, RefitVerificationError)
from refit_verify.report import VerificationReport, act_on, compare_manifests
from refit_verify.manifest import ExternalDigests
from refit_verify.transport import checked_item

__all__ = [
    "BROADCAST_PROTOCOL",
    "BroadcastReceiveResult",
    "BroadcastReceiver",
    "BroadcastSender",
    "BroadcastVerificationError",
    "receive_broadcast",
]

logger = logging.getLogger("refit_verify")

BROADCAST_PROTOCOL = 1
"""Version of the header/bucket/complete object sequence below."""

Batch = list[tuple[str, torch.Tensor]]
LoadFn = Callable[[Batch], None]

_MAX_ERROR_CHARS = 8192
_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer closed")


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _dist(group=None):
    """``torch.distributed``, checked: ``group=None`` needs the default group; an explicit group
    (registered or not) does not, e.g. a trainer process whose only group is a stateless one."""
    import torch.distributed as dist

    if not dist.is_available() or (group is None and not dist.is_initialized()):
        raise RuntimeError("the broadcast path needs an initialised torch.distributed process group")
    return dist


def _group_rank(group) -> int:
    """This process's rank within ``group`` (``group=None``: the default world)."""
    return _dist(group).get_rank() if group is None else group.rank()


def _group_size(group) -> int:
    """Number of ranks of ``group`` (``group=None``: the default world)."""
    return _dist(group).get_world_size() if group is None else group.size()


def _check_membership(group, src: int, side: str) -> int:
    """Check, before any collective, that this process is in ``group`` and ``src`` is one of its
    ranks; return the group size.

    Raises:
        RefitProtocolError: this process is not a member of ``group`` (``new_group`` hands
            non-members a sentinel instead of a group).
        RefitConfigError: ``src`` is not an int in ``[0, group size)``.
    """
    _dist(group)
    if group is not None and not callable(getattr(group, "rank", None)):
        raise RefitProtocolError(f"broadcast {side}: this process is not a member of the process group it was given ({group!r})")
    size = _group_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise RefitConfigError(f"broadcast {side}: src={src!r} is not a rank of the group (ranks 0..{size - 1})")
    return size


def _comm_device(group) -> torch.device:
    """Device of the bytes a collective of ``group`` moves: the current CUDA device for NCCL, else CPU."""
    dist = _dist(group)
    try:
        nccl = "nccl" in str(dist.get_backend(group)).lower()
    except ValueError:
        # ``get_backend`` reads torch's global group map, which an unregistered (stateless) group is
        # not in; ask the group itself which devices its backends serve (torch's object collectives
        # pick their device the same way, ``_get_object_coll_device``).
        nccl = any(d.type == "cuda" for d in group._device_types)
    if nccl:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _masked_by_c10d_logger(e: BaseException) -> bool:
    """True when ``e`` was raised by torch's c10d exception logger while it described another error."""
    import traceback

    return e.__context__ is not None and any(
        f.name == "_get_msg_dict" and f.filename.endswith("c10d_logger.py") for f in traceback.extract_tb(e.__traceback__))


def _collective(what: str, progress: dict, fn, *args, **kwargs):
    """Run one collective; a timeout or a dropped peer becomes :class:`RefitTimeoutError`.

    Unregistered groups: torch wraps its collectives (``broadcast``, ``broadcast_object_list``,
    ``gather_object`` and the ``gather`` / ``all_gather`` they call) in ``c10d_logger._exception_logger``.
    On an error, when the default group is initialised (always, inside a vLLM worker), it describes
    the failing call with ``dist.get_backend(group)`` and ``dist.get_rank(group)``; both look the
    group up in torch's global maps and raise ``ValueError("... is not initialized in the world
    group map ...")`` for a group that is not there (vLLM's stateless groups). That ValueError
    replaces the real error (a gloo timeout, a reset peer), which survives as its ``__context__``,
    once per nested wrapper. Such ValueErrors are unwrapped here back to the error the collective
    raised. (The collectives themselves work: they only use ``group.rank()``, ``group.size()`` and
    ``group_src`` / ``group_dst``. Also not usable on such groups: ``src=`` / ``dst=`` global ranks,
    ``dist.get_backend(group)``, and the object collectives under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
    with NCCL built in, which call ``get_backend`` on every object.)
    """
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, ValueError) as e:  # gloo/NCCL raise DistBackendError (a RuntimeError) on timeouts and resets
        real: BaseException = e
        while isinstance(real, ValueError) and _masked_by_c10d_logger(real):
            real = real.__context__
        if isinstance(real, RuntimeError) and any(w in str(real).lower() for w in _TIMEOUT_WORDS):
            raise RefitTimeoutError(
                f"{progress.get('side', '?')}: {what} did not complete within the process group's timeout or a peer "
                f"dropped out ({progress.get('buckets', 0)} buckets, {progress.get('tensors', 0)} tensors done, last "
                f"{progress.get('last_name')!r}): {str(real)[:500]}", dict(progress, waiting_for=what)) from real
        if real is e:
            raise
        raise real from None  # the collective's own error, not the logger's ValueError


# ------------------------------------------------------------------------------ sender


class BroadcastSender:
    """Sender side of a verified broadcast refit; construct and call :meth:`send` on rank ``src``.

    Args:
        group: the process group holding the sender and every receiving worker (default: world). It
            may be a group outside torch's global maps (vLLM's stateless groups).
        src: rank of the sender (this process) **within** ``group`` (``group.rank()``; the global
            rank when ``group`` is None).
        config: ``mode`` (default from ``REFIT_VERIFY``), ``alignment`` of tensor offsets in a
            bucket (512), and ``buffer_bytes``: a bucket holds up to ``buffer_bytes // 2`` bytes
            (same budget as one staging half of the colocated transport). ``timeout_s`` is not
            used: the group's timeout bounds every wait.
        device: device of the buckets; default the current CUDA device for an NCCL group, else CPU.

    Every other rank of ``group`` must call :func:`receive_broadcast` for the same refit.
    Reports are keyed by the receivers' ranks within ``group`` (or the ``rank`` labels they chose).
    """

    def __init__(self, group=None, src: int = 0, config: RefitConfig | None = None, *, device: str | torch.device | None = None) -> None:
        self.group = group
        self.src = src
        self.config = config or RefitConfig()
        self._device = torch.device(device) if device is not None else None
        self.last_stats: dict | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[int, VerificationReport] | None:
        """Broadcast every ``(name, tensor)`` to the group and verify each receiving rank.

        Args:
            named_tensors: unique wire names and dense tensors (any dtype, shape, strides, device).

        Returns:
            ``{rank: VerificationReport}`` for every receiving rank (its rank within ``group`` unless it
            passed another ``rank`` label; in group order) when the mode
            verifies (``log`` returns failing reports after logging them); ``None`` in ``off`` mode.

        Raises:
            BroadcastVerificationError: ``enforce`` and at least one rank's manifest differs; it
                carries every rank's report.
            RefitProtocolError: a receiver reported errors (``load`` raised, entries it refused),
                after the reports were checked; its ``reports`` attribute holds them (when verifying).
            RefitTimeoutError: a collective ran past the group's timeout or a peer dropped out.
            TypeError / ValueError: a bad name or tensor (receivers are sent ``abort`` first).
            RefitProtocolError: this process is not rank ``src`` of ``group``, or not a member of it;
                receivers share a ``rank`` label (raised before any collective, resp. at the verdict).
            RefitConfigError: ``src`` is not a rank of ``group``; or the mode verifies and the group
                holds no receiver (size 1). Both before any collective.
        """
        size = _check_membership(self.group, self.src, "sender")
        dist = _dist(self.group)
        me = _group_rank(self.group)
        if me != self.src:
            raise RefitProtocolError(f"BroadcastSender.send runs on rank {self.src} of the group, this is rank {me}")
        cfg = self.config
        mode = cfg.mode
        if size < 2:
            if mode.verifies:
                raise RefitConfigError(f"broadcast sender: REFIT_VERIFY={mode.value} but the group holds no receiver "
                                       "(size 1): nothing would be verified")
            logger.warning("broadcast refit into a group of size 1: no receiver")
        align = cfg.alignment
        bucket_bytes = max(cfg.buffer_bytes // 2, align)
        device = self._device or _comm_device(self.group)
        refit_id = uuid.uuid4().hex
        progress = {"side": "sender", "refit_id": refit_id, "mode": mode.value, "buckets": 0, "tensors": 0, "last_name": None}
        t_start = time.perf_counter()
        digest_s = 0.0
        batch = DigestBatch() if mode.verifies else None
        cuda_pending = False
        names: set[str] = set()
        entries: list[tuple[str, str, list[int], int, int]] = []
        bucket: torch.Tensor | None = None
        used = 0
        n_tensors = 0
        n_bytes = 0
        in_collective = False
        header_sent = False

        def bcast_obj(obj: object, what: str) -> None:
            nonlocal in_collective
            in_collective = True
            _collective(what, progress, dist.broadcast_object_list, [obj], group_src=self.src, group=self.group)
            in_collective = False

        def bcast_bytes(u8: torch.Tensor, what: str) -> None:
            nonlocal in_collective
            in_collective = True
            _collective(what, progress, dist.broadcast, u8, group_src=self.src, group=self.group)
            in_collective = False

        def finish_digests() -> None:
            nonlocal digest_s, cuda_pending
            if cuda_pending and batch is not None:
                t0 = time.perf_counter()
                batch.hexdigests()  # drops the batch's references to CUDA tensors (one sync per bucket)
                digest_s += time.perf_counter() - t0
            cuda_pending = False

        def post(ents: list, data: torch.Tensor) -> None:
            finish_digests()
            seq = progress["buckets"]
            self._sending(ents, data)
            bcast_obj({"kind": "bucket", "seq": seq, "entries": ents, "used": data.numel()}, f"bucket {seq} metadata")
            bcast_bytes(data, f"bucket {seq} bytes")
            progress["buckets"] += 1
            progress["tensors"] += len(ents)

        def flush() -> None:
            nonlocal entries, used, bucket
            if entries:
                post(entries, bucket[:used])
            entries, used, bucket = [], 0, None

        try:
            header_sent = True
            bcast_obj({"kind": "hello", "protocol": BROADCAST_PROTOCOL, "refit_id": refit_id, "mode": mode.value,
                       "alignment": align}, "header")
            for item in named_tensors:
                name, t = checked_item(item, names)
                progress["last_name"] = name
                if batch is not None:
                    t0 = time.perf_counter()
                    batch.add(name, t)  # before packing: covers the pack, the broadcast and the slicing
                    digest_s += time.perf_counter() - t0
                    cuda_pending |= t.is_cuda
                u8 = logical_bytes(t)
                n = u8.numel()
                ent = (name, dtype_name(t.dtype), list(t.shape), 0, n)
                n_tensors += 1
                n_bytes += n
                if _round_up(n, align) > bucket_bytes:
                    # Oversized: alone, broadcast straight from the tensor's bytes when they already
                    # lie on the group's device (else one copy there).
                    flush()
                    data = u8 if u8.device == device else u8.to(device)
                    post([ent], data)
                    continue
                if used + _round_up(n, align) > bucket_bytes:
                    flush()
                if bucket is None:
                    bucket = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
                if n:
                    bucket[used : used + n].copy_(u8, non_blocking=bucket.is_cuda and u8.is_cuda)
                entries.append((name, ent[1], ent[2], used, n))
                used = _round_up(used + n, align)
            flush()
            sender_manifest = None
            if batch is not None:
                t0 = time.perf_counter()
                sender_manifest = batch.hexdigests()
                digest_s += time.perf_counter() - t0
            bcast_obj({"kind": "complete", "n_tensors": n_tensors}, "complete")
            gathered: list = [None] * _group_size(self.group)
            in_collective = True
            _collective("receiver manifests", progress, dist.gather_object, None, gathered, group_dst=self.src, group=self.group)
            in_collective = False
        except BaseException as e:
            if header_sent and not in_collective:
                try:
                    bcast_obj({"kind": "abort", "reason": f"{type(e).__name__}: {e}"[:1000]}, "abort")
                except Exception:  # noqa: BLE001 - the original error matters more
                    logger.exception("could not broadcast abort")
            raise
        results = [g for g in gathered if g is not None]
        self.last_stats = {
            "refit_id": refit_id, "mode": mode.value, "tensors": n_tensors, "bytes": n_bytes,
            "buckets": progress["buckets"], "receivers": len(results), "digest_s": digest_s,
            "wall_s": time.perf_counter() - t_start,
            "receiver_digest_s": max((float(g.get("digest_s", 0.0)) for g in results), default=0.0),
        }
        return self._verdict(mode, sender_manifest, results, refit_id)

    def _sending(self, entries: list, data: torch.Tensor) -> None:
        """Called with a bucket's entries ``[(name, dtype, shape, offset, nbytes)]`` and its uint8
        bytes right before they are broadcast, after the sender digested them (CUDA digests done).
        A no-op; a test subclass may alter ``data`` here to simulate a transfer that corrupts the
        bytes. ``data`` may be an oversized tensor's own bytes (not a copy)."""

    def _verdict(self, mode: VerifyMode, sender_manifest: dict[str, str] | None, results: list[dict],
                 refit_id: str) -> dict[int, VerificationReport] | None:
        labels = [g["rank"] for g in results]
        dup = sorted({r for r in labels if labels.count(r) > 1}, key=str)
        if dup:  # a report keyed by a shared label would hide another rank's report
            raise RefitProtocolError(f"broadcast refit {refit_id}: receivers share rank labels {dup} (labels {labels}); each "
                                     "receiver needs a unique `rank` label (the default, its rank in the group, is unique)")
        errors = {g["rank"]: g["error"] for g in results if g.get("error")}
        err_text = "; ".join(f"rank {r}: {e}" for r, e in errors.items())
        if not mode.verifies:
            if errors:
                raise RefitProtocolError(f"broadcast refit {refit_id}: receivers reported: {err_text}")
            return None
        reports: dict[int, VerificationReport] = {}
        for g in results:
            reports[g["rank"]] = compare_manifests(sender_manifest, g.get("manifest") or {}, rank=g["rank"],
                                                   receiver_error=g.get("error"))
        failing = False
        for rep in reports.values():
            try:
                act_on(rep, mode)  # log: WARNING per failing rank; enforce: raises
            except RefitVerificationError:
                failing = True
        if failing:
            raise BroadcastVerificationError(reports)
        for rep in reports.values():
            if rep.ok:
                logger.info("%s", rep.describe())
        if errors:
            err = RefitProtocolError(f"broadcast refit {refit_id}: receivers reported: {err_text}")
            err.reports = reports  # every rank's verification report, as in the return value
            raise err
        return reports


# ------------------------------------------------------------------------------ receiver


@dataclass
class BroadcastReceiveResult:
    """Outcome of one :meth:`BroadcastReceiver.receive` on one rank.

    Attributes:
        manifest: ``{name: 32-hex digest}`` of every received tensor (``None`` in ``off`` mode).
        tensors / bytes / buckets: counts of what arrived. digest_s: seconds in digest code.
        refit_id, mode: from the sender's header. rank: this receiver's rank label.
        error: ``load`` errors and refused entries (also sent to the sender), or ``None``.
    """

    manifest: dict[str, str] | None
    tensors: int
    bytes: int
    buckets: int
    digest_s: float
    refit_id: str
    mode: VerifyMode
    rank: int
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class BroadcastReceiver:
    """Receiver side of a verified broadcast refit (every rank of the group but ``src``).

    Args:
        group: the process group (default: world); it may be a group outside torch's global maps.
        src: the sender's rank **within** ``group`` (the global rank when ``group`` is None).
        config: accepted for symmetry with :class:`~refit_verify.transport.RefitReceiver`; the mode
            and alignment come from the sender's header and the timeouts from the group.
        device: where buckets land; default the current CUDA device for NCCL, else CPU.
        rank: the label of this receiver in reports (default: its rank within ``group``). Labels
            must be unique among the receivers of a refit (the sender refuses duplicates): TP ranks
            repeat across DP replicas, so prefer the default there.
    """

    def __init__(self, group=None, src: int = 0, config: RefitConfig | None = None, *,
                 device: str | torch.device | None = None, rank: int | None = None) -> None:
        self.group = group
        self.src = src
        self.config = config
        self._device = torch.device(device) if device is not None else None
        self.rank = rank

    def _received(self, batch: Batch) -> None:
        """Called with a bucket's views right after its bytes arrived, before they are digested
        and loaded. A no-op; a test subclass may alter the views here to simulate a corrupted
        transfer (the digest then sees what ``load`` sees)."""

    def receive(self, load: LoadFn, *, digests: ExternalDigests | None = None) -> BroadcastReceiveResult:
        """Take part in one broadcast refit: receive, digest, ``load``, send the manifest back.

        Args:
            load: called once per bucket with ``[(name, view)]``; the views alias the bucket and
                must be copied if kept. Exceptions are recorded and sent to the sender.
            digests: where the digests are taken instead of here (a vLLM worker's model boundary,
                :class:`refit_verify.boundary.SessionDigests`); default: each bucket's views here.

        Raises:
            RefitAbortedError: the sender broadcast ``abort`` (its exception is in the message).
            RefitProtocolError: an unexpected message or protocol version; this process is not a
                member of ``group`` or is its ``src`` (before any collective).
            RefitConfigError: ``src`` is not a rank of ``group`` (before any collective).
            RefitTimeoutError: a collective ran past the group's timeout or a peer dropped out.
        """
        _check_membership(self.group, self.src, "receiver")
        dist = _dist(self.group)
        me = _group_rank(self.group)
        if me == self.src:
            raise RefitProtocolError(f"rank {self.src} of the group is the broadcast sender, not a receiver")
        label = me if self.rank is None else self.rank
        device = self._device or _comm_device(self.group)
        progress = {"side": f"receiver rank {label}", "refit_id": None, "mode": None, "buckets": 0, "tensors": 0, "last_name": None}

        def next_obj(what: str) -> dict:
            box = [None]
            _collective(what, progress, dist.broadcast_object_list, box, group_src=self.src, group=self.group)
            msg = box[0]
            if not isinstance(msg, dict) or "kind" not in msg:
                raise RefitProtocolError(f"receiver rank {label}: expected a broadcast refit message, got {type(msg).__name__}")
            return msg

        hello = next_obj("header")
        if hello["kind"] != "hello":
            raise RefitProtocolError(f"receiver rank {label}: expected the header, got {hello['kind']!r}")
        if hello.get("protocol") != BROADCAST_PROTOCOL:
            raise RefitProtocolError(f"receiver rank {label}: sender speaks broadcast protocol {hello.get('protocol')}, "
                                     f"receiver {BROADCAST_PROTOCOL}")
        mode = VerifyMode.parse(hello["mode"], source="broadcast header mode")
        refit_id = hello["refit_id"]
        progress.update(refit_id=refit_id, mode=mode.value)
        external = digests if mode.verifies else None
        batch = DigestBatch() if mode.verifies and external is None else None
        if external is not None:
            external.begin(refit_id, None)
        try:
            return self._receive_loop(load, dist, label, device, progress, next_obj, mode, refit_id, batch, external)
        except BaseException as e:
            if external is not None:
                external.fail(f"{type(e).__name__}: {e}")
            raise

    def _receive_loop(self, load, dist, label, device, progress, next_obj, mode, refit_id, batch, external) -> BroadcastReceiveResult:
        errors: list[str] = []
        seen: set[str] = set()
        tensors = n_bytes = buckets = entries_received = 0
        digest_s = 0.0
        while True:
            msg = next_obj(f"bucket {buckets} metadata or complete")
            kind = msg["kind"]
            if kind == "abort":
                raise RefitAbortedError(f"receiver rank {label}: broadcast refit {refit_id} aborted by the sender after "
                                        f"{buckets} buckets, {tensors} tensors: {msg.get('reason')}", msg.get("reason", ""), progress)
            if kind == "complete":
                break
            if kind != "bucket":
                raise RefitProtocolError(f"receiver rank {label}: unexpected message {kind!r} in refit {refit_id}")
            data = torch.empty(int(msg["used"]), dtype=torch.uint8, device=device)
            _collective(f"bucket {msg['seq']} bytes", progress, dist.broadcast, data, group_src=self.src, group=self.group)
            buckets += 1
            views: Batch = []
            entries_received += len(msg["entries"])
            for name, dn, shape, off, nb in msg["entries"]:
                try:
                    dtype = getattr(torch, dn)
                    if not isinstance(dtype, torch.dtype):
                        raise TypeError(f"not a dtype: {dn}")
                    if nb != math.prod(shape) * dtype.itemsize or off + nb > data.numel():
                        raise ValueError(f"layout {dn}{list(shape)} at [{off}, {off + nb}) in {data.numel()} bytes")
                    if name in seen:
                        raise ValueError("sent twice in one refit")
                    seen.add(name)
                    views.append((name, data[off : off + nb].view(dtype).view(shape)))
                except Exception as e:  # noqa: BLE001 - refused entry: recorded, left out of the manifest
                    errors.append(f"entry {name!r} refused: {type(e).__name__}: {e}")
            tensors += len(views)
            n_bytes += sum(v.numel() * v.element_size() for _, v in views)
            progress.update(buckets=buckets, tensors=tensors, last_name=views[-1][0] if views else progress["last_name"])
            try:
                self._received(views)
                if batch is not None:
                    t0 = time.perf_counter()
                    for name, v in views:
                        batch.add(name, v)
                    if data.is_cuda:
                        batch.hexdigests()  # finish reading the views before load can touch them
                    digest_s += time.perf_counter() - t0
                load(views)
            except Exception as e:  # noqa: BLE001 - recorded for the sender; the refit continues
                logger.exception("broadcast refit %s: bucket %d failed on rank %s", refit_id, msg["seq"], label)
                errors.append(f"bucket {msg['seq']} ({len(views)} entries): {type(e).__name__}: {e}")
            finally:
                views.clear()
                del data
        if msg.get("n_tensors") != entries_received:
            errors.append(f"sender sent {msg.get('n_tensors')} tensors, rank {label} got {entries_received} entries")
        manifest = None
        if batch is not None or external is not None:
            t0 = time.perf_counter()
            try:
                manifest = external.finish()[0] if external is not None else batch.hexdigests()
            except Exception as e:  # noqa: BLE001 - the manifest gather must still happen
                errors.append(f"digest: {type(e).__name__}: {e}")
                manifest = {}
            digest_s += time.perf_counter() - t0
        error = "; ".join(errors)[:_MAX_ERROR_CHARS] if errors else None
        reply = {"rank": label, "manifest": manifest, "error": error, "tensors": tensors, "bytes": n_bytes, "digest_s": digest_s}
        _collective("manifest gather", progress, dist.gather_object, reply, None, group_dst=self.src, group=self.group)
        return BroadcastReceiveResult(manifest=manifest, tensors=tensors, bytes=n_bytes, buckets=buckets, digest_s=digest_s,
                                      refit_id=refit_id, mode=mode, rank=label, error=error)


def receive_broadcast(group, src: int, load: LoadFn, config: RefitConfig | None = None, *,
                      device: str | torch.device | None = None, rank: int | None = None,
                      digests: ExternalDigests | None = None) -> BroadcastReceiveResult:
    """Receive one broadcast refit on this rank: ``BroadcastReceiver(group, src, config, ...).receive(load, digests=)``.

    ``src`` is the sender's rank within ``group``; raises what :meth:`BroadcastReceiver.receive` raises.
    """
    return BroadcastReceiver(group, src, config, device=device, rank=rank).receive(load, digests=digests)
