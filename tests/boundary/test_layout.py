"""The layout map (refit_verify.boundary.layout): direct writes, out-of-band states and deltas judged by
what the engine holds, on the toy model (tests/support/toy_model.py: a fused qkv_proj, a padded vocab
embedding, a plain norm) through the plugin's session methods (ToyEngine), as a vLLM worker runs them."""

from __future__ import annotations

import pytest
import torch

import refit_verify
from refit_verify import RefitVerificationError
from refit_verify.boundary.layout import LayoutMap, describe_region, dry_learn
from refit_verify.boundary.record import ModuleSession
from tests.support.toy_model import KV, Q, VOCAB, ToyEngine, toy_weights, toy_worker

PAD = "embed rows 13:16"


def _engine():
    worker, wb, model = toy_worker()
    return ToyEngine(worker), wb, model


def _write(model, w, *, skip=(), flip=None):
    """A worker extension's direct writes (``param.data[rows].copy_``), no load_weights; ``flip``: one
    bit of that tensor's slice flipped after the write."""
    qkv = model.qkv_proj.data
    parts = {"q_proj": qkv[:Q], "k_proj": qkv[Q:Q + KV], "v_proj": qkv[Q + KV:],
             "embed": model.embed.data[:VOCAB], "norm": model.norm.data}
    for n, t in w.items():
        if n not in skip:
            parts[n].copy_(t)
    if flip is not None:
        parts[flip].view(torch.uint8).view(-1)[3] ^= 1


def _refit(e, w, version, **kw):
    """A refit whose push is direct writes; the report (enforce raises, so log)."""
    push = kw.pop("push", _write)
    model = kw.pop("model")
    with refit_verify.refit(e, version=version, mode="log", **kw) as r:
        for n, t in w.items():
            r.add(n, t)
        push(model, w)
    (rep,) = r.reports
    return rep, r.manifests[0]


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_dry_learn_maps_fused_slices_excludes_padding_and_writes_nothing():
    _e, wb, model = _engine()
    model.qkv_proj.data.fill_(3)
    before = _state(model)
    b = wb.modules["model"]
    specs = {n: (tuple(t.shape), "bfloat16") for n, t in toy_weights(0).items()}
    m, notes = b.layout_for(specs)
    assert notes == ["dry learn of 5 names (the model's load_weights on placeholders, no write reaching the engine): 5 mapped"]
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())  # no write reached the engine
    s = m.summary()
    assert s["entries"] == {"q_proj": ["qkv_proj rows 0:8"], "k_proj": ["qkv_proj rows 8:12"], "v_proj": ["qkv_proj rows 12:16"],
                            "embed": ["embed rows 0:13"], "norm": ["norm whole"]}
    assert s["padding"] == {"embed": ["rows 13:16"]} and s["conversions"] == {} and s["unlearned"] == {}
    assert set(m.source.values()) == {"dry learn"}
    again, notes = b.layout_for(specs)  # known names, same shapes: nothing learned
    assert again is m and notes == []
    _m, notes = b.layout_for({**specs, "k_proj": ((KV, 4), "bfloat16")})
    assert notes[0] == "k_proj was mapped as [4, 8] bfloat16 and is announced as [4, 4] bfloat16: learned again"


def test_a_loader_that_changes_the_model_another_way_leaves_every_name_unlearned():
    _e, wb, model = _engine()

    def reassigning(param, loaded):  # replaces the parameter's storage (not a write a dispatch mode sees)
        param.data = loaded.clone()

    model.norm.weight_loader = reassigning
    b = wb.modules["model"]
    b.install()
    ms, failed = dry_learn(b, {"norm": ((8,), "bfloat16"), "k_proj": ((KV, 8), "bfloat16")}, lambda: ModuleSession(b, True))
    assert set(failed) == {"norm", "k_proj"} and "cannot be learned dry" in failed["norm"]
    assert ms.placed == {}


def test_a_name_the_model_refuses_is_not_provable_and_fails():
    e, _wb, model = _engine()
    w = {**toy_weights(1), "unknown.weight": torch.ones(4, dtype=torch.bfloat16)}
    rep, man = _refit(e, w, 1, model=model, push=lambda m, w: _write(m, {n: t for n, t in w.items() if n != "unknown.weight"}))
    assert not rep.ok and rep.missing == ("unknown.weight",)
    assert "unknown.weight" in man.modules["model"].not_provable
    assert any("cannot be judged by its state (not provable): unknown.weight" in p for p in rep.problems)


