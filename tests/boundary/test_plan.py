"""Plan replay (refit_verify.boundary.plan): a steady-state refit verified with the loader tap off.

The toy model's loaders behave like vLLM's (tests/support/toy_model.py). Landing digests are switched
on for the CPU (placement.DERIVE_DEVICE_TYPES), as on CUDA workers, so the replay logic runs in CI.
"""

from __future__ import annotations

import pytest
import torch

from refit_verify.boundary import record as delivery
from refit_verify.boundary import close_reads

from refit_verify.engine import state as engine_state
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors
from refit_verify.errors import RefitConfigError
from refit_verify.boundary.plan import replay_call, replay_from_env
from tests.support.toy_model import HIDDEN, KV, Q, ToyModel, default_weight_loader, toy_weights, untimed

QKV_BYTES = (Q + 2 * KV) * HIDDEN * 2
EMBED_BYTES = 13 * HIDDEN * 2
NORM_BYTES = HIDDEN * 2
ALL = QKV_BYTES + EMBED_BYTES + NORM_BYTES
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(autouse=True)
def landed(monkeypatch):
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)


@pytest.fixture
def writes(monkeypatch):
    """Counts the loader tap's reports of real writes (every watched loader call makes one)."""
    seen = []
    orig = delivery.ModuleSession.on_write

    def on_write(self, pname, *a):
        seen.append(pname)
        return orig(self, pname, *a)

    monkeypatch.setattr(delivery.ModuleSession, "on_write", on_write)
    return seen


