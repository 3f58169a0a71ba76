"""vLLM worker extension of a profiled ``bench_paths`` run (``--profile DIR``, ``mp`` engines).

Also loaded into an ``mp`` engine's worker by ``--timers`` and ``--landed-cpu`` (which it applies there:
landed digests on the CPU, as on CUDA workers).

An ``mp`` engine's worker runs in a process of its own, where the child's cProfile cannot see: the
child starts such an engine with ``worker_extension_cls="benchmarks._paths_ext.WorkerProfile"`` and,
around every counted refit, calls ``collective_rpc("bench_profile", args=("start",))`` / ``("stop",)``;
at the end ``("write", FILE)``. The profile then holds the worker's side of those refits (its main
thread: where vLLM runs every ``collective_rpc``, including ``refit_verify_receive`` and vLLM's own
``update_weights``). The start and stop calls themselves are outside the child's timed region.
"""

from __future__ import annotations

import os
from typing import Any

if os.environ.get("REFIT_BENCH_LANDED_CPU") == "1":  # bench_paths --landed-cpu: the worker process too, as on CUDA
    from refit_verify.boundary import placement

    placement.DERIVE_DEVICE_TYPES = frozenset({*placement.DERIVE_DEVICE_TYPES, "cpu"})


class WorkerProfile:
    """Mixed into vLLM's worker by ``worker_extension_cls``; one method, reached through ``collective_rpc``."""

    def bench_profile(self, op: str, out: str = "") -> Any:
        """``op``: ``"start"`` / ``"stop"`` (enable / disable cProfile in this thread), ``"write"`` (stats to
        ``out``): returns how many profiled spans so far; ``"timers"``: wrap :data:`TIMED_WORKER` in
        timers (returns how many were not found), ``"read"``: their ``{path: [seconds, calls]}`` since
        the last read."""
        import cProfile
        import io
        import pstats

        st = self.__dict__.setdefault("_bench_profile", {"prof": cProfile.Profile(), "spans": 0})
        if op == "start":
            st["prof"].enable()
            st["spans"] += 1
        elif op == "stop":
            st["prof"].disable()
        elif op == "timers":  # --timers: out is unused; returns how many targets this process lacks
            return len(install_timers(TIMED_WORKER))
        elif op == "read":
            return read_timers()
        elif op == "write":
            buf = io.StringIO()
            buf.write(f"===== worker process: {st['spans']} profiled refits =====\n")
            st["prof"].create_stats()
            if not st["prof"].stats:  # pstats refuses an empty profile
                buf.write("no calls were profiled\n")
                with open(out, "w") as f:
                    f.write(buf.getvalue())
                return st["spans"]
            s = pstats.Stats(st["prof"], stream=buf)
            s.sort_stats("tottime").print_stats(50)
            s.sort_stats("cumulative").print_stats(80)
            s.sort_stats("cumulative").print_stats("refit_verify", 120)  # our own functions, however small
            s.sort_stats("tottime").print_stats("refit_verify", 60)
            with open(out, "w") as f:
                f.write(buf.getvalue())
        else:
            raise ValueError(f"bench_profile: unknown op {op!r}")
        return st["spans"]


# ---------------------------------------------------------------------------------------- --timers

