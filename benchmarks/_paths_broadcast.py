"""The ``broadcast`` path of ``benchmarks/bench_paths.py``: refit-verify's verified broadcast over a
``torch.distributed`` group, from the bench child (the trainer) into an ``mp`` engine's worker.

Wired as ``tests/e2e/test_broadcast_path.py`` does, in one child:

* the group, once per child (at start-up, not per refit): the child joins as group rank 0 (the sender;
  ``refit_verify.vllm_plugin.broadcast_group``, it hosts the rendezvous) while a helper thread makes the
  engine's worker join as group rank 1 (``collective_rpc("refit_verify_broadcast_init", ...)``,
  ``rank_offset=1``); gloo on CPU (``GLOO_SOCKET_IFNAME=lo``, set by the parent for every process of
  the child). Both sides leave it at the child's end (``refit_verify_broadcast_close``, ``group.shutdown()``).
* per refit: a helper thread calls ``collective_rpc("refit_verify_broadcast_receive", args=(0,))``
  (the worker receives, loads through vLLM's layerwise reload, digests at its model boundary when
  its REFIT_VERIFY verifies) while the child's main thread runs ``BroadcastSender.send`` (one sender,
  reused across rounds: it keeps no state between refits but ``last_stats``). The sender's mode decides:
  ``RefitConfig(mode=<the child's mode>)``; buckets of ``--bucket-mib`` (``buffer_bytes`` = 2 x
  bucket: a bucket holds ``buffer_bytes // 2``). The refit is timed from the helper thread's start to
  both sides' return.
* CUDA: skipped. NCCL cannot put two ranks of one communicator on one GPU, and the bench runs the
  trainer and its engines on one GPU (tests/e2e/test_broadcast_path.py puts them on two).

The sender runs in the main thread so that ``--profile`` (cProfile, which before Python 3.12 sees only
the thread that enables it) sees it in the child's profile; the worker's side is in the worker's profile.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import traceback
from typing import Any

pc = time.perf_counter

CUDA_SKIP = "broadcast on CUDA needs the trainer and the engine on two GPUs; this bench runs them on one"
HOST = "127.0.0.1"


def prepare(bench: Any) -> None:
    """Before the engine starts: on CUDA, the skip; on CPU, gloo on the loopback for this process and the
    engine processes it starts (the parent sets it too; a value already there is kept)."""
    if bench.cuda:
        n = bench.torch.cuda.device_count()
        bench.skips["broadcast"] = f"{CUDA_SKIP} (NCCL cannot put two ranks of one communicator on one GPU; {n} visible)"
        return
    if bench.kind != "mp":
        bench.skips["broadcast"] = f"needs an `mp` engine (its worker in a process of its own), this child runs {bench.kind}"
        return
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class _Call:
    """One ``collective_rpc`` in a daemon thread; :meth:`result` waits a bounded time for it."""

    def __init__(self, llm: Any, method: str, name: str, bound_s: float, args: tuple = (), kwargs: dict | None = None) -> None:
        self.box: dict[str, Any] = {}
        self.timeout_s = bound_s

        def run() -> None:
            try:
                self.box["result"] = llm.collective_rpc(method, args=args, kwargs=kwargs, timeout=bound_s)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                self.box["error"] = e

        self.method = method
        self.thread = threading.Thread(target=run, name=name, daemon=True)
        self.thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the call (at most ``timeout_s``, default its own bound plus 30 s); True when it returned."""
        self.thread.join(self.timeout_s + 30.0 if timeout_s is None else timeout_s)
        return not self.thread.is_alive()

    def result(self) -> Any:
        if not self.join():
            raise TimeoutError(f"collective_rpc({self.method!r}) did not return within {self.timeout_s + 30.0:g} s")
        if "error" in self.box:
            raise self.box["error"]
        return self.box["result"]