class _Faulty(ToyModel):
    """``skip``: names its load_weights drops; ``scribble``: it also changes ``norm`` in place."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.skip: set[str] = set()
        self.scribble = False

    def load_weights(self, weights):
        out = super().load_weights((n, t) for n, t in weights if n not in self.skip)
        if self.scribble:
            self.norm.data[0] += 1
        return out


def _worker(device: str = "cpu") -> tuple[WorkerBoundary, ToyModel]:
    model = _Faulty(device)
    wb = WorkerBoundary(identity_of(rank=0, device=device))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    wb.attach("model", model, default_weight_loader)
    return wb, model


def _refit(wb, model, w, version, *, per_param=False, replay=True, items=None, form=list):
    sid = wb.open(f"s{version}", version=version, replay=replay)
    items = list(w.items()) if items is None else items
    if per_param:
        for it in items:
            model.load_weights([it])
    else:
        model.load_weights(form(items))
    return wb.close(sid)


def _ok(w, man, version):
    return compare_session({"model": digest_tensors(w.items())}, man, session=f"s{version}", version=version)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_param", [False, True], ids=["bucket", "per-param"])
def test_second_refit_replays_the_plan_with_the_tap_off(writes, per_param, device):
    wb, model = _worker(device)
    w1 = toy_weights(1, device=device)
    m1 = _refit(wb, model, w1, 1, per_param=per_param)
    assert m1.modules["model"].replayed == 0 and len(writes) == 5  # watched: q, k, v, embed, norm
    assert wb.modules["model"].plan is not None and len(wb.modules["model"].plan) == 5
    for v in (2, 3):
        w = toy_weights(v, device=device)
        writes.clear()
        man = _refit(wb, model, w, v, per_param=per_param)
        m = man.modules["model"]
        assert writes == []  # the tap stayed off
        assert m.replayed == 5 and m.replay_left is None and sorted(m.in_place) == sorted(w)
        assert m.digests == digest_tensors(w.items()) and m.written == 3 and m.unwritten == []
        assert m.calls == (5 if per_param else 1) and m.bytes == sum(t.numel() * 2 for t in w.values())
        r = _ok(w, man, v)
        assert r.ok and r.verified == 5 and not r.problems and r.proven_bytes == ALL
        assert man.engine.proven_bytes == ALL and man.engine.padding_bytes == 3 * HIDDEN * 2
        assert torch.equal(model.qkv_proj[Q:Q + KV], w["k_proj"])
    assert wb.modules["model"].tap.enabled  # loads outside sessions are watched again


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_loader_that_misplaces_blocks_is_caught(device):
    """swap_halves_after: the loader writes k into v's rows and v into k's on a later load; the tap
    is off, yet both names read back other bytes than the trainer sent."""
    wb, model = _worker(device)
    _refit(wb, model, toy_weights(1, device=device), 1)
    model.swap_halves_after = model.qkv_loads
    w = toy_weights(2, device=device)
    man = _refit(wb, model, w, 2)
    assert man.modules["model"].replayed == 5
    r = _ok(w, man, 2)
    assert not r.ok and sorted(r.mismatched) == ["k_proj", "v_proj"]


def test_replayed_loader_that_skips_a_name_is_caught():
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    model.skip = {"norm"}
    w = toy_weights(2)
    man = _refit(wb, model, w, 2)
    assert man.modules["model"].replayed == 5
    r = _ok(w, man, 2)
    assert not r.ok and list(r.mismatched) == ["norm"]  # it still holds version 1's bytes
    # the trainer's failure makes its next session watched (replay=False): the skip is named then
    w3 = toy_weights(3)
    r3 = _ok(w3, _refit(wb, model, w3, 3, replay=False), 3)
    assert not r3.ok and list(r3.unconsumed) == ["norm"]
    # bytes equal to what the engine holds are a pass: the engine holds the trainer's bytes
    model.skip = set()
    _refit(wb, model, w3, 4)
    model.skip = {"norm"}
    w5 = dict(toy_weights(5), norm=w3["norm"])
    man = _refit(wb, model, w5, 5)
    assert man.modules["model"].replayed == 5 and _ok(w5, man, 5).ok


def test_flipped_byte_in_transit_is_caught_while_replaying():
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = toy_weights(2)
    bad = dict(w, embed=w["embed"].clone())
    bad["embed"].view(-1).view(torch.uint8)[3] ^= 0x01
    man = _refit(wb, model, bad, 2)
    assert man.modules["model"].replayed == 5
    r = _ok(w, man, 2)
    assert not r.ok and list(r.mismatched) == ["embed"]


def test_write_outside_the_plan_is_reported_by_the_close_audit():
    """A partial plan (norm not refitted): a replayed load that also scribbles on norm is seen by the
    snapshot at close (a parameter no session write covers changed)."""
    wb, model = _worker()
    w1 = {n: t for n, t in toy_weights(1).items() if n != "norm"}
    _refit(wb, model, w1, 1)
    model.scribble = True
    w2 = {n: t for n, t in toy_weights(2).items() if n != "norm"}
    man = _refit(wb, model, w2, 2)
    assert man.modules["model"].replayed == 4
    r = compare_session({"model": digest_tensors(w2.items())}, man, session="s2", version=2, partial=True)
    assert not r.ok and any("norm" in p for p in r.problems)


@pytest.mark.parametrize("change", ["unknown name", "twice", "shape", "dtype", "iterator"])
def test_what_the_plan_does_not_describe_is_watched_and_said(writes, change):
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = toy_weights(2)
    items = list(w.items())
    form = list
    if change == "unknown name":
        items.insert(2, ("layers.0.mlp.down_proj.bias", torch.ones(3, dtype=torch.bfloat16)))
    elif change == "twice":
        items.append(("norm", w["norm"]))
    elif change == "shape":
        items[-1] = ("norm", w["norm"].reshape(2, HIDDEN // 2))
    elif change == "dtype":
        items[-1] = ("norm", w["norm"].float())
    else:
        form = iter
    writes.clear()
    if change == "shape":
        sid = wb.open("s2", version=2)
        with pytest.raises(RuntimeError):
            model.load_weights(items)
        man = wb.close(sid)
    else:
        man = _refit(wb, model, w, 2, items=items, form=form)
    m = man.modules["model"]
    assert m.replayed == 0 and m.replay_left  # the whole call was watched
    assert len(writes) >= 4
    why = {"unknown name": "not a name of the plan", "twice": "delivered twice", "shape": "another type, shape",
           "dtype": "another type, shape", "iterator": "not a list"}[change]
    assert why in m.replay_left
    r = _ok(w, man, 2)
    if change in ("iterator", "twice"):
        assert r.ok and r.verified == 5 and r.proven_bytes == ALL
    elif change == "unknown name":
        assert not r.ok and list(r.unexpected) == ["layers.0.mlp.down_proj.bias"]
    elif change == "dtype":  # a conversion the tap saw: norm cannot be proven bytewise, and the digest differs
        assert not r.ok and "norm" in r.not_proven and list(r.mismatched) == ["norm"]
    # a session that could not replay is not learned from: the next one is watched
    writes.clear()
    m3 = _refit(wb, model, toy_weights(3), 3).modules["model"]
    assert m3.replayed == 0 and len(writes) == 5


@pytest.mark.parametrize("change", ["unknown name", "twice", "dtype", "subclass", "name not a str", "not a pair", "kwargs"])
def test_one_pair_calls_the_plan_does_not_describe_are_watched_and_said(writes, change, monkeypatch):
    """One pair a call (TRL, OpenRLHF) takes the wrapper's inline replay (replay_call is not called);
    whatever it does not describe falls to the watched path with replay_call's reason, the pairs
    before it kept replayed."""
    from refit_verify.boundary import model as mb

    general = []
    monkeypatch.setattr(mb, "replay_call", lambda *a: general.append(1) or replay_call(*a))

    class Sub(torch.Tensor):
        pass

    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1, per_param=True)
    w = toy_weights(2)
    items = list(w.items())
    last = items[-1]
    kw = False
    if change == "unknown name":
        last = ("layers.0.mlp.down_proj.bias", torch.ones(3, dtype=torch.bfloat16))
    elif change == "twice":
        last = items[0]
    elif change == "dtype":
        last = ("norm", w["norm"].float())
    elif change == "subclass":
        last = ("norm", w["norm"].as_subclass(Sub))
    elif change == "name not a str":
        last = (b"norm", w["norm"])
    elif change == "not a pair":
        last = ["norm", w["norm"]]
    else:
        kw = True
    sid = wb.open("s2", version=2)
    for it in items[:-1]:
        model.load_weights([it])
    assert not general  # the inline replay took every one
    writes.clear()
    try:
        if kw:
            model.load_weights(weights=[last])
        else:
            model.load_weights([last])
    except Exception:  # noqa: BLE001 - the toy model refuses some of these itself
        pass
    man = wb.close(sid)
    m = man.modules["model"]
    if kw:  # a keyword call the plan describes: replayed by the general path
        assert m.replayed == 5 and not m.replay_left
        return
    assert m.replayed == (3 if change == "twice" else 4) and m.replay_left  # a name given again is watched from then on
    why = {"unknown name": "not a name of the plan", "twice": "delivered twice", "dtype": "another type, shape",
           "subclass": "another type, shape", "name not a str": "not a name of the plan",
           "not a pair": "not a (name, tensor) pair"}[change]
    assert why in m.replay_left


def test_fallback_in_a_later_call_keeps_what_was_replayed(writes):
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1, per_param=True)
    w = toy_weights(2)
    sid = wb.open("s2", version=2)
    items = list(w.items())
    for it in items[:3]:
        model.load_weights([it])
    writes.clear()
    model.load_weights(iter(items[3:]))  # an iterator: watched from here on
    man = wb.close(sid)
    m = man.modules["model"]
    assert m.replayed == 3 and "not a list" in m.replay_left and len(writes) == 2
    r = _ok(w, man, 2)
    assert r.ok and r.verified == 5 and r.proven_bytes == ALL


def test_replay_false_and_env_off_watch_every_load(writes, monkeypatch):
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    writes.clear()
    assert _refit(wb, model, toy_weights(2), 2, replay=False).modules["model"].replayed == 0 and len(writes) == 5
    monkeypatch.setenv("REFIT_VERIFY_REPLAY", "0")
    writes.clear()
    assert _refit(wb, model, toy_weights(3), 3).modules["model"].replayed == 0 and len(writes) == 5
    monkeypatch.setenv("REFIT_VERIFY_REPLAY", "yes")
    with pytest.raises(RefitConfigError, match="REFIT_VERIFY_REPLAY"):
        replay_from_env()


def test_no_replay_without_the_snapshot_or_after_the_model_changed(writes):
    wb, model = _worker()
    wb.snapshotter = None  # a write outside the plan would go unseen: never replayed
    _refit(wb, model, toy_weights(1), 1)
    writes.clear()
    assert _refit(wb, model, toy_weights(2), 2).modules["model"].replayed == 0 and len(writes) == 5
    wb.snapshotter = engine_state.snapshot
    model.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)  # a new parameter object
    writes.clear()
    m = _refit(wb, model, toy_weights(3), 3).modules["model"]
    assert m.replayed == 0 and len(writes) == 5
    assert wb.modules["model"].plan is not None
    writes.clear()
    assert _refit(wb, model, toy_weights(4), 4).modules["model"].replayed == 5 and writes == []


def test_sharded_or_converted_loads_are_never_replayed(writes):
    """A tensor delivered as float32 into a bf16 parameter is a conversion: not exact, no plan."""
    wb, model = _worker()
    w = dict(toy_weights(1), norm=toy_weights(1)["norm"].float())
    _refit(wb, model, w, 1)
    assert wb.modules["model"].plan is None and "conversion" in wb.modules["model"].plan_why
    writes.clear()
    assert _refit(wb, model, w, 2).modules["model"].replayed == 0 and len(writes) == 5


def test_the_plan_keeps_no_replaced_parameter_alive():
    """A model whose parameter objects are replaced between sessions: the kept plan refers to its
    model index weakly, so the old parameters are freed, and the next session is watched."""
    import gc
    import weakref

    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    old = weakref.ref(model.qkv_proj)
    model.qkv_proj = torch.nn.Parameter(torch.zeros_like(model.qkv_proj), requires_grad=False)
    model.qkv_proj.weight_loader = model._qkv_loader
    wb.audit()  # rebuilds the index (the engine state is read through it)
    gc.collect()
    assert old() is None and wb.modules["model"].plan is not None
    w = toy_weights(2)
    man = _refit(wb, model, w, 2)
    assert man.modules["model"].replayed == 0 and _ok(w, man, 2).ok


def test_explicit_open_with_replay_false_joining_an_implicit_one_watches(writes):
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    sid = wb.open("implicit", explicit=False)  # e.g. vLLM's start_weight_update
    wb.open("s2", version=2, replay=False)  # the trainer's open after a failed refit takes it over
    writes.clear()
    model.load_weights(list(toy_weights(2).items()))
    wb.close("s2")
    assert wb.close(sid, explicit=False) is None and len(writes) == 5


def test_no_plan_from_a_session_whose_read_back_failed():
    wb, model = _worker()

    def boom(*a, **k):
        raise RuntimeError("read-back crashed")

    wb.readback = boom
    man = _refit(wb, model, toy_weights(1), 1)
    assert any("read-back failed" in e for e in man.errors)
    assert wb.modules["model"].plan is None and wb.modules["model"].plan_why == "the session's read-back failed"


def test_after_a_failed_snapshot_no_replay_and_unwritten_parameters_are_said(writes):
    """The last close's snapshot failed: the next session is watched (a write outside the plan could
    not be audited), and the parameters it does not write are reported as not compared."""
    wb, model = _worker()
    part = {n: t for n, t in toy_weights(1).items() if n != "norm"}
    _refit(wb, model, part, 1)
    calls = []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("transient snapshot failure")
        return engine_state.snapshot(*a, **k)

    wb.snapshotter = flaky
    assert any("snapshot failed" in e for e in _refit(wb, model, part, 2).errors) and wb.baseline is None
    model.scribble = True
    writes.clear()
    w3 = {n: t for n, t in toy_weights(3).items() if n != "norm"}
    man = _refit(wb, model, w3, 3)
    assert man.modules["model"].replayed == 0 and len(writes) == 4
    r = compare_session({"model": digest_tensors(w3.items())}, man, session="s3", version=3, partial=True)
    assert not r.ok and any("snapshot at the close of session 's2' failed: the 1 parameters" in p for p in r.problems)


def test_a_partial_refit_says_what_it_does_not_compare():
    """Only q_proj is refitted, in a session not opened as partial (so its close compares no region of
    qkv_proj's rest), and compared as partial: the rest of qkv_proj is neither written nor audited,
    and the report says so."""
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = {"q_proj": toy_weights(2)["q_proj"]}
    man = _refit(wb, model, w, 2)
    assert man.modules["model"].replayed == 1
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s2", version=2, partial=True)
    assert r.ok and r.unchecked == ("1 parameters were written in part by this partial refit; their other elements are not "
                                    "compared with what the last session left (no region of the layout map holds them, or the "
                                    "last close did not read it; before any close, prepare at engine start did not): "
                                    f"qkv_proj ({Q * HIDDEN} of {(Q + 2 * KV) * HIDDEN} elements)",)


def test_a_replay_in_another_order_is_recorded_name_by_name_and_verifies_alike(writes):
    """Replayed names are recorded as they come and filled in from the plan before anything reads
    them: a whole replay in the plan's order takes the plan's records as a whole (kept on the plan),
    one in another order name by name; both give the same manifest as a watched session."""
    wb, model = _worker()
    m1 = _refit(wb, model, toy_weights(1), 1, per_param=True).modules["model"]
    plan = wb.modules["model"].plan
    w = toy_weights(2)
    rev = list(reversed(list(w.items())))
    writes.clear()
    man = _refit(wb, model, w, 2, per_param=True, items=rev)
    m = man.modules["model"]
    assert m.replayed == 5 and writes == [] and plan._whole is None  # not in the plan's order: name by name
    assert _ok(w, man, 2).ok and m.written == m1.written == 3 and m.bytes == m1.bytes
    man3 = _refit(wb, model, w, 3, per_param=True)
    assert plan._whole is not None and man3.modules["model"].replayed == 5 and _ok(w, man3, 3).ok
    def states(e):  # the blocks of a parameter are listed in the order they were written
        return {k: (st.status, st.bytes, sorted(st.blocks)) for k, st in e.params.items()}

    assert states(man3.engine) == states(man.engine) and man3.modules["model"].digests == m.digests
    man4 = _refit(wb, model, toy_weights(4), 4)  # one list in the plan's order: the kept records again
    assert man4.modules["model"].replayed == 5 and _ok(toy_weights(4), man4, 4).ok
    assert man4.engine.proven_bytes == man3.engine.proven_bytes == ALL


def test_an_open_sessions_check_leaves_the_kept_close_alone():
    """vLLM's native update is checked while still open (0.26's sender), inside its layerwise reload,
    which swaps parameters: that check walks the model itself, so the module's index and what the
    close keeps on it (snapshot set, read-back program) stay those taken outside updates."""
    wb, model = _worker()
    b = wb.modules["model"]
    for v in (1, 2):
        _refit(wb, model, toy_weights(v), v)
    idx, prog = b.index(), b.index().kept["read_back"][1]
    w = toy_weights(3)
    sid = wb.open("s3", version=3)
    model.load_weights(list(w.items()))
    real = model.norm
    model.norm = torch.nn.Parameter(torch.zeros_like(real), requires_grad=False)  # a layer swapped mid-update
    digests, calls, tensors, _ = wb.snapshot()
    assert tensors == 5 and calls == 1 and {n: digests[n] for n in w if n != "norm"} == {
        n: h for n, h in digest_tensors(w.items()).items() if n != "norm"}
    model.norm = real  # restored at the update's finish
    man = wb.close(sid)
    assert b.index() is idx and b.index().kept["read_back"][1] is prog
    assert man.modules["model"].replayed == 5 and _ok(w, man, 3).ok


def test_an_open_sessions_check_reads_kept_regions_and_sees_in_place_changes(monkeypatch):
    """The open-update check reads the regions where the names landed at once (digest_now): from
    its second call over the same regions of the same memory it launches the set the first one kept
    (no HeldBatch add, no view per region), and still reads the bytes as they are now (a change in
    place between two checks is seen); a parameter replaced by other memory of its layout is read
    where it is now, and its new bytes are what the check gives."""
    from refit_verify.digest import incremental as digest_stream
    from refit_verify.digest import kept as held_sets
    from refit_verify.digest.batch import tensor_digest

    # kept sets are process-wide: another test's toy model of the same names and layout would be read through its
    # relocatable set from the first check on (right digests, no general path); this test starts with none
    monkeypatch.setattr(held_sets, "_HELD_SETS", type(held_sets._HELD_SETS)())
    monkeypatch.setattr(held_sets, "_HELD_TENSORS", 0)
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = toy_weights(3)
    sid = wb.open("s3", version=3)
    model.load_weights(list(w.items()))
    adds = []
    orig = digest_stream.HeldBatch.add

    def add(self, name, t):
        adds.append(name)
        return orig(self, name, t)

    monkeypatch.setattr(digest_stream.HeldBatch, "add", add)
    want = digest_tensors(w.items())
    b = wb.modules["model"]
    assert wb.snapshot()[0] == want and len(adds) == len(w) and b.landed_kept is not None  # read the general way, set kept
    adds.clear()
    views = []
    real_view = delivery.as_view
    monkeypatch.setattr(delivery, "as_view", lambda *a: views.append(1) or real_view(*a))
    assert wb.snapshot()[0] == want and adds == [] and views == []  # the kept set: one launch, nothing per region
    saved = model.norm.detach().clone()
    model.norm.data[0] += 1  # changed in place inside the open update
    got = wb.snapshot()[0]
    assert adds == [] and got["norm"] == tensor_digest(model.norm.detach()) != want["norm"]
    assert {n: h for n, h in got.items() if n != "norm"} == {n: h for n, h in want.items() if n != "norm"}
    model.norm.data.copy_(saved)
    real = model.norm
    model.norm = torch.nn.Parameter(real.detach().clone(), requires_grad=False)  # other memory, same bytes but one
    model.norm.data[-1] -= 1
    got = wb.snapshot()[0]
    # the regions' kept set no longer holds (views made again); the check's own set, built at its first read (CPU
    # memory), reads the new memory of the same layout where it is now: the new bytes are what it gives
    assert adds == [] and views and got["norm"] == tensor_digest(model.norm.detach()) != want["norm"]
    model.norm = real
    assert wb.snapshot()[0] == want
    man = wb.close(sid)
    assert man.modules["model"].replayed == 5 and _ok(w, man, 3).ok


def test_an_open_sessions_check_falls_back_to_each_region_when_the_batch_cannot_read(monkeypatch):
    """If reading the regions at once raises (one region cannot be read after all), each readable
    region is read on its own and the unreadable one is left out (missing in that check)."""
    from refit_verify.errors import RefitInputError

    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = toy_weights(3)
    sid = wb.open("s3", version=3)
    model.load_weights(list(w.items()))

    def refuse(items, space=""):
        raise RefitInputError("a region cannot be read")

    real_now, real = delivery.digest_now, delivery._each_readable
    monkeypatch.setattr(delivery, "digest_now", refuse)

    def each(items):
        items = [(k, t if not k.endswith(":norm") else t.to_sparse()) for k, t in items]  # this one cannot be read
        return real(items)

    monkeypatch.setattr(delivery, "_each_readable", each)
    got = wb.snapshot()[0]
    want = digest_tensors(w.items())
    assert "norm" not in got and got == {n: h for n, h in want.items() if n != "norm"}
    monkeypatch.setattr(delivery, "digest_now", real_now)
    monkeypatch.setattr(delivery, "_each_readable", real)
    man = wb.close(sid)
    assert _ok(w, man, 3).ok


def test_an_open_sessions_check_from_another_thread_mid_call_loses_no_replayed_name():
    """A replayed call records its names, then queues them to be filled in; a check of the open
    session from another thread (vLLM's native open-update check) that lands in between fills in
    what is queued then, and the rest is filled in later: every name is recorded once."""
    wb, model = _worker()
    _refit(wb, model, toy_weights(1), 1)
    w = toy_weights(3)
    items = list(w.items())
    sid = wb.open("s3", version=3)
    ms = wb.modules["model"].session
    checks = []

    class Racy(list):  # the other thread's check runs right before this call's names are queued
        def extend(self, names):
            checks.append(wb.snapshot()[2])
            super().extend(names)

    ms.unexpanded = Racy()
    model.load_weights(items[:2])
    model.load_weights(items[2:])
    assert checks == [0, 2]  # tensors recorded as each check saw them
    man = wb.close(sid)
    m = man.modules["model"]
    assert m.replayed == 5 and m.unwritten == [] and m.bytes == sum(t.numel() * 2 for t in w.values())
    r = _ok(w, man, 3)
    assert r.ok and r.verified == 5 and r.proven_bytes == ALL


def _refit_ahead(wb, model, w, version, *, enforce=True, staging=None, tamper=None, buckets=(("q_proj", "k_proj"), ("v_proj", "embed", "norm")),
                 copy_fault=None):
    """Our transport's way: before each ``load_weights`` call, the sender's digests of its tensors
    (``wb.expect``); the tensors are ``staging``'s (refilled in place, as a staging slot is) when
    given. ``tamper``: a name whose bytes change after the sender's digest (one flipped bit).
    ``copy_fault``: as the vLLM worker under layerwise reload, the model gets copies of the staged
    tensors, and this name's copy differs from its staged bytes (one flipped bit)."""
    sid = wb.open(f"s{version}", version=version)
    want = digest_tensors(w.items())
    for names in buckets:
        items = []
        for n in names:
            t = w[n]
            if staging is not None:
                t = staging[n]
                t.copy_(w[n])
            if n == tamper:
                t = t.clone() if staging is None else t
                t.view(-1).view(torch.uint8)[1] ^= 0x04
            items.append((n, t))
        wb.expect({n: want[n] for n in names}, enforce)
        if copy_fault is not None:
            items = [(n, t.clone()) for n, t in items]
            for n, t in items:
                if n == copy_fault:
                    t.view(-1).view(torch.uint8)[0] ^= 0x10
        model.load_weights(items)
    return wb.close(sid)


@pytest.mark.parametrize("device", DEVICES)
def test_checked_before_loading_then_replayed(writes, device):
    """Digests ahead of the bytes (our transport): every call is checked before loading and, once a
    watched session left a plan, replayed (tap off); the verdict reads what landed. The check reads
    a staging slot refilled in place through a kept set from the third refit on."""
    from refit_verify.digest import kept as held_sets

    wb, model = _worker(device)
    staging = {n: torch.empty_like(t) for n, t in toy_weights(0, device=device).items()}
    w1 = toy_weights(1, device=device)
    m1 = _refit_ahead(wb, model, w1, 1, staging=staging)
    assert m1.modules["model"].replayed == 0 and len(writes) == 5
    assert wb.modules["model"].plan is not None  # a pre-checked session is learned from
    assert _ok(w1, m1, 1).ok and sorted(m1.modules["model"].in_place) == sorted(w1)
    for v in (2, 3):
        w = toy_weights(v, device=device)
        writes.clear()
        man = _refit_ahead(wb, model, w, v, staging=staging)
        m = man.modules["model"]
        assert writes == [] and m.replayed == 5 and m.replay_left is None and m.calls == 2
        r = _ok(w, man, v)
        assert r.ok and r.verified == 5 and r.proven_bytes == ALL and m.digests == digest_tensors(w.items())
        assert torch.equal(model.qkv_proj[Q:Q + KV], w["k_proj"])
    kept = held_sets._HELD_SETS.get(("checked before loading", "v_proj", "embed", "norm"))
    assert isinstance(kept, held_sets.DigestSet)  # the same names over the same memory: planned once


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["k_proj", "norm"])
def test_the_check_before_loading_reads_what_the_model_is_handed(device, name):
    """The tensors a ``load_weights`` call hands the model are what is checked, not what they were
    copied from: a copy that differs from the staged bytes (a late write into the staging slot, a
    copy fault) is refused in ``enforce`` and never loaded, also while replaying; in ``log`` it is
    loaded and named. (A check of the staging views instead of the copies passed such a copy when
    the loader narrowed or cast it: regression test for that design, reverted.)"""
    wb, model = _worker(device)
    staging = {n: torch.empty_like(t) for n, t in toy_weights(0, device=device).items()}
    for v in (1, 2, 3):
        w = toy_weights(v, device=device)
        assert _ok(w, _refit_ahead(wb, model, w, v, staging=staging), v).ok
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    w = toy_weights(4, device=device)
    man = _refit_ahead(wb, model, w, 4, staging=staging, copy_fault=name)
    r = _ok(w, man, 4)
    assert not r.ok and list(r.mismatched) == [name] and r.verified == 4
    assert man.modules["model"].replay_left == "a tensor was refused before loading"
    target = "qkv_proj" if name == "k_proj" else name
    got = getattr(model, target).detach()
    assert torch.equal(got[Q:Q + KV], before[target][Q:Q + KV]) if name == "k_proj" else torch.equal(got, before[target])
    w = toy_weights(5, device=device)
    man = _refit_ahead(wb, model, w, 5, staging=staging, copy_fault=name, enforce=False)
    r = _ok(w, man, 5)
    assert not r.ok and list(r.mismatched) == [name] and r.verified == 4
    got = getattr(model, target).detach()
    assert not torch.equal(got[Q:Q + KV], w["k_proj"]) if name == "k_proj" else not torch.equal(got, w["norm"])


