"""Read-back of the regions a weight loader fills itself (vocab padding rows), watched and replayed.

The toy model's embedding loader copies the 13 delivered rows and zero-fills the 3 padding rows, as
vLLM's ``VocabParallelEmbedding`` does (tests/support/toy_model.py). The loader tap records the fill
and its value (``placement.Copy.value``); the close reads the padding rows back and compares them
with a tensor of that value: padding that holds other bytes (written over after the load, or filled
by a loader swapped in under a replayed plan) is a mismatch, never counted as filled. A fill whose
value was not recorded is not read, and the parameter says so.
"""

from __future__ import annotations

import pytest
import torch


from refit_verify.engine import state as engine_state

from refit_verify.engine import fills, readback
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors, tensor_digest
from refit_verify.boundary.placement import Copy
from tests.support.toy_model import HIDDEN, KV, Q, VOCAB, ToyModel, default_weight_loader, toy_weights

QKV_BYTES = (Q + 2 * KV) * HIDDEN * 2
EMBED_BYTES = VOCAB * HIDDEN * 2  # the delivered rows
NORM_BYTES = HIDDEN * 2
ALL = QKV_BYTES + EMBED_BYTES + NORM_BYTES
PAD = 3  # padding rows of the embedding (16 - 13)
PAD_BYTES = PAD * HIDDEN * 2


@pytest.fixture
def landed(monkeypatch):
    """Landing digests and plan replay on the CPU, as on CUDA workers (tests/boundary/test_plan.py)."""
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)


def _worker(model: ToyModel | None = None, *, state: bool = False) -> tuple[WorkerBoundary, ToyModel]:
    """A worker boundary over ``model``; ``state``: with the close's engine-state snapshot and audit
    (what plan replay needs, and the kept read-back program rides on)."""
    model = model or ToyModel()
    wb = WorkerBoundary(identity_of(rank=0, device="cpu"))
    wb.readback = engine_state.read_back
    if state:
        wb.snapshotter, wb.auditor = engine_state.snapshot, engine_state.audit
    wb.attach("model", model, default_weight_loader)
    return wb, model


def _refit(wb, model, w, version, *, after_load=None, replay=True):
    """One session of one list call; ``after_load(model)`` runs after the load, before the close;
    ``replay``: the session may replay the module's plan (False: the tap watches every load)."""
    sid = wb.open(f"s{version}", version=version, replay=replay)
    model.load_weights(list(w.items()))
    if after_load is not None:
        after_load(model)
    man = wb.close(sid)
    return man, compare_session({"model": digest_tensors(w.items())}, man, session=f"s{version}", version=version)


def _scribble(model):
    """Something writes 7s into the embedding's padding rows after its loader zeroed them."""
    model.embed.data[VOCAB:] = 7


def _clean(man, r):
    st = man.engine.params["embed"]
    assert r.ok, r.describe()
    assert st.status == "verified" and st.why is None and st.bytes == EMBED_BYTES
    assert man.engine.padding_bytes == PAD_BYTES and man.engine.unproven_bytes == 0
    assert man.engine.proven_bytes == ALL


def _caught(man, r, value="0"):
    st = man.engine.params["embed"]
    assert st.status == "mismatch", st
    assert f"padding the loader filled at offset {VOCAB * HIDDEN} shape [{PAD}, {HIDDEN}]" in st.why
    assert f"holds other bytes than the loader's fill ({value})" in st.why
    assert "delivered in" not in st.why  # the delivered rows hold what was delivered: only the padding is named
    assert st.bytes == EMBED_BYTES + PAD_BYTES
    assert man.engine.padding_bytes == 0  # not credited
    assert man.engine.proven_bytes == QKV_BYTES + NORM_BYTES
    assert man.engine.unproven_bytes == EMBED_BYTES + PAD_BYTES
    assert not r.ok and r.engine_mismatched == ("embed",) and r.mismatched == ()
    assert "embed" in r.describe()


