"""refit_verify.trainer.adapters without an engine: the PEFT config it sends, the bytes it expects
vLLM to hold, bad input, and reports built from workers' answers (a fake engine)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

import refit_verify
from refit_verify.digest.batch import tensor_digest
from refit_verify.errors import RefitConfigError, RefitInputError, RefitVerificationError
from refit_verify.manifest import WorkerIdentity, to_text
from refit_verify.trainer.adapters import (AdapterManifest, describe_slice, expected_digests, expected_slices, peft_config, take_slice,
                                           unheld)

A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


def test_peft_config_from_a_dict_an_object_verls_request_or_the_adapter_directory(tmp_path):
    cfg = {"r": 4, "lora_alpha": 8, "target_modules": {"v_proj", "q_proj"}, "rank_pattern": {}, "task_type": "CAUSAL_LM"}
    want = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "rank_pattern": {}}
    assert peft_config(1, cfg) == want
    assert peft_config(1, SimpleNamespace(**cfg)) == want
    assert peft_config(SimpleNamespace(lora_int_id=1, peft_config=cfg)) == want
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "use_rslora": True}))
    assert peft_config(SimpleNamespace(lora_int_id=1, lora_path=str(tmp_path))) == {"r": 8, "lora_alpha": 16, "use_rslora": True,
                                                                                   "target_modules": []}
    with pytest.raises(RefitConfigError, match="PEFT config is needed"):
        peft_config(SimpleNamespace(lora_int_id=1, lora_path=str(tmp_path / "nowhere")))
    with pytest.raises(RefitConfigError, match="no int r"):
        peft_config(1, {"lora_alpha": 8})


def test_expected_bytes_are_cast_then_scaled_as_vllm_does_and_the_trainers_tensors_stay():
    a = torch.randn(4, 16)
    b = torch.randn(16, 4, dtype=torch.bfloat16)
    b_before = b.clone()
    got = expected_digests({A: a, B: b}, torch.bfloat16, {A: 1.0, B: 2.5})
    vllm_b = b.to(device="cpu", dtype=torch.bfloat16)
    vllm_b = vllm_b.clone()
    vllm_b *= 2.5
    assert got == {A: (tensor_digest(a.to(torch.bfloat16)), [4, 16]), B: (tensor_digest(vllm_b), [16, 4])}
    assert torch.equal(b, b_before)  # vLLM scales a bf16 CPU tensor in place; the trainer's copy is not touched
    assert got[B][0] != tensor_digest(b)


class _Engine:
    """A fake engine whose one worker answers with ``answer(method, args)``."""

    def __init__(self, answer):
        self.answer, self.calls = answer, []

    def collective_rpc(self, method, args=(), timeout=None):
        self.calls.append(method)
        return [self.answer(method, args)]


def _layout(method, args):
    cfg, names, _shapes = args
    return {"rank": 0, "verifying": True, "enabled": True, "lora_dtype": "bfloat16",
            "scalings": {n: 1.0 if "lora_A" in n else 2.0 for n in names}}


def test_bad_input_and_off():
    eng = _Engine(_layout)
    t = {A: torch.zeros(4, 16)}
    for bad in (0, True, "x", SimpleNamespace(lora_int_id=-1)):
        with pytest.raises(RefitConfigError):
            refit_verify.verify_adapter(eng, bad, t, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    with pytest.raises(RefitInputError):
        refit_verify.verify_adapter(eng, 1, {A: [1, 2]}, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    with pytest.raises(RefitConfigError):
        refit_verify.verify_adapter(eng, 1, t, version=-1, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    assert refit_verify.verify_adapter(eng, 1, t, version=1, mode="off") == [] and eng.calls == []


def test_reports_from_the_workers_answers():
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    exp = expected_digests({A: a, B: b}, torch.bfloat16, {B: 2.0})
    held = {A: exp[A][0], B: exp[B][0]}

    def answer(method, args):
        if method == "refit_verify_lora_layout":
            return _layout(method, args)
        aid, version, text = args
        assert json.loads(text) == {n: [d, s] for n, (d, s) in exp.items()}
        man = AdapterManifest(worker=WorkerIdentity(rank=0), adapter_id=aid, version=version, loaded=True, slot=0,
                              digests=dict(held), where={A: "qkv[q].lora_a, slot 0", B: "qkv[q].lora_b, slot 0"},
                              proven_bytes=192, ok=True)
        return {"rank": 0, "verifying": True, "adapter": to_text(man)}

    eng = _Engine(answer)
    (rep,) = refit_verify.verify_adapter(eng, 3, {A: a, B: b}, version=9, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    assert rep.ok and rep.verified == 2 and rep.session == "adapter 3" and rep.version == 9 and rep.proven_bytes == 192
    held[B] = "0" * 32
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(eng, 3, {A: a, B: b}, version=10, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    assert ei.value.report.mismatched == (B,) and f"{B}: qkv[q].lora_b, slot 0" in ei.value.report.problems


def test_a_worker_that_does_not_verify_or_has_no_lora_fails_the_verify():
    off = _Engine(lambda m, a: {"rank": 0, "verifying": False, "reason": "REFIT_VERIFY=off in this vLLM worker"})
    (rep,) = refit_verify.verify_adapter(off, 1, {A: torch.zeros(4, 16)}, config={"r": 4, "lora_alpha": 8}, mode="log")
    assert not rep.ok and "does not verify" in rep.problems[0]
    assert rep.describe().startswith("adapter 1 verification failed (0 of 0 verified): nothing was checked; vLLM worker rank 0")
    no_lora = _Engine(lambda m, a: {"rank": 0, "verifying": True, "enabled": False, "reason": "LoRA is not enabled"})
    with pytest.raises(RefitVerificationError, match="LoRA is not enabled"):
        refit_verify.verify_adapter(no_lora, 1, {A: torch.zeros(4, 16)}, config={"r": 4, "lora_alpha": 8}, mode="enforce")


def test_a_report_speaks_of_the_adapter():
    def answer(method, args):
        if method == "refit_verify_lora_layout":
            return _layout(method, args)
        man = AdapterManifest(worker=WorkerIdentity(rank=0), adapter_id=args[0], version=args[1], loaded=False,
                              where={A: "adapter not loaded"}, problems=["adapter 4 was never loaded on this worker"])
        return {"rank": 0, "verifying": True, "adapter": to_text(man)}

    (rep,) = refit_verify.verify_adapter(_Engine(answer), 4, {A: torch.zeros(4, 16)}, version=2, config={"r": 4, "lora_alpha": 8},
                                         mode="log")
    text = rep.describe()
    assert text.startswith("adapter 4 version 2 verification failed on worker rank 0") and "refit" not in text
    assert "the worker holds none of the adapter's tensors" in text and "adapter 4 was never loaded" in text


# --------------------------------------------------------------------------- tensor parallelism: each rank's slice


def test_slices_of_the_expected_bytes_digested_in_one_batch_with_the_whole_ones():
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    specs = {0: {B: (0, [(0, 8)]), A: (1, [(0, 8)])}, 1: {B: (0, [(8, 12), (14, 16)])}}
    whole, by_rank = expected_slices({A: a, B: b}, torch.bfloat16, {B: 2.0}, specs)
    assert whole == expected_digests({A: a, B: b}, torch.bfloat16, {B: 2.0})
    vb = b.to(torch.bfloat16) * 2
    assert by_rank[0][B] == (tensor_digest(vb[:8]), [8, 4], (0, [(0, 8)]))
    assert by_rank[0][A] == (tensor_digest(a.to(torch.bfloat16)[:, :8].contiguous()), [4, 8], (1, [(0, 8)]))
    assert by_rank[1] == {B: (tensor_digest(torch.cat([vb[8:12], vb[14:16]])), [6, 4], (0, [(8, 12), (14, 16)]))}
    assert describe_slice((0, [(8, 12), (14, 16)])) == "dim 0 [8:12]+[14:16]"
    with pytest.raises(RefitInputError, match="does not fit"):
        take_slice(b, (0, [(12, 20)]))


def test_parts_no_rank_holds_are_named():
    shapes = {A: [4, 16], B: [16, 4]}
    assert unheld({0: {B: (0, [(0, 8)])}, 1: {B: (0, [(8, 16)])}}, shapes) == {}
    assert unheld({0: {B: (0, [(0, 8)])}, 1: {B: (0, [(0, 8)])}}, shapes) == {B: "dim 0 [8:16]"}  # both ranks took rank 0's rows
    assert unheld({0: {A: (1, [(0, 4)])}, 1: {A: (1, [(8, 12)])}}, shapes) == {A: "dim 1 [4:8]+[12:16]"}


class _TwoWorkers:
    """A fake TP=2 engine: each worker's answer from ``answer(rank, method, args)``."""

    def __init__(self, answer):
        self.answer, self.args = answer, {}

    def collective_rpc(self, method, args=(), timeout=None):
        self.args[method] = args
        return [self.answer(r, method, args) for r in range(2)]


