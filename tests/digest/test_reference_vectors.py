"""Known-answer tests: every implementation reproduces ``tests/vectors/digest_vectors.json``.

The reference (``refit_verify.digest.reference``), the torch CPU path (``refit_verify.tensor_digest``) and
the independent numpy reimplementation written from the spec (``tests/support/numpy_reference.py``) must
all give every vector bit for bit. Vectors over 1 MiB run through the pure-Python reference only
under ``-m slow`` (about 2 s per 8 MiB chunk).

Source: ``docs/digest-spec.md`` §10.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from refit_verify.digest import _numba_many

from refit_verify.digest import _torch as _torch_digest
from refit_verify.digest import reference as ref
from refit_verify import tensor_digest
from refit_verify.digest.batch import DigestBatch
from refit_verify.digest.tensors import dtype_name, logical_bytes

HERE = Path(__file__).resolve().parents[1]
from tests.support import numpy_reference as npref  # noqa: E402  (independent of reference.py)
_spec = importlib.util.spec_from_file_location("refit_digest_vectors_generate", HERE / "vectors" / "generate.py")
gen = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gen
_spec.loader.exec_module(gen)

DATA = json.loads(gen.JSON_PATH.read_text())
VECTORS = DATA["vectors"]
FAST_NBYTES = 1 << 20  # the pure-Python reference runs larger vectors only under -m slow
STALE_NBYTES = 1 << 16  # the staleness check recomputes vectors up to this size


def _id(v: dict) -> str:
    return f"{v['dtype']}{v['shape']}"


def _params(big_is_slow: bool):
    out = []
    for v in VECTORS:
        marks = [pytest.mark.slow] if big_is_slow and v["nbytes"] > FAST_NBYTES else []
        out.append(pytest.param(v, id=_id(v), marks=marks))
    return out


def make_tensor(v: dict) -> torch.Tensor:
    """Build a vector's input tensor from the rule (contiguous, CPU)."""
    b = gen.input_bytes(v["dtype"], v["nbytes"])
    u8 = torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else torch.empty(0, dtype=torch.uint8)
    return u8.view(getattr(torch, v["dtype"])).reshape(v["shape"])


