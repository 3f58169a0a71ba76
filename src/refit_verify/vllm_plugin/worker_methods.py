"""Methods added to vLLM's ``WorkerBase`` by :func:`refit_verify.vllm_plugin.register`.

Each runs inside a vLLM worker, reached through ``LLM.collective_rpc(name, args=...)``. Arguments and
return values are plain strings, numbers, lists and dicts (msgpack-safe), never tensors.
The ``refit_verify_`` prefix keeps them clear of every method vLLM's workers define.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from refit_verify.manifest import digest_map_text
from refit_verify.vllm_plugin import runner, shims
from refit_verify.vllm_plugin import worker_sessions as sessions
from refit_verify.vllm_plugin.broadcast_trainer import DEFAULT_GROUP_TIMEOUT_S
from refit_verify.vllm_plugin.worker_copies import owned_copies

METHODS = ("refit_verify_receive", "refit_verify_param_digests", "refit_verify_broadcast_init",
           "refit_verify_broadcast_receive", "refit_verify_broadcast_close")

_BCAST_ATTR = "_refit_verify_broadcast"  # the worker's broadcast-group state, set by refit_verify_broadcast_init


def refit_verify_receive(self, endpoint: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Receive one refit over the refit-verify transport and load it with ``model.load_weights``.

    Args:
        endpoint: the sender's ZMQ endpoint; ``{rank}`` is replaced by this worker's rank, and then the
            sender must be trainer rank ``rank`` (``RefitSender(rank=)``): a payload of another
            producer is named in the report (``misrouted payload``).
        options: keyword options of :class:`refit_verify.RefitConfig` (``mode`` is taken from the
            sender's handshake; timeouts and buffer sizes from here).

    Returns:
        dict: ``rank``, ``manifest`` (``{wire name: 32-hex}`` as JSON text, :func:`~refit_verify.manifest.digest_map`
        reads it; None when not verifying),
        ``tensors``, ``bytes``, ``digest_s`` (receiver digest seconds), ``mode`` (agreed at the
        handshake), ``rejected`` (``{name: reason}`` of refused entries), ``error`` (or None),
        ``landed`` (engine parameters this refit wrote) and ``kept`` (``{engine parameter: why}``
        of those that still hold the previous version), when verifying; ``seconds``: wall seconds of
        this worker's phases (:func:`_phase_seconds`).

    A worker that does not verify (``REFIT_VERIFY=off`` here, or its model not found) answers the
    handshake ``off`` with that reason: a sender in ``enforce`` refuses the refit before any byte moves.

    Verify before load: every tensor is checked against the digest the sender sent with it, at
    the model boundary, before ``load_weights`` (one synchronisation per call on CUDA); in
    ``enforce`` a corrupt one is refused and never loaded, and a fused layer with a refused part
    keeps its previous kernel tensors whole (:func:`shims.restore_unfinished_layers`).

    Raises:
        RefitConfigError: ``options`` is not a mapping or holds an unknown key, ``None``, an empty or
            out-of-range value (validated here, in the worker process).
        RefitTimeoutError: the sender went silent for longer than ``timeout_s`` or disconnected.
        RefitAbortedError: the sender aborted the refit.
        RefitProtocolError: the sender broke the protocol.

    On failure the layerwise reload is still finalized (the engine stays usable for the next refit);
    an error while finalizing is logged and the original error raised.
    """
    from refit_verify.boundary.worker import SessionDigests
    from refit_verify.config import RefitConfig
    from refit_verify.errors import RefitError
    from refit_verify.transport.receiver import RefitReceiver

    cfg = RefitConfig.from_options(options, source="refit_verify_receive options")
    wb = sessions.boundary_of(self)
    # a worker that dials the endpoint of its own rank must be fed by the sender of that rank
    expect = self.rank if "{rank}" in endpoint else None
    digests = SessionDigests(wb, "transport", expect_producer=expect) if wb is not None else None
    outcome: dict[str, Any] = {"load_s": 0.0}
    own0 = wb.own_seconds() if wb is not None else 0.0
    # a worker that does not verify answers the handshake "off" with its reason (enforce then refuses the refit):
    # digesting the staged slices alone would prove the transport, not what the engine loaded
    why_not = None if wb is not None else f"worker rank {self.rank}: {sessions.not_verifying_reason(self)}"
    try:
        with RefitReceiver(endpoint.format(rank=self.rank), config=cfg, device=runner.device(self), verify=wb is not None,
                           why_not=why_not) as receiver:
            with _reload_session(self, digests, outcome) as load:
                try:
                    res = receiver.receive(load=load, digests=digests)
                finally:
                    receiver.close()  # idempotent: closed as soon as the protocol is over, before the reload is finalized
    except RefitError as e:  # say what the engine holds now (the message crosses vLLM's RPC as text)
        kept = outcome.get("kept") or (digests.kept if digests is not None else {})
        if kept and e.args and isinstance(e.args[0], str):
            e.args = (f"{e.args[0]}; engine: {len(kept)} parameters keep the previous version (layers the refit did not "
                      f"complete were put back whole): {', '.join(list(kept)[:12])}" + (" …" if len(kept) > 12 else ""), *e.args[1:])
        raise
    seconds = _phase_seconds(digests, outcome["load_s"], wb.own_seconds() - own0 if wb is not None else 0.0)
    return {"rank": self.rank, "manifest": digest_map_text(res.manifest), "tensors": res.tensors, "bytes": res.bytes, "digest_s": res.digest_s,
            "mode": res.mode.value, "rejected": res.rejected, "error": res.error, "landed": res.landed, "kept": res.kept,
            "seconds": seconds}