def test_each_rank_compared_with_the_trainers_digest_of_its_slice():
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    rows = {0: (0, [(0, 8)]), 1: (0, [(8, 16)])}
    whole, by_rank = expected_slices({A: a, B: b}, torch.bfloat16, {B: 2.0}, {r: {B: s} for r, s in rows.items()})
    held = {r: {A: whole[A][0], B: by_rank[r][B][0]} for r in range(2)}

    def answer(rank, method, args):
        if method == "refit_verify_lora_layout":
            assert args[2] == [[4, 16], [16, 4]]
            lay = _layout(method, args)
            return {**lay, "rank": rank, "slices": {B: [rows[rank][0], [list(x) for x in rows[rank][1]]]}}
        sent = json.loads(args[3])
        assert sent[str(rank)][B][1:] == [[8, 4], [rows[rank][0], [list(x) for x in rows[rank][1]]]]
        man = AdapterManifest(worker=WorkerIdentity(rank=rank), adapter_id=args[0], version=args[1], loaded=True, slot=0,
                              digests=dict(held[rank]), where={B: f"qkv[q].lora_b, slot 0, worker rank {rank}'s slice dim 0"},
                              proven_bytes=64, ok=True)
        return {"rank": rank, "verifying": True, "adapter": to_text(man)}

    eng = _TwoWorkers(answer)
    reps = refit_verify.verify_adapter(eng, 3, {A: a, B: b}, version=1, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    assert [(r.rank, r.ok, r.verified) for r in reps] == [(0, True, 2), (1, True, 2)]
    held[1][B] = "0" * 32
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_adapter(eng, 3, {A: a, B: b}, version=2, config={"r": 4, "lora_alpha": 8}, mode="enforce")
    rep = ei.value.report
    assert rep.rank == 1 and rep.mismatched == (B,) and f"{B}: qkv[q].lora_b, slot 0, worker rank 1's slice dim 0" in rep.problems
    held[1][B] = by_rank[0][B][0]
    rows[1] = rows[0]  # both ranks hold rows 0:8 (and compare equal): rows 8:16 are served by no rank
    reps = refit_verify.verify_adapter(eng, 3, {A: a, B: b}, version=3, config={"r": 4, "lora_alpha": 8}, mode="log")
    for rep in reps:
        assert not rep.ok and rep.mismatched == () and rep.problems == (f"{B}: dim 0 [8:16] is held by no worker's LoRA slot "
                                                                         "(the ranks' slices leave it out)",)