def test_the_tap_records_the_fill_value():
    """``zero_`` -> 0, ``fill_(scalar)`` -> the scalar, ``fill_(0-dim CPU tensor)`` -> its value;
    a tensor elsewhere, or a value taken from the loaded tensor, is unknown with the reason."""
    seen = {}

    def rows_then(fill):
        def loader(param, loaded_weight):
            param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
            fill(param[loaded_weight.shape[0]:].data, loaded_weight)
        return loader

    fills = {
        "zero": lambda t, w: t.zero_(),
        "scalar": lambda t, w: t.fill_(5),
        "cpu tensor": lambda t, w: t.fill_(torch.tensor(2.5)),
        "meta tensor": lambda t, w: t.fill_(torch.tensor(0.0, device="meta")),
        "from loaded": lambda t, w: t.fill_(w[0, 0]),
        "item of loaded": lambda t, w: t.fill_(w[0, 0].item()),
    }
    for kind, fill in fills.items():
        model = ToyModel()
        model.embed.weight_loader = rows_then(fill)
        b = WorkerBoundary(identity_of(rank=0, device="cpu"))
        b.attach("model", model, default_weight_loader)
        tap = b.modules["model"].tap
        model.load_weights([("embed", toy_weights(1)["embed"])])
        (placement,) = tap.placements.values()
        copy, pad = placement.copies
        assert not copy.fill and pad.fill and placement.exact
        seen[kind] = (pad.value, pad.unknown)
        hash(pad)  # a Copy stays hashable
    assert seen["zero"] == (0, None) and seen["scalar"] == (5, None) and seen["cpu tensor"] == (2.5, None)
    assert seen["meta tensor"][0] is None and "0-dim tensor on meta" in seen["meta tensor"][1]
    assert seen["from loaded"][0] is None and "taken from the loaded tensor" in seen["from loaded"][1]
    assert seen["item of loaded"][0] is None and "read a number out of the loaded tensor" in seen["item of loaded"][1]
    assert Copy((0, (1,), (1,)), None, fill=True) == Copy((0, (1,), (1,)), None, True, None, None)  # defaults kept


def test_a_clean_watched_session_reads_its_padding(monkeypatch):
    """The padding rows are read (one more region) and proven to hold the loader's zeros."""
    read = []
    raw = readback._program

    def program(*a, **k):
        prog, views = raw(*a, **k)
        read.extend(prog.dest_keys)
        return prog, views

    monkeypatch.setattr(readback, "_program", program)
    wb, model = _worker()
    for v in (1, 2):
        read.clear()
        man, r = _refit(wb, model, toy_weights(v), v)
        _clean(man, r)
        assert "embed@pad0" in read, read
        assert bool((model.embed[VOCAB:] == 0).all())


@pytest.mark.parametrize("state", [False, True], ids=["plain", "with snapshot"])
def test_padding_written_over_after_the_load_is_a_mismatch(state):
    wb, model = _worker(state=state)
    _clean(*_refit(wb, model, toy_weights(1), 1))
    man, r = _refit(wb, model, toy_weights(2), 2, after_load=_scribble)
    _caught(man, r)
    assert bool((model.embed[:VOCAB] == toy_weights(2)["embed"]).all())  # the delivered rows are right


@pytest.mark.parametrize("compare", ["flat", "loop"])
def test_a_replayed_session_reads_its_padding(landed, monkeypatch, compare):
    """Replayed sessions (the tap off; from the third on through the kept program and the close's
    snapshot launch) read the padding the plan says was filled: clean ones prove it, one whose
    padding was written over after the load fails (it used to pass: the plan's fills were credited
    without a read). ``compare``: the kept program's flat compare, or the per-parameter loop."""
    used = []
    raw = readback._flat
    flat = (lambda prog: None) if compare == "loop" else (lambda prog: (lambda f: (used.append(f), f)[1])(raw(prog)))
    monkeypatch.setattr(readback, "_flat", flat)
    wb, model = _worker(state=True)
    for v in (1, 2, 3, 4):
        man, r = _refit(wb, model, toy_weights(v), v)
        assert man.modules["model"].replayed == (0 if v == 1 else 5)
        _clean(man, r)
    man, r = _refit(wb, model, toy_weights(5), 5, after_load=_scribble)
    assert man.modules["model"].replayed == 5
    _caught(man, r)
    prog = wb.modules["model"].index(refresh=False).kept["read_back"][1]  # the kept program reads the padding rows
    assert any(g == (VOCAB * HIDDEN, (PAD, HIDDEN), (HIDDEN, 1)) for _, g in prog.dest_regions)
    if compare == "flat":  # the flat pass compares the padding too (a fill entry is never skipped there)
        assert any(f is not None and f.fkeys for f in used)
    # a correct padding again: verified, through the same kept program
    man, r = _refit(wb, model, toy_weights(6), 6)
    assert man.modules["model"].replayed == 5
    _clean(man, r)


def test_a_loader_swapped_under_a_replayed_plan_that_fills_other_bytes_is_caught(landed):
    """The embedding keeps its parameter object, but its loader is swapped for one that fills the
    padding with 7s: the replayed session (the tap off) reads the padding and names it."""
    wb, model = _worker(state=True)
    for v in (1, 2):
        _clean(*_refit(wb, model, toy_weights(v), v))

    def sevens(param, loaded_weight):
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(7)

    model.embed.weight_loader = sevens  # the same parameter object, another loader
    man, r = _refit(wb, model, toy_weights(3), 3)
    assert man.modules["model"].replayed == 5
    assert bool((model.embed[VOCAB:] == 7).all())
    _caught(man, r)