def test_direct_writes_verified_then_a_flipped_k_slice_and_a_forgotten_tensor_named():
    e, _wb, model = _engine()
    w = toy_weights(1)
    rep, man = _refit(e, w, 1, model=model)
    assert rep.ok, rep.describe()
    assert rep.verified == 5 and rep.proven_bytes == sum(t.nbytes for t in w.values()) and rep.unproven_bytes == 0
    assert man.modules["model"].by_state["k_proj"] == "qkv_proj rows 8:12"
    assert rep.unchecked == (f"padding a loader fills (no trainer tensor's) in parameters judged by the engine state is excluded "
                             f"from the layout map and not compared: {PAD}",)

    rep, _ = _refit(e, toy_weights(2), 2, model=model, push=lambda m, w: _write(m, w, flip="k_proj"))
    assert (rep.mismatched, rep.engine_mismatched, rep.missing, rep.unwritten) == (("k_proj",), ("qkv_proj",), (), ())
    assert len(rep.problems) == 1 and "k_proj at qkv_proj rows 8:12" in rep.problems[0] and "worker rank 0" in rep.problems[0]

    rep, _ = _refit(e, toy_weights(3), 3, model=model, push=lambda m, w: _write(m, w, skip=("norm",)))
    assert (rep.missing, rep.unwritten, rep.mismatched, rep.problems) == (("norm",), ("norm",), (), ())


def test_a_map_learned_from_a_watched_load_needs_no_dry_learn():
    e, wb, model = _engine()
    w = toy_weights(1)
    with refit_verify.refit(e, version=1, mode="enforce") as r:
        for n, t in w.items():
            r.add(n, t)
        model.load_weights(list(w.items()))
    assert set(wb.modules["model"].layout.source.values()) == {f"session {r.session}"}
    rep, man = _refit(e, toy_weights(2), 2, model=model)
    assert rep.ok and man.modules["model"].layout is None  # nothing learned at this close


def test_sparse_delta_verified_over_the_full_state():
    e, _wb, model = _engine()
    w = toy_weights(1)
    assert _refit(e, w, 1, model=model)[0].ok
    k, norm = w["k_proj"].clone(), w["norm"].clone()
    idx = torch.tensor([1, 5, 9])
    k.view(-1)[idx] = 7
    norm[[0, 3]] = -1

    def patch(m, _w):  # sparse indices written in place, into a slice of the fused qkv and into norm
        m.qkv_proj.data[Q:Q + KV].view(-1)[idx] = 7
        m.norm.data[[0, 3]] = -1

    rep, man = _refit(e, {"k_proj": k, "norm": norm}, 2, base=1, model=model, push=patch)
    assert rep.ok, rep.describe()
    # embed: not written, compared whole by the close; q and v of the fused qkv_proj: proven unchanged
    assert man.base == 1 and man.delta == [] and man.modules["model"].unwritten == ["embed"] and rep.unchanged == 1
    assert rep.verified == 2 and rep.unchecked == ()


def test_delta_that_changes_an_unannounced_slice_is_named():
    e, _wb, model = _engine()
    w = toy_weights(1)
    assert _refit(e, w, 1, model=model)[0].ok
    k = w["k_proj"] + 1

    def patch(m, _w):
        m.qkv_proj.data[Q:Q + KV].copy_(k)
        m.qkv_proj.data[0, 0] += 1  # q, which the delta does not announce

    rep, man = _refit(e, {"k_proj": k}, 2, base=1, model=model, push=patch)
    assert not rep.ok and rep.mismatched == ()
    assert rep.problems == ("delta refit: qkv_proj: rows 0:8 changed since the last close, and this delta did not announce them",)


def test_delta_on_a_stale_or_unverified_base_is_named():
    e, _wb, model = _engine()
    w = toy_weights(1)
    assert _refit(e, w, 1, model=model)[0].ok
    assert _refit(e, w, 2, model=model)[0].ok
    k = w["k_proj"] + 1
    rep, man = _refit(e, {"k_proj": k}, 3, base=1, model=model)
    assert rep.problems == (f"delta refit: a delta on version 1, but the last session closed on this worker ({man.base_session!r}) "
                            "holds version 2",)
    # version 3's session failed: a delta on it names the failed verdict
    rep, man = _refit(e, {"k_proj": k + 1}, 4, base=3, model=model)
    assert len(rep.problems) == 1 and rep.problems[0].startswith(f"delta refit: it applies to the state session {man.base_session!r} "
                                                                 "left, which failed in this trainer")
    with pytest.raises(refit_verify.RefitConfigError, match="older than its version"):
        refit_verify.refit(e, version=5, base=5)