TIMED_WORKER = (
    # the worker's side of our transport
    "refit_verify.transport.receiver:RefitReceiver.receive",
    "refit_verify.transport.receiver:RefitReceiver._recv",
    "refit_verify.transport.receiver:RefitReceiver._handle_buffer",
    "refit_verify.transport.receiver:RefitReceiver._reply",
    "refit_verify.transport.staging:open_handle",
    "refit_verify.transport.staging:release",
    "refit_verify.stream.unpack:ReceiveState.deliver",
    "refit_verify.stream.unpack:ReceiveState.finish",
    # the worker's side of the broadcast path (the module's own names: what its code calls)
    "refit_verify.collective.broadcast:BroadcastReceiver.receive",
    "refit_verify.collective.broadcast:BroadcastReceiver._receive_loop",
    "refit_verify.collective.broadcast:broadcast_message",
    "refit_verify.collective.broadcast:gather_messages",
    "refit_verify.collective.broadcast:_collective",  # every collective, its wait for the peer included
    # the model boundary and the session
    "refit_verify.boundary.model:ModelBoundary._check_first~",
    "refit_verify.boundary.model:ModelBoundary._replayed",
    "refit_verify.boundary.model:replay_call",
    "refit_verify.boundary.worker:WorkerBoundary.open",
    "refit_verify.boundary.worker:WorkerBoundary.close~",  # "~": a Python loop timed apart first (is the worker slowed in the refit?)
    "refit_verify.boundary.worker:WorkerBoundary.snapshot",
    "refit_verify.boundary.worker:SessionDigests.finish",
    "refit_verify.boundary.record:ModuleSession.landed_now",
    "refit_verify.boundary.worker:SessionDigests.begin",
    "refit_verify.boundary.worker:WorkerBoundary.outcome",
    "refit_verify.stream.unpack:ReceiveState.start",
    "refit_verify.vllm_plugin.worker_methods:owned_copies",  # the layerwise reload's copies of a buffer's slots
    "refit_verify.boundary.model:ModelBoundary.learn",
    "refit_verify.engine.readback:_kept_program",
    # kept sets: digest_now as its users call it, how often a kept set was found, adds of the general path
    "refit_verify.boundary.model:digest_now!",  # "!": the GPU work queued before it, waited for apart (row "… backlog")
    "refit_verify.boundary.record:digest_now",
    "refit_verify.digest.kept:_kept_held?",
    "refit_verify.digest.incremental:HeldBatch.add",
    # inside the digests and the close: where a call's milliseconds go
    "refit_verify.digest.incremental:HeldBatch.hexdigests",
    "refit_verify.digest.incremental:HeldBatch._launch_general",
    "refit_verify.digest.kept:_keep_held",
    "refit_verify.digest.incremental:_columns_or_none",  # a flush's (or digest_now's) signatures, column by column
    "refit_verify.digest.batch:DigestBatch.add",
    "refit_verify.digest.batch:DigestBatch.launch",
    "refit_verify.digest.batch:DigestBatch.hexdigests",
    "refit_verify.digest.kept:DigestSet.__init__",
    "refit_verify.digest.kept:DigestSet.launch",
    "refit_verify.digest.kept:DigestSet.collect",
    "refit_verify.digest.kernels.direct:run",  # a CUDA plan's launches (JIT or straight to its compiled kernels)
    "refit_verify.digest.kernels.direct:jit",  # those that went through Triton's JIT dispatch
    "refit_verify.digest.kernels.launch:_device_plan",  # a plan built and sent to the device (a pinned block), or found
    "refit_verify.digest.kernels.launch:_run",  # a plan's launches, scratch allocated
    "refit_verify.digest.kernels.launch:digest_views",
    "refit_verify.digest.kernels.launch:to_hex",
    "refit_verify.digest.batch:_hexes",  # a device's words to hex: the device-to-host copy (its wait) and the formatting
    "refit_verify.engine.state:_kept_set",
    "refit_verify.engine.state:_snapshot_launch",
    "refit_verify.engine.state:_snapshot_collect",
    "refit_verify.engine.readback:_evaluate",
    "refit_verify.engine.readback:read_back",
    # the CPU's proof of repacked linear weights through their layers' forward
    "refit_verify.engine.forward:settle",
    "refit_verify.engine.readback:read_now",  # settle's read-back of the weight just loaded
    "refit_verify.engine.readback:_program",
    "refit_verify.engine.forward:finite",
    "refit_verify.engine.forward:prove",
    "refit_verify.engine.forward:rebuild",
    "refit_verify.engine.forward:_identity_block",
    "refit_verify.engine.forward:_digests",
    "refit_verify.boundary.worker:WorkerBoundary._refresh_indexes",
    "refit_verify.boundary.model:ModelBoundary.index",  # the close checks the index inside snapshot(refresh=True)
    "refit_verify.boundary.worker:WorkerBoundary._audit_unwritten",
    "refit_verify.boundary.model:ModelBoundary.manifest",
    "refit_verify.boundary.model:ModelBoundary.end",
    # vLLM's own
    "vllm.model_executor.models.utils:AutoWeightsLoader.load_weights",
    "vllm.model_executor.model_loader.reload:initialize_layerwise_reload",
    "vllm.model_executor.model_loader.reload:finalize_layerwise_reload",
    "vllm.model_executor.model_loader.reload.layerwise:_layerwise_process",  # a layer complete: materialise, load, copy back
    "vllm.model_executor.model_loader.reload.layerwise:get_numel_loaded",  # each buffered loader call, under a dispatch mode
    "vllm.model_executor.model_loader.reload.layerwise:materialize_layer",
    "vllm.model_executor.model_loader.reload.layerwise:_copy_and_restore_kernel_tensors",
    "refit_verify.boundary.placement:LoaderTap._call",  # every weight_loader call through the tap (a pass-through when off)
    "vllm.distributed.weight_transfer.ipc_engine:IPCWeightTransferEngine.receive_weights",
    # the native worker's RPCs
    "refit_verify.vllm_plugin.native_worker:refit_verify_native_manifest",
)
"""``module:attribute path`` of each function timed in an ``mp`` engine's worker process (``--timers``)."""

