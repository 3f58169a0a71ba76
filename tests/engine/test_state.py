"""The close's one launch (refit_verify.engine.state._snapshot_launch): the engine state and the
regions of a kept read-back program read together, with two roles ("model" and "drafter"), an audit
and a parameter given new memory between closes, a write after a replayed load in each role, and a
drafter snapshot that fails after the model's ride. Every close must give the manifest the two
launches give, and every write after loading must be caught. (A fresh reviewer's scenario.)"""

from __future__ import annotations

import pytest
import torch


from refit_verify.engine import state as engine_state

from refit_verify.engine import readback
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors
from refit_verify.digest.kept import DigestSet
from tests.support.toy_model import Q, default_weight_loader, toy_weights
from tests.boundary.test_plan import _Faulty
from tests.support.toy_model import untimed


@pytest.fixture(autouse=True)
def landed(monkeypatch):
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)


class _Tamper(_Faulty):
    """``tamper``: after its (replayed) load, the first element of k's block in ``qkv_proj`` changes."""

    tamper = False

    def load_weights(self, weights):
        out = super().load_weights(weights)
        if self.tamper:
            self.qkv_proj.data[Q, 0] += 1
        return out


def _setup():
    wb = WorkerBoundary(identity_of(rank=0))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    m, d = _Tamper(), _Tamper()
    wb.attach("model", m, default_weight_loader)
    wb.attach("drafter", d, default_weight_loader)
    return wb, m, d


def _close(wb, m, d, v):
    wm, wd = toy_weights(v), toy_weights(100 + v)
    sid = wb.open(f"s{v}", version=v)
    m.load_weights(list(wm.items()))
    d.load_weights(list(wd.items()))
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(wm.items()), "drafter": digest_tensors(wd.items())}, man,
                        session=f"s{v}", version=v)
    return man, r


def _scenario(ride: bool, monkeypatch, fail_at: int | None = None):
    monkeypatch.setattr(engine_state, "_riding", readback._riding if ride else (lambda *a: None))
    raw, drafter_calls = engine_state._snapshot_launch, []

    def snapshot_launch(idx, ds, ms, prefix, *rest):
        out = raw(idx, ds, ms, prefix, *rest)
        if prefix == "drafter:":
            drafter_calls.append(1)
            if len(drafter_calls) == fail_at:
                raise RuntimeError("the drafter's snapshot fails after the model's ride")
        return out

    monkeypatch.setattr(engine_state, "_snapshot_launch", snapshot_launch)
    wb, m, d = _setup()
    out = []
    for v in range(1, 10):
        if v == 5:
            assert wb.audit() is not None  # an audit between closes
        if v == 6:  # new memory, the same bytes, between closes (a re-allocation)
            d.qkv_proj.data = d.qkv_proj.data.clone()
            wb.state()
        m.tamper, d.tamper = v == 7, v == 8
        out.append(_close(wb, m, d, v))
    return out


@pytest.mark.parametrize("fail_at", [None, 4], ids=["snapshots-ok", "drafter-snapshot-fails"])
def test_one_launch_gives_the_two_launches_manifests_with_two_roles(monkeypatch, fail_at):
    with_ride = _scenario(True, monkeypatch, fail_at)
    without = _scenario(False, monkeypatch, fail_at)
    for v, ((ma, ra), (mb, rb)) in enumerate(zip(with_ride, without), start=1):
        assert untimed(ma) == untimed(mb) and ma.errors == mb.errors and ra.ok == rb.ok, v
        if v == 7:
            assert not ra.ok and "k_proj" in ra.mismatched, (v, ra)
        elif v == 8:
            assert not ra.ok and "drafter:k_proj" in ra.mismatched, (v, ra)
        elif v == fail_at:
            assert any("snapshot failed" in e for e in ma.errors), v
        else:
            assert ra.ok, (v, ra)


def test_both_roles_take_their_regions_from_the_snapshots_launch(monkeypatch):
    """From the third close on, each role's read-back takes its region digests from the snapshot's
    launch (``prog.pre``, tagged with its own module session): one launch per role, not two."""
    taken, launched = [], []
    raw_launch, raw_collect = DigestSet.launch, engine_state._snapshot_collect
    monkeypatch.setattr(DigestSet, "launch", lambda self, *a, **k: (launched.append(len(self)), raw_launch(self, *a, **k))[1])

    def snapshot_collect(launch, prog, extra, ms, n, *rest):
        out = raw_collect(launch, prog, extra, ms, n, *rest)
        taken.append(prog is not None and prog.pre is not None and prog.pre[0] is ms)
        return out

    monkeypatch.setattr(engine_state, "_snapshot_collect", snapshot_collect)
    wb, m, d = _setup()
    for v in range(1, 5):
        taken.clear()
        launched.clear()
        assert _close(wb, m, d, v)[1].ok
        if v >= 3:
            assert taken == [True, True] and len(launched) == 2, (v, taken, launched)  # the model's, then the drafter's


