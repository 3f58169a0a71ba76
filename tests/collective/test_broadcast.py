"""The verified torch.distributed broadcast path (``refit_verify.collective.broadcast``) on three gloo CPU
processes over loopback: rank 0 sends, ranks 1 and 2 receive.

One module fixture spawns the processes once and runs every scenario in order on the same group
(clean ``enforce`` refit, a byte flipped on one receiving rank under ``enforce`` and under ``log``,
``off``, a ``load`` error, a sender abort, a timeout); each rank pickles what it saw and the tests
below check it. ``tests/gpu/test_two_gpu.py`` reuses :func:`run_scenarios` over NCCL.

Faults are injected by a test-only receiver subclass (:class:`FlipReceiver`) that alters a
received view in the ``_received`` hook, after the bytes arrived and before they are digested and
loaded: the transfer itself "corrupted" them.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from datetime import timedelta

import pytest
import torch

from tests.support.dist_utils import init_rank, rank_result, spawn_ranks

from refit_verify import RefitConfig, RefitVerificationError, verdicts
from refit_verify.collective.broadcast import AFTER_LOAD_UNCHECKED, BroadcastReceiver, BroadcastSender, BroadcastVerificationError
from refit_verify.errors import RefitAbortedError, RefitProtocolError, RefitTimeoutError
from refit_verify.stream.pack import Packer

WORLD = 3
SRC = 0
BUFFER = 1 << 20  # buckets of 512 KiB: several buckets and one oversized tensor


def named_tensors(device: torch.device | str = "cpu") -> list[tuple[str, torch.Tensor]]:
    """A small model-like set: several dtypes, a strided view, 0-dim, 0-element, an oversized tensor."""
    g = torch.Generator().manual_seed(1234)
    out = [
        ("model.embed_tokens.weight", torch.randn(300, 64, generator=g).to(torch.bfloat16)),
        ("model.layers.0.mlp.w_int8", torch.randint(-128, 128, (1000, 33), generator=g).to(torch.int8)),
        ("model.layers.0.attn.o_proj.weight", torch.randn(40, 30, generator=g).t()),  # non-contiguous
        ("model.layers.0.scale", torch.tensor(3.5)),
        ("model.layers.0.empty", torch.zeros(0, 4)),
        ("model.layers.0.mask", torch.randint(0, 2, (17,), generator=g).bool()),
        ("model.layers.0.rotary", torch.randn(5, 2, generator=g).contiguous().view(torch.complex64).reshape(5)),
        ("lm_head.weight", torch.randn(600, 1024, generator=g).to(torch.bfloat16)),  # 1.2 MiB: oversized
        ("model.norm.weight", torch.randn(64, generator=g).to(torch.float16)),
    ]
    return [(n, t.to(device)) for n, t in out]


class FlipReceiver(BroadcastReceiver):
    """Test-only receiver: flips bit 0 of the first byte of ``flip`` as it arrives."""

    def __init__(self, *args, flip: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flip = flip

    def _received(self, batch) -> None:
        for name, v in batch:
            if name == self.flip:
                flat = v.reshape(-1)
                if flat.dtype.is_complex:
                    flat = torch.view_as_real(flat).reshape(-1)
                flat.view(torch.uint8)[0] ^= 1


class LateWriteSender(BroadcastSender):
    """Test-only sender: when its second bucket goes out, writes into a trainer tensor that a later
    bucket carries (the sender digested the first bucket's tensors before it and every other one
    right after it went: the write comes after that tensor's digest and before it is packed)."""

    def __init__(self, *args, late: torch.Tensor, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.late, self.sent = late, 0

    def _sending(self, entries, data) -> None:
        self.sent += 1
        if self.sent == 2:
            self.late.add_(1)


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def _err(e: BaseException) -> dict:
    d = {"type": type(e).__name__, "message": str(e), "is_verification": isinstance(e, RefitVerificationError)}
    if isinstance(e, BroadcastVerificationError):
        d.update(failed=e.failed_ranks, clean=e.clean_ranks,
                 per_rank={r: {"ok": rep.ok, "mismatched": list(rep.mismatched), "verified": rep.verified, "rank": rep.rank}
                           for r, rep in e.reports.items()},
                 affected=e.affected)
    if getattr(e, "reports", None) is not None and not isinstance(e, BroadcastVerificationError):
        d["reports_ok"] = {r: rep.ok for r, rep in e.reports.items()}
    return d


def _reports(reps) -> dict | None:
    if reps is None:
        return None
    return {r: {"ok": rep.ok, "mismatched": list(rep.mismatched), "missing": list(rep.missing), "verified": rep.verified,
                "rank": rep.rank, "unchecked": list(rep.unchecked), "text": rep.describe()} for r, rep in reps.items()}


def run_scenarios(rank: int, world: int, device: torch.device, fault_rank: int, timeout_group: bool = True) -> dict:
    """Run every scenario on this rank (rank 0 sends); return what this rank saw."""
    import torch.distributed as dist

    cap = _Capture()
    logging.getLogger("refit_verify").addHandler(cap)
    tensors = named_tensors(device)
    want = {n: t.cpu().clone() for n, t in tensors}
    out: dict = {}

    def cfg(mode: str) -> RefitConfig:
        return RefitConfig(mode=mode, buffer_bytes=BUFFER)

    def step(key: str, mode: str, *, flip: dict[int, str] | None = None, load_error: dict[int, str] | None = None,
             items=None, label: int | None = None, late: str | None = None, count_left: bool = False) -> None:
        cap.records.clear()
        if rank == SRC:
            failed_before = len(verdicts._FAILED)
            if count_left:  # what the send leaves to the cyclic collector: counted with the collector off
                gc.collect()
                gc.disable()
            try:
                if late is not None:  # a copy of the list, one tensor of it written while the refit is sent
                    items = [(n, t.clone()) for n, t in tensors]
                    sender = LateWriteSender(group=None, src=SRC, config=cfg(mode), late=dict(items)[late])
                else:
                    sender = BroadcastSender(group=None, src=SRC, config=cfg(mode))
                fuses = Packer._fuses
                if late is not None:  # the digest-ahead path (tensors the fused copy+digest does not take)
                    Packer._fuses = lambda self, t, aligned: False
                try:
                    res = sender.send(items if items is not None else tensors)
                finally:
                    Packer._fuses = fuses
                out[key] = {"reports": _reports(res)}
                if count_left:
                    out[key]["sends_left"] = sum(type(o).__name__ == "_BroadcastSend" for o in gc.get_objects())
            except Exception as e:  # noqa: BLE001
                out[key] = {"error": _err(e)}
            finally:
                if count_left:
                    gc.enable()
            out[key]["logs"] = list(cap.records)
            out[key]["failed_recorded"] = len(verdicts._FAILED) - failed_before  # this trainer's verdicts (audits read them)
            return
        loaded: dict[str, torch.Tensor] = {}
        bad = (load_error or {}).get(rank)

        def load(batch) -> None:
            for name, v in batch:
                if name == bad:
                    raise RuntimeError(f"load failed for {name}")
                loaded[name] = v.detach().cpu().clone()

        # Receivers are configured "off" on purpose: they follow the sender's mode.
        recv = FlipReceiver(group=None, src=SRC, config=RefitConfig(mode="off"), flip=(flip or {}).get(rank), rank=label)
        try:
            r = recv.receive(load)
            out[key] = {"ok": r.ok, "mode": r.mode.value, "manifest": None if r.manifest is None else len(r.manifest),
                        "error": r.error, "rank": r.rank, "tensors": r.tensors, "buckets": r.buckets,
                        "loaded": sorted(loaded),
                        "equal": {n: bool(torch.equal(loaded[n].reshape(-1).view(torch.uint8) if loaded[n].numel() else loaded[n],
                                                      want[n].contiguous().reshape(-1).view(torch.uint8) if want[n].numel() else want[n]))
                                  for n in loaded}}
        except Exception as e:  # noqa: BLE001
            out[key] = {"error": _err(e)}

    others = [r for r in range(1, world) if r != fault_rank]
    step("clean_enforce", "enforce", count_left=True)
    step("fault_enforce", "enforce", flip={fault_rank: "model.layers.0.mlp.w_int8"})
    step("fault_log", "log", flip={fault_rank: "model.embed_tokens.weight"})
    step("fault_oversized", "enforce", flip={fault_rank: "lm_head.weight"})
    step("off", "off", flip={fault_rank: "model.norm.weight"})
    step("load_error", "enforce", load_error={fault_rank: "model.norm.weight"})

    def bad_items():
        yield from tensors[:3]
        yield ("not_a_tensor", [1, 2, 3])

    step("abort", "enforce", items=bad_items() if rank == SRC else None)
    step("after_abort", "enforce")  # the group is still usable
    step("late_write", "enforce", late="model.norm.weight")  # digested after the first bucket, written before it is packed
    out["others"] = others
    if others:  # a load error on one rank and a mismatch on another: both reach the sender's error
        step("load_error_and_fault", "enforce", load_error={others[0]: "model.norm.weight"},
             flip={fault_rank: "model.layers.0.mlp.w_int8"})
        step("shared_labels", "enforce", flip={fault_rank: "model.layers.0.mlp.w_int8"}, label=0)
        step("after_shared_labels", "enforce")
    try:  # no collective runs: every rank raises on its own
        if rank == SRC:
            BroadcastSender(group=None, src=world, config=cfg("enforce")).send(tensors)
        else:
            BroadcastReceiver(group=None, src=world).receive(lambda b: None)
        out["src_out_of_range"] = {"error": None}
    except Exception as e:  # noqa: BLE001
        out["src_out_of_range"] = {"error": _err(e)}

    if timeout_group and world >= 3:
        # membership: rank 2 is not in `pair`; a group of one holds no receiver
        pair, alone = dist.new_group([SRC, 1]), dist.new_group([SRC])
        try:
            if rank == 2:
                BroadcastReceiver(group=pair, src=SRC).receive(lambda b: None)
            elif rank == SRC:
                BroadcastSender(group=alone, src=SRC, config=cfg("enforce")).send(tensors)
            out["membership"] = {"error": None}
        except Exception as e:  # noqa: BLE001
            out["membership"] = {"error": _err(e)}
    if timeout_group:
        # A receiver whose sender never sends: the subgroup's 2 s timeout bounds the wait.
        sub = dist.new_group([SRC, fault_rank], timeout=timedelta(seconds=2))
        if rank == fault_rank:
            t0 = time.monotonic()
            try:
                BroadcastReceiver(group=sub, src=SRC).receive(lambda b: None)
                out["timeout"] = {"error": None}
            except Exception as e:  # noqa: BLE001
                out["timeout"] = {"error": _err(e), "waited_s": time.monotonic() - t0}
    logging.getLogger("refit_verify").removeHandler(cap)
    return out


def _gloo_worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    init_rank(rank, WORLD, port, one_numba_thread=True)
    with rank_result(out_dir, rank) as out:
        out.update(run_scenarios(rank, WORLD, torch.device("cpu"), fault_rank=2))
        dist.barrier()
    # The timed-out subgroup is left as is: destroying it could wait on the broken pair.
    os._exit(0)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return spawn_ranks(_gloo_worker, WORLD, str(tmp_path_factory.mktemp("broadcast")))


ALL = [n for n, _ in named_tensors()]


# --------------------------------------------------------------------------- shared checks (also used over NCCL)


def check_clean(ranks: list[dict], world: int) -> None:
    reps = ranks[SRC]["clean_enforce"]["reports"]
    assert sorted(reps) == list(range(1, world))
    assert ranks[SRC]["clean_enforce"]["sends_left"] == 0  # the send's state (bucket, digest buffers) freed as it returned
    for r in range(1, world):
        assert reps[r]["ok"] and reps[r]["verified"] == len(ALL) and reps[r]["rank"] == r
        # what the digests before load cannot see is said, in the report and its text
        assert reps[r]["unchecked"] == [AFTER_LOAD_UNCHECKED] and "not checked: what each receiver's load did" in reps[r]["text"]
        got = ranks[r]["clean_enforce"]
        assert got["ok"] and got["mode"] == "enforce" and got["manifest"] == len(ALL)
        assert got["loaded"] == sorted(ALL) and all(got["equal"].values())
        assert got["buckets"] >= 3  # several buckets plus the oversized tensor alone


def check_fault_enforce(ranks: list[dict], world: int, fault_rank: int, key: str = "fault_enforce",
                        param: str = "model.layers.0.mlp.w_int8") -> None:
    err = ranks[SRC][key]["error"]
    assert err["type"] == "BroadcastVerificationError" and err["is_verification"]
    assert err["failed"] == [fault_rank]
    assert err["clean"] == [r for r in range(1, world) if r != fault_rank]
    assert err["per_rank"][fault_rank]["mismatched"] == [param]
    assert err["affected"] == [param]
    assert f"rank {fault_rank}" in err["message"] and param in err["message"]
    for r in err["clean"]:
        assert err["per_rank"][r]["ok"] and err["per_rank"][r]["verified"] == len(ALL)
        assert f"refit verified on worker rank {r}" in err["message"]
    # Enforce detects after loading (as the colocated path): the receivers loaded what arrived.
    assert ranks[fault_rank][key]["loaded"] == sorted(ALL)
    assert not ranks[fault_rank][key]["equal"][param]


# --------------------------------------------------------------------------- gloo tests


def test_clean_refit_verified_on_every_rank(ranks) -> None:
    check_clean(ranks, WORLD)


def test_fault_on_one_rank_named_other_rank_clean(ranks) -> None:
    check_fault_enforce(ranks, WORLD, fault_rank=2)


def test_fault_in_oversized_tensor(ranks) -> None:
    check_fault_enforce(ranks, WORLD, fault_rank=2, key="fault_oversized", param="lm_head.weight")


def test_log_mode_logs_and_continues(ranks) -> None:
    got = ranks[SRC]["fault_log"]
    assert "error" not in got
    reps = got["reports"]
    assert reps[1]["ok"] and not reps[2]["ok"] and reps[2]["mismatched"] == ["model.embed_tokens.weight"]
    assert any("rank 2" in m and "model.embed_tokens.weight" in m for m in got["logs"])
    assert not any("rank 1" in m and "failed" in m for m in got["logs"])
    for r in (1, 2):
        assert ranks[r]["fault_log"]["loaded"] == sorted(ALL) and ranks[r]["fault_log"]["mode"] == "log"


def test_off_mode_digests_nothing(ranks) -> None:
    assert ranks[SRC]["off"] == {"reports": None, "logs": [], "failed_recorded": 0}
    for r in (1, 2):
        got = ranks[r]["off"]
        assert got["mode"] == "off" and got["manifest"] is None and got["loaded"] == sorted(ALL)
    assert not ranks[2]["off"]["equal"]["model.norm.weight"]  # unverified: the flip went through unseen


def test_load_error_reported_with_rank(ranks) -> None:
    err = ranks[SRC]["load_error"]["error"]
    assert err["type"] == "RefitReceiveError" and "rank 2" in err["message"] and "load failed for model.norm.weight" in err["message"]
    assert ranks[1]["load_error"]["ok"] and not ranks[2]["load_error"]["ok"]
    # rank 2's report carries its load error (so it is not ok); its digests matched (taken before load:
    # the bytes arrived intact), so the error raised is a RefitReceiveError, not a verification failure
    assert err["reports_ok"] == {1: True, 2: False}


def test_a_failed_broadcast_is_recorded_as_failed_in_every_mode(ranks) -> None:
    """A broadcast refit that failed (a mismatch in enforce or log, a load error, a sender that aborted)
    records its receivers' session as failed in the trainer, so an audit or an empty partial refit never
    vouches for what it left; a clean one records nothing (its reports hold no engine-side check)."""
    got = {k: ranks[SRC][k]["failed_recorded"] for k in ("clean_enforce", "fault_enforce", "fault_log", "off", "load_error",
                                                         "abort", "after_abort")}
    assert got == {"clean_enforce": 0, "fault_enforce": 1, "fault_log": 1, "off": 0, "load_error": 1, "abort": 1, "after_abort": 0}


def test_sender_error_aborts_receivers(ranks) -> None:
    assert ranks[SRC]["abort"]["error"]["type"] == "RefitInputError"
    for r in (1, 2):
        e = ranks[r]["abort"]["error"]
        assert e["type"] == "RefitAbortedError" and "not_a_tensor" in e["message"]
    for r in (1, 2):
        assert ranks[SRC]["after_abort"]["reports"][r]["ok"]


def test_wait_bounded_by_group_timeout(ranks) -> None:
    got = ranks[2]["timeout"]
    assert got["error"]["type"] == "RefitTimeoutError", got
    assert got["waited_s"] < 30


def test_a_tensor_written_after_the_list_was_digested_is_a_mismatch(ranks) -> None:
    """A list is digested ahead of its buckets (the first bucket's tensors before it goes, the rest
    right after: kept sets, two synchronisations per refit): a trainer tensor written after its
    digest and before it is packed reaches every receiver with other bytes than its digest, a
    mismatch on every rank, never a pass. (The path of tensors the fused copy+digest does not take:
    fusing is off in this step; a fused tensor is digested from the bytes it is packed with.)"""
    err = ranks[SRC]["late_write"]["error"]
    assert err["type"] == "BroadcastVerificationError" and err["failed"] == list(range(1, WORLD))
    assert all(rep["mismatched"] == ["model.norm.weight"] for rep in err["per_rank"].values())
    assert all(ranks[r]["late_write"]["ok"] for r in range(1, WORLD))  # each receiver got and loaded every tensor


def test_error_types_are_exported() -> None:
    assert issubclass(BroadcastVerificationError, RefitVerificationError)
    assert issubclass(RefitAbortedError, Exception) and issubclass(RefitProtocolError, Exception)
    assert issubclass(RefitTimeoutError, TimeoutError)


def test_load_error_and_fault_on_different_ranks(ranks) -> None:
    """The verification error carries the other rank's load error too (its report, which is not ok, and message)."""
    err = ranks[SRC]["load_error_and_fault"]["error"]
    assert err["type"] == "BroadcastVerificationError" and err["failed"] == [1, 2] and err["clean"] == []
    assert err["per_rank"][2]["mismatched"] == ["model.layers.0.mlp.w_int8"]
    assert "worker rank 1" in err["message"] and "load failed for model.norm.weight" in err["message"]


def test_shared_rank_labels_refused(ranks) -> None:
    """Two receivers labelled 0 would share one report (a failing one hidden by a clean one)."""
    err = ranks[SRC]["shared_labels"]["error"]
    assert err["type"] == "RefitProtocolError" and "share rank labels [0]" in err["message"]
    assert all(ranks[SRC]["after_shared_labels"]["reports"][r]["ok"] for r in (1, 2))


def test_src_and_membership_checked_before_any_collective(ranks) -> None:
    for r in range(WORLD):
        e = ranks[r]["src_out_of_range"]["error"]
        assert e["type"] == "RefitConfigError" and "src=3 is not a rank of the group" in e["message"]
    assert ranks[2]["membership"]["error"]["type"] == "RefitProtocolError"
    assert "not a member" in ranks[2]["membership"]["error"]["message"]
    e = ranks[SRC]["membership"]["error"]
    assert e["type"] == "RefitConfigError" and "holds no receiver" in e["message"]
    assert ranks[1]["membership"]["error"] is None


def test_verification_errors_pickle() -> None:
    """Raised in a process pool or a Ray task, the errors reach the caller whole."""
    import pickle

    from refit_verify.compare import compare_manifests

    a, b = "0" * 32, "1" * 32
    bad = compare_manifests({"w": a, "v": a}, {"w": b, "v": a}, rank=2)
    good = compare_manifests({"w": a}, {"w": a}, rank=1)
    e = pickle.loads(pickle.dumps(BroadcastVerificationError({1: good, 2: bad})))
    assert e.failed_ranks == [2] and e.clean_ranks == [1] and e.mismatched == ["w"] and "worker rank 2" in str(e)
    e2 = pickle.loads(pickle.dumps(RefitVerificationError(bad)))
    assert e2.mismatched == ["w"] and e2.report.rank == 2 and str(e2) == str(RefitVerificationError(bad))


# --------------------------------------------------------------------------- the weight version, on two ranks


def _versions_worker(rank: int, port: int, out_dir: str) -> None:
    from tests.support.toy_model import toy_weights, toy_worker

    with rank_result(out_dir, rank) as out:
        init_rank(rank, 2, port, timeout_s=60.0, one_numba_thread=True)
        cfg = RefitConfig.build(mode="enforce")
        w = list(toy_weights(2).items())
        if rank == SRC:
            tx = BroadcastSender(src=SRC, config=cfg)
            for label, version in (("v5", 5), ("none", None), ("v4", 4), ("v6", 6)):
                try:
                    out[label] = {r: (rep.ok, rep.problems) for r, rep in tx.send(w, version=version).items()}
                except BroadcastVerificationError as e:
                    out[label] = {r: (rep.ok, rep.problems) for r, rep in e.reports.items()}
            try:
                tx.send(w, version=-1)
            except Exception as e:  # noqa: BLE001 - checked by the test
                out["bad"] = type(e).__name__
        else:
            from refit_verify.boundary.worker import SessionDigests

            _, wb, model = toy_worker()  # a vLLM worker's boundary around a toy model
            rx = BroadcastReceiver(src=SRC)
            out["stale"] = []
            for _ in range(4):
                rx.receive(model.load_weights, digests=SessionDigests(wb, "broadcast"))
                out["stale"].append((wb.last.version, wb.last.stale))
        torch.distributed.destroy_process_group()


def test_the_broadcast_carries_its_version_and_a_receiver_names_an_older_one(tmp_path):
    src, dst = spawn_ranks(_versions_worker, 2, str(tmp_path))
    older = "version 4 is older than version 5 already closed on this worker"
    assert dst["stale"] == [(5, None), (None, None), (4, older), (6, None)]
    assert src["v5"] == {1: (True, ())} and src["none"] == {1: (True, ())} and src["v6"] == {1: (True, ())}
    assert src["v4"] == {1: (False, (f"stale refit: {older}",))}
    assert src["bad"] == "RefitConfigError"