TIMED_TRAINER = (
    "refit_verify.transport.sender:RefitSender._send_refit",
    "refit_verify.transport.sender:RefitSender._take_reply",
    "refit_verify.transport.sender:RefitSender._verdict",
    "refit_verify.transport.sender:RefitSender._post^",
    "refit_verify.stream.pack:Packer.digest_first",
    "refit_verify.stream.pack:Packer.add_all",
    "refit_verify.collective.broadcast:BroadcastSender.send",
    "refit_verify.collective.broadcast:BroadcastSender._verdict",
    "refit_verify.collective.broadcast:_BroadcastSend._post",
    "refit_verify.collective.broadcast:broadcast_message",
    "refit_verify.collective.broadcast:gather_messages",
    "refit_verify.collective.broadcast:_collective",  # every collective, its wait for the peers included
    "refit_verify.vllm_plugin.native_sender:NativeSendVerifier.fetch",
    "refit_verify.vllm_plugin.native_sender:NativeSendVerifier._compare~",
    "refit_verify.vllm_plugin.native_sender:NativeSendVerifier.add",
    "refit_verify.trainer.channel:WorkerChannel.call",
    "refit_verify.stream.pack:digest_now!",
    "refit_verify.digest.kept:_kept_held?",
    "refit_verify.digest.incremental:_columns_or_none",  # a flush's (or digest_now's) signatures, column by column
    "refit_verify.digest.kept:DigestSet.launch",
    "refit_verify.digest.kept:DigestSet.collect",
    "refit_verify.digest.kernels.direct:run",
    "refit_verify.digest.kernels.direct:jit",
    "refit_verify.digest.kernels.launch:_device_plan",
    "refit_verify.digest.kernels.launch:_run",
    "refit_verify.digest.batch:DigestBatch._launch_copies",  # the sender's fused copies into staging
    "refit_verify.digest.batch:DigestBatch.hexdigests",
    "refit_verify.stream.pack:Packer.flush",
    "refit_verify.digest.kernels.launch:to_hex",
    "refit_verify.digest.batch:_hexes",
    "refit_verify.digest.incremental:HeldBatch.add",
    "refit_verify.trainer.refit:compare_session",
    "refit_verify.vllm_plugin.native_sender:NativeSendVerifier._sent",
    "refit_verify.vllm_plugin.native_sender:from_wire",
    "refit_verify.vllm_plugin.native_sender:act_on_all",
    "refit_verify.vllm_plugin.native_sender:NativeSendVerifier.shadow_work",
)
"""The same in the trainer (the bench child; our transport's sender runs in ``push``'s thread)."""

_TIMES: dict[str, list[float]] = {}


