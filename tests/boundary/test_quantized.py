"""What a parameter quantized on load must satisfy (:mod:`refit_verify.boundary.quantized`), on CPU tensors."""

from __future__ import annotations

import pytest
import torch

from refit_verify.boundary.quantized import differs, is_scale, scale_problem

FP8 = torch.float8_e4m3fn


def test_is_scale_reads_the_last_part_of_the_name():
    assert is_scale("model.layers.0.mlp.down_proj.weight_scale") and is_scale("x.weight_scale_inv") and is_scale("x.input_scale")
    assert not is_scale("model.layers.0.mlp.down_proj.weight") and not is_scale("scale_proj.weight")


@pytest.mark.parametrize("value,kind", [(0.0, "zero"), (-1.0, "negative"), (float("nan"), "NaN"), (float("inf"), "Inf")])
def test_a_scale_that_cannot_be_right_is_named(value, kind):
    s = torch.full((8, 1), 0.01)
    s[5, 0] = value
    why = scale_problem("l.weight_scale", s)
    assert why == (f"l.weight_scale holds 1 of 8 scale elements that are {kind} (first at flat index 5: {value}): every "
                   "weight it scales dequantizes to 0, a sign flip or NaN")


def test_good_scales_and_other_parameters_pass():
    assert scale_problem("l.weight_scale", torch.tensor([0.5, 1e-30])) is None
    assert scale_problem("l.weight_scale", torch.tensor(0.25)) is None  # 0-dim, a per-tensor scale
    assert scale_problem("l.weight", torch.zeros(4)) is None  # not a scale: zeros are weights
    assert "empty" in scale_problem("l.weight_scale", torch.empty(0))
    assert scale_problem("l.weight_scale", torch.tensor([0.0, 0.0], dtype=torch.bfloat16)).startswith(
        "l.weight_scale holds 2 of 2 scale elements that are zero")


def test_differs_compares_logical_bytes():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(6, 10, generator=g) * 50).to(FP8)
    assert differs("l.weight", w.t(), w.t().contiguous()) is None  # the same values in another layout
    bad = w.clone()
    bad.view(torch.uint8)[2, 3] ^= 0x01
    assert differs("l.weight", bad, w) == ("l.weight holds other bytes than the engine's quantization of the delivered "
                                           "tensor: 1 of 60 elements differ (first at flat index 23)")
    s = torch.rand(6, 1) + 0.1
    s2 = s.clone()
    s2[4, 0] = torch.nextafter(s2[4, 0], torch.tensor(2.0))  # one ulp: equal as floats to no tolerance
    assert "1 of 6 elements differ (first at flat index 4)" in differs("l.weight_scale", s2, s)
    assert differs("l.weight", w.float(), w) == ("l.weight is float32 [6, 10], the engine's quantization of the delivered "
                                                 "tensor gives float8_e4m3fn [6, 10]")
    assert "gives float8_e4m3fn [10, 6]" in differs("l.weight", w, w.t().contiguous())
    nan = torch.tensor([float("nan")])
    assert differs("l.weight_scale", nan, nan.clone()) is None  # the same bytes (NaN == NaN bytewise)