@pytest.mark.parametrize("device", DEVICES)
def test_refused_before_loading_ends_the_replay_and_is_never_loaded(writes, device):
    wb, model = _worker(device)
    for v in (1, 2):
        assert _ok(toy_weights(v, device=device), _refit_ahead(wb, model, toy_weights(v, device=device), v), v).ok
    before = model.embed.detach().clone()
    w = toy_weights(3, device=device)
    writes.clear()
    man = _refit_ahead(wb, model, w, 3, tamper="embed")
    m = man.modules["model"]
    assert m.replayed == 2 and m.replay_left == "a tensor was refused before loading"  # q, k replayed; the second call watched
    assert len(writes) == 2  # v and norm, watched; embed never reached the model
    assert torch.equal(model.embed, before)  # it keeps version 2
    r = _ok(w, man, 3)
    assert not r.ok and list(r.mismatched) == ["embed"] and r.verified == 4
    assert torch.equal(model.qkv_proj[Q + KV:], w["v_proj"])


def test_a_mismatch_in_log_mode_is_loaded_replayed_and_named():
    wb, model = _worker()
    for v in (1, 2):
        _refit_ahead(wb, model, toy_weights(v), v, enforce=False)
    w = toy_weights(3)
    man = _refit_ahead(wb, model, w, 3, enforce=False, tamper="norm")
    m = man.modules["model"]
    assert m.replayed == 5 and m.replay_left is None
    assert not torch.equal(model.norm, w["norm"])  # the flipped bytes were loaded (log mode)
    r = _ok(w, man, 3)
    assert not r.ok and list(r.mismatched) == ["norm"] and r.verified == 4


