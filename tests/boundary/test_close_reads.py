"""One pass over engine memory per close (refit_verify.boundary.close_reads): the state and the regions
inside fused parameters in one launch, whole-parameter regions from the state's digests, on the toy
model (a fused ``qkv_proj`` written in q / k / v rows, an ``embed`` with padding rows, a ``norm``)."""

from __future__ import annotations

import pytest
import torch

from refit_verify.boundary import close_reads
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors, tensor_digest
from tests.support.toy_model import toy_weights, toy_worker, untimed


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _loaded(wb, model, w, v):
    sid = wb.open(f"s{v}", version=v)
    model.load_weights(list(w.items()))
    return wb.close(sid)




def test_a_watched_close_reads_the_state_and_the_fused_regions_in_one_pass(monkeypatch):
    _, wb, model = toy_worker()
    state = _nbytes(model.qkv_proj, model.embed, model.norm)
    regions = _nbytes(model.qkv_proj, model.embed)  # q, k, v rows; the embedding's rows and its padding rows
    one = [_loaded(wb, model, toy_weights(v), v) for v in (1, 2)]
    for man in one:
        assert man.reads.passes == 1 and man.reads.why == [] and man.reads.state_bytes == state
        assert man.reads.bytes == state + regions
    monkeypatch.setattr(close_reads, "ONE_PASS", False)  # each step reads its own regions, as before
    _, wb2, model2 = toy_worker()
    two = [_loaded(wb2, model2, toy_weights(v), v) for v in (1, 2)]
    for a, b in zip(one, two):
        assert untimed(a) == untimed(b) and a.errors == b.errors == []
        assert b.reads.passes == 2 and b.reads.bytes == state + regions
        assert b.reads.why == [f"read-back: 5 regions ({regions} bytes) read after the state's pass: one-pass closes are off"]
    r = compare_session({"model": digest_tensors(toy_weights(2).items())}, one[1], version=2)
    assert r.ok and r.proven_bytes == _nbytes(*toy_weights(2).values())


def test_names_judged_by_the_state_take_their_regions_from_the_one_pass():
    """Direct writes (no load_weights): the layout map's regions of the announced names are read in
    the snapshot's launch; one byte flipped in the k rows is still named."""
    _, wb, model = toy_worker()
    _loaded(wb, model, toy_weights(1), 1)  # a watched load teaches the layout map
    state = _nbytes(model.qkv_proj, model.embed, model.norm)
    for v, flip in ((2, False), (3, True)):
        w = toy_weights(v)
        expected = {"model": {n: (tensor_digest(t), tuple(t.shape), "bfloat16") for n, t in w.items()}}
        sid = wb.open(f"s{v}", version=v)
        q, kv = w["q_proj"].shape[0], w["k_proj"].shape[0]
        model.qkv_proj.data.copy_(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))
        model.embed.data[: w["embed"].shape[0]].copy_(w["embed"])
        model.norm.data.copy_(w["norm"])
        if flip:
            model.qkv_proj.data[q:q + kv].view(torch.uint8).view(-1)[5] ^= 1
        man = wb.close(sid, expected=expected)
        assert man.reads.passes == 1 and man.reads.why == [] and man.reads.state_bytes == state, man.reads
        # the q, k, v rows and the embedding's rows beside the state; the norm is the whole parameter: its state digest
        assert man.reads.bytes == state + _nbytes(model.qkv_proj) + _nbytes(w["embed"]), man.reads
        # judged after the snapshot: its records of the parameters judging found written say this version
        assert {n: st.written_version for n, st in wb.baseline.params.items()} == {"qkv_proj": v, "embed": v, "norm": v}
        assert wb.baseline.params["norm"].replicated and not wb.baseline.params["qkv_proj"].replicated
        r = compare_session({"model": {n: h for n, (h, _s, _d) in expected["model"].items()}}, man, version=v)
        assert r.ok == (not flip) and list(r.mismatched) == (["k_proj"] if flip else []), r.describe()


def test_a_failed_snapshot_leaves_the_read_back_its_own_pass_and_says_why():
    _, wb, model = toy_worker()

    def broken(*a, **k):
        raise RuntimeError("device lost")

    wb.snapshotter = broken
    man = _loaded(wb, model, toy_weights(1), 1)
    regions = _nbytes(model.qkv_proj, model.embed)
    assert man.reads.passes == 1 and man.reads.state_bytes == 0 and man.reads.bytes == regions + _nbytes(model.norm)
    assert man.reads.why == [f"read-back: 6 regions ({regions + _nbytes(model.norm)} bytes) read after the state's pass: "
                             "the engine-state snapshot did not run or failed"]