class BroadcastPath:
    """The group, the reused sender, and one refit per :meth:`run` (see the module docstring)."""

    def __init__(self, bench: Any) -> None:
        from refit_verify import RefitConfig
        from refit_verify.collective.broadcast import BroadcastSender
        from refit_verify.vllm_plugin import broadcast_group

        self.bench, self.llm = bench, bench.llm
        # every collective (and the join) is bounded by the group's timeout: under the parent's bound on a
        # refit (--timeout-s), so that a stalled collective is reported by this child before the parent kills it
        self.timeout_s = max(5.0, 0.8 * bench.a.timeout_s)
        self.buffer_bytes = 2 * bench.a.bucket_bytes  # a bucket holds buffer_bytes // 2 (BroadcastSender)
        port = _free_port()
        join = _Call(self.llm, "refit_verify_broadcast_init", "bench-broadcast-init", self.timeout_s, (HOST, port, 2),
                     {"rank_offset": 1, "backend": "gloo", "timeout_s": self.timeout_s})
        self.group = None
        try:
            self.group = broadcast_group(HOST, port, 0, 2, backend="gloo", timeout_s=self.timeout_s)
            (init,) = join.result()
        except BaseException:
            if self.group is not None:
                self.group.shutdown()
            raise
        want = {"rank": 0, "group_rank": 1, "world_size": 2, "backend": "gloo"}
        if init != want or (self.group.rank(), self.group.size()) != (0, 2):
            self.close()
            raise RuntimeError(f"broadcast group: worker joined as {init}, the child as rank {self.group.rank()} of "
                               f"{self.group.size()}; expected the worker {want}, the child rank 0 of 2")
        self.sender = BroadcastSender(group=self.group, src=0, device="cpu",
                                      config=RefitConfig.build(mode=bench.mode, buffer_bytes=self.buffer_bytes))

    def info(self) -> dict[str, str]:
        return {"broadcast": f"gloo over the loopback, the child = group rank 0 (sender), the engine's worker = rank 1; buckets "
                             f"of {self.buffer_bytes // 2} bytes; group timeout {self.timeout_s:g} s"}

    def run(self, off: bool) -> tuple[float, dict[str, float], dict[str, int]]:
        b = self.bench
        t0 = pc()
        recv = _Call(self.llm, "refit_verify_broadcast_receive", "bench-broadcast-receive", self.timeout_s, (0,))
        s0 = pc()
        try:
            reports = self.sender.send(b.items)
        except BaseException as e:
            recv.join(self.timeout_s)  # the worker's view, if it has one soon (the sender's error is the one raised)
            if "error" in recv.box:
                raise e from recv.box["error"]
            raise
        s1 = pc()
        (w,) = recv.result()
        b._sync()
        wall = pc() - t0
        b._grab_timers()
        st = dict(self.sender.last_stats or {})
        problems = []
        if st.get("refit_id") != w["refit_id"] or st.get("receivers") != 1:
            problems.append(f"sender stats {st} do not match the worker's refit {w['refit_id']}")
        if (w["mode"], w["tensors"], w["group_rank"], w["error"]) != (b.mode, len(b.items), 1, None):
            problems.append(f"worker: mode {w['mode']}, {w['tensors']} tensors, group rank {w['group_rank']}, error {w['error']!r} "
                            f"(expected {b.mode}, {len(b.items)}, 1, None)")
        if problems:
            raise RuntimeError("broadcast refit: " + "; ".join(problems))
        send_s, sender_wall = s1 - s0, st.get("wall_s", 0.0)
        ph = {"b.wall": sender_wall, "b.digest": st.get("digest_s", 0.0), "b.shadow": st.get("digest_shadow_s", 0.0),
              "b.crit": st.get("digest_s", 0.0) - st.get("digest_shadow_s", 0.0), "b.verdict": send_s - sender_wall,
              "b.wdigest": float(w["digest_s"]), "b.rest": wall - send_s}
        counts = {"buckets": int(st.get("buckets", 0)), "tensors": int(st.get("tensors", 0))}
        if off:
            if reports is not None:
                raise RuntimeError(f"broadcast refit in off returned reports {reports!r}")
            return wall, ph, counts
        from refit_verify.manifest import from_wire

        if not reports or set(reports) != {1} or not reports[1].ok:
            raise RuntimeError(f"broadcast refit in {b.mode} gave reports {reports!r}")
        counts["verified"] = reports[1].verified
        (m,) = self.llm.collective_rpc("refit_verify_session_manifest")
        man = from_wire(m["manifest"]) if m.get("manifest") else None
        if man is None or man.session != w["refit_id"] or man.opened_by != "broadcast":
            raise RuntimeError(f"the worker's last session is not this broadcast refit's ({w['refit_id']}): "
                               f"{None if man is None else (man.session, man.opened_by)}")
        b._worker_phases(man, ph, counts)
        return wall, ph, counts

    def close(self) -> None:
        """Both sides leave the group (the worker first: its shutdown is local, as the child's)."""
        if self.group is None:
            return
        try:
            self.llm.collective_rpc("refit_verify_broadcast_close", timeout=60)
        except Exception:  # noqa: BLE001 - the engine may be gone; this side still leaves
            traceback.print_exc()
        finally:
            self.group.shutdown()
            self.group = None