def test_after_a_replayed_pre_checked_session_that_failed_the_next_is_watched(writes):
    """Our transport's sessions are opened by the worker, not by the trainer's refit() (which opens
    the session after a failure with replay=False): a replayed session whose names were right before
    loading and hold other bytes where the plan says they land drops the plan, so the next one is
    watched and names what the loader did (here: skipped norm)."""
    wb, model = _worker()
    for v in (1, 2):
        _refit_ahead(wb, model, toy_weights(v), v)
    model.skip = {"norm"}
    w3 = toy_weights(3)
    m3 = _refit_ahead(wb, model, w3, 3)
    r3 = _ok(w3, m3, 3)
    assert m3.modules["model"].replayed == 5 and not r3.ok and list(r3.mismatched) == ["norm"]
    assert wb.modules["model"].plan is None and "norm holds other bytes where it landed" in wb.modules["model"].plan_why
    writes.clear()
    w4 = toy_weights(4)
    m4 = _refit_ahead(wb, model, w4, 4)
    r4 = _ok(w4, m4, 4)
    assert m4.modules["model"].replayed == 0 and len(writes) == 4  # watched: q, k, v, embed (norm skipped)
    assert not r4.ok and list(r4.unconsumed) == ["norm"]




@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_read_back_program_is_read_in_the_snapshots_launch(device, monkeypatch):
    """From the third refit on the close reads the state and the kept read-back regions (the qkv
    blocks) in one launch: the same manifest as two launches, a misplaced block still caught, and
    region digests left by another session never taken."""
    from refit_verify.digest.kept import DigestSet

    launches, closing = [], []
    raw_launch, raw_close = DigestSet.launch, WorkerBoundary.close
    monkeypatch.setattr(DigestSet, "launch", lambda self, *a, **k: (closing and launches.append(len(self)), raw_launch(self, *a, **k))[1])
    monkeypatch.setattr(WorkerBoundary, "close",
                        lambda self, *a, **k: (closing.append(1), raw_close(self, *a, **k), closing.clear())[1])
    riding = engine_state._riding

    def run(ride: bool):
        monkeypatch.setattr(engine_state, "_riding", riding if ride else lambda *a: None)
        monkeypatch.setattr(close_reads, "ONE_PASS", ride)  # (one-pass closes would read the regions it plans with the state)
        wb, model = _worker(device)
        mans = []
        for v in (1, 2, 3):
            launches.clear()
            mans.append(_refit(wb, model, toy_weights(v, device=device), v))
        return wb, model, mans, list(launches)

    wb, model, mans, ridden = run(True)
    wb2, _, plain, two = run(False)
    assert ({k: st.digest for k, st in wb.baseline.params.items()} == {k: st.digest for k, st in wb2.baseline.params.items()}
            and wb.baseline.params.keys() == {"qkv_proj", "embed", "norm"})  # the snapshot itself: the same digests
    n_state = len(wb.baseline.params) + len(wb.baseline.buffers)
    # the state, then the regions written in part: q, k, v in qkv_proj, the embedding's 13 rows and its 3 padding rows
    assert ridden == [n_state + 5] and two == [n_state, 5]  # one launch, not two
    for a, b in zip(mans, plain):
        assert untimed(a) == untimed(b) and a.errors == b.errors == []
    assert _ok(toy_weights(3, device=device), mans[2], 3).proven_bytes == ALL
    monkeypatch.setattr(engine_state, "_riding", riding)
    model.swap_halves_after = model.qkv_loads
    launches.clear()
    w = toy_weights(4, device=device)
    r = _ok(w, _refit(wb, model, w, 4), 4)
    assert launches == [n_state + 5] and not r.ok and sorted(r.mismatched) == ["k_proj", "v_proj"]
    model.swap_halves_after = None
    (_plan, prog), = [wb.modules["model"].index(refresh=False).kept["read_back"]]
    monkeypatch.setattr(engine_state, "_riding", lambda *a: None)
    prog.pre = (object(), ["0" * 32] * 5)  # another session's: never this close's
    w = toy_weights(5, device=device)
    r = _ok(w, _refit(wb, model, w, 5), 5)
    assert r.ok and r.proven_bytes == ALL and prog.pre is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_transport_sessions_outcome_takes_the_replayed_plans_records_whole(writes, device):
    """Our transport closes through SessionDigests: its outcome (landed, kept) is read just before the
    close and expands a session that replayed its whole plan as the close would, from the plan's
    records taken whole (not name by name), with the same verdict, landed list and manifest."""
    from refit_verify.boundary.worker import SessionDigests

    wb, model = _worker(device)
    staging = {n: torch.empty_like(t) for n, t in toy_weights(0, device=device).items()}
    buckets = (("q_proj", "k_proj"), ("v_proj", "embed", "norm"))
    for v in (1, 2, 3):
        w = toy_weights(v, device=device)
        want = digest_tensors(w.items())
        writes.clear()
        sd = SessionDigests(wb, "transport")
        sd.begin(f"refit-{v}", None)
        for names in buckets:
            for n in names:
                staging[n].copy_(w[n])
            sd.expect({n: want[n] for n in names}, True)
            model.load_weights([(n, staging[n]) for n in names])
        digests, man = sd.finish()
        m = man.modules["model"]
        r = compare_session({"model": want}, man, session=f"refit-{v}")
        assert r.ok and r.verified == 5 and r.proven_bytes == ALL and digests == want
        assert sorted(sd.landed) == ["embed", "norm", "qkv_proj"] and sd.rejected == {} and sd.kept == {}
        if v >= 2:
            assert m.replayed == 5 and writes == []
    plan = wb.modules["model"].plan
    assert plan is not None and plan._whole is not None  # taken whole at the outcome of refits 2 and 3