def _phase_seconds(digests: Any, load_s: float, boundary_s: float) -> dict[str, float]:
    """Wall seconds of one received refit on this worker, split into refit-verify's work and vLLM's.

    ``open_s``: the session's open; ``boundary_s``: the model boundary's own code during the loads and
    vLLM's finalize (digests checked before loading, the loader tap, a placement learned: the whole
    loader call; the read-back of weights vLLM repacked or quantized after loading, though it runs
    inside vLLM's processing); ``close_s``: the close (coverage, read-back, engine-state snapshot, manifest) —
    together ``own_s``. ``reload_s``: the rest of ``model.load_weights`` and of vLLM's layerwise
    reload (start, per-layer processing, finalize), with the copies it keeps (:func:`owned_copies`):
    what the same refit costs with ``REFIT_VERIFY=off``. Zero where the worker does not verify.
    """
    open_s = getattr(digests, "open_s", 0.0)
    close_s = getattr(digests, "close_s", 0.0)
    settle_s = getattr(digests, "settle_s", 0.0)
    return {"open_s": open_s, "boundary_s": boundary_s, "close_s": close_s, "own_s": open_s + boundary_s + close_s,
            "reload_s": max(0.0, load_s + settle_s - boundary_s)}


def refit_verify_param_digests(self, names: list[str] | None = None) -> dict[str, str]:
    """Return ``{vLLM parameter name: 32-hex digest}`` of the engine's current parameters.

    Reads back what the engine holds after loading (fused and sharded as vLLM stores them), for
    checks beyond the transport boundary.

    Args:
        names: parameter names as in ``model.named_parameters()``; None means all.

    Raises:
        KeyError: a requested name is not a parameter of the model.
    """
    from refit_verify.digest.batch import digest_tensors

    params = dict(runner.main_model(self).named_parameters())
    wanted = list(params) if names is None else list(names)
    missing = [n for n in wanted if n not in params]
    if missing:
        raise KeyError(f"not parameters of the model: {missing}")
    return digest_tensors((n, params[n].detach()) for n in wanted)


