"""The worker methods of adapter verification without an engine: arguments as a ``vllm serve``
sends them (JSON text), vLLM's own scaling rule, a worker without LoRA, layers not provable."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from refit_verify.trainer.adapters import AdapterManifest  # noqa: E402
from refit_verify.manifest import from_wire  # noqa: E402
from refit_verify.vllm_plugin import worker_adapters as wa  # noqa: E402

B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(autouse=True)
def enforce(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "enforce")


def _worker(manager=None):
    runner = SimpleNamespace(lora_manager=SimpleNamespace(_adapter_manager=manager) if manager is not None else None)
    return SimpleNamespace(rank=0, model_runner=runner, get_model=lambda: SimpleNamespace())


def test_layout_uses_vllms_scaling_and_reads_json_text_arguments():
    am = SimpleNamespace(lora_config=SimpleNamespace(lora_dtype=torch.bfloat16))
    got = wa.refit_verify_lora_layout(_worker(am), json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}), json.dumps([A, B]))
    assert got["lora_dtype"] == "bfloat16" and got["scalings"] == {A: 1.0, B: 2.0}
    got = wa.refit_verify_lora_layout(_worker(am), {"r": 4, "lora_alpha": 8, "target_modules": [], "use_rslora": True,
                                                    "alpha_pattern": {"q_proj": 6}}, [B])
    assert got["scalings"] == {B: 6 / math.sqrt(4)}


def test_a_worker_without_lora_says_so():
    w = _worker()
    assert wa.refit_verify_lora_layout(w, {"r": 4, "lora_alpha": 8, "target_modules": []}, [A])["enabled"] is False
    got = wa.refit_verify_lora_verify(w, "3", "null", json.dumps({A: ["0" * 32, [4, 16]]}))
    man = from_wire(got["adapter"], AdapterManifest)
    assert man.adapter_id == 3 and man.version is None and not man.loaded and "LoRA is not enabled" in man.problems[0]


def test_off_answers_not_verifying(monkeypatch):
    monkeypatch.setenv("REFIT_VERIFY", "off")
    assert wa.refit_verify_lora_verify(_worker(), 1, None, "{}")["verifying"] is False
    assert wa.refit_verify_lora_audit(_worker())["verifying"] is False


def test_sharded_and_unknown_layers_are_not_provable():
    am = SimpleNamespace(lora_config=SimpleNamespace(fully_sharded_loras=False))
    stacked = (torch.zeros(2, 1, 8, 16),)
    assert "2 tensor-parallel ranks" in wa._why_not_provable(am, SimpleNamespace(tp_size=2, lora_a_stacked=stacked))
    assert wa._why_not_provable(am, SimpleNamespace(tp_size=1, lora_a_stacked=stacked)) is None
    assert "not mapped" in wa._why_not_provable(am, SimpleNamespace(tp_size=1, w13_lora_a_stacked=stacked))
    sharded = SimpleNamespace(lora_config=SimpleNamespace(fully_sharded_loras=True))
    assert "fully sharded" in wa._why_not_provable(sharded, SimpleNamespace(tp_size=1, lora_a_stacked=stacked))