# -- the first session: a plan learned dry at prepare, its close audit against prepare's snapshot ----------


def _specs(device: str = "cpu") -> dict:
    return {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in toy_weights(0, device=device).items()}


def _prepared(device: str = "cpu", specs: dict | None = None) -> tuple[WorkerBoundary, ToyModel]:
    """A worker as the plugin leaves it after the model loaded: prepared with the checkpoint's specs."""
    wb, model = _worker(device)
    wb.modules["model"].tap.callable_ahead = lambda f: True  # the toy's loaders stand in for vLLM's own
    assert wb.prepare(specs={"model": _specs(device) if specs is None else specs}) is True
    return wb, model


def _plan_records(plan) -> tuple:
    return (plan.spec, plan.nbytes, {n: [(p, c, k if k is None or k.startswith("whole:") else "block", n_) for p, c, k, n_ in w]
                                     for n, w in plan.writes.items()}, plan.regions, plan.params)


@pytest.mark.parametrize("device", DEVICES)
def test_the_plan_learned_dry_is_the_one_a_watched_first_session_learns(device):
    """prepare's dry learn (placeholders, every write blocked) gives the plan a watched first
    session of the same checkpoint learns: the same names, geometry, writes, regions and parameters."""
    wb, _ = _prepared(device)
    dry = wb.modules["model"].plan
    assert dry is not None and len(dry) == 5 and wb.start is not None
    plain, model = _worker(device)
    _refit(plain, model, toy_weights(1, device=device), 1, replay=False)
    watched = plain.modules["model"].plan
    assert watched is not None and _plan_records(dry) == _plan_records(watched)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_param", [False, True], ids=["bucket", "per-param"])
