"""DigestSet (refit_verify.digest.kept) and the close's kept paths built on it (engine_state).

A kept set must give exactly tensor_digest's digests of the bytes the tensors hold at each call,
and must refuse (None) as soon as a tensor's memory is not where it was when the set was built.
The engine-state snapshot and a replayed session's read-back keep their work on the model index:
their results must equal the general path's, and a parameter given other memory must never be
read where it used to be.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():  # the kernel path on CPU tensors, as tests/kernels (on a GPU: compiled)
    os.environ.setdefault("TRITON_INTERPRET", "1")


from refit_verify.digest import backends
from refit_verify.digest import incremental as digest_stream

from refit_verify.engine import state as engine_state

from refit_verify.engine import readback
from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.compare import compare_session
from refit_verify.digest.batch import digest_tensors, tensor_digest
from refit_verify.digest.kept import DigestSet, signature
from refit_verify.errors import RefitInputError
from refit_verify.manifest import WorkerIdentity
from tests.support.toy_model import ToyModel, default_weight_loader, toy_weights

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    out = [torch.randn(n, generator=g).to(dtype) for n, dtype in
           ((1, torch.float32), (13, torch.bfloat16), (4096, torch.float16), (3, torch.int64), (300_000, torch.float32))]
    out += [torch.empty(0), torch.zeros((), dtype=torch.bfloat16), torch.randn(5, 7, generator=g).to(torch.bfloat16),
            torch.tensor([True, False, True]), torch.randn(2, 3, generator=g, dtype=torch.complex64)]
    return [t.to(device) for t in out]


@pytest.mark.parametrize("device", DEVICES)
def test_digests_equal_tensor_digest_and_follow_the_bytes(device):
    ts = _tensors(device)
    ds = DigestSet(ts)
    assert ds.digest() == [tensor_digest(t) for t in ts]
    ts[2][5] += 1  # in place: the same memory, other bytes
    ts[4].zero_()
    got = ds.digest()
    assert got == [tensor_digest(t) for t in ts]
    assert got[2] != DigestSet([ts[2].clone().fill_(0)]).digest()[0]


def test_the_kernel_path_on_the_interpreter_equals_the_reference(monkeypatch):
    """CPU tensors through the Triton kernels' kept plans (TRITON_INTERPRET), as CUDA tensors go."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is not on in this process")
    ts = _tensors("cpu")[:4] + [torch.randn(70_000)]
    want = [tensor_digest(t) for t in ts]
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    ds = DigestSet(ts)
    assert ds._groups[0][2].name == "triton"
    assert ds.digest() == want
    ts[-1][-1] = 5.0
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset())
    want = [tensor_digest(t) for t in ts]
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    assert ds.digest() == want


def test_regions_beside_their_fused_parameter_are_not_read_twice_on_the_kernel_path(monkeypatch):
    """A set over a fused parameter and its q / k / v rows (regions at 512 KiB multiples, as an
    engine's close reads them) on the Triton kernels (interpreter): the regions' whole superblocks
    come from the parameter's read (``saved``), a region off a superblock boundary is read itself,
    and every digest is the reference's, again after the parameter's bytes changed. The CPU's
    compiled batch reads everything (``saved`` 0)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter is not on in this process")
    p = torch.nn.Parameter(torch.randn(768 + 2, 1024).to(torch.bfloat16), requires_grad=False)  # 3 superblocks + 4 KiB
    rows = [(0, 256), (256, 512), (512, 770), (1, 256)]  # q, k, v (+ the tail), and rows off a superblock boundary
    regions = [(0, (770, 1024), (1024, 1))] + [(a * 1024, (b - a, 1024), (1024, 1)) for a, b in rows]
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset())
    want = [tensor_digest(p[a:b]) for a, b in [(0, 770), *rows]]
    cpu = DigestSet([p] * 5, regions)
    assert cpu.saved == 0 and cpu.digest() == want
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    ds = DigestSet([p] * 5, regions)
    assert ds._groups[0][2].name == "triton"
    assert ds.saved == 3 * 512 * 1024  # q, k, v: one superblock each; v's 4 KiB tail and the off rows are read
    assert ds.digest() == want
    p.data[300, 7] += 1  # a k row
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset())
    want2 = [tensor_digest(p[a:b]) for a, b in [(0, 770), *rows]]
    assert [a == b for a, b in zip(want, want2)] == [False, True, False, True, True]
    monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    assert ds.digest() == want2


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("change", ["data", "reshape", "resize", "dtype-view", "neg", "strides"])
def test_memory_that_moved_is_never_read(change, device):
    p = torch.nn.Parameter(torch.randn(4, 6, device=device), requires_grad=False)
    other = torch.randn(8, device=device)
    ds = DigestSet([other, p])
    assert ds.valid() and ds.digest() == [tensor_digest(other), tensor_digest(p)]
    if change == "data":
        p.data = torch.randn(4, 6, device=device)
    elif change == "reshape":  # same address, other shape
        p.data = p.data.view(6, 4)
    elif change == "resize":  # freed under the tensor, as FSDP does after a gather
        p.untyped_storage().resize_(0)
    elif change == "dtype-view":
        p.data = p.data.view(torch.int32)
    elif change == "strides":  # same address and shape, other strides
        p.data = p.data.as_strided((4, 6), (1, 4))
    else:
        p.data = p.data._neg_view()
    assert not ds.valid() and ds.digest() is None


@pytest.mark.parametrize("device", DEVICES)
def test_a_conjugate_view_over_the_same_memory_is_never_read(device):
    """Only a complex tensor can carry the conjugate bit, so signatures skip that field for sets
    without a complex dtype; a complex parameter turned into its conjugate view keeps its address,
    shape, strides and dtype and is still seen (a real one's negative view: ``neg`` above)."""
    c = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.complex64, device=device), requires_grad=False)
    other = torch.randn(8, device=device)
    ds = DigestSet([other, c])
    assert ds.valid() and ds.signatures[1][6:] == (False, False)
    new = c.data.conj()
    assert new.data_ptr() == c.data_ptr() and new.stride() == c.stride() and new.dtype == c.dtype and new.is_conj()
    c.data = new
    assert c.is_conj() and not ds.valid() and ds.digest() is None