class _FiveFill(ToyModel):
    """An embedding loader that fills the padding with 5s (``fill_(5)``)."""

    def _embed_loader(self, param, loaded_weight):
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(5)


@pytest.mark.parametrize("replay", [False, True], ids=["watched", "replayed"])
def test_a_non_zero_fill_is_read_back_against_its_value(landed, replay):
    wb, model = _worker(_FiveFill(), state=True)
    for v in (1, 2, 3):
        man, r = _refit(wb, model, toy_weights(v), v, replay=replay)
        assert man.modules["model"].replayed == (5 if replay and v > 1 else 0)
        _clean(man, r)
        assert bool((model.embed[VOCAB:] == 5).all())
    pad = model.embed[VOCAB:]
    assert fills.fill_hex(torch.bfloat16, (PAD, HIDDEN), 5) == tensor_digest(pad)  # the expected digest is of 5s
    assert fills.fill_hex(torch.bfloat16, (PAD, HIDDEN), 5) != fills.fill_hex(torch.bfloat16, (PAD, HIDDEN), 0)

    def zeros(m):
        m.embed.data[VOCAB:] = 0  # the bytes of another fill (a loader that zeroes) are not the loader's 5s

    man, r = _refit(wb, model, toy_weights(4), 4, after_load=zeros, replay=replay)
    assert man.modules["model"].replayed == (5 if replay else 0)
    _caught(man, r, value="5")


class _DeviceFill(ToyModel):
    """An embedding loader that fills the padding from a 0-dim tensor that is not on the CPU (a
    device tensor, simulated on the meta device): its value is not read (no device sync)."""

    def _embed_loader(self, param, loaded_weight):
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(torch.tensor(0.0, device="meta"))


class _ItemFill(ToyModel):
    """An embedding loader that fills the padding with a value read from the loaded tensor: it
    changes with the weights, so the placement learned once cannot keep it."""

    def _embed_loader(self, param, loaded_weight):
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        param[loaded_weight.shape[0]:].data.fill_(loaded_weight[0, 0].item())


@pytest.mark.parametrize("model_cls, reason", [(_DeviceFill, "0-dim tensor on meta"),
                                                (_ItemFill, "read a number out of the loaded tensor")],
                         ids=["device tensor", "value of the weights"])
def test_a_fill_of_unknown_value_is_unproven_with_its_reason(model_cls, reason):
    """Not read, never counted as padding: its bytes are unproven, the embedding is not coverable
    with the reason (its delivered rows are still compared and proven), and the report says so.
    The fill from the weights changes every refit: had the first value been kept, every later
    session would report a false mismatch."""
    wb, model = _worker(model_cls())
    for v in (1, 2, 3):
        man, r = _refit(wb, model, toy_weights(v), v)
        st = man.engine.params["embed"]
        assert st.status == "not_coverable", st
        assert f"{PAD_BYTES} bytes the loader filled itself were not read back" in st.why and reason in st.why
        assert man.engine.padding_bytes == 0
        assert man.engine.unproven_bytes == PAD_BYTES and man.engine.proven_bytes == ALL
        assert r.ok and "embed" in r.not_proven and reason in r.not_proven["embed"]
    # its delivered rows are still compared: other bytes there are a mismatch
    man, r = _refit(wb, model, toy_weights(4), 4, after_load=lambda m: m.embed.data[0].add_(1))
    st = man.engine.params["embed"]
    assert st.status == "mismatch" and "delivered in embed" in st.why and st.bytes == EMBED_BYTES + PAD_BYTES
    assert man.engine.unproven_bytes == EMBED_BYTES + PAD_BYTES and man.engine.padding_bytes == 0
    assert not r.ok and r.engine_mismatched == ("embed",)