def test_the_flat_compare_gives_the_loops_manifests(monkeypatch):
    """A kept read-back program compares its regions in one flat pass (``readback._flat``) when
    every block is a whole delivered tensor; the manifests, verdicts and mismatch reasons are those
    of the per-parameter loop, through an audit, a re-allocation, a write after a replayed load in
    each role and a failing drafter snapshot."""
    used = []
    raw = readback._flat
    monkeypatch.setattr(readback, "_flat", lambda prog: (lambda f: (used.append(f is not None), f)[1])(raw(prog)))
    flat = _scenario(True, monkeypatch, 4)
    assert any(used), "the flat compare never ran"
    monkeypatch.setattr(readback, "_flat", lambda prog: None)
    loop = _scenario(True, monkeypatch, 4)
    for v, ((ma, ra), (mb, rb)) in enumerate(zip(flat, loop), start=1):
        assert untimed(ma) == untimed(mb) and ma.errors == mb.errors and ra.ok == rb.ok, v
        assert ra.mismatched == rb.mismatched and ra.engine_mismatched == rb.engine_mismatched, v
    r7, r8 = flat[6][1], flat[7][1]
    assert r7.mismatched == ("k_proj",) and "qkv_proj" in r7.engine_mismatched, r7
    assert r8.mismatched == ("drafter:k_proj",) and "drafter:qkv_proj" in r8.engine_mismatched, r8


def test_a_kept_snapshot_records_what_the_general_path_records(monkeypatch):
    """The kept state set's records (``engine_state._Columns``: labels with the role's prefix,
    pointers, dtypes, shapes, replicated and written flags) equal those a snapshot of the bare
    modules takes through a DigestBatch, buffers included, in the same order."""
    wb, m, d = _setup()
    m.register_buffer("scale", toy_weights(3)["norm"].clone())
    d.register_buffer("scale", toy_weights(4)["norm"].clone())
    for v in range(1, 4):
        assert _close(wb, m, d, v)[1].ok
    rep, wv = dict(wb._replicated), dict(wb._written_version)
    assert any(rep.values()) and any(x is not None for x in wv.values())
    kept = engine_state.snapshot(wb.modules, wb.identity, "s", 3, rep, wv)
    assert wb.modules["model"].index(refresh=False).kept.get("columns") is not None  # the kept path ran
    bare = engine_state.snapshot({"model": m, "drafter": d}, wb.identity, "s", 3, rep, wv)
    for kind in ("params", "buffers"):
        a, b = getattr(kept, kind), getattr(bare, kind)
        assert list(a) == list(b) and a == b, kind
    assert "scale" in kept.buffers and "drafter:scale" in kept.buffers and "drafter:qkv_proj" in kept.params


class _Tied(torch.nn.Module):
    """``w`` is copied whole into two parameters (a tied pair loaded from one tensor); ``tamper``:
    after the load, ``b`` changes."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.b = torch.nn.Parameter(torch.zeros(8, 4), requires_grad=False)
        self.c = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
        for p in (self.a, self.b, self.c):
            p.weight_loader = default_weight_loader
        self.tamper = False

    def load_weights(self, weights):
        for name, t in weights:
            if name == "w":
                for p in (self.a, self.b):
                    p.weight_loader(p, t)
            else:
                self.c.weight_loader(self.c, t)
        if self.tamper:
            self.b.data[0, 0] += 1
        return {"a", "b", "c"}


def test_a_kept_program_finds_a_copy_that_changed_after_a_replayed_load():
    """A name copied whole into two regions, one changed after a replayed load: the kept program's
    compare names both regions' parameters mismatched (the flat pass must not call it verified)."""
    wb = WorkerBoundary(identity_of(rank=0))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    m = _Tied()
    wb.attach("model", m, default_weight_loader)
    for v in range(1, 6):
        w = {"w": torch.randn(8, 4, generator=torch.Generator().manual_seed(v)), "c": torch.full((4,), float(v))}
        m.tamper = v == 5
        sid = wb.open(f"s{v}", version=v)
        m.load_weights(list(w.items()))
        man = wb.close(sid)
        r = compare_session({"model": digest_tensors(w.items())}, man, session=f"s{v}", version=v)
        if v < 5:
            assert r.ok, (v, r)
            continue
        assert man.modules["model"].replayed == 2, man.modules["model"]  # a replayed session, read by a kept program
        assert man.engine.params["a"].status == "mismatch" and man.engine.params["b"].status == "mismatch", man.engine.params
        assert man.engine.params["c"].status == "verified" and not r.ok and set(r.engine_mismatched) == {"a", "b"}, r