def test_the_same_address_in_another_storage_is_a_moved_tensor():
    """The same data pointer, shape, strides, dtype and storage size, but another storage (it starts 2
    elements earlier): the set's signature fields include the storage offset (a snapshot records the
    storage pointer)."""
    import numpy as np

    arr = np.zeros(28, dtype=np.float32)
    p = torch.nn.Parameter(torch.from_numpy(arr[:26]).as_strided((4, 6), (6, 1), 2), requires_grad=False)
    ds = DigestSet([p])
    assert ds.valid()
    p.data = torch.from_numpy(arr[2:]).as_strided((4, 6), (6, 1), 0)
    assert p.data_ptr() == ds.signatures[0][0] and p.untyped_storage().nbytes() == ds.signatures[0][5]
    assert p.storage_offset() == 0 and p.untyped_storage().data_ptr() != ds.signatures[0][4]
    assert not ds.valid() and ds.digest() is None


def test_an_empty_tensor_whose_region_moved_to_another_storage_is_never_read():
    """An empty tensor's data pointer is 0 whatever storage it views: a set reading a region of its
    storage must compare the storage pointer itself (found in review: derived from the storage
    offset, the set stayed valid and read the old storage)."""
    b = torch.randn(16)
    p = torch.nn.Parameter(b[:0], requires_grad=False)
    ds = DigestSet([p], [(0, (4,), (1,))])
    assert ds.valid() and ds.digest() == [tensor_digest(b[:4])]
    other = torch.full((16,), 7.0)
    p.data = other[:0]
    assert p.data_ptr() == ds.signatures[0][0] and p.untyped_storage().nbytes() == ds.signatures[0][5]
    assert not ds.valid() and ds.digest() is None


def test_what_it_cannot_read_in_place_is_refused():
    base = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous"):
        DigestSet([base.t()])
    with pytest.raises(RefitInputError):
        DigestSet([torch.empty(3, device="meta")])
    with pytest.raises(RefitInputError):
        DigestSet([torch.randn(3).to_sparse()])


def test_signature_names_address_geometry_and_storage():
    t = torch.arange(12, dtype=torch.float32)
    s = signature(t)
    assert s[0] == t.data_ptr() and s[1] == t.shape and s[2] == (1,) and s[3] is torch.float32
    assert s[4] == t.untyped_storage().data_ptr() and s[5] == 48
    assert signature(t[2:]) != s and signature(t.view(3, 4)) != s
    ts = [t, t[2:], t.view(3, 4), torch.empty(0)]
    assert DigestSet(ts).signatures == [signature(u) for u in ts]  # a set's signatures are the same tuples


# --------------------------------------------------------------------------- the close's kept paths


def _worker(device: str):
    model = ToyModel(device)
    model.register_buffer("rope", torch.arange(6, dtype=torch.float32, device=device))
    wb = WorkerBoundary(identity_of(rank=0, device=device))
    wb.readback, wb.snapshotter, wb.auditor = engine_state.read_back, engine_state.snapshot, engine_state.audit
    wb.attach("model", model, default_weight_loader)
    return wb, model


def _general(model: torch.nn.Module):
    """The snapshot's general path (an nn.Module is walked and batched, never kept)."""
    return engine_state.snapshot({"model": model}, WorkerIdentity(rank=0, dp=0, tp=0, pp=0, device="x", pid=0))


@pytest.mark.parametrize("device", DEVICES)
def test_kept_snapshot_equals_the_general_path_and_sees_every_change(device):
    wb, model = _worker(device)
    b = wb.modules["model"]
    ident = WorkerIdentity(rank=0, dp=0, tp=0, pp=0, device="x", pid=0)

    def both():
        kept = engine_state.snapshot({"model": b}, ident)
        gen = _general(model)
        assert kept.params == gen.params and kept.buffers == gen.buffers
        return kept

    s1 = both()
    entry = b.index().kept["set"]
    s2 = both()
    assert b.index().kept["set"] is entry and s2.params == s1.params  # kept, nothing changed
    model.norm.data[1] += 1  # bytes changed in place
    s3 = both()
    assert b.index().kept["set"] is entry and s3.params["norm"].digest != s1.params["norm"].digest
    model.rope.mul_(2)
    assert both().buffers["rope"].digest != s1.buffers["rope"].digest
    model.embed.data = model.embed.data.clone()  # new memory, the same bytes: moved, rebuilt
    s4 = both()
    assert b.index().kept["set"] is not entry and b.index().kept["set"][2] == entry[2] + 1
    assert s4.params["embed"].ptr != s1.params["embed"].ptr and s4.params["embed"].digest == s1.params["embed"].digest
    res = engine_state.audit(s3, s4)
    assert res.moved == ["embed"] and res.changed == ["rope"]


