"""ModelIndex: one walk of a model's tensors, stale as soon as the model's structure changes.

A stale index would let read-back and the snapshot read a parameter object the model no longer
uses: the worst defect (verified while the engine computes with other bytes). These tests change
the structure every way a loader or ``process_weights_after_loading`` does and check that the
index is rebuilt, and that read-back and audits then see the model's live tensors.
"""

from __future__ import annotations

import torch

from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.engine.state import audit, read_back, snapshot
from refit_verify.boundary.model_index import ModelIndex
from tests.support.toy_model import ToyModel, default_weight_loader, toy_weights


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 3)
        self.b = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
        self.register_buffer("steps", torch.zeros(1))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.register_buffer("nothing", None)
        self.b[0].shared = self.a  # a module reached twice


def _move_bias(n: Net) -> None:
    bias = n.a.bias
    del n.a.bias
    n.b.register_parameter("bias", bias)  # b (registered after a) had no parameter of its own


def _rename_bias(n: Net) -> None:
    bias = n.a.bias
    del n.a.bias
    n.a.register_parameter("bias2", bias)  # the same object under another name: the same sizes and values


CHANGES = [
    lambda n: setattr(n.a, "weight", torch.nn.Parameter(torch.zeros(3, 4))),  # a parameter replaced
    lambda n: n.a.register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),  # one added
    lambda n: delattr(n.a, "bias"),  # one removed
    lambda n: n.register_buffer("more", torch.zeros(1)),  # a buffer added
    lambda n: setattr(n, "steps", torch.ones(1)),  # a buffer replaced
    lambda n: n._non_persistent_buffers_set.add("steps"),  # a buffer made non-persistent
    lambda n: n.b.__setitem__(1, torch.nn.LayerNorm(2)),  # a child module replaced
    lambda n: n.b[1].add_module("inner", torch.nn.Linear(1, 1)),  # a child module added deep down
    _move_bias,  # a parameter moved into a module that had none: the same names and objects in the same order
    _rename_bias,
    lambda n: setattr(n.a, "_parameters", dict(n.a._parameters)),  # another dictionary object, the same entries
]
QUICK_MISSES = {5, 10}  # what ModelIndex.unchanged (a session open's check) leaves to the close's full check


def test_index_matches_the_walks_and_is_fresh_until_the_structure_changes():
    m = Net()
    ix = ModelIndex(m)
    assert ix.params == dict(m.named_parameters())
    assert ix.all_params == list(m.named_parameters(remove_duplicate=False)) and len(ix.all_params) > len(ix.params)
    # every parameter once, then the persistent buffers that are not None
    assert [(n, k) for n, _, k in ix.state] == [(n, "param") for n in ix.params] + [("steps", "buffer")]
    assert ix.fresh(m) and not ix.fresh(Net())
    m.a.weight.data = torch.ones(3, 4)  # same parameter object, other storage: still fresh, read live
    assert ix.fresh(m) and torch.equal(ix.params["a.weight"], torch.ones(3, 4))

    for i, change in enumerate(CHANGES):
        n = Net()
        ix = ModelIndex(n)
        change(n)
        assert not ix.fresh(n), i
        again = ModelIndex(n)
        assert again.fresh(n) and again.params == dict(n.named_parameters()), i


def _worker(model: ToyModel) -> WorkerBoundary:
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback, wb.snapshotter, wb.auditor = read_back, snapshot, audit
    wb.attach("model", model, default_weight_loader)
    return wb


def test_a_parameter_replaced_after_loading_is_read_where_the_model_has_it_now():
    """After the loads of a session, the norm parameter is replaced by a new object with other bytes (as
    ``process_weights_after_loading`` may do). Read-back must read the new object: a mismatch, never the
    old object's delivered bytes. The audit after another replacement names it changed and moved."""
    model = ToyModel()
    wb = _worker(model)
    w = toy_weights(1)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    assert man.engine.params["norm"].status == "verified" and man.engine.unproven_bytes == 0

    w2 = toy_weights(2)
    sid = wb.open("s2", version=2)
    model.load_weights(list(w2.items()))
    model.norm = torch.nn.Parameter(w2["norm"] + 1, requires_grad=False)  # after the load: other bytes, a new object
    man = wb.close(sid)
    st = man.engine.params["norm"]
    assert st.status == "mismatch", st
    assert man.engine.params["qkv_proj"].status == "verified"
    assert wb.baseline.params["norm"].digest != man.modules["model"].digests["norm"]

    model.norm = torch.nn.Parameter(torch.zeros_like(model.norm), requires_grad=False)  # outside any session
    res = wb.audit()
    assert res.changed == ["norm"] and res.moved == ["norm"]


def test_a_dict_subclass_that_reports_itself_false_is_still_compared():
    """The structure check re-reads the dictionaries that held entries when indexed, chosen by their
    sizes (what the sizes pass compares), not their truth value: a parameter dictionary whose
    ``__bool__`` says empty still has its replaced weight found (found in review)."""

    class FalsyDict(dict):
        def __bool__(self):
            return False

    m = torch.nn.Module()
    m.lin = torch.nn.Linear(2, 2)
    m.lin._parameters = FalsyDict(m.lin._parameters)
    ix = ModelIndex(m)
    assert ix.fresh(m)
    m.lin._parameters["weight"] = torch.nn.Parameter(torch.full((2, 2), 7.0))
    assert not ix.fresh(m)