def test_a_prepared_first_session_replays_the_plan_learned_dry(writes, per_param, device):
    """The first refit after prepare replays with the tap off; its verdict and manifest are a watched
    first session's, and prepare's snapshot is dropped at its close."""
    wb, model = _prepared(device)
    w1 = toy_weights(1, device=device)
    writes.clear()
    man = _refit(wb, model, w1, 1, per_param=per_param)
    m = man.modules["model"]
    assert writes == [] and m.replayed == 5 and m.replay_left is None and wb.start is None
    r = _ok(w1, man, 1)
    assert r.ok and r.verified == 5 and not r.problems and r.proven_bytes == ALL and man.engine.proven_bytes == ALL
    assert man.audits == [] and man.tainted == {}
    plain, plain_model = _worker(device)
    ref = _refit(plain, plain_model, w1, 1, per_param=per_param)
    assert m.digests == ref.modules["model"].digests and man.state_digest == ref.state_digest
    assert man.engine.params == ref.engine.params and sorted(m.in_place) == sorted(ref.modules["model"].in_place)
    w2 = toy_weights(2, device=device)
    writes.clear()
    man2 = _refit(wb, model, w2, 2, per_param=per_param)
    assert writes == [] and man2.modules["model"].replayed == 5 and _ok(w2, man2, 2).ok


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["skip norm", "swap k and v", "flipped byte"])
def test_a_first_replay_catches_a_wrong_load(device, fault):
    """The loader bugs a watched first session fails on fail a replayed one too (by what landed)."""
    wb, model = _prepared(device)
    w = toy_weights(1, device=device)
    sent = w
    if fault == "skip norm":
        model.skip = {"norm"}
    elif fault == "swap k and v":
        model.swap_halves_after = 0
    else:
        sent = dict(w, embed=w["embed"].clone())
        sent["embed"].view(-1).view(torch.uint8)[3] ^= 0x01
    man = _refit(wb, model, sent, 1)
    assert man.modules["model"].replayed == 5
    r = _ok(w, man, 1)
    want = {"skip norm": ["norm"], "swap k and v": ["k_proj", "v_proj"], "flipped byte": ["embed"]}[fault]
    assert not r.ok and sorted(r.mismatched) == want