def test_a_tensor_the_set_cannot_read_falls_back_to_the_general_path_and_recovers():
    wb, model = _worker("cpu")
    b = wb.modules["model"]
    ident = WorkerIdentity(rank=0, dp=0, tp=0, pp=0, device="x", pid=0)
    model.norm.data = torch.randn(2 * model.norm.numel()).to(torch.bfloat16)[::2]  # strided: not read in place
    s = engine_state.snapshot({"model": b}, ident)
    assert b.index().kept["set"][0] is None and b.index().kept["fresh"] is None
    assert s.params == _general(model).params and s.params["norm"].digest == tensor_digest(model.norm)
    model.norm.data = model.norm.data.contiguous()
    s = engine_state.snapshot({"model": b}, ident)
    assert b.index().kept["set"][0] is not None and b.index().kept["fresh"] is not None
    assert s.params == _general(model).params
    model.norm.untyped_storage().resize_(0)
    with pytest.raises(RefitInputError, match="freed or resized"):
        engine_state.snapshot({"model": b}, ident)


@pytest.fixture
def landed(monkeypatch):
    monkeypatch.setattr("refit_verify.boundary.placement.DERIVE_DEVICE_TYPES", frozenset({"cpu", "cuda"}))
    monkeypatch.delenv("REFIT_VERIFY_REPLAY", raising=False)


def _refit(wb, model, w, version):
    sid = wb.open(f"s{version}", version=version)
    for it in w.items():
        model.load_weights([it])
    man = wb.close(sid)
    return man, compare_session({"model": digest_tensors(w.items())}, man, session=f"s{version}", version=version)


@pytest.mark.parametrize("device", DEVICES)
def test_replayed_read_back_keeps_its_program_and_equals_the_general_one(landed, device, monkeypatch):
    wb, model = _worker(device)
    b = wb.modules["model"]
    _refit(wb, model, toy_weights(1, device=device), 1)  # watched: learns the plan
    man2, r2 = _refit(wb, model, toy_weights(2, device=device), 2)  # replayed: builds the program
    prog = b.index().kept["read_back"][1]
    assert man2.modules["model"].replayed == 5 and r2.ok and r2.verified == 5
    assert prog.region_set is not None and len(prog.region_set) == 5  # q, k, v in qkv_proj, the padded embed's 13 rows and 3 padding rows
    w3 = toy_weights(3, device=device)
    man3, r3 = _refit(wb, model, w3, 3)
    assert b.index().kept["read_back"][1] is prog and r3.ok and r3.verified == 5
    model.swap_halves_after = model.qkv_loads  # the loader misplaces k and v: caught by the kept program
    man5, r5 = _refit(wb, model, toy_weights(5, device=device), 5)
    assert b.index().kept["read_back"][1] is prog and man5.modules["model"].replayed == 5
    assert not r5.ok and sorted(r5.mismatched) == ["k_proj", "v_proj"]
    model.swap_halves_after = None
    assert _refit(wb, model, w3, 6)[1].ok  # a correct loader again: verified
    # the same session records through the general path give the same engine state
    monkeypatch.setattr(readback, "_kept_program", lambda *a: None)
    man4, r4 = _refit(wb, model, w3, 7)
    e3, e4 = man3.engine, man4.engine
    assert r4.ok and e4.params == e3.params and man4.modules["model"].digests == man3.modules["model"].digests
    assert (e4.proven_bytes, e4.unproven_bytes, e4.padding_bytes) == (e3.proven_bytes, e3.unproven_bytes, e3.padding_bytes)


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_program_never_reads_memory_a_parameter_left(landed, device):
    """qkv_proj given new memory between refits: the kept program's views show the old memory; the
    snapshot sees the move, drops the program, and the read-back reads where the parameter is now."""
    wb, model = _worker(device)
    b = wb.modules["model"]
    for v in (1, 2):
        _refit(wb, model, toy_weights(v, device=device), v)
    prog = b.index().kept["read_back"][1]
    old = model.qkv_proj.data
    model.qkv_proj.data = torch.zeros_like(old)
    model.swap_halves_after = model.qkv_loads  # and the loader now misplaces k and v: caught in the new memory
    w = toy_weights(3, device=device)
    man, r = _refit(wb, model, w, 3)
    new = b.index().kept["read_back"][1]
    assert new is not prog
    ptrs = {p.untyped_storage().data_ptr() for p, _ in new.dest_regions}
    assert ptrs == {model.qkv_proj.untyped_storage().data_ptr(), model.embed.untyped_storage().data_ptr()}
    assert old.untyped_storage().data_ptr() not in ptrs
    assert not r.ok and sorted(r.mismatched) == ["k_proj", "v_proj"]
    assert man.audits == [] or all("qkv_proj" not in a.changed for a in man.audits)