class TestFile:
    """The JSON itself: header, coverage, no duplicates."""

    def test_header_states_rule_and_command(self):
        """The comment gives the input rule and the regenerate command."""
        assert "(7*i + 3) mod 251" in DATA["_comment"]
        assert gen.REGENERATE in DATA["_comment"] and DATA["regenerate"] == gen.REGENERATE
        assert DATA["version"] == "refit-verify digest v1"

    def test_fields_consistent(self):
        """nbytes = numel × itemsize, lanes = ⌈nbytes/8⌉, digests are 32 lowercase hex."""
        for v in VECTORS:
            assert v["nbytes"] == gen.nbytes_of(v["dtype"], tuple(v["shape"]))
            assert v["lanes"] == -(-v["nbytes"] // 8)
            assert len(v["digest"]) == 32 and int(v["digest"], 16) >= 0 and v["digest"] == v["digest"].lower()
            assert v["why"]

    def test_all_digests_distinct(self):
        """No two vectors (all differ in bytes or metadata) share a digest or a channel."""
        ds = [v["digest"] for v in VECTORS]
        assert len(set(ds)) == len(ds)
        assert len({d[:16] for d in ds}) == len(ds) and len({d[16:] for d in ds}) == len(ds)

    def test_coverage(self):
        """Every dtype, 0-dim, 0-element, 1 byte and every tree edge ±1 is present."""
        dts = {v["dtype"] for v in VECTORS}
        assert dts == set(gen.ITEMSIZE)
        lanes = {v["lanes"] for v in VECTORS}
        for edge in (16, 256, 4096, 8192, 65536, 1 << 20, 2 << 20):  # lanes: group, folds, block, chunk
            assert {edge - 1, edge, edge + 1} <= lanes, edge
        assert {7, 8, 9, 15, 16, 17} <= {v["nbytes"] for v in VECTORS}  # bytes around one and two lanes
        assert any(v["shape"] == [] for v in VECTORS) and any(v["nbytes"] == 0 for v in VECTORS)
        assert any(v["nbytes"] == 1 for v in VECTORS)

    def test_not_stale(self):
        """The checked-in JSON matches the generator (cases, and digests of the cheap subset)."""
        msg = f"tests/vectors/digest_vectors.json is stale; regenerate it with: {gen.REGENERATE}"
        meta = [(v["dtype"], tuple(v["shape"]), v["why"]) for v in VECTORS]
        assert meta == gen.cases(), msg
        fresh = gen.build(max_nbytes=STALE_NBYTES)
        stored = [v for v in VECTORS if v["nbytes"] <= STALE_NBYTES]
        assert fresh == stored, msg
        assert gen.dumps(stored) == gen.dumps(fresh), msg


@pytest.mark.parametrize("v", _params(big_is_slow=True))
def test_reference(v):
    """The pure-Python reference reproduces the vector."""
    data = gen.input_bytes(v["dtype"], v["nbytes"])
    assert ref.digest_bytes(data, v["dtype"], v["shape"]) == v["digest"]


@pytest.mark.parametrize("v", _params(big_is_slow=False))
def test_tensor_digest_cpu(v):
    """``refit_verify.tensor_digest`` on a CPU tensor built from the rule reproduces the vector."""
    t = make_tensor(v)
    assert dtype_name(t.dtype) == v["dtype"] and list(t.shape) == v["shape"]
    assert tensor_digest(t) == v["digest"]


def test_batched_cpu_path_reproduces_every_vector():
    """``DigestBatch(hold_cpu=True)``: every vector's tensor in one batch (the small ones in one
    ``digest_many`` call, the rest one by one) reproduces every vector."""
    vs = [v for v in VECTORS if v["nbytes"] <= FAST_NBYTES]
    b = DigestBatch(hold_cpu=True)
    for i, v in enumerate(vs):
        b.add(str(i), make_tensor(v))
    got = b.hexdigests()
    assert [got[str(i)] for i in range(len(vs))] == [v["digest"] for v in vs]
    assert sum(v["nbytes"] < _numba_many.MANY_MAX_BYTES for v in vs) > 10  # the batched call did most of them


def test_fused_copy_reproduces_every_vector():
    """The numba copy+digest (``_numba_copy``, ``DigestBatch.add_copy`` on CPU): every vector's bytes
    copied into one staging buffer and digested in one call reproduce every vector, the large ones
    (several chunks) included, and the buffer holds the bytes."""
    from refit_verify.digest import _numba_copy

    ts = [logical_bytes(make_tensor(v)) for v in VECTORS]
    offs = [0]
    for t in ts:
        offs.append(offs[-1] + (t.numel() + 7) // 8 * 8)
    buf = torch.zeros(offs[-1] + 8, dtype=torch.uint8)
    items = [(t.data_ptr(), buf.data_ptr() + o, t.numel(), ref.seed(v["dtype"], v["shape"], v["nbytes"]))
             for t, o, v in zip(ts, offs, VECTORS)]
    h0, h1 = _numba_copy.copy_digest_arrays(items)
    assert [ref.hexdigest(a, b) for a, b in zip(h0.tolist(), h1.tolist())] == [v["digest"] for v in VECTORS]
    assert all(torch.equal(buf[o : o + t.numel()], t) for t, o in zip(ts, offs))


@pytest.mark.parametrize("v", _params(big_is_slow=False))
def test_torch_path(v):
    """The vectorised torch path (``_torch_digest``) reproduces the vector, whatever CPU path the API picks."""
    t = make_tensor(v)
    assert _torch_digest.digest_u8(logical_bytes(t), v["dtype"], tuple(v["shape"])) == v["digest"]


@pytest.mark.parametrize("v", _params(big_is_slow=False))
def test_numpy_reference(v):
    """The independent numpy reimplementation (written from the spec) reproduces the vector."""
    data = gen.input_bytes(v["dtype"], v["nbytes"])
    assert npref.digest(data, v["dtype"], v["shape"]) == v["digest"]


@pytest.mark.parametrize("v", [pytest.param(v, id=_id(v)) for v in VECTORS if 0 < v["nbytes"] <= FAST_NBYTES])
def test_torch_views_hash_logical_order(v):
    """A non-contiguous view and a view at an odd storage offset give the vector's digest."""
    t = make_tensor(v)
    flat = t.reshape(-1)
    shifted = torch.empty(flat.numel() + 1, dtype=t.dtype)
    shifted[1:] = flat  # storage offset of one element: not 8-byte aligned for itemsize < 8
    assert tensor_digest(shifted[1:].reshape(v["shape"])) == v["digest"]
    if t.dim() >= 2:
        nc = t.transpose(0, 1).contiguous().transpose(0, 1)  # same values, transposed strides
        assert not nc.is_contiguous() or 1 in t.shape[:2]
        assert tensor_digest(nc) == v["digest"]


def test_worked_examples():
    """Spec Appendix A values."""
    assert npref.seeds("uint8", (3,), 3) == (0xF3D1BFA6DAF271C4, 0x95D5F0CB8A99EFDC)
    assert ref.seed("uint8", (3,), 3) == (0xF3D1BFA6DAF271C4, 0x95D5F0CB8A99EFDC)
    assert ref.digest_bytes(bytes([3, 10, 17]), "uint8", (3,)) == "37293b70c95990af5e069a1eff2708a7"
    assert ref.digest_bytes(gen.input_bytes("int64", 24), "int64", (3,)) == "cd9e15b743f3682b84c046f0fc6d8511"
    assert ref.digest_bytes(b"", "uint8", (0,)) == "cf2af016f13729475a292f42282687bc"