def test_a_first_replay_reports_a_write_outside_the_plan_against_the_engine_start():
    """A partial first refit (norm not pushed) whose load also changes norm in place: the close audit
    compares norm with prepare's snapshot and reports it as changed since the engine's start."""
    wb, model = _prepared()
    model.scribble = True
    w1 = {n: t for n, t in toy_weights(1).items() if n != "norm"}
    man = _refit(wb, model, w1, 1)
    assert man.modules["model"].replayed == 4
    assert [a.changed for a in man.audits] == [["norm"]] and man.audits[0].since_session is None
    assert "since the engine's start" in man.audits[0].describe()
    r = compare_session({"model": digest_tensors(w1.items())}, man, session="s1", version=1, partial=True)
    assert not r.ok and any("norm" in p for p in r.problems)
    model.scribble = False  # the same partial refit on a worker whose load leaves norm alone: nothing changed
    wb, model = _prepared()
    man = _refit(wb, model, w1, 1)
    assert man.modules["model"].replayed == 4 and man.audits == [] and man.unchanged == 1


def test_the_first_session_is_watched_when_prepare_read_another_state_or_learned_nothing(writes):
    """No replay in the first session (every load watched, as unprepared) after a load outside any
    session since prepare, after the engine discarded its weights, with replay=False, or when the
    dry learn placed nothing (no specs)."""
    w1 = toy_weights(1)
    cases = {}
    wb, model = _prepared()
    model.load_weights(list(toy_weights(7).items()))  # the engine loaded weights itself, outside any session
    cases["loaded outside"] = (wb, model, True)
    wb, model = _prepared()
    wb.discarded("sleep(level=2)")
    cases["discarded"] = (wb, model, True)
    wb, model = _prepared()
    cases["replay=False"] = (wb, model, False)
    wb, model = _worker()
    assert wb.prepare() is True and wb.modules["model"].plan is None
    cases["no specs"] = (wb, model, True)
    for case, (wb, model, replay) in cases.items():
        writes.clear()
        man = _refit(wb, model, w1, 1, replay=replay)
        assert man.modules["model"].replayed == 0 and len(writes) == 5, case
        r = _ok(w1, man, 1)
        assert man.audits == [] and r.verified == 5 and not r.mismatched, case
        assert r.ok == (case != "loaded outside"), (case, r.problems)  # a load outside any session is a problem of its own


def test_no_plan_is_learned_dry_for_a_model_that_quantizes_on_load(writes):
    """A module with a quant method other than an unquantized one: the loaders' output is processed
    after loading (what a dry learn cannot see), so the first session is watched."""
    wb, model = _worker()
    model.quant_holder = torch.nn.Module()
    model.quant_holder.quant_method = type("Fp8OnlineLinearMethod", (), {})()
    wb.modules["model"].tap.callable_ahead = lambda f: True
    assert wb.prepare(specs={"model": _specs()}) is True
    b = wb.modules["model"]
    assert b.plan is None and "Fp8OnlineLinearMethod" in b.plan_why
    writes.clear()
    assert _refit(wb, model, toy_weights(1), 1).modules["model"].replayed == 0 and len(writes) == 5
    model.quant_holder.quant_method = type("UnquantizedLinearMethod", (), {})()
    wb, model2 = _worker()
    model2.quant_holder = model.quant_holder
    wb.modules["model"].tap.callable_ahead = lambda f: True
    assert wb.prepare(specs={"model": _specs()}) is True and wb.modules["model"].plan is not None


def test_names_the_dry_learn_did_not_place_whole_are_watched_in_the_first_session(writes):
    """Prepared for a checkpoint whose norm is announced in float32 (the loader converts it: not
    exact, left out of the plan): the first session replays the other four names, then watches
    the call that delivers norm; the verdict is a watched session's."""
    specs = dict(_specs(), norm=((HIDDEN,), "float32"))
    wb, model = _prepared(specs=specs)
    assert sorted(wb.modules["model"].plan.spec) == ["embed", "k_proj", "q_proj", "v_proj"]
    w1 = toy_weights(1)
    writes.clear()
    man = _refit(wb, model, w1, 1, per_param=True)
    m = man.modules["model"]
    assert m.replayed == 4 and m.replay_left == "'norm' is not a name of the plan" and writes == ["norm"]
    assert _ok(w1, man, 1).ok


@pytest.mark.parametrize("device", DEVICES)
def test_a_first_session_checked_before_loading_replays_the_plan_learned_dry(writes, device):
    """Digests ahead of the bytes (our transport): the first session's calls are checked, then replayed."""
    wb, model = _prepared(device)
    staging = {n: torch.empty_like(t) for n, t in toy_weights(0, device=device).items()}
    w1 = toy_weights(1, device=device)
    writes.clear()
    man = _refit_ahead(wb, model, w1, 1, staging=staging)
    m = man.modules["model"]
    assert writes == [] and m.replayed == 5 and m.replay_left is None
    assert _ok(w1, man, 1).ok and sorted(m.in_place) == sorted(w1)