def test_coverage_kept_for_whole_replays_is_not_used_for_a_partial_one(landed):
    wb, model = _worker("cpu")
    for v in (1, 2, 3):
        man, r = _refit(wb, model, toy_weights(v), v)
        assert r.ok and man.modules["model"].unwritten == [] and man.modules["model"].written == 3
    plan = wb.modules["model"].plan
    assert plan.covered == {"qkv_proj": 128, "embed": 128, "norm": 8}  # embed: 13 rows copied, 3 filled
    w = toy_weights(4)
    sid = wb.open("s4", version=4, partial=True)
    model.load_weights([("q_proj", w["q_proj"]), ("k_proj", w["k_proj"])])
    man = wb.close(sid)
    m = man.modules["model"]
    assert m.replayed == 2 and m.written == 0
    # qkv_proj written in part (q and k): its v rows compared with the last close's read, so not listed
    assert sorted(m.unwritten) == ["embed", "norm"] and list(wb._basis["qkv_proj"]) == ["s3", "s4"]


@pytest.mark.parametrize("device", DEVICES)
def test_a_kept_program_holds_no_memory_a_parameter_left(landed, device):
    """The kept program and its set hold the parameters, never views of their storage: memory a
    parameter is moved off is freed at once, not at the next close."""
    wb, model = _worker(device)
    b = wb.modules["model"]
    for v in (1, 2):
        _refit(wb, model, toy_weights(v, device=device), v)
    prog = b.index().kept["read_back"][1]
    old = model.qkv_proj.untyped_storage().data_ptr()
    model.qkv_proj.data = model.qkv_proj.data.clone()
    held = [p for p, _ in prog.dest_regions] + list(prog.region_set.tensors)
    assert held and all(t.untyped_storage().data_ptr() != old for t in held)
    assert any(t is model.qkv_proj for t in held)


def test_a_parameter_freed_and_given_new_memory_is_read_where_it_is(landed):
    """Freed (resize_(0)) and given new memory, maybe at the same address: never a failed read-back."""
    wb, model = _worker("cpu")
    for v in (1, 2):
        _refit(wb, model, toy_weights(v), v)
    shape = model.qkv_proj.shape
    model.qkv_proj.untyped_storage().resize_(0)
    model.qkv_proj.data = torch.empty(shape, dtype=torch.bfloat16)
    man, r = _refit(wb, model, toy_weights(3), 3)
    assert r.ok and not man.errors and r.verified == 5


def test_manifests_of_a_kept_program_share_no_state(landed):
    wb, model = _worker("cpu")
    mans = [_refit(wb, model, toy_weights(v), v)[0] for v in (1, 2, 3, 4)]
    a, b_ = mans[2].engine.params["qkv_proj"], mans[3].engine.params["qkv_proj"]
    assert a == b_ and a is not b_ and a.blocks is not b_.blocks


@pytest.mark.parametrize("device", DEVICES)
def test_digest_now_reads_a_kept_set_from_the_second_call_and_follows_the_memory(device, monkeypatch):
    """digest_now (a transport's digests ahead of the bytes, a receiver's check before loading):
    the first calls of a list of names go through a HeldBatch and keep a set; from then on the kept
    plan is run with no HeldBatch at all, and it reads the bytes as they are at each call. Other
    memory under the same names, a duplicate name or a tensor that cannot be read take the general
    path again, with the right digests."""
    from refit_verify.digest import kept as held_sets
    from refit_verify.digest.incremental import HeldBatch, digest_now

    ts = _tensors(device)
    items = [(f"w{i}", t) for i, t in enumerate(ts)]
    space = f"test {device} {os.getpid()}"
    want = {n: tensor_digest(t) for n, t in items}
    assert digest_now(items, space=space) == want  # signatures remembered
    assert digest_now(items, space=space) == want  # the set is built
    adds = []
    real_add = HeldBatch.add
    monkeypatch.setattr(HeldBatch, "add", lambda self, n, t: (adds.append(n), real_add(self, n, t)))
    ts[2][5] += 1  # the same memory, other bytes: read as it is now
    ts[4].zero_()
    assert digest_now(items, space=space) == {n: tensor_digest(t) for n, t in items} != want
    assert adds == []  # the kept set, no HeldBatch
    moved = [(n, t.clone()) for n, t in items]  # the same names over other memory
    moved[1][1].add_(1)
    assert digest_now(moved, space=space) == {n: tensor_digest(t) for n, t in moved}
    assert adds == [n for n, _ in moved]
    adds.clear()
    assert digest_now(items, space="another user") == {n: tensor_digest(t) for n, t in items}
    assert adds == [n for n, _ in items]  # kept sets of one space are not another's
    twice = [("a", ts[0]), ("a", ts[1])]
    assert digest_now(twice, space=space) == {"a": tensor_digest(ts[1])}  # the later pair of a name counts
    with pytest.raises(RefitInputError):
        digest_now([("s", torch.eye(3).to_sparse())], space=space)
    assert digest_now(iter(items), space=space) == {n: tensor_digest(t) for n, t in items}  # an iterator, read once
    empty = [("e", torch.empty(0, device=device))]
    for _ in range(3):
        assert digest_now(empty, space=space) == {"e": tensor_digest(empty[0][1])}
    with pytest.raises(RefitInputError):  # a meta tensor signs like an empty one: refused, never taken from the set
        digest_now([("e", torch.empty(0, device="meta"))], space=space)
    assert held_sets._HELD_SETS  # what was kept is signatures and plans only
    assert all(getattr(v, "tensors", None) is None for v in held_sets._HELD_SETS.values())