def test_verify_state_after_an_out_of_band_restore():
    e, _wb, model = _engine()
    w = toy_weights(4)
    _write(model, w)  # a restore: no refit open
    (rep,) = refit_verify.verify_state(e, w, version=1, mode="enforce")
    assert rep.ok and rep.verified == 5 and rep.proven_bytes == sum(t.nbytes for t in w.values())
    other = {**w, "v_proj": w["v_proj"] + 1}
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(e, other, version=2, mode="enforce")
    rep = ei.value.report
    assert (rep.mismatched, rep.engine_mismatched, rep.missing) == (("v_proj",), ("qkv_proj",), ())
    assert "v_proj at qkv_proj rows 12:16" in rep.problems[0]
    partial = {n: t for n, t in w.items() if n != "norm"}
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(e, partial, version=3, mode="enforce")
    assert ei.value.report.unwritten == ("norm",)  # a parameter no tensor covers


def test_describe_region():
    assert describe_region((16, (2, 8), (8, 1)), (4, 8)) == "rows 2:4"
    assert describe_region((0, (4, 8), (8, 1)), (4, 8)) == "whole"
    assert describe_region((1, (2, 2), (8, 1)), (4, 8)) == "offset 1 shape [2, 2] stride [8, 1]"
    assert LayoutMap(None).why_not("x").startswith("no load placed it")


def test_a_tied_name_the_model_skips_maps_to_the_tensor_it_shares():
    """A tied lm_head (the embedding's parameter under a second name, skipped by load_weights as vLLM
    skips one name of a tied pair): a direct write of the embedding proves lm_head.weight too, and a
    trainer sending other bytes for lm_head is named."""
    from tests.support.toy_model import ToyModel, default_weight_loader

    class Tied(ToyModel):
        def __init__(self) -> None:
            super().__init__()
            self.lm_head = self.embed  # one Parameter, two names

        def load_weights(self, weights):
            return super().load_weights((n, t) for n, t in weights if n != "lm_head")

    worker, wb, model = toy_worker(Tied(), default_weight_loader)
    e = ToyEngine(worker)
    w = toy_weights(1)
    w["lm_head"] = w["embed"]
    rep, man = _refit(e, w, 1, model=model, push=lambda m, w: _write(m, {n: t for n, t in w.items() if n != "lm_head"}))
    assert rep.ok and rep.verified == 6, rep.describe()
    assert wb.modules["model"].layout.source["lm_head"] == "tied to embed (dry learn)"
    other = {**w, "embed": toy_weights(2)["embed"], "lm_head": toy_weights(3)["embed"]}
    rep, _ = _refit(e, other, 2, model=model, push=lambda m, w: _write(m, {n: t for n, t in w.items() if n != "lm_head"}))
    assert rep.mismatched == ("lm_head",) and rep.engine_mismatched == ("embed",)


# --------------------------------------------------------------------------- tensor-parallel shards (slices)


def _tp2():
    """Two toy workers of one TP=2 engine (ShardedToyModel ranks 0 and 1) and their models."""
    from tests.support.toy_model import ShardedToyModel

    models_ = [ShardedToyModel(r) for r in range(2)]
    workers = [toy_worker(m, rank=r) for r, m in enumerate(models_)]
    return ToyEngine(*(w for w, _wb, _m in workers)), [wb for _w, wb, _m in workers], models_


def _shard_write(models_, w, *, skip=(), flip=None):
    """Each rank's direct writes of its shards; ``flip``: ``(rank, name)`` of one bit flipped there."""
    for m in models_:
        for n, t in w.items():
            if n not in skip:
                m.engine_slice(n).copy_(m.shard(n, t))
    if flip is not None:
        r, n = flip
        models_[r].engine_slice(n).view(torch.uint8).view(-1)[5] ^= 1


def _tp_refit(e, models_, w, version, push=None, **kw):
    with refit_verify.refit(e, version=version, mode="log", **kw) as r:
        for n, t in w.items():
            r.add(n, t)
        (push or _shard_write)(models_, w)
    return r.reports, r.manifests


def _shard_bytes(m, w):
    return sum(m.shard(n, t)[: m.engine_slice(n).shape[0]].nbytes if n == "embed" else m.shard(n, t).nbytes for n, t in w.items())


def test_dry_learn_maps_each_ranks_shards_as_slices_and_excludes_vocab_padding():
    from tests.support.toy_model import sharded_weights

    _e, wbs, _models = _tp2()
    specs = {n: (tuple(t.shape), "bfloat16") for n, t in sharded_weights(0).items()}
    m1, notes = wbs[1].modules["model"].layout_for(specs)
    assert notes == ["dry learn of 6 names (the model's load_weights on placeholders, no write reaching the engine): 6 mapped"]
    s = m1.summary()
    assert s["entries"] == {"norm": ["norm whole"]}  # replicated: the whole tensor
    assert s["slices"] == {"q_proj": ["qkv_proj rows 0:4 <- dim 0 [4:8]"], "k_proj": ["qkv_proj rows 4:6 <- dim 0 [2:4]"],
                           "v_proj": ["qkv_proj rows 6:8 <- dim 0 [2:4]"], "o_proj": ["o_proj whole <- dim 1 [4:8]"],
                           "embed": ["embed rows 0:5 <- dim 0 [8:13]"]}
    assert s["padding"] == {"embed": ["rows 5:8"]} and s["sliced"] == {} and s["unlearned"] == {}
    m0, _ = wbs[0].modules["model"].layout_for(specs)
    assert m0.summary()["slices"]["o_proj"] == ["o_proj whole <- dim 1 [0:4]"] and m0.padding == {}