@pytest.mark.parametrize("device", DEVICES)
def test_prepare_builds_what_the_first_replayed_close_keeps(device):
    """With a plan learned ahead, prepare also builds the read-back program a whole replay's close
    keeps, the snapshot's one launch over the state and its regions, and the layout map: the first
    close uses them as they are (one pass over the engine) and its verdict is an unprepared worker's."""
    wb, model = _prepared(device)
    b = wb.modules["model"]
    idx = b._index
    plan, prog = idx.kept["read_back"]
    close_set = idx.kept["close_set"]
    layout = b.layout
    assert plan is b.plan and prog.pre is None and close_set[1] is prog and close_set[2] is not None
    assert layout is not None and sorted(layout.entries) == sorted(toy_weights(0))
    w1 = toy_weights(1, device=device)
    man = _refit(wb, model, w1, 1)
    assert man.modules["model"].replayed == 5 and _ok(w1, man, 1).ok
    assert idx.kept["read_back"][1] is prog and idx.kept["close_set"] is close_set and b._index is idx
    assert b.layout is layout and man.reads.passes == 1 and man.reads.why == []
    plain, plain_model = _worker(device)
    ref = _refit(plain, plain_model, w1, 1)
    assert man.engine.params == ref.engine.params and man.state_digest == ref.state_digest
    assert man.engine.proven_bytes == ref.engine.proven_bytes == ALL
    w = toy_weights(2, device=device)  # a wrong landing is still found through the program built ahead
    model.swap_halves_after = model.qkv_loads
    r = _ok(w, _refit(wb, model, w, 2), 2)
    assert not r.ok and sorted(r.mismatched) == ["k_proj", "v_proj"]


class _RestScribbler(ToyModel):
    """Its q loader also changes v's rows of qkv_proj (outside what q_proj's plan entry writes)."""

    scribble_rest = False

    def _qkv_loader(self, param, loaded_weight, shard_id):
        super()._qkv_loader(param, loaded_weight, shard_id)
        if self.scribble_rest and shard_id == "q":
            param.data[Q + KV:] += 1


@pytest.mark.parametrize("prepared", [True, False], ids=["replayed", "watched"])
def test_a_partial_first_refit_whose_load_changes_the_rest_of_a_parameter_fails(monkeypatch, prepared):
    """A partial first refit (q, embed, norm: every parameter written at least in part) whose q loader
    also changes v's rows of qkv_proj: the trainer's refit() fails it, replayed or watched. Replayed,
    the close compares the rows it did not write with what prepare read there at engine start
    (``region_start``): with the tap off, nothing else sees that write."""
    import refit_verify
    from refit_verify.vllm_plugin import worker_sessions
    from tests.support.toy_model import ToyEngine, toy_worker

    monkeypatch.setattr(worker_sessions, "attach_models", lambda *a, **k: None)
    worker, wb, model = toy_worker(_RestScribbler())
    if prepared:
        assert wb.prepare(specs={"model": _specs()}) is True and wb.modules["model"].region_start
    before = model.qkv_proj.detach()[Q + KV:].clone()
    model.scribble_rest = True
    sent = {n: t for n, t in toy_weights(1).items() if n in ("q_proj", "embed", "norm")}
    with pytest.raises(refit_verify.RefitVerificationError) as ei:
        with refit_verify.refit(ToyEngine(worker), mode="enforce", partial=True, version=1) as r:
            for n, t in sent.items():
                r.add(n, t)
            model.load_weights(list(sent.items()))
    assert not torch.equal(model.qkv_proj.detach()[Q + KV:], before)
    man = wb.last
    assert man.modules["model"].replayed == (3 if prepared else 0)
    if prepared:
        assert any("qkv_proj" in p and "changed since the engine started" in p for p in ei.value.report.problems), \
            ei.value.report.problems
    assert wb.modules["model"].region_start == {}  # dropped at the first close


def test_a_discard_inside_the_first_replayed_session_keeps_its_baseline():
    """The engine discards its weights (a level-2 sleep's wake) while the first session is open: the
    session keeps the baseline it opened with, so its close audit still runs (a load's write into a
    parameter it did not push is reported)."""
    wb, model = _prepared()
    sent = {n: t for n, t in toy_weights(1).items() if n != "norm"}
    sid = wb.open("s1", version=1)
    wb.discarded("sleep(level=2)")
    model.scribble = True
    model.load_weights(list(sent.items()))
    man = wb.close(sid)
    assert man.modules["model"].replayed == 4 and [a.changed for a in man.audits] == [["norm"]]
    assert not compare_session({"model": digest_tensors(sent.items())}, man, session="s1", version=1, partial=True).ok


class _RaisesAfterLoad(ToyModel):
    """load_weights raises after norm's loader copied it, while ``refuse`` is set."""

    refuse = False

    def load_weights(self, weights):
        out = super().load_weights(weights)
        if self.refuse and "norm" in out:
            raise ValueError("norm: refused after loading")
        return out


def test_a_name_the_dry_learn_failed_on_is_neither_in_the_plan_nor_in_the_layout_map():
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    model = _RaisesAfterLoad()
    model.refuse = True
    wb.attach("model", model, default_weight_loader)
    wb.modules["model"].tap.callable_ahead = lambda f: True
    assert wb.prepare(specs={"model": _specs()}) is True
    b = wb.modules["model"]
    assert "norm" not in b.plan.spec and "norm" not in b.layout.entries and "norm" in b.layout.unlearned
    assert sorted(b.plan.spec) == sorted(b.layout.entries) == ["embed", "k_proj", "q_proj", "v_proj"]


def test_a_bad_replay_setting_raises_at_the_first_open_before_anything_is_taken(monkeypatch):
    """``REFIT_VERIFY_REPLAY`` is read before the open takes the record of loads outside any session:
    the open that raises loses nothing, and the next one reports them."""
    wb, model = _prepared()
    model.load_weights(list(toy_weights(7).items()))  # outside any session
    monkeypatch.setenv("REFIT_VERIFY_REPLAY", "yes")
    with pytest.raises(RefitConfigError, match="REFIT_VERIFY_REPLAY"):
        wb.open("s1", version=1)
    monkeypatch.setenv("REFIT_VERIFY_REPLAY", "1")
    man = _refit(wb, model, toy_weights(1), 1)
    assert [u.tensors for u in man.unsessioned] == [5] and man.modules["model"].replayed == 0