def install_timers(targets) -> list[str]:
    """Wrap each ``module:attr.path`` target in a wall-clock timer (inclusive seconds and calls, every
    thread, a recursive call counted once; about 1 µs a call); returns the targets that were not found
    (this vLLM, this process). A target ending in ``?`` also counts the calls that returned something
    (row ``path?``); one ending in ``!`` first waits for the GPU work queued on the current CUDA stream
    and times that wait apart (row ``path backlog``): what the call would otherwise have waited for at
    its read, queued before it (a diagnostic: the wait moves, it does not go away); one ending in ``~``
    first runs the calibration's Python loop and times it apart (row ``calibration: … before path``):
    compared with the same loop at the read, whether the process runs Python slower inside the refit; one
    ending in ``^`` sleeps ``BENCH_PAUSE_AFTER_MS`` after each call when that is set (row ``pause after
    path``): the sender's pause after posting a buffer, before it packs the next one, tells whether its
    packing slows the receiver's check of the buffer just posted (the two processes share the GPU)."""
    import functools
    import importlib
    import time

    pc = time.perf_counter
    missing = []
    for target in targets:
        hits, backlog, calib, pause = target.endswith("?"), target.endswith("!"), target.endswith("~"), target.endswith("^")
        mod_name, _, path = target.rstrip("?!~^").partition(":")
        try:
            owner = importlib.import_module(mod_name)
            *parents, name = path.split(".")
            for p in parents:
                owner = getattr(owner, p)
            raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        except (ImportError, AttributeError, KeyError):
            missing.append(target)
            continue
        if getattr(raw, "__bench_timed__", False):
            continue
        kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
        fn = raw.__func__ if kind is not None else raw
        acc = _TIMES.setdefault(path, [0.0, 0, 0])  # seconds, calls, depth (a recursive call is timed once, outermost)
        hit = _TIMES.setdefault(path + "?", [0.0, 0, 0]) if hits else None  # calls that returned something
        wait = _TIMES.setdefault(path + " backlog", [0.0, 0, 0]) if backlog else None  # queued GPU work waited for first
        # the same Python loop as the read's calibration, run (and timed apart) before each call: inside a refit
        cal = _TIMES.setdefault(f"calibration: {_CAL_STEPS:,} Python loop steps before {path}", [0.0, 0, 0]) if calib else None
        pause_s = float(os.environ.get("BENCH_PAUSE_AFTER_MS", "0") or 0) / 1000 if pause else 0.0
        slept = _TIMES.setdefault(f"pause after {path} (BENCH_PAUSE_AFTER_MS)", [0.0, 0, 0]) if pause_s > 0 else None

        def timed(*args, _fn=fn, _acc=acc, _hit=hit, _wait=wait, _cal=cal, _slept=slept, _pause=pause_s, **kwargs):
            if _acc[2]:
                return _fn(*args, **kwargs)
            _acc[2] += 1
            if _wait is not None:
                _sync_backlog(_wait)
            if _cal is not None:
                _cal[0] += _loop(_CAL_STEPS)
                _cal[1] += _CAL_STEPS
            t0 = pc()
            try:
                out = _fn(*args, **kwargs)
                if _hit is not None and out is not None:
                    _hit[1] += 1
                return out
            finally:
                _acc[0] += pc() - t0
                _acc[1] += 1
                _acc[2] -= 1
                if _slept is not None:  # after the call, outside its time: what the caller does next starts later
                    t1 = pc()
                    time.sleep(_pause)
                    _slept[0] += pc() - t1
                    _slept[1] += 1

        functools.update_wrapper(timed, fn)
        timed.__bench_timed__ = True
        setattr(owner, name, kind(timed) if kind is not None else timed)
    _time_gc()
    return missing


_CAL_STEPS = 10_000


def _loop(n: int) -> float:
    """Seconds of ``n`` steps of a Python loop (the calibration rows)."""
    import time

    t0 = time.perf_counter()
    k = 0
    for i in range(n):
        k += i
    return time.perf_counter() - t0


def _sync_backlog(acc: list) -> None:
    """Wait for the current CUDA stream's queued work (when CUDA is initialised here); add the wait to ``acc``."""
    import sys
    import time

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    t0 = time.perf_counter()
    torch.cuda.current_stream().synchronize()
    acc[0] += time.perf_counter() - t0
    acc[1] += 1