def refit_verify_broadcast_init(self, host: str, port: int, world_size: int, rank_offset: int = 1,
                                backend: str | None = None, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> dict[str, Any]:
    """Join the trainer-worker process group of the broadcast path (non-colocated refits).

    Runs on every worker through ``collective_rpc``, concurrently with the trainer's
    :func:`refit_verify.vllm_plugin.broadcast_group` (every member blocks until all joined). Worker
    ``i = dp_index * (TP * PP) + rank`` (as vLLM's ``worker_init_process_group``) joins as rank
    ``rank_offset + i``. The group is made without touching torch's global state (vLLM's own TP
    group stays the default group) and is kept on this worker for
    :func:`refit_verify_broadcast_receive`.

    Args:
        host, port: rank 0's rendezvous address (the trainer, with ``rank_offset=1``).
        world_size: members of the group: the trainer ranks plus every worker of every DP replica.
        rank_offset: group rank of worker 0 (default 1: one trainer rank at 0).
        backend: ``"nccl"`` (on this worker's CUDA device) or ``"gloo"``; default ``"nccl"`` when
            the worker's device is CUDA, else ``"gloo"``.
        timeout_s: seconds bounding the join and every collective on the group (> 0, <= 86400;
            default :data:`refit_verify.vllm_plugin.DEFAULT_GROUP_TIMEOUT_S`, 600).

    Returns:
        dict: ``rank`` (this worker's vLLM rank), ``group_rank``, ``world_size``, ``backend``.

    Raises:
        RefitConfigError: bad arguments, a group rank outside ``world_size``, or this worker already
            joined a group (call ``refit_verify_broadcast_close`` first).
        RuntimeError / DistStoreError: the rendezvous failed or timed out.
    """
    import torch

    from refit_verify.errors import RefitConfigError
    from refit_verify.vllm_plugin.broadcast_trainer import broadcast_group

    if getattr(self, _BCAST_ATTR, None) is not None:
        raise RefitConfigError(f"refit_verify_broadcast_init: worker rank {self.rank} already joined a broadcast group; "
                               "call refit_verify_broadcast_close first")
    if isinstance(rank_offset, bool) or not isinstance(rank_offset, int) or rank_offset < 0:
        raise RefitConfigError(f"refit_verify_broadcast_init: rank_offset must be an int >= 0, got {rank_offset!r}")
    pc = self.parallel_config
    dp_index = getattr(pc, "data_parallel_index", getattr(pc, "data_parallel_rank", 0))
    worker_index = dp_index * pc.world_size + pc.rank
    rank = rank_offset + worker_index
    if isinstance(world_size, int) and not isinstance(world_size, bool) and rank >= world_size:
        raise RefitConfigError(f"refit_verify_broadcast_init: worker {worker_index} would join as rank {rank} "
                               f"(rank_offset {rank_offset}), not below world_size {world_size}: world_size must count "
                               "the trainer ranks plus every worker of every data-parallel replica")
    device = runner.device(self) or torch.device("cpu")
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if str(backend).lower() != "nccl":
        device = torch.device("cpu")  # gloo moves CPU tensors
    with _on_device(device):
        group = broadcast_group(host, port, rank, world_size, backend, timeout_s)
    setattr(self, _BCAST_ATTR, {"group": group, "device": device, "backend": str(backend).lower()})
    return {"rank": self.rank, "group_rank": group.rank(), "world_size": group.size(), "backend": str(backend).lower()}


def refit_verify_broadcast_receive(self, src: int = 0, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Receive one broadcast refit (:mod:`refit_verify.collective.broadcast`) and load it with ``model.load_weights``.

    The trainer runs ``BroadcastSender(group, src, config).send(...)`` at the same time; the mode
    comes from its header. Loading goes through vLLM's layerwise reload as in
    :func:`refit_verify_receive`; this worker's manifest goes back to the sender, which compares.

    Args:
        src: the sender's rank within the group (default 0).
        options: keyword options of :class:`refit_verify.RefitConfig`, validated here for symmetry
            with ``refit_verify_receive``; none of them changes this receive: the mode and
            alignment come from the sender's header, and every wait is bounded by the group's
            timeout (``timeout_s`` of ``refit_verify_broadcast_init``), not by ``options["timeout_s"]``.

    Returns:
        dict: ``rank`` (vLLM rank), ``group_rank``, ``manifest`` (``{wire name: 32-hex}`` as JSON text, or None
        when not verifying), ``tensors``, ``bytes``, ``buckets``, ``digest_s`` (seconds),
        ``mode``, ``refit_id``, ``error`` (``load`` errors and refused entries, or None).

    Raises:
        RefitConfigError: ``refit_verify_broadcast_init`` was not called on this worker (or the group
            was closed), or ``options`` is invalid.
        RefitAbortedError: the sender aborted the refit.
        RefitProtocolError: an unexpected message, or ``src`` is this worker's own group rank.
        RefitTimeoutError: a collective ran past the group's timeout or a peer dropped out.
    """
    from refit_verify.boundary.worker import SessionDigests
    from refit_verify.collective.broadcast import receive_broadcast
    from refit_verify.config import RefitConfig
    from refit_verify.errors import RefitConfigError

    state = getattr(self, _BCAST_ATTR, None)
    if state is None:
        raise RefitConfigError(f"refit_verify_broadcast_receive: worker rank {self.rank} is in no broadcast group; "
                               "call collective_rpc('refit_verify_broadcast_init', ...) first (concurrently with the "
                               "trainer's refit_verify.vllm_plugin.broadcast_group)")
    cfg = RefitConfig.from_options(options, source="refit_verify_broadcast_receive options")
    group = state["group"]
    wb = sessions.boundary_of(self)
    digests = SessionDigests(wb, "broadcast") if wb is not None else None
    with _on_device(state["device"]), _reload_session(self, digests) as load:
        res = receive_broadcast(group, src, load, cfg, device=state["device"], digests=digests)
    return {"rank": self.rank, "group_rank": group.rank(), "manifest": digest_map_text(res.manifest), "tensors": res.tensors,
            "bytes": res.bytes, "buckets": res.buckets, "digest_s": res.digest_s, "mode": res.mode.value,
            "refit_id": res.refit_id, "error": res.error}


def refit_verify_broadcast_close(self) -> dict[str, Any]:
    """Leave the broadcast group joined by ``refit_verify_broadcast_init`` (shuts it down here).

    Returns:
        dict: ``rank`` (vLLM rank) and ``closed`` (False when this worker was in no group).
    """
    state = self.__dict__.pop(_BCAST_ATTR, None)
    if state is None:
        return {"rank": self.rank, "closed": False}
    try:
        state["group"].shutdown()
    except Exception:  # noqa: BLE001 - the group is dropped either way
        logging.getLogger("refit_verify").exception("shutting down the broadcast group failed on worker rank %s", self.rank)
    return {"rank": self.rank, "closed": True}



@contextlib.contextmanager
def _reload_session(worker, digests=None, outcome: dict | None = None) -> Iterator[Callable[[list], None]]:
    """Yield ``load(batch)`` feeding ``model.load_weights`` inside vLLM's layerwise reload.

    The reload is started at the first ``load`` (a session opened by the transport's handshake
    indexes the model outside the reload, so what the session keeps on its index — snapshot set,
    read-back program, refit plan — survives from one refit to the next) and finalized after the
    body, also when the body raises (the engine stays usable for the next refit); an error while
    finalizing after a failure is logged and the original error raised. With ``digests`` (a :class:`~refit_verify.boundary.worker.SessionDigests`),
    the reload is finalized just before its session closes, so the layers vLLM processes at
    finalize are inside the session (coverage and read-back see them).

    Before finalize, a layer that cannot land whole gets its previous kernel tensors back
    (:func:`shims.restore_unfinished_layers`): a layer with a part refused before loading (verify
    before load), and after a failed refit every partly loaded layer, never a fused parameter half
    written with uninitialised rows. What was put back is recorded with the session and, when
    ``outcome`` is given, in ``outcome["kept"]`` (``{parameter: why}``).
    """
    model = runner.main_model(worker)
    start, finish = shims.layerwise_reload()
    started = [False]
    finished = [not start]
    wb = getattr(digests, "wb", None)

    def finalize(failed: bool = False) -> None:
        if finished[0]:
            return
        finished[0] = True
        if not started[0]:
            return  # nothing was loaded: the reload never started
        refused = wb.refused_names("model") if wb is not None else []
        if refused or failed:
            boundary = wb.modules.get("model") if wb is not None else None
            kept, withheld, attributed = shims.restore_unfinished_layers(
                model, refused, failed, boundary.delivered_name if boundary is not None else (lambda t: None))
            if wb is not None:
                wb.note_kept(kept, withheld, attributed)
            if outcome is not None:
                outcome.setdefault("kept", {}).update(kept)
            if kept:
                logging.getLogger("refit_verify").warning(
                    "refit-verify: %d parameters keep the previous version (%s): %s", len(kept),
                    "the refit failed" if failed and not refused else f"refused before loading: {', '.join(refused[:4])}",
                    ", ".join(list(kept)[:8]))
        finish(model, runner.model_config(worker))

    def load(batch):
        # Layerwise reload defers a layer's processing until all its weights arrived and keeps
        # references to what it was handed: give it owned copies, never views of a staging slot
        # that the sender refills after our Ack (the staged-slot reuse race) or of a broadcast
        # bucket that is freed and reused after the bucket. A clone per tensor: one block shared by
        # a buffer's tensors (tried, 797ed20) let one kept view pin the whole block and shared one
        # version counter, so a watched session's write check blamed untouched tensors.
        t0 = time.perf_counter()
        if start and not started[0]:
            start(model)  # at the first batch: the session (opened at the handshake) indexed the model outside the reload
            started[0] = True
        try:
            model.load_weights(owned_copies(batch) if start else batch)
        finally:
            if outcome is not None:
                outcome["load_s"] = outcome.get("load_s", 0.0) + time.perf_counter() - t0

    if digests is not None:
        digests.before_close = finalize
    failed = True
    try:
        yield load
        failed = False
    finally:
        try:
            finalize(failed)
        except Exception:
            if not failed:
                raise
            logging.getLogger("refit_verify").exception("finalizing the layerwise reload after a failed refit failed")


def _on_device(device):
    """``torch.cuda.device(device)`` for a CUDA device (NCCL's object collectives use the current
    device), else a no-op context."""
    import torch

    return torch.cuda.device(device) if device is not None and device.type == "cuda" else contextlib.nullcontext()