def test_a_replayed_close_with_no_kept_program_to_ride_takes_its_regions_from_the_one_pass(monkeypatch):
    """Plan replay (landing digests, as on CUDA workers; forced on the CPU here): the first replayed
    close of a plan, and the first after a parameter was given new memory (the state set rebuilt),
    have no kept read-back program for the snapshot to ride (``_riding`` None); their regions are
    read beside the state as the close planned them, and the read-back program built at that close
    takes them from there: one pass, not a second read of the same regions. A k row changed after
    such a replayed load is still named."""
    from refit_verify.engine import state as engine_state

    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)
    rode = []
    raw = engine_state._riding
    monkeypatch.setattr(engine_state, "_riding", lambda *a: (lambda p: (rode.append(p is not None), p)[1])(raw(*a)))
    _, wb, model = toy_worker()
    state = _nbytes(model.qkv_proj, model.embed, model.norm)
    regions = _nbytes(model.qkv_proj, model.embed)  # q, k, v rows; the embedding's rows and its padding rows
    for v in range(1, 7):
        if v == 4:  # new memory, the same bytes, between closes: the state set and its kept programs are built again
            model.qkv_proj.data = model.qkv_proj.data.clone()
        rode.clear()
        w = toy_weights(v)
        sid = wb.open(f"s{v}", version=v)
        model.load_weights(list(w.items()))
        if v == 5:
            model.qkv_proj.data[w["q_proj"].shape[0], 0] += 1  # k's first row, after the replayed load
        man = wb.close(sid)
        assert man.modules["model"].replayed == (0 if v == 1 else 5), (v, man.modules["model"])
        assert rode == [v not in (1, 2, 4)], (v, rode)  # 2 and 4 (replayed): the case that took two passes
        assert man.reads.passes == 1 and man.reads.why == [], (v, man.reads)
        assert man.reads.state_bytes == state and man.reads.bytes == state + regions, (v, man.reads)
        r = compare_session({"model": digest_tensors(w.items())}, man, version=v)
        if v == 5:
            assert not r.ok and list(r.mismatched) == ["k_proj"] and "qkv_proj" in r.engine_mismatched, r.describe()
        else:
            assert r.ok and r.proven_bytes == _nbytes(*w.values()), (v, r.describe())


def test_a_close_on_the_kernel_path_reads_a_fused_parameter_once(monkeypatch):
    """q / k / v rows of 512 KiB each in a 1.5 MiB ``qkv_proj``: on the Triton kernels (the
    interpreter here, CUDA in an engine) the regions read beside the state take their superblocks
    from the parameter's read, so the close reads about the state's bytes once (only the small
    embedding rows again); on the CPU's compiled batch it reads the fused rows twice. Same manifests."""
    import os

    from tests.support import toy_model, triton_interp

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is not on in this process")
    triton_interp.install()
    monkeypatch.setattr(toy_model, "HIDDEN", 1024)
    monkeypatch.setattr(toy_model, "Q", 256)
    monkeypatch.setattr(toy_model, "KV", 256)
    w = toy_weights(1)
    want = digest_tensors(w.items())
    mans = {}
    for path, types in (("batch", frozenset()), ("kernels", frozenset({"cpu"}))):
        monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", types)
        _, wb, model = toy_worker()
        assert model.qkv_proj.numel() * 2 == 3 * 512 * 1024
        mans[path] = _loaded(wb, model, w, 1)
    state = _nbytes(model.qkv_proj, model.embed, model.norm)
    small = _nbytes(model.embed)  # the embedding's rows and padding rows: regions of 32 KiB, read again
    for path, regions in (("batch", _nbytes(model.qkv_proj) + small), ("kernels", small)):
        man = mans[path]
        assert man.reads.passes == 1 and man.reads.why == [] and man.reads.state_bytes == state, (path, man.reads)
        assert man.reads.bytes == state + regions, (path, man.reads)
        r = compare_session({"model": want}, man, version=1)
        assert r.ok and r.proven_bytes == _nbytes(*w.values()), (path, r.describe())
    assert mans["kernels"].reads.bytes / state < 1.03 < 1.9 < mans["batch"].reads.bytes / state
    assert untimed(mans["kernels"]) == untimed(mans["batch"])