class _OnlyFill(ToyModel):
    """The norm's loader ignores the delivered tensor and zeroes the parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.norm.weight_loader = lambda param, loaded_weight: param.data.zero_()


def test_a_parameter_written_only_by_fills_stays_not_coverable_and_its_fill_is_read():
    """Nothing delivered landed in it: not coverable ("only padding was written"), as before; its
    fill is read all the same, and other bytes there are a mismatch."""
    wb, model = _worker(_OnlyFill())
    man, r = _refit(wb, model, toy_weights(1), 1)
    st = man.engine.params["norm"]
    assert st.status == "not_coverable" and st.why == "only padding was written" and st.bytes == NORM_BYTES
    assert man.engine.padding_bytes == PAD_BYTES + NORM_BYTES
    assert man.engine.unproven_bytes == 0  # its bytes are counted once: as padding that holds its fill
    man, r = _refit(wb, model, toy_weights(2), 2, after_load=lambda m: m.norm.data.fill_(3))
    st = man.engine.params["norm"]
    assert st.status == "mismatch" and "holds other bytes than the loader's fill (0)" in st.why
    assert man.engine.padding_bytes == PAD_BYTES and not r.ok and "norm" in r.engine_mismatched
    assert man.engine.unproven_bytes == NORM_BYTES


class _ZeroThenRows(ToyModel):
    """An embedding loader that zeroes the whole parameter, then copies the delivered rows over
    part of it (as a block-aligned MoE loader fills its destination then copies a narrower block):
    what the filled region holds is not one value, so it is not read, and says why."""

    def _embed_loader(self, param, loaded_weight):
        param.data.zero_()
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)


def test_a_fill_a_delivered_block_overlaps_is_not_read():
    wb, model = _worker(_ZeroThenRows())
    man, r = _refit(wb, model, toy_weights(1), 1)
    st = man.engine.params["embed"]
    assert st.status == "not_coverable" and "a delivered block was written over part of it" in st.why, st
    assert man.engine.padding_bytes == 0 and man.engine.unproven_bytes == 16 * HIDDEN * 2
    assert r.ok and man.engine.proven_bytes == ALL  # the delivered rows are compared and hold
    assert not fills.overlap((VOCAB * HIDDEN, (PAD, HIDDEN), (HIDDEN, 1)), (0, (VOCAB, HIDDEN), (HIDDEN, 1)))
    assert fills.overlap((0, (4, 2), (4, 1)), (1, (4, 2), (4, 1)))  # columns 0-1 and 1-2 of a 4x4
    assert not fills.overlap((0, (4, 2), (4, 1)), (2, (4, 2), (4, 1)))  # interleaved spans, no shared element


class _WideViewFill(ToyModel):
    """An embedding loader that zeroes the padding rows through a view of a wider dtype (32-bit
    words over the bf16 parameter): the recorded geometry would be in int32 elements, half the
    padding read as bf16 (a fresh reviewer's case)."""

    def _embed_loader(self, param, loaded_weight):
        param[: loaded_weight.shape[0]].data.copy_(loaded_weight)
        words = param.data.view(torch.int32)  # [16, 4]
        words[loaded_weight.shape[0]:].zero_()


@pytest.mark.parametrize("replay", [False, True], ids=["watched", "replayed"])
def test_a_fill_through_a_view_of_another_dtype_is_not_credited(landed, replay):
    """The placement is inexact (the loader writes through a view of another dtype): the embedding
    is not coverable with that reason, and no padding is counted, clean or with 7s in the second
    half of the padding (which the int32-unit geometry would have missed)."""
    wb, model = _worker(_WideViewFill(), state=True)
    for v in range(1, 5):
        scribble = v >= 3
        man, r = _refit(wb, model, toy_weights(v), v, replay=replay,
                        after_load=(lambda m: m.embed.data.view(-1)[VOCAB * HIDDEN + 12:].fill_(7)) if scribble else None)
        st = man.engine.params["embed"]
        assert st.status == "not_coverable" and "through a view of another dtype" in st.why, st
        assert man.engine.padding_bytes == 0, (v, man.engine)
        assert "embed" in r.not_proven and "embed" not in {n for n in r.engine_mismatched}


def test_overlap_is_exact_on_small_spans_and_says_when_it_cannot_tell():
    """Filled columns beside delivered columns (interleaved spans): exact on a span of at most
    ``MASK_MAX`` elements, None beyond (the fill is then not read, and the reason says it may share
    elements), never a mask of more than ``MASK_MAX`` bytes."""
    cols, rows = 64, 4
    block = (0, (rows, cols - 8), (cols, 1))  # the first 56 columns of each row
    pad = (cols - 8, (rows, 8), (cols, 1))  # the last 8
    assert fills.overlap(block, pad) is False and fills.overlap(pad, (cols - 9, (rows, 2), (cols, 1))) is True
    big = fills.MASK_MAX // cols + 2  # rows: the spans meet over more than MASK_MAX elements
    assert fills.overlap((0, (big, cols - 8), (cols, 1)), (cols - 8, (big, 8), (cols, 1))) is None
    assert fills.first_overlap(pad, [block]) is False
    assert fills.first_overlap((cols - 8, (big, 8), (cols, 1)), [(0, (big, cols - 8), (cols, 1)), block]) is None
    p = torch.zeros(big, cols, dtype=torch.bfloat16)
    read, unread = fills.fill_plan(p, [((cols - 8, (big, 8), (cols, 1)), Copy((cols - 8, (big, 8), (cols, 1)), None, True, 0))],
                                       [(0, (big, cols - 8), (cols, 1))])
    assert read == [] and len(unread) == 1 and "may share elements with it" in unread[0][1]