def test_tp2_direct_writes_verified_then_one_byte_in_rank_1s_row_parallel_shard_named():
    from tests.support.toy_model import sharded_weights

    e, _wbs, models_ = _tp2()
    w = sharded_weights(1)
    reps, mans = _tp_refit(e, models_, w, 1)
    for r, (rep, man) in enumerate(zip(reps, mans)):
        assert rep.ok and rep.rank == r and rep.verified == 6, rep.describe()
        assert (rep.proven_bytes, rep.unproven_bytes) == (_shard_bytes(models_[r], w), 0)
        assert man.modules["model"].by_state["o_proj"] == f"o_proj whole <- dim 1 [{4 * r}:{4 * r + 4}]"
    assert reps[1].unchecked == ("padding a loader fills (no trainer tensor's) in parameters judged by the engine state is "
                                 "excluded from the layout map and not compared: embed rows 5:8",)

    reps, _ = _tp_refit(e, models_, sharded_weights(2), 2, push=lambda ms, w: _shard_write(ms, w, flip=(1, "o_proj")))
    assert reps[0].ok, reps[0].describe()
    bad = reps[1]
    assert (bad.mismatched, bad.engine_mismatched, bad.missing, bad.unwritten) == (("o_proj",), ("o_proj",), (), ())
    assert bad.verified == 5 and len(bad.problems) == 1
    assert "o_proj at o_proj whole (its slice dim 1 [4:8])" in bad.problems[0] and "worker rank 1" in bad.problems[0]
    assert bad.proven_bytes == _shard_bytes(models_[1], w) - models_[1].o_proj.nbytes

    reps, _ = _tp_refit(e, models_, sharded_weights(3), 3, push=lambda ms, w: _shard_write(ms, w, skip=("k_proj",)))
    for rep in reps:  # every region of k as the last close left it: not written
        assert (rep.missing, rep.unwritten, rep.mismatched) == (("k_proj",), ("qkv_proj",), ()), rep.describe()


def test_tp2_slices_learned_from_a_watched_load_and_verify_state():
    from tests.support.toy_model import sharded_weights

    e, wbs, models_ = _tp2()
    w = sharded_weights(4)
    with refit_verify.refit(e, version=1, mode="enforce") as r:
        for n, t in w.items():
            r.add(n, t)
        for m in models_:
            m.load_weights(list(w.items()))
    assert all(rep.ok for rep in r.reports)
    assert wbs[1].modules["model"].layout.summary()["slices"]["o_proj"] == ["o_proj whole <- dim 1 [4:8]"]
    assert set(wbs[1].modules["model"].layout.source.values()) == {f"session {r.session}"}
    w2 = sharded_weights(5)
    reps, mans = _tp_refit(e, models_, w2, 2)
    assert all(rep.ok for rep in reps) and mans[1].modules["model"].layout is None  # no dry learn: the watched load taught it

    reps = refit_verify.verify_state(e, w2, version=3, mode="enforce")
    assert [(rep.ok, rep.verified) for rep in reps] == [(True, 6), (True, 6)]
    other = {**w2, "embed": w2["embed"].clone()}
    other["embed"][10, 0] += 1  # a row of rank 1's vocab shard
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(e, other, version=4, mode="enforce")
    rep = ei.value.report
    assert rep.rank == 1 and (rep.mismatched, rep.engine_mismatched) == (("embed",), ("embed",))
    assert "embed at embed rows 0:5 (its slice dim 0 [8:13])" in rep.problems[0]


def test_a_shard_the_trainer_did_not_keep_is_not_provable():
    """One worker only (the trainer keeps no tensors): a name its map holds as a slice fails, never passes."""
    from tests.support.toy_model import ShardedToyModel, sharded_weights

    m = ShardedToyModel(1)
    worker, _wb, _m = toy_worker(m, rank=1)
    e = ToyEngine(worker)
    w = sharded_weights(6)
    (rep,), _ = _tp_refit(e, [m], w, 1)
    assert not rep.ok and rep.verified == 1 and set(rep.missing) == set(w) - {"norm"}
    assert any("the trainer did not keep the tensor" in p for p in rep.problems)
