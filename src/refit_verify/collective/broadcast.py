"""Verified weight broadcast over a ``torch.distributed`` group (non-colocated refits).

Non-colocated RL setups do not share IPC buffers: the trainer's sender rank broadcasts each
tensor (or a packed bucket of tensors) to the inference workers over a process group (NCCL on
GPUs, gloo on CPUs). This module is that path, verified end to end:

* the sender (:class:`BroadcastSender`, on rank ``src``) broadcasts a
  :class:`~refit_verify.wire.collective.BroadcastHello` with its **mode** first; receivers verify iff it
  is not ``off`` (one mode for the whole refit, chosen by the sender, as in the staged transport);
* the sender digests each tensor **before** packing it (covers the cast, pack, broadcast and
  slicing) and packs with the stream layer shared with the staged transport
  (:class:`refit_verify.stream.pack.Packer`: aligned slots, groups cut at ``buffer_bytes // 2``, an
  oversized tensor alone); per bucket it broadcasts one typed :class:`~refit_verify.wire.collective.Bucket`
  (names, dtypes, shapes, offsets) followed by the bucket's bytes;
* each receiver (:func:`receive_broadcast` / :class:`BroadcastReceiver`) validates every entry on
  its own (:class:`refit_verify.stream.unpack.EntryChecker`: dtype, size, alignment, overlap, bounds,
  names sent twice; a refused entry is named in the report), slices the bucket into views of the
  wire dtype and shape, digests each view **before** calling ``load`` (before ``model.load_weights``,
  renames, fusion or quantisation), and records ``load`` errors;
* after :class:`~refit_verify.wire.collective.BroadcastComplete` every receiver's
  :class:`~refit_verify.wire.collective.RankReport` comes back to the sender in one gather; the sender
  compares it with its own manifest per receiving rank (:func:`refit_verify.compare.receiver_report`)
  and applies the mode with :func:`refit_verify.config.act_on`: ``log`` warns per failing rank and
  returns every report, ``enforce`` raises :class:`BroadcastVerificationError` (a
  :class:`RefitVerificationError`) carrying **all** ranks' reports, so a clean rank is reported
  clean next to a failing one.

Nothing a peer sends is unpickled: every message is typed msgspec moved as a length-first ``uint8``
tensor (:mod:`refit_verify.wire.collective`). This module does not import the ZMQ transport.

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
collective into an error instead of a hang, and ``torch.cuda.set_device(local_rank)`` on every
rank before the refit (the message tensors live on the current CUDA device).

The module stays whole past 500 lines: sender and receiver are the two halves of one collective
protocol and share its group checks (membership, configuration, timeouts).

Source: ``docs/protocol.md`` (broadcast path), ``docs/scale.md``; the digest is ``docs/digest-spec.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from refit_verify import verdicts
from refit_verify.compare import receiver_report
from refit_verify.config import RefitConfig, VerifyMode, act_on, check_version
from refit_verify.digest.batch import DigestBatch
from refit_verify.errors import (
    BroadcastVerificationError,
    RefitAbortedError,
    RefitConfigError,
    RefitProtocolError,
    RefitReceiveError,
    RefitTimeoutError,
    RefitVerificationError,
)
from refit_verify.manifest import ExternalDigests
from refit_verify.report import VerificationReport
from refit_verify.stream.items import MAX_ERROR_CHARS, Batch, LoadFn, StreamResult, StreamStats, round_up
from refit_verify.stream.pack import Packer
from refit_verify.stream.unpack import ReceiveState, view_slots
from refit_verify.wire.collective import (
    BROADCAST_PROTOCOL,
    BroadcastAbort,
    BroadcastComplete,
    BroadcastHello,
    Bucket,
    RankReport,
    broadcast_message,
    comm_device,
    decode_broadcast,
    decode_rank_report,
    gather_messages,
    group_rank,
    group_size,
)
from refit_verify.wire.fields import MAX_MESSAGE_BYTES, Entry

__all__ = [
    "BROADCAST_PROTOCOL",
    "BroadcastReceiveResult",
    "BroadcastReceiver",
    "BroadcastSender",
    "BroadcastStats",
    "BroadcastVerificationError",
    "receive_broadcast",
]

logger = logging.getLogger("refit_verify")

AFTER_LOAD_UNCHECKED = (
    "what each receiver's load did with the bytes it digested: a broadcast rank report carries the digests of what "
    "arrived, not a vLLM worker's coverage and read-back of its engine (compare those with "
    "collective_rpc('refit_verify_session_manifest') and refit_verify.compare.compare_session)")
"""The ``unchecked`` entry of every verifying broadcast report: the verdict compares the digests
each receiver took before ``load``; nothing a receiver learns after it (a vLLM worker's read-back)
travels back in its :class:`~refit_verify.wire.collective.RankReport`."""

_TIMEOUT_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "peer closed")


def _dist(group=None):
    """``torch.distributed``, checked: ``group=None`` needs the default group; an explicit group
    (registered or not) does not, e.g. a trainer process whose only group is a stateless one."""
    import torch.distributed as dist

    if not dist.is_available() or (group is None and not dist.is_initialized()):
        raise RuntimeError("the broadcast path needs an initialised torch.distributed process group")
    return dist


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
    size = group_size(group)
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < size:
        raise RefitConfigError(f"broadcast {side}: src={src!r} is not a rank of the group (ranks 0..{size - 1})")
    return size


def _check_config(config: RefitConfig | None, side: str) -> RefitConfig:
    if config is None:
        return RefitConfig()
    if not isinstance(config, RefitConfig):
        raise RefitConfigError(f"broadcast {side}: config must be a RefitConfig, got {type(config).__name__}")
    return config


def _masked_by_c10d_logger(e: BaseException) -> bool:
    """True when ``e`` was raised by torch's c10d exception logger while it described another error."""
    import traceback

    return e.__context__ is not None and any(
        f.name == "_get_msg_dict" and f.filename.endswith("c10d_logger.py") for f in traceback.extract_tb(e.__traceback__))


def _collective(what: str, progress: dict, fn, *args, **kwargs):
    """Run one collective; a timeout or a dropped peer becomes :class:`RefitTimeoutError`.

    Unregistered groups: torch wraps its collectives (``broadcast``, ``gather``, ``all_gather``) in
    ``c10d_logger._exception_logger``. On an error, when the default group is initialised (always,
    inside a vLLM worker), it describes the failing call with ``dist.get_backend(group)`` and
    ``dist.get_rank(group)``; both look the group up in torch's global maps and raise
    ``ValueError("... is not initialized in the world group map ...")`` for a group that is not
    there (vLLM's stateless groups). That ValueError replaces the real error (a gloo timeout, a
    reset peer), which survives as its ``__context__``, once per nested wrapper. Such ValueErrors
    are unwrapped here back to the error the collective raised. (The collectives themselves work:
    they only use ``group.rank()``, ``group.size()`` and ``group_src`` / ``group_dst``. Also not
    usable on such groups: ``src=`` / ``dst=`` global ranks and ``dist.get_backend(group)``.)
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


class BroadcastStats(StreamStats):
    """Numbers of a broadcast sender's last refit (a plain dict): the keys of
    :class:`~refit_verify.stream.items.StreamStats`, ``buckets`` (buckets broadcast, oversized tensors
    included) and ``receivers`` (receiving ranks that answered)."""

    buckets: int
    receivers: int


# ------------------------------------------------------------------------------ sender


class _BroadcastSend:
    """One broadcast refit on the sender: the progress, the collectives, and the buckets (the packer's sink)."""

    def __init__(self, sender: BroadcastSender, refit_id: str, mode: VerifyMode, capacity: int, device: torch.device) -> None:
        self.sender, self.capacity, self.device = sender, capacity, device
        self.msg_device = comm_device(sender.group)
        self.progress = {"side": "sender", "refit_id": refit_id, "mode": mode.value, "buckets": 0, "tensors": 0, "last_name": None}
        self.in_collective = False
        self.bucket: torch.Tensor | None = None
        self.packer: Packer | None = None

    def run(self, what: str, fn, *args, **kwargs):
        """Run one collective; ``in_collective`` stays set if it raised (the group is then not usable for an abort)."""
        self.in_collective = True
        if self.packer is not None:
            self.progress["last_name"] = self.packer.last_name
        out = _collective(what, self.progress, fn, *args, **kwargs)
        self.in_collective = False
        return out

    def send(self, msg, what: str) -> None:
        """Broadcast one typed message to the receivers."""
        s = self.sender
        broadcast_message(msg, group=s.group, src=s.src, device=self.msg_device, decode=decode_broadcast,
                          max_bytes=MAX_MESSAGE_BYTES, what=what, run=self.run)

    # -- PackSink ---------------------------------------------------------------------------------

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        if self.bucket is None:  # a fresh bucket per group: the last one may still be read by an async collective
            self.bucket = torch.empty(self.capacity, dtype=torch.uint8, device=self.device)
        return self.bucket

    def post(self, entries: list[Entry], used: int) -> None:
        self._post(entries, self.bucket[:used])
        self.bucket = None

    def post_alone(self, u8: torch.Tensor, entry: Entry, aligned: int, meanwhile: Callable[[], None] | None = None) -> None:
        # Broadcast straight from the tensor's bytes when they already lie on the group's device
        # (else one copy there); unpadded: the receivers check such an entry against its exact size.
        # Nothing waits for the receivers here: ``meanwhile`` runs once it is sent.
        self._post([entry], u8 if u8.device == self.device else u8.to(self.device))
        if meanwhile is not None:
            meanwhile()

    def _post(self, entries: list[Entry], data: torch.Tensor) -> None:
        s, p = self.sender, self.progress
        seq = p["buckets"]
        s._sending(entries, data)
        self.send(Bucket(seq=seq, entries=entries, used_bytes=data.numel()), f"bucket {seq} metadata")
        self.run(f"bucket {seq} bytes", _dist(s.group).broadcast, data, group_src=s.src, group=s.group)
        p["buckets"] += 1
        p["tensors"] += len(entries)


class BroadcastSender:
    """Sender side of a verified broadcast refit; construct and call :meth:`send` on rank ``src``.

    Args:
        group: the process group holding the sender and every receiving worker (default: world). It
            may be a group outside torch's global maps (vLLM's stateless groups).
        src: rank of the sender (this process) **within** ``group`` (``group.rank()``; the global
            rank when ``group`` is None).
        config: ``mode`` (default from ``REFIT_VERIFY``), ``alignment`` of tensor offsets in a
            bucket (512), and ``buffer_bytes``: a bucket holds up to ``buffer_bytes // 2`` bytes
            (same budget as one staging half of the staged transport). ``timeout_s`` is not
            used: the group's timeout bounds every wait.
        device: device of the buckets; default the current CUDA device for an NCCL group, else CPU.

    Attributes:
        last_stats (BroadcastStats | None): the numbers of the last refit whose reports came back.

    Every other rank of ``group`` must call :func:`receive_broadcast` for the same refit.
    Reports are keyed by the receivers' ranks within ``group`` (or the ``rank`` labels they chose).

    Raises:
        RefitConfigError: ``config`` is not a :class:`RefitConfig`.
    """

    def __init__(self, *, group=None, src: int = 0, config: RefitConfig | None = None, device: str | torch.device | None = None) -> None:
        self.group = group
        self.src = src
        self.config = _check_config(config, "sender")
        self._device = torch.device(device) if device is not None else None
        self.last_stats: BroadcastStats | None = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int | None = None
             ) -> dict[int, VerificationReport] | None:
        """Broadcast every ``(name, tensor)`` to the group and verify each receiving rank.

        Args:
            named_tensors: unique wire names and dense tensors (any dtype, shape, strides, device).
            version: the weight version (the trainer's step, an int >= 0), carried in the header: a
                receiving vLLM worker that already closed this version or a newer one reports its
                rank stale (a ``problems`` entry: that rank's report fails). None: unversioned.

        Returns:
            ``{rank: VerificationReport}`` for every receiving rank (its rank within ``group`` unless it
            passed another ``rank`` label; in group order) when the mode
            verifies (``log`` returns failing reports after logging them); ``None`` in ``off`` mode.

        Raises:
            BroadcastVerificationError: ``enforce`` and at least one rank's manifest differs or
                rank refused entries; it carries every rank's report.
            RefitReceiveError: a receiver reported errors (``load`` raised; in ``off`` mode also
                refused entries or a count mismatch), after the reports were checked; its
                ``reports`` attribute holds them (when verifying).
            RefitTimeoutError: a collective ran past the group's timeout or a peer dropped out.
            RefitInputError (a ``TypeError`` and a ``ValueError``): a bad item, name or tensor (receivers
                are sent an abort first).
            RefitProtocolError: this process is not rank ``src`` of ``group``, or not a member of it
                (before any collective); receivers share a ``rank`` label, or a receiver's report is
                malformed, oversized or inconsistent with the mode (at the verdict).
            RefitConfigError: ``src`` is not a rank of ``group``; or the mode verifies and the group
                holds no receiver (size 1); or ``version`` is neither None nor an int >= 0. All before
                any collective.
        """
        version = check_version(version)
        size = _check_membership(self.group, self.src, "sender")
        me = group_rank(self.group)
        if me != self.src:
            raise RefitProtocolError(f"BroadcastSender.send runs on rank {self.src} of the group, this is rank {me}")
        cfg = self.config
        mode = cfg.mode
        if size < 2:
            if mode.verifies:
                raise RefitConfigError(f"broadcast sender: REFIT_VERIFY={mode.value} but the group holds no receiver "
                                       "(size 1): nothing would be verified")
            logger.warning("broadcast refit into a group of size 1: no receiver")
        refit_id = uuid.uuid4().hex
        st = _BroadcastSend(self, refit_id, mode, max(cfg.buffer_bytes // 2, cfg.alignment), self._device or comm_device(self.group))
        packer = st.packer = Packer(st, capacity=st.capacity, alignment=cfg.alignment, digests=DigestBatch() if mode.verifies else None,
                                    sync_digests=True)
        t_start = time.perf_counter()
        abort_due = False  # between the header and the complete, a failure here is told to the receivers
        try:
            abort_due = True
            st.send(BroadcastHello(protocol=BROADCAST_PROTOCOL, refit_id=refit_id, mode=mode.value, alignment=cfg.alignment,
                                   version=version), "header")
            if isinstance(named_tensors, (list, tuple)):
                packer.digest_first(named_tensors)  # the first bucket's digests now, the rest's once it is sent (kept sets)
            packer.add_all(named_tensors)
            sender_manifest = packer.manifest()
            st.send(BroadcastComplete(n_tensors=packer.tensors), "complete")
            abort_due = False  # the receivers are past their last broadcast: they read no abort
            gathered = gather_messages(None, group=self.group, dst=self.src, device=st.msg_device, decode=decode_rank_report,
                                       max_bytes=MAX_MESSAGE_BYTES, what="receiver reports", run=st.run)
        except BaseException as e:
            # the receivers' sessions (named after the refit) may hold part of it: never vouched for later
            verdicts.record(refit_id, False, f"its broadcast refit failed before the verdict ({type(e).__name__})")
            if abort_due and not st.in_collective:
                try:
                    st.send(BroadcastAbort(reason=f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS]), "abort")
                except Exception:  # noqa: BLE001 - the original error matters more
                    logger.exception("could not broadcast abort")
            raise
        finally:
            st.packer = None  # the packer refers to st (its sink): no cycle keeps the bucket and digest buffers after the send
        results = [g for g in gathered if g is not None]
        self.last_stats = BroadcastStats(
            refit_id=refit_id, mode=mode.value, tensors=packer.tensors, bytes=packer.bytes, buckets=st.progress["buckets"],
            receivers=len(results), digest_s=packer.digest_s, digest_shadow_s=packer.digest_shadow_s, wall_s=time.perf_counter() - t_start,
            receiver_digest_s=max((g.digest_s for g in results), default=0.0),
        )
        return self._verdict(mode, sender_manifest, results, refit_id)

    def _sending(self, entries: list[Entry], data: torch.Tensor) -> None:
        """Called with a bucket's entries and its uint8 bytes right before they are broadcast,
        after the sender digested them (CUDA digests done). A no-op; a test subclass may alter
        ``data`` here to simulate a transfer that corrupts the bytes. ``data`` may be an oversized
        tensor's own bytes (not a copy)."""

    def _verdict(self, mode: VerifyMode, sender_manifest: dict[str, str] | None, results: list[RankReport],
                 refit_id: str) -> dict[int, VerificationReport] | None:
        labels = [g.rank for g in results]
        dup = sorted({r for r in labels if labels.count(r) > 1}, key=str)
        if dup:  # a report keyed by a shared label would hide another rank's report
            raise RefitProtocolError(f"broadcast refit {refit_id}: receivers share rank labels {dup} (labels {labels}); each "
                                     "receiver needs a unique `rank` label (the default, its rank in the group, is unique)")
        problems: dict[int, str] = {}
        for g in results:
            if (g.manifest is None) is mode.verifies:
                raise RefitProtocolError(f"broadcast refit {refit_id}: mode is {mode.value} but rank {g.rank} returned "
                                         f"{'no manifest' if mode.verifies else 'a manifest'}")
            parts = [] if mode.verifies or not g.rejected else [
                f"{len(g.rejected)} entries rejected: " + "; ".join(f"{k} ({v})" for k, v in list(g.rejected.items())[:20])]
            if g.error:
                parts.append(g.error)
            if parts:
                problems[g.rank] = "; ".join(parts)
        text = "; ".join(f"rank {r}: {e}" for r, e in problems.items())
        if not mode.verifies:
            if problems:
                raise RefitReceiveError(f"broadcast refit {refit_id}: receivers reported: {text}")
            return None
        reports = {g.rank: receiver_report(sender_manifest, g.manifest, None, refit_id=refit_id, rejected=g.rejected or {},
                                           error=g.error, rank=g.rank, stale=g.stale) for g in results}
        reports = {r: dataclasses.replace(rep, unchecked=(*rep.unchecked, AFTER_LOAD_UNCHECKED)) for r, rep in reports.items()}
        failing = False
        for rep in reports.values():
            try:  # a load error alone is the RefitReceiveError below, not a verification failure
                act_on(dataclasses.replace(rep, receiver_error=None) if rep.receiver_error else rep, mode)
            except RefitVerificationError:
                failing = True
        if not all(rep.ok for rep in reports.values()):  # in every mode (a pass is not recorded: a rank's report holds
            verdicts.record(refit_id, False, "its broadcast refit failed")  # no engine-side check of its session)
        if failing:
            raise BroadcastVerificationError(reports)
        for rep in reports.values():
            if rep.ok:
                logger.info("%s", rep.describe())
        if problems:
            err = RefitReceiveError(f"broadcast refit {refit_id}: receivers reported: {text}")
            err.reports = reports  # every rank's verification report, as in the return value
            raise err
        return reports


# ------------------------------------------------------------------------------ receiver


@dataclass(kw_only=True)
class BroadcastReceiveResult(StreamResult):
    """Outcome of one :meth:`BroadcastReceiver.receive` on one rank: the fields of
    :class:`~refit_verify.stream.items.StreamResult` (``manifest``, ``tensors``, ``bytes``, ``digest_s``,
    ``refit_id``, ``mode``, ``error``, ``rejected``, ``.ok``), ``buckets`` (buckets received) and
    ``rank`` (this receiver's label)."""

    buckets: int = 0
    rank: int = 0


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

    Raises:
        RefitConfigError: ``config`` is given and is not a :class:`RefitConfig`.
    """

    def __init__(self, *, group=None, src: int = 0, config: RefitConfig | None = None,
                 device: str | torch.device | None = None, rank: int | None = None) -> None:
        self.group = group
        self.src = src
        self.config = None if config is None else _check_config(config, "receiver")
        self._device = torch.device(device) if device is not None else None
        self.rank = rank

    def _received(self, batch: Batch) -> None:
        """Called with a bucket's views right after its bytes arrived, before they are digested
        and loaded. A no-op; a test subclass may alter the views here to simulate a corrupted
        transfer (the digest then sees what ``load`` sees)."""

    def receive(self, load: LoadFn, *, digests: ExternalDigests | None = None) -> BroadcastReceiveResult:
        """Take part in one broadcast refit: receive, check, digest, ``load``, send the report back.

        Args:
            load: called once per bucket with ``[(name, view)]`` of its accepted entries; the views
                alias the bucket and must be copied if kept. Exceptions are recorded and sent to the sender.
            digests: where the digests are taken instead of here (a vLLM worker's model boundary,
                :class:`refit_verify.boundary.worker.SessionDigests`); default: each bucket's views here.

        Raises:
            RefitAbortedError: the sender broadcast an abort (its exception is in the message).
            RefitProtocolError: a malformed, oversized or unexpected message or protocol version;
                this process is not a member of ``group`` or is its ``src`` (before any collective).
            RefitConfigError: ``src`` is not a rank of ``group`` (before any collective).
            RefitTimeoutError: a collective ran past the group's timeout or a peer dropped out.
        """
        _check_membership(self.group, self.src, "receiver")
        me = group_rank(self.group)
        if me == self.src:
            raise RefitProtocolError(f"rank {self.src} of the group is the broadcast sender, not a receiver")
        label = me if self.rank is None else self.rank
        progress = {"side": f"receiver rank {label}", "refit_id": None, "mode": None, "buckets": 0, "tensors": 0, "last_name": None}
        msg_device = comm_device(self.group)

        def run(what: str, fn, *args, **kwargs):
            return _collective(what, progress, fn, *args, **kwargs)

        def next_message(what: str):
            return broadcast_message(None, group=self.group, src=self.src, device=msg_device, decode=decode_broadcast,
                                     max_bytes=MAX_MESSAGE_BYTES, what=what, run=run)

        hello = next_message("header")
        if not isinstance(hello, BroadcastHello):
            raise RefitProtocolError(f"receiver rank {label}: expected the header, got {type(hello).__name__}")
        if hello.protocol != BROADCAST_PROTOCOL:
            raise RefitProtocolError(f"receiver rank {label}: sender speaks broadcast protocol {hello.protocol}, "
                                     f"receiver {BROADCAST_PROTOCOL}")
        mode = VerifyMode(hello.mode)
        state = ReceiveState.start(mode, hello.refit_id, hello.alignment, digests, padded_tail=False)
        progress.update(refit_id=hello.refit_id, mode=mode.value)
        if state.external is not None:
            state.external.begin(hello.refit_id, None, hello.version)
        try:
            n_tensors = self._receive_loop(load, state, progress, label, run, next_message)
        except BaseException as e:
            if state.external is not None:
                state.external.fail(f"{type(e).__name__}: {e}")
            raise
        manifest, session, error = state.finish(n_tensors)  # the session manifest stays with the worker's boundary
        rejected = dict(state.checker.rejected)
        report = RankReport(rank=label, manifest=manifest, error=error, rejected=rejected or None, tensors=state.tensors,
                            bytes=state.bytes, digest_s=state.digest_s, stale=session.stale if session is not None else None)
        gather_messages(report, group=self.group, dst=self.src, device=msg_device, decode=decode_rank_report,
                        max_bytes=MAX_MESSAGE_BYTES, what="receiver reports", run=run)
        return BroadcastReceiveResult(manifest=manifest, tensors=state.tensors, bytes=state.bytes, buckets=state.groups,
                                      digest_s=state.digest_s, refit_id=state.refit_id, mode=mode, rank=label, error=error,
                                      rejected=rejected)

    def _receive_loop(self, load: LoadFn, state: ReceiveState, progress: dict, label: int, run, next_message) -> int:
        """Receive buckets until the sender's complete; return its tensor count."""
        device = self._device or comm_device(self.group)
        dist = _dist(self.group)
        while True:
            msg = next_message(f"bucket {state.groups} metadata or complete")
            if isinstance(msg, BroadcastAbort):
                raise RefitAbortedError(f"receiver rank {label}: broadcast refit {state.refit_id} aborted by the sender after "
                                        f"{state.groups} buckets, {state.tensors} tensors: {msg.reason}", msg.reason, progress)
            if isinstance(msg, BroadcastComplete):
                return msg.n_tensors
            if not isinstance(msg, Bucket):
                raise RefitProtocolError(f"receiver rank {label}: unexpected {type(msg).__name__} in refit {state.refit_id}")
            ends = max((round_up(e.offset + e.nbytes, state.checker.alignment) for e in msg.entries), default=0)
            if msg.used_bytes > ends:  # checked before allocating: a sender never sends bytes no entry names
                raise RefitProtocolError(f"receiver rank {label}: bucket {msg.seq} announces {msg.used_bytes} bytes but its "
                                         f"entries end at byte {ends}")
            slots = state.checker.check(msg.seq, msg.entries, msg.used_bytes)
            data = torch.empty(msg.used_bytes, dtype=torch.uint8, device=device)
            run(f"bucket {msg.seq} bytes", dist.broadcast, data, group_src=self.src, group=self.group)
            state.groups += 1
            views = view_slots(data, slots)
            try:
                self._received(views)
                state.deliver(views, load, sync_cuda=True)  # finish reading the views before load can touch them
            except Exception as e:  # noqa: BLE001 - recorded for the sender; the refit continues
                logger.exception("broadcast refit %s: bucket %d failed on rank %s", state.refit_id, msg.seq, label)
                state.errors.append(f"bucket {msg.seq} ({len(views)} entries): {type(e).__name__}: {e}")
            finally:
                progress.update(buckets=state.groups, tensors=state.tensors, last_name=state.last_name)
                views.clear()
                del data


def receive_broadcast(group, src: int, load: LoadFn, config: RefitConfig | None = None, *,
                      device: str | torch.device | None = None, rank: int | None = None,
                      digests: ExternalDigests | None = None) -> BroadcastReceiveResult:
    """Receive one broadcast refit on this rank:
    ``BroadcastReceiver(group=, src=, config=, device=, rank=).receive(load, digests=)``.

    ``src`` is the sender's rank within ``group``; raises what :meth:`BroadcastReceiver.receive` raises.
    """
    return BroadcastReceiver(group=group, src=src, config=config, device=device, rank=rank).receive(load, digests=digests)
