"""ModelIndex: one walk of a model's tensors, stale as soon as the model's structure changes.

A stale index would let read-back and the snapshot read a parameter object the model no longer
uses: the worst defect (verified while the engine computes with other bytes). These tests change
the structure every way a loader or ``process_weights_after_loading`` does and check that the
index is rebuilt, and that read-back and audits then see the model's live tensors.
"""

from __future__ import annotations

import torch

from refit_verify.boundary import WorkerBoundary, identity_of
from refit_verify.engine_state import audit, read_back, snapshot
from refit_verify.model_index import ModelIndex
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

    changes = [
        lambda n: setattr(n.a, "weight", torch.nn.Parameter(torch.zeros(3, 4))),  # a parameter replaced
        lambda n: n.a.register_parameter("extra", torch.nn.Parameter(torch.zeros(1))),  # one added
        lambda n: delattr(n.a, "bias"),  # one removed
        lambda n: n.register_buffer("more", torch.zeros(1)),  # a buffer added
        lambda n: setattr(n, "steps", torch.ones(1)),  # a buffer replaced
        lambda n: n._non_persistent_buffers_set.add("steps"),  # a buffer made non-persistent
        lambda n: n.b.__setitem__(1, torch.nn.LayerNorm(2)),  # a child module replaced
        lambda n: n.b[1].add_module("inner", torch.nn.Linear(1, 1)),  # a child module added deep down
        _move_bias,  # a parameter moved into a module that had none: the same names and objects in the same order
    ]
    for i, change in enumerate(changes):
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
