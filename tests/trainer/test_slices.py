"""The trainer's side of slices judged by the engine state (refit_verify.trainer.slices), on the toy
TP=2 model (tests/support/toy_model.py ShardedToyModel, two workers of one engine): what the trainer
keeps, when it digests, and a tensor changed after r.add."""

from __future__ import annotations

import refit_verify
from refit_verify.trainer.slices import resolve
from tests.support.toy_model import ShardedToyModel, ToyEngine, ToyModel, sharded_weights, toy_weights, toy_worker


def _tp2():
    ms = [ShardedToyModel(r) for r in range(2)]
    return ToyEngine(*(toy_worker(m, rank=r)[0] for r, m in enumerate(ms))), ms


def _write(ms, w):
    for m in ms:
        for n, t in w.items():
            m.engine_slice(n).copy_(m.shard(n, t))


def test_one_worker_keeps_nothing_and_a_close_without_slices_runs_nothing():
    worker, _wb, model = toy_worker(ToyModel())
    e = ToyEngine(worker)
    w = toy_weights(1)
    with refit_verify.refit(e, version=1, mode="enforce") as r:
        assert r._kept is None  # one worker (TP=1): no tensor is held for the close
        for n, t in w.items():
            r.add(n, t)
        model.load_weights(list(w.items()))
    assert r.reports[0].ok
    mans = list(r.manifests)
    assert resolve(mans, {}, {}) is mans  # no worker reported a slice: the same list back, nothing digested


def test_two_workers_keep_the_added_tensors_until_the_close():
    e, ms = _tp2()
    w = sharded_weights(1)
    with refit_verify.refit(e, version=1, mode="enforce") as r:
        for n, t in w.items():
            r.add(n, t)
        assert set(r._kept["model"]) == set(w) and r._kept["model"]["o_proj"][0] is w["o_proj"]
        _write(ms, w)
    assert r._kept is None and all(rep.ok for rep in r.reports)
    assert [len(m.modules["model"].state_slices) for m in r.manifests] == [5, 5]


def test_a_tensor_changed_after_add_is_not_provable():
    e, ms = _tp2()
    w = sharded_weights(2)
    with refit_verify.refit(e, version=1, mode="log") as r:
        for n, t in w.items():
            r.add(n, t)
        _write(ms, w)
        w["o_proj"].add_(1)  # the trainer's tensor changes after r.add (copy=True digested it as added)
    for rep in r.reports:
        assert not rep.ok and rep.missing == ("o_proj",) and rep.mismatched == ()
        assert any("o_proj (its regions hold slices of it, and the trainer's tensor changed after r.add" in p for p in rep.problems)


def test_a_tensor_whose_bytes_changed_after_add_unseen_by_its_version_counter_is_not_provable():
    """Overwritten after r.add through a path its version counter does not see (numpy here; DLPack,
    shared memory, ``.data``) and the new bytes written: the slices of what the trainer holds now match
    the engine, but the trainer's tensor is not what r.add digested, so the name is not provable."""
    import torch

    e, ms = _tp2()
    w = sharded_weights(2)
    with refit_verify.refit(e, version=1, mode="log") as r:
        for n, t in w.items():
            r.add(n, t)
        w["o_proj"].view(torch.int16).numpy()[:] += 1
        _write(ms, w)
    for rep in r.reports:
        assert not rep.ok and rep.missing == ("o_proj",) and rep.mismatched == ()
        assert any("o_proj (its regions hold slices of it, and the trainer's tensor holds other bytes than it did at r.add"
                   in p for p in rep.problems), rep.problems
    w = sharded_weights(3)
    with refit_verify.refit(e, version=2, mode="enforce") as r:  # untouched: verified
        for n, t in w.items():
            r.add(n, t)
        _write(ms, w)
    assert all(rep.ok for rep in r.reports)