def test_the_opens_partial_check_sees_every_change_but_a_new_dictionary_object_or_a_buffers_persistence():
    """``ModelIndex.unchanged`` (the check at a session's open) against the full check, change by change."""
    m = Net()
    ix = ModelIndex(m)
    assert ix.unchanged(m) and not ix.unchanged(Net())
    for i, change in enumerate(CHANGES):
        n = Net()
        ix = ModelIndex(n)
        change(n)
        assert not ix.fresh(n), i
        assert ix.unchanged(n) is (i in QUICK_MISSES), i


class _CachingLoader(ToyModel):
    """A model whose load_weights resolves parameter names once and keeps the objects: after its
    parameters are replaced it writes the old objects while the model computes with the new ones."""

    def load_weights(self, weights) -> set[str]:
        cached = self.__dict__.setdefault("_cached", dict(self.named_parameters()))
        for name, w in weights:
            shard = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}.get(name)
            p = cached["qkv_proj" if shard else name]
            if shard:
                p.weight_loader(p, w, shard)
            else:
                getattr(p, "weight_loader", default_weight_loader)(p, w)
        return set()


def _swap_dictionary(model: ToyModel) -> torch.nn.Parameter:
    """Give the model a new parameter dictionary whose ``norm`` is a new object (what the open's check misses)."""
    new = torch.nn.Parameter(torch.zeros_like(model.norm), requires_grad=False)
    model._parameters = {**model._parameters, "norm": new}
    return new


def _replaying_worker(model: ToyModel, monkeypatch) -> WorkerBoundary:

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))  # landing digests on the CPU
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)
    wb = _worker(model)
    for v in (1, 2):
        sid = wb.open(f"s{v}", version=v)
        model.load_weights(list(toy_weights(v).items()))
        man = wb.close(sid)
        assert man.engine.unproven_bytes == 0 and man.modules["model"].replayed == (5 if v == 2 else 0)
    return wb


def test_a_change_the_opens_check_misses_is_read_back_from_the_live_tensors(monkeypatch):
    """The open keeps the plan through a change it does not see (a new parameter dictionary): the
    session replays, the loader writes the new ``norm`` (resolved by name), and the close's full check
    reads the model's live tensors: verified, the bytes the trainer sent."""
    from refit_verify.compare import compare_session
    from refit_verify.digest.batch import digest_tensors

    model = ToyModel()
    wb = _replaying_worker(model, monkeypatch)
    new = _swap_dictionary(model)
    assert wb.modules["model"].index(refresh=False).unchanged(model)  # missed at the open
    w = toy_weights(3)
    sid = wb.open("s3", version=3)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    assert man.modules["model"].replayed == 5
    assert torch.equal(new, w["norm"]) and man.engine.params["norm"].status == "verified"
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s3", version=3)
    assert r.ok and r.verified == 5


def test_a_change_the_opens_check_misses_never_passes_bytes_the_model_does_not_use(monkeypatch):
    """The same miss with a loader that still writes the old ``norm`` object: the model computes
    with the new one, which holds other bytes. The replayed session must fail, not pass."""
    from refit_verify.compare import compare_session
    from refit_verify.digest.batch import digest_tensors

    model = _CachingLoader()
    wb = _replaying_worker(model, monkeypatch)
    old = model.norm
    new = _swap_dictionary(model)
    w = toy_weights(3)
    sid = wb.open("s3", version=3)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    assert torch.equal(old, w["norm"]) and not torch.equal(new, w["norm"])  # written where the model no longer looks
    # replayed: the worker knows the delivered norm only where the plan says it landed (the live norm)
    assert man.modules["model"].replayed == 5 and man.modules["model"].digests["norm"] == wb.baseline.params["norm"].digest
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s3", version=3)
    assert not r.ok and r.mismatched == ("norm",) and r.engine_mismatched == ("norm",) and r.verified == 4


def test_keys_re_registered_in_another_order_with_the_same_objects_keep_the_index():
    """vLLM's first layerwise reload deletes a linear layer's ``weight`` and registers it again after
    its ``bias``: the same objects under the same names, so the index (and the kept sets on it) holds."""
    lin = torch.nn.Linear(4, 3)
    idx = ModelIndex(lin)
    w = lin._parameters.pop("weight")
    lin._parameters["weight"] = w
    assert list(lin._parameters) == ["bias", "weight"]
    assert idx.unchanged(lin) and idx.fresh(lin)
    assert idx._structure.keys == ["bias", "weight"]  # the order found is recorded: the next check takes the fast path
    assert idx.fresh(lin)


def test_names_swapped_between_objects_make_the_index_stale():
    lin = torch.nn.Linear(4, 4, bias=False)
    lin.register_parameter("other", torch.nn.Parameter(torch.zeros(4, 4)))
    idx = ModelIndex(lin)
    d = lin._parameters
    w, o = d.pop("weight"), d.pop("other")
    d["other"], d["weight"] = w, o  # another order, and each name now holds the other object
    assert not idx.unchanged(lin) and not idx.fresh(lin)
    lin2 = torch.nn.Linear(4, 3)
    idx2 = ModelIndex(lin2)
    b = lin2._parameters.pop("bias")
    lin2._parameters["bias"] = torch.nn.Parameter(b.detach().clone())  # same key, same order, a new object
    assert not idx2.fresh(lin2)