def test_a_manifest_times_its_sessions_open_and_close():
    """``open_s`` / ``close_s``: the worker's host seconds of the open and of the close up to the
    manifest, which hold the close's snapshot and read-back; a joined open adds nothing."""
    wb, m, d = _setup()
    for v in range(1, 4):
        man, r = _close(wb, m, d, v)
        assert r.ok and man.open_s > 0 and man.close_s > 0, man
        assert man.close_s >= man.snapshot_s + man.engine.digest_s, man
    sid = wb.open("joined", version=9)
    assert wb.open(explicit=False) == sid and wb.open_session.depth == 2
    open_s = wb.open_session.open_s
    wb.close(explicit=False)
    assert wb.close(sid).open_s == open_s


class _Named(torch.nn.Module):
    """One parameter under ``name`` (``tamper``: it changes after its load)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.pname = name
        self.register_parameter(name, torch.nn.Parameter(torch.zeros(4), requires_grad=False))
        getattr(self, name).weight_loader = default_weight_loader
        self.tamper = False

    def load_weights(self, weights):
        p = getattr(self, self.pname)
        for _n, t in weights:
            p.weight_loader(p, t)
        if self.tamper:
            p.data[0] += 1
        return {self.pname}


@pytest.mark.parametrize("tampered", ["model", "drafter"])
def test_two_roles_naming_one_tensor_fail_the_close_instead_of_hiding_one(tampered):
    """A ``model`` parameter registered as ``drafter:w`` next to role ``drafter``'s ``w``: both are
    labelled ``drafter:w``, so one record would hide the other and a change to it would pass
    (found in review). Every close reports the collision and no refit verifies."""
    wb = WorkerBoundary(identity_of(rank=0))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    m, d = _Named("drafter:w"), _Named("w")
    wb.attach("model", m, default_weight_loader)
    wb.attach("drafter", d, default_weight_loader)
    for v in range(1, 4):
        t = torch.full((4,), float(v))
        (m if tampered == "model" else d).tamper = v == 3
        sid = wb.open(f"s{v}", version=v)
        m.load_weights([("drafter:w", t)])
        d.load_weights([("w", t)])
        man = wb.close(sid)
        r = compare_session({"model": digest_tensors({"drafter:w": t}.items()), "drafter": digest_tensors({"w": t}.items())},
                            man, session=f"s{v}", version=v)
        assert not r.ok and any("two roles name the same engine tensor" in e and "'drafter:w' (model and drafter)" in e
                                for e in man.errors), (v, man.errors)


def test_a_snapshot_of_bare_modules_refuses_two_roles_naming_one_tensor():
    """The general path (``nn.Module`` roles, read through a DigestBatch) refuses the same collision."""
    from refit_verify.errors import RefitInputError

    m, d = _Named("drafter:w"), _Named("w")
    with pytest.raises(RefitInputError, match=r"'drafter:w' \(model and drafter\)"):
        engine_state.snapshot({"model": m, "drafter": d}, identity_of(rank=0))


def test_the_state_is_launched_before_the_closes_index_check(monkeypatch):
    """In a steady state the close starts the device's read of the state (the kept set over the
    index as the last check left it) and then checks the model index, one launch per role: the
    check runs while the device reads (``snapshot(refresh=True)``)."""
    from refit_verify.boundary.model import ModelBoundary

    events = []
    raw_launch, raw_index = engine_state._snapshot_launch, ModelBoundary.index
    monkeypatch.setattr(engine_state, "_snapshot_launch",
                        lambda idx, ds, ms, prefix, *rest: (events.append(("launch", prefix)), raw_launch(idx, ds, ms, prefix, *rest))[1])

    def index(self, refresh=True, quick=False):
        if refresh and not quick:
            events.append(("check", self.role))
        return raw_index(self, refresh, quick)

    monkeypatch.setattr(ModelBoundary, "index", index)
    wb, m, d = _setup()
    for v in range(1, 4):
        events.clear()
        assert _close(wb, m, d, v)[1].ok
    assert events == [("launch", ""), ("check", "model"), ("launch", "drafter:"), ("check", "drafter")], events


class _Replacing(_Tamper):
    """``replace``: after its load, ``qkv_proj`` is replaced by a copy in new memory (a model that
    re-allocates a parameter after loading), and the old parameter, still alive, is overwritten."""

    replace = False

    def load_weights(self, weights):
        out = super().load_weights(weights)
        if self.replace:
            old = self.qkv_proj
            self.qkv_proj = torch.nn.Parameter(old.detach().clone(), requires_grad=False)
            self.qkv_proj.weight_loader = old.weight_loader
            self.replaced = [old]  # kept alive, not registered
            old.data.fill_(7.0)
        return out


@pytest.mark.parametrize("ride", [True, False], ids=["riding", "state-only"])
def test_a_parameter_replaced_before_the_close_drops_the_early_launch(monkeypatch, ride):
    """A parameter replaced by another object after the load of a replayed session (the session's
    open checked the index before): the close's launch over the index the last check left reads the
    old tensors, so it is dropped when the close's check finds the change, and the new parameters
    are read. The snapshot records the live parameter's bytes and storage (not the old one's, still
    alive and overwritten), the refit verifies, and a write after the next load is still caught."""
    monkeypatch.setattr(engine_state, "_riding", readback._riding if ride else (lambda *a: None))
    launches = []
    raw_launch = engine_state._snapshot_launch
    monkeypatch.setattr(engine_state, "_snapshot_launch",
                        lambda idx, ds, ms, prefix, *rest: (launches.append(prefix), raw_launch(idx, ds, ms, prefix, *rest))[1])
    wb = WorkerBoundary(identity_of(rank=0))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    m, d = _Replacing(), _Replacing()
    wb.attach("model", m, default_weight_loader)
    wb.attach("drafter", d, default_weight_loader)
    for v in (1, 2, 3):
        assert _close(wb, m, d, v)[1].ok
    assert man_replayed(wb)
    launches.clear()
    m.replace = True
    man, r = _close(wb, m, d, 4)
    m.replace = False
    assert r.ok, r
    assert launches == ["", "", "drafter:"], launches  # the model's first launch read the old index: dropped
    st = wb.baseline.params["qkv_proj"]
    assert st.digest == digest_tensors([("qkv_proj", m.qkv_proj.detach())])["qkv_proj"]
    assert st.digest != digest_tensors([("qkv_proj", m.replaced[0].detach())])["qkv_proj"]
    assert st.ptr == m.qkv_proj.untyped_storage().data_ptr() != m.replaced[0].untyped_storage().data_ptr()
    m.tamper = True
    man, r = _close(wb, m, d, 5)
    assert not r.ok and "k_proj" in r.mismatched, r


def man_replayed(wb) -> bool:
    """True iff the last close's model session replayed every name it delivered."""
    mm = wb.last.modules["model"]
    return mm.replayed > 0 and mm.replayed == len(mm.digests)