def _laid_out(seed: int, base_len: int = 100, start: int = 8) -> list[torch.Tensor]:
    """CPU tensors of one fixed layout (dtypes, shapes, one view into a larger storage), values from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(base_len, generator=g)
    return [torch.randn(13, generator=g).to(torch.bfloat16), torch.randn(5, 7, generator=g).to(torch.float16),
            torch.zeros((), dtype=torch.bfloat16) + seed, torch.empty(0), torch.randint(0, 9, (3,), generator=g),
            base[start:start + 32]]


def test_a_cpu_set_reads_tensors_of_its_layout_where_they_are_now():
    """A relocatable set (CPU, whole tensors, the compiled batch) reads tensors of its layout at other
    addresses (a receiver's clones of a staged buffer, made at every refit), with the digests of the
    bytes they hold; any other shape, dtype, strides, offset or storage size, or an address the batch
    cannot read, is refused (None, nothing read)."""
    ts = _laid_out(1)
    ds = DigestSet(ts, hold=False)
    assert ds.relocatable
    other = _laid_out(2)
    assert not ds.valid(other) and ds.moved(other)
    got = ds.digest(tensors=other, moved=True)
    assert got == [tensor_digest(t) for t in other] != [tensor_digest(t) for t in ts]
    assert ds.digest(tensors=ts) == [tensor_digest(t) for t in ts]  # still the set of the first memory
    changed = {
        "shape": lambda o: o[:0] + [torch.randn(14).to(torch.bfloat16)] + o[1:],
        "dtype": lambda o: [o[0].to(torch.float16)] + o[1:],
        "strides": lambda o: o[:1] + [torch.randn(7, 5).to(torch.float16).t()] + o[2:],
        "offset": lambda o: o[:5] + [_laid_out(3, start=16)[5]],
        "storage": lambda o: o[:5] + [_laid_out(3, base_len=101)[5]],
        "fewer": lambda o: o[:5],
    }
    for why, f in changed.items():
        bad = f(_laid_out(3))
        assert not ds.moved(bad), why
        assert ds.digest(tensors=bad, moved=True) is None, why
    raw = bytearray(40)
    aligned = torch.frombuffer(raw, dtype=torch.uint8, count=32)
    odd = torch.frombuffer(raw, dtype=torch.uint8, count=32, offset=1)  # the same layout at an address % 8 == 1
    assert odd.data_ptr() % 8 and odd.untyped_storage().nbytes() == aligned.untyped_storage().nbytes()
    one = DigestSet([aligned], hold=False)
    assert one.relocatable and not one.moved([odd]) and one.moved([torch.zeros(32, dtype=torch.uint8)])


def test_sets_that_cannot_follow_their_tensors_are_not_relocatable():
    """Regions, tensors the compiled batch does not take (large ones) and kernel plans hold more
    than a pointer per tensor: such a set never reads tensors at other addresses."""
    ts = _laid_out(1)
    assert not DigestSet(ts, regions=[(0, tuple(t.shape), tuple(t.stride())) for t in ts], hold=False).relocatable
    large = [torch.zeros((backends.backend_for("cpu").many_max_bytes // 4) + 1)]
    ds = DigestSet(large, hold=False)
    assert not ds.relocatable and not ds.moved([large[0].clone()])
    assert ds.digest(tensors=[large[0].clone()], moved=True) is None


def test_digest_now_reads_clones_made_at_every_call_through_one_kept_set(monkeypatch):
    """The CPU transport's check before loading digests the clones vLLM's layerwise reload keeps,
    new memory at every refit: the first call reads them through a set it builds (a set can follow
    CPU memory: ``kept.keep_held_now``), and from the second call of the same names and layout that
    kept set reads them where they are (no HeldBatch), with the digests of the bytes each call's
    clones hold; a tensor of another layout under a name takes the general path again."""
    from refit_verify.digest.incremental import HeldBatch, digest_now

    staged = [(f"layers.{i}.w", t) for i, t in enumerate(_laid_out(5)[:5] + [torch.randn(6, 4)])]
    space = f"test moved {os.getpid()}"
    adds = []
    real_add = HeldBatch.add
    monkeypatch.setattr(HeldBatch, "add", lambda self, n, t: (adds.append(n), real_add(self, n, t)))
    keep = []  # every call's copies stay alive: each call's are at other addresses, as vLLM's clones are
    for call in range(5):
        copies = [(n, t.clone()) for n, t in staged]
        keep.append(copies)
        if call == 3:
            copies[5][1][2, 1] += 1  # this refit's copy holds other bytes: read as it is
        want = {n: tensor_digest(t) for n, t in copies}
        assert digest_now(copies, space=space) == want
        assert adds == ([n for n, _ in copies] if call < 1 else []), call
        adds.clear()
    copies = [(n, t.clone()) for n, t in staged]
    copies[1] = (copies[1][0], torch.randn(7, 5).to(torch.float16))  # another layout under the name
    assert digest_now(copies, space=space) == {n: tensor_digest(t) for n, t in copies}
    assert adds == [n for n, _ in copies]


def test_held_batch_reads_moved_cpu_memory_through_its_set_and_still_sees_changes(monkeypatch):
    """A trainer that exports a new CPU copy of its weights at every refit (a gathered or cast
    state dict): the first refit reads each flush through the set it keeps, and from the second each
    flush reads that set where the copies are; a copy written after its add is still found (not
    digested, named in ``changed``)."""
    from refit_verify.digest import kept as dst

    monkeypatch.setattr(dst, "_HELD_SETS", type(dst._HELD_SETS)())
    monkeypatch.setattr(dst, "_HELD_TENSORS", 0)
    moved_launches = []
    real = DigestSet.launch
    monkeypatch.setattr(DigestSet, "launch", lambda self, *a, **k: (moved_launches.append(k.get("moved", False)), real(self, *a, **k))[1])
    weights = dict(zip("abcdef", _laid_out(7)))
    keep = []  # every refit's copies stay alive: each refit's are at other addresses
    for refit in range(4):
        copies = {n: t.clone() for n, t in weights.items()}
        keep.append(copies)
        hb = digest_stream.HeldBatch(flush_bytes=1 << 30)
        for n, t in copies.items():
            hb.add(n, t)
        if refit == 3:
            copies["b"].add_(1)  # written after its add
        got = hb.hexdigests()
        if refit < 3:
            assert got == {n: tensor_digest(t) for n, t in copies.items()} and not hb.changed
        else:
            assert list(hb.changed) == ["b"] and "modified in place" in hb.changed["b"]
            assert got == {n: tensor_digest(t) for n, t in copies.items() if n != "b"}
        assert moved_launches == ([False] if refit == 0 else [True] if refit < 3 else []), refit  # refit 3: a version counter moved, general path
        moved_launches.clear()


def test_a_relocatable_set_never_reads_meta_or_device_tensors_of_its_layout():
    """A meta tensor signs like memory at address 0 and a CUDA tensor is not the CPU batch's to
    read: neither is ever taken as the set's layout elsewhere."""
    ds = DigestSet([torch.zeros(8)], hold=False)
    assert not ds.moved([torch.empty(8, device="meta")])
    assert ds.digest(tensors=[torch.empty(8, device="meta")], moved=True) is None
    if torch.cuda.is_available():
        assert not ds.moved([torch.zeros(8, device="cuda")])


@pytest.mark.parametrize("kind", ["kernel", "large"])
def test_moving_memory_no_set_can_follow_is_never_planned(kind, monkeypatch):
    """Memory that moves at every call where no set can follow it (the kernel path, a GPU's clones
    or a sharded gather's; a CPU tensor past the compiled batch's bound) keeps only its signatures:
    no set is built and thrown away at each call, and the digests stay right."""
    from refit_verify.digest import kept as dst

    device = "cuda" if kind == "kernel" and torch.cuda.is_available() else "cpu"
    if kind == "kernel" and device == "cpu":  # the kernels' kept plans on CPU tensors, as CUDA tensors go
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("neither a GPU nor the Triton interpreter in this process")
        monkeypatch.setattr("refit_verify.digest.backends.KERNEL_DEVICE_TYPES", frozenset({"cpu"}))
    monkeypatch.setattr(dst, "_HELD_SETS", type(dst._HELD_SETS)())
    monkeypatch.setattr(dst, "_HELD_TENSORS", 0)
    built = []
    real_init = DigestSet.__init__
    monkeypatch.setattr(DigestSet, "__init__", lambda self, *a, **k: (built.append(1), real_init(self, *a, **k))[1])
    base = _laid_out(9)[:2] + ([torch.zeros(backends.backend_for("cpu").many_max_bytes // 4 + 1)] if kind == "large" else [])
    base = [t.to(device) for t in base]
    keep = []  # every call's clones stay alive: the next ones are at other addresses, as at a refit whose memory moved
    for call in range(4):
        items = [(f"t{i}", t.clone()) for i, t in enumerate(base)]
        keep.append(items)
        assert digest_stream.digest_now(items, space=f"moving {kind}") == {n: tensor_digest(t) for n, t in items}
    assert built == [] and all(isinstance(v, list) for v in dst._HELD_SETS.values())


def test_a_set_that_cannot_follow_its_tensors_never_reads_others_even_unchecked():
    """``launch(moved=True, check=False)`` on a set that is not relocatable (regions, large tensors)
    reads nothing (None): a region's digest is never taken of the start of another tensor."""
    q = torch.randn(64)
    regioned = DigestSet([q], regions=[(6, (6,), (1,))], hold=False)
    assert regioned.launch(check=False, tensors=[torch.randn(64)], moved=True) is None
    large = DigestSet([torch.zeros(backends.backend_for("cpu").many_max_bytes // 4 + 1)], hold=False)
    assert large.digest(check=False, tensors=[torch.ones(backends.backend_for("cpu").many_max_bytes // 4 + 1)], moved=True) is None


def test_a_kept_flush_with_an_inference_tensor_and_an_empty_one_still_sees_in_place_changes(monkeypatch):
    """A flush's changed-since-add check reads version counters as a column, skipping where none was
    read (an inference tensor: its address is checked) and storage sizes skipping empty tensors: a
    flush holding both still reads its kept set, and a write after an add is still found."""
    from refit_verify.digest import kept as held_sets

    monkeypatch.setattr(held_sets, "_HELD_SETS", type(held_sets._HELD_SETS)())
    monkeypatch.setattr(held_sets, "_HELD_TENSORS", 0)
    with torch.inference_mode():
        frozen = torch.arange(12, dtype=torch.float32)
    weights = {"frozen": frozen, "empty": torch.empty(0, 3), "w": torch.nn.Parameter(torch.randn(5, 7), requires_grad=False),
               "b": torch.nn.Parameter(torch.randn(7), requires_grad=False)}
    launched = []
    real = DigestSet.launch
    monkeypatch.setattr(DigestSet, "launch", lambda self, *a, **k: (launched.append(len(self)), real(self, *a, **k))[1])
    for refit in range(4):
        hb = digest_stream.HeldBatch(flush_bytes=1 << 30)
        for n, t in weights.items():
            hb.add(n, t)
        if refit == 3:
            with torch.no_grad():
                weights["w"].mul_(3)  # after its add
        got = hb.hexdigests()
        if refit < 3:
            assert got == {n: tensor_digest(t) for n, t in weights.items()} and not hb.changed
            assert launched == [4], refit  # the set built at the first flush (CPU memory), kept since
        else:
            assert list(hb.changed) == ["w"] and "modified in place" in hb.changed["w"]
            assert got == {n: tensor_digest(t) for n, t in weights.items() if n != "w"} and launched == []
        launched.clear()


@pytest.mark.parametrize("fail_at", ["launch", "collect"])
def test_a_held_batch_whose_launch_failed_never_answers_again(fail_at, monkeypatch):
    """A kept-set flush whose launch (or read) raises leaves the batch refusing every later call: a
    caller that catches the error and asks for the digests again never gets the earlier add's digest
    of a name it added again with other bytes (a stale digest that would match an engine that kept the
    old bytes), nor the failed flush's names silently missing."""
    from refit_verify.digest import kept as dst
    from refit_verify.errors import RefitError

    monkeypatch.setattr(dst, "_HELD_SETS", type(dst._HELD_SETS)())
    monkeypatch.setattr(dst, "_HELD_TENSORS", 0)
    weights = dict(zip("abcd", _laid_out(5)))
    hb0 = digest_stream.HeldBatch(flush_bytes=1 << 30)  # the first refit keeps the flush's set
    for n, t in weights.items():
        hb0.add(n, t)
    assert hb0.hexdigests() == {n: tensor_digest(t) for n, t in weights.items()}
    hb = digest_stream.HeldBatch(flush_bytes=1 << 30)
    for n, t in weights.items():
        hb.add(n, t)
    old = hb.hexdigests()  # through the kept set
    assert old == {n: tensor_digest(t) for n, t in weights.items()}
    weights["a"].add_(1)  # new bytes, exported again into the same batch
    for n, t in weights.items():
        hb.add(n, t)
    calls = []
    real = DigestSet.launch if fail_at == "launch" else DigestSet.collect

    def failing(*a, **k):
        calls.append(1)
        raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")

    if fail_at == "launch":
        monkeypatch.setattr(DigestSet, "launch", failing)
    else:
        monkeypatch.setattr(DigestSet, "collect", staticmethod(failing))
    with pytest.raises(RuntimeError, match="injected"):
        hb.hexdigests()
    assert calls == [1]  # the kept path was the one that failed
    monkeypatch.setattr(DigestSet, fail_at, real if fail_at == "launch" else staticmethod(real))
    hb.add("e", torch.zeros(3))  # held only: the next launch or read refuses
    for call in (hb.hexdigests, hb.launch):
        with pytest.raises(RefitError, match="failed earlier .*injected"):
            call()
    fresh = digest_stream.HeldBatch(flush_bytes=1 << 30)  # a new batch digests them again, right
    for n, t in weights.items():
        fresh.add(n, t)
    assert fresh.hexdigests() == {n: tensor_digest(t) for n, t in weights.items()} != old


def _expected_calls(monkeypatch):
    """A fresh space and the names each HeldBatch add took (the general path)."""
    from refit_verify.digest.incremental import HeldBatch

    adds = []
    real_add = HeldBatch.add
    monkeypatch.setattr(HeldBatch, "add", lambda self, n, t: (adds.append(n), real_add(self, n, t)))
    return adds


_SPECS = [("embed", (6, 4), torch.bfloat16), ("q", (4, 4), torch.bfloat16), ("norm", (4,), torch.float32),
          ("empty", (0, 4), torch.bfloat16), ("head", (6, 4), torch.float16)]


def _fresh(specs, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(sh, generator=g).to(dt)) for n, sh, dt in specs]


@pytest.mark.parametrize("split", [[5], [2, 3], [1, 1, 3], [3]], ids=["one call", "two calls", "three calls", "a subset"])
def test_tensors_expected_ahead_are_read_through_a_planned_set_with_the_general_paths_digests(split, monkeypatch):
    """Names and layouts expected ahead (``expect_layouts``: the checkpoint's tensors a refit's check
    before loading gets as fresh copies), in one or several calls, each a run in the expected order
    (a leading subset too): every call reads through a set planned from the layout, no tensor taken
    by the general path, and its digests are tensor_digest's; the set is kept for the next call."""
    from refit_verify.digest import kept
    from refit_verify.digest.incremental import digest_now

    space = f"test ahead {os.getpid()} {split}"
    assert kept.expect_layouts(space, _SPECS) == 5
    adds = _expected_calls(monkeypatch)
    items, at = _fresh(_SPECS), 0
    for n in split:
        call = [(name, t.clone()) for name, t in items[at : at + n]]
        at += n
        assert digest_now(call, space=space) == {name: tensor_digest(t) for name, t in call}
        ds = kept.kept_set((space, *(name for name, _ in call)))
        assert ds is not None and ds.ahead
    assert adds == []
    call = [(name, t.clone()) for name, t in _fresh(_SPECS, 1)[: split[0]]]  # the next refit: other bytes, other memory
    assert digest_now(call, space=space) == {name: tensor_digest(t) for name, t in call}
    assert adds == []


def test_the_whole_expected_sequence_is_planned_at_expect_layouts_and_a_shorter_run_at_its_call(monkeypatch):
    """``expect_layouts`` makes the compiled batch's plan of the whole sequence (one call of every
    expected tensor: one staging buffer): that call plans nothing more, reads the same plan a plan
    made at the call would be, and gives tensor_digest's digests; a shorter run is planned at its call."""
    from refit_verify.digest import backends, kept
    from refit_verify.digest.incremental import digest_now

    backend = backends.backend_for("cpu")
    made = []
    real = backend.plan_many
    counted = dataclasses.replace(backend, plan_many=lambda items: (made.append(list(items)), real(items))[1])
    monkeypatch.setattr(kept._backends, "backend_for", lambda device: counted if str(device) == "cpu" else backend)
    space = f"test planned ahead {os.getpid()}"
    assert kept.expect_layouts(space, _SPECS) == 5
    assert len(made) == 1
    ahead = kept._EXPECTED[space][0].plans[(0, 5)]
    now = real(made[0])
    assert [list(getattr(now, f)) for f in ("addrs", "nbytes", "s0", "s1")] == \
        [list(getattr(ahead, f)) for f in ("addrs", "nbytes", "s0", "s1")]
    call = [(n, t.clone()) for n, t in _fresh(_SPECS)]
    assert digest_now(call, space=space) == {n: tensor_digest(t) for n, t in call}
    assert len(made) == 1  # the call took the plan made ahead
    assert kept.expected_set(space, ("q", "norm")) is not None
    assert len(made) == 2 and [it[1] for it in made[1]] == [16 * 2, 4 * 4]  # a shorter run: planned at its call


@pytest.mark.parametrize("case", ["another order", "an extra tensor", "another dtype", "another shape", "a view",
                                  "a storage of more bytes", "not a run", "a large tensor"])
def test_tensors_not_as_expected_take_the_general_path_with_its_digests(case, monkeypatch):
    """Anything but a run of the expected names with their layout (another order, an extra name,
    another dtype or shape under a name, a view into a larger storage, a skipped name, a tensor too
    large for the compiled batch) is checked and planned as without anything expected, with the same
    digests; the set it keeps is not the planned one."""
    from refit_verify.digest import kept
    from refit_verify.digest.incremental import digest_now

    specs = _SPECS + [("big", (300_000,), torch.float32)] if case == "a large tensor" else _SPECS
    space = f"test not ahead {os.getpid()} {case}"
    kept.expect_layouts(space, specs)
    adds = _expected_calls(monkeypatch)
    call = [(n, t.clone()) for n, t in _fresh(specs)]
    if case == "another order":
        call[0], call[1] = call[1], call[0]
    elif case == "an extra tensor":
        call.append(("extra", torch.randn(3)))
    elif case == "another dtype":
        call[1] = (call[1][0], call[1][1].to(torch.float16))
    elif case == "another shape":
        call[1] = (call[1][0], call[1][1].reshape(2, 8).clone())
    elif case == "a view":
        call[2] = (call[2][0], torch.randn(8)[4:])
    elif case == "a storage of more bytes":
        big = torch.randn(16)
        call[2] = (call[2][0], big[:4])
    elif case == "not a run":
        del call[1]
    want = {n: tensor_digest(t) for n, t in call}
    assert digest_now(call, space=space) == want
    assert adds == [n for n, _ in call]
    ds = kept.kept_set((space, *(n for n, _ in call)))
    assert ds is None or not ds.ahead


def test_expected_layouts_stay_in_their_space_and_a_warm_up_keeps_nothing():
    """Names expected under one space are not planned ahead under another (nor the trainer's own,
    unnamed space, which cannot be expected); the digest warm-up's throwaway sets are dropped."""
    from refit_verify.digest import kept
    from refit_verify.digest.incremental import digest_now

    space = f"test space {os.getpid()}"
    kept.expect_layouts(space, _SPECS)
    assert kept.expected_set(space, ("q", "norm")) is not None
    assert kept.expected_set(space + " other", ("q", "norm")) is None
    assert kept.expected_set(space, ("norm", "q")) is None
    with pytest.raises(ValueError):
        kept.expect_layouts("", _SPECS)
    call = [(n, t.clone()) for n, t in _fresh(_SPECS)]
    assert digest_now(call) == {n: tensor_digest(t) for n, t in call}
    before = dict(kept._HELD_SETS)
    backends.warmup("cpu")
    assert not any(k and k[0] == digest_stream._WARM_SPACE for k in kept._HELD_SETS)
    assert digest_stream._WARM_SPACE not in kept._EXPECTED
    assert all(k in kept._HELD_SETS for k in before)