def _time_gc() -> None:
    """Time Python's cyclic garbage collector in this process as two more rows (``gc.callbacks``):
    every collection, and those of generation 2 (the whole heap: the costly ones in an engine's
    process). Once per process."""
    import gc
    import time

    if "gc: every collection" in _TIMES:
        return
    every, full = _TIMES.setdefault("gc: every collection", [0.0, 0, 0]), _TIMES.setdefault("gc: generation 2", [0.0, 0, 0])
    started = [0.0]

    def cb(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
            return
        dt = time.perf_counter() - started[0]
        every[0] += dt
        every[1] += 1
        if info.get("generation") == 2:
            full[0] += dt
            full[1] += 1

    gc.callbacks.append(cb)


_ALLOC_STATS = (("num_device_alloc", "cudaMalloc calls"), ("num_device_free", "cudaFree calls"),
                ("num_alloc_retries", "allocation retries (cache freed, synchronising)"),
                ("num_sync_all_streams", "synchronisations of every stream"))
_HOST_STATS = (("num_host_alloc", "pinned host allocations (cudaHostAlloc)"), ("num_host_free", "pinned host frees"))
_ALLOC_LAST: dict[str, int] = {}


def _allocator_counts() -> dict[str, list[float]]:
    """CUDA caching allocator counters of this process since the last read, as ``{"cuda: <what> (count)":
    [0.0, n]}`` rows of the timers table (no time: the calls column is the count). A refit that makes the
    allocator go to the device (``cudaMalloc`` / ``cudaFree``, a retry that empties the cache) pays
    synchronisations no timer of refit-verify or vLLM names; off and enforce side by side show whether an
    enforce engine's extra memory sends vLLM's own allocations there; with the memory the process holds
    (allocated, reserved) at the read. Empty without an initialised CUDA."""
    import contextlib
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    now: dict[str, int] = {}
    try:
        dev = torch.cuda.memory_stats()
        now.update({label: int(dev.get(key, 0)) for key, label in _ALLOC_STATS})
        host = torch.cuda.host_memory_stats()
        now.update({label: int(host.get(key, 0)) for key, label in _HOST_STATS})
    except (RuntimeError, AttributeError):  # an older torch without host stats: what was read
        pass
    out = {f"cuda: {label} (count)": [0.0, n - _ALLOC_LAST.get(label, n)] for label, n in now.items()}
    _ALLOC_LAST.update(now)
    out = {k: v for k, v in out.items() if v[1]}
    with contextlib.suppress(RuntimeError):  # what the process holds at the read (levels, not deltas), in MiB
        out["cuda: memory allocated at the read (MiB)"] = [0.0, torch.cuda.memory_allocated() >> 20]
        out["cuda: memory reserved at the read (MiB)"] = [0.0, torch.cuda.memory_reserved() >> 20]
        out["cuda: device memory free at the read (MiB)"] = [0.0, torch.cuda.mem_get_info()[0] >> 20]
    return out


def _calibration() -> dict[str, list[float]]:
    """How fast this process runs Python and torch's tensor-method calls at the read (outside any refit): the
    seconds of :data:`_CAL_STEPS` steps of a Python loop and of 3,000 ``stride()`` / ``untyped_storage()`` calls on one tensor
    (a CUDA one when CUDA is initialised here), as rows of the table (``calls`` = the count): the same work timed in
    the trainer and in the worker process tells whether the worker runs the same code slower."""
    import sys
    import time

    pc = time.perf_counter
    out = {f"calibration: {_CAL_STEPS:,} Python loop steps at the read": [_loop(_CAL_STEPS), _CAL_STEPS]}
    torch = sys.modules.get("torch")
    if torch is None:
        return out
    dev = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "cpu"
    t = torch.empty(64, 26, device=dev)
    stride, storage = t.stride, t.untyped_storage
    t0 = pc()
    for _ in range(3000):
        stride()
    out[f"calibration: 3,000 {dev} tensor stride() calls"] = [pc() - t0, 3000]
    t0 = pc()
    for _ in range(3000):
        storage()
    out[f"calibration: 3,000 {dev} tensor untyped_storage() calls"] = [pc() - t0, 3000]
    return out


_RUSAGE = (("ru_minflt", "minor page faults"), ("ru_majflt", "major page faults"),
           ("ru_nvcsw", "voluntary context switches"), ("ru_nivcsw", "involuntary context switches"))
_RUSAGE_LAST: dict[str, int] = {}


def _rusage_counts() -> dict[str, list[float]]:
    """This process's page faults and context switches since the last read (``getrusage``), as
    ``{"process: <what> (count)": [0.0, n]}`` rows: memory a refit touches for the first time shows as
    minor faults; a process that waits or is preempted, as switches. The first read records only."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    now = {label: int(getattr(ru, key)) for key, label in _RUSAGE}
    out = {f"process: {label} (count)": [0.0, n - _RUSAGE_LAST[label]] for label, n in now.items() if label in _RUSAGE_LAST}
    _RUSAGE_LAST.update(now)
    return out


def read_timers() -> dict[str, list[float]]:
    """``{attr path: [seconds, calls]}`` since the last read (then reset), with the CUDA allocator's
    counters since then (:func:`_allocator_counts`), this process's page faults and context switches
    (:func:`_rusage_counts`), the calibration (:func:`_calibration`) and the threads alive."""
    out = {k: v[:2] for k, v in _TIMES.items() if v[1]}
    for v in _TIMES.values():
        v[0], v[1] = 0.0, 0
    out.update(_rusage_counts())
    import gc  # objects the collector leaves alone (gc.freeze: vLLM's freeze of a worker's startup heap)
    out["gc: frozen objects at the read (count)"] = [0.0, gc.get_freeze_count()]
    out.update(_allocator_counts())
    out.update(_calibration())
    import threading  # other Python threads of the process contend for the GIL at every call that releases it
    out["python: threads alive at the read (count)"] = [0.0, threading.active_count()]
    for t in threading.enumerate():  # which: a thread that polls takes the GIL from the refit's host work
        out[f"python: thread {t.name[:40]} (count)"] = [0.0, 1]
    return out