def test_a_model_that_replaces_its_parameters_at_every_load_is_read_once_per_close(monkeypatch):
    """After a close whose check found other parameters, the next close checks the index first and
    launches once (a model that re-registers a parameter at every load would otherwise have its
    state read twice per close: the early launch, dropped, then the new index's); once a close finds
    the same index, the following ones launch before the check again. Every verdict is right."""
    from refit_verify.boundary.model import ModelBoundary

    events = []
    raw_launch, raw_index = engine_state._snapshot_launch, ModelBoundary.index
    monkeypatch.setattr(engine_state, "_snapshot_launch",
                        lambda idx, ds, ms, prefix, *rest: (events.append("launch"), raw_launch(idx, ds, ms, prefix, *rest))[1] if prefix == ""
                        else raw_launch(idx, ds, ms, prefix, *rest))

    def index(self, refresh=True, quick=False):
        if refresh and not quick and self.role == "model":
            events.append("check")
        return raw_index(self, refresh, quick)

    monkeypatch.setattr(ModelBoundary, "index", index)
    wb = WorkerBoundary(identity_of(rank=0))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    m, d = _Replacing(), _Replacing()
    wb.attach("model", m, default_weight_loader)
    wb.attach("drafter", d, default_weight_loader)
    seen = []
    for v in range(1, 9):
        m.replace = 3 <= v <= 5
        events.clear()
        man, r = _close(wb, m, d, v)
        assert r.ok, (v, r)
        assert wb.baseline.params["qkv_proj"].ptr == m.qkv_proj.untyped_storage().data_ptr()
        seen.append(tuple(events))
    early, late, dropped = ("launch", "check"), ("check", "launch"), ("launch", "check", "launch")
    assert seen[2:] == [dropped, late, late, late, early, early], seen  # v3: dropped; v4, v5: replaced again; v6: the last built
