"""Ray as the distributed engine users run: the trainer and the vLLM engine in two Ray actors.

The trainer actor holds the engine actor's handle and verifies each refit through it
(``refit_verify.refit(handle, version=step)``: sessions opened and closed with
``handle.collective_rpc.remote``); the weights cross processes as safetensors files in
``/dev/shm`` that the engine's worker loads with ``model.load_weights`` (tests/support/ray_actors.py).
Errors raised in the trainer actor reach this process through Ray.

Two engines start side by side (one per Ray CPU): one with ``REFIT_VERIFY=enforce`` and one with
``off`` (a deployment that forgot the variable in the engine's environment).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")
ray = pytest.importorskip("ray")

from refit_verify import RefitConfigError, RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from tests.support.ray_actors import RPC_TIMEOUT_S, EngineActor, TrainerActor  # noqa: E402

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parents[2]
TOTAL_BYTES = 853248  # the tiny Llama's 21 bf16 tensors
START_TIMEOUT_S = 300.0
ENGINE_ENV = {"REFIT_VERIFY": "enforce", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
              "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONPATH": str(ROOT)}
TRAINER_ENV = {"REFIT_VERIFY": "enforce", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def cluster():
    if torch.cuda.is_available():
        pytest.skip("CPU engine test")
    if ray.is_initialized():
        pytest.skip("another Ray session is running in this process")
    model_dir = Path(tempfile.mkdtemp(prefix="rv-ray-model-"))
    (model_dir / "config.json").write_text((models.packaged_config_dir() / "config.json").read_text())
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    actors = []
    try:
        engine_cls = ray.remote(num_cpus=1)(EngineActor)
        trainer_cls = ray.remote(num_cpus=0)(TrainerActor)
        engine = engine_cls.remote(str(model_dir), ENGINE_ENV)
        off = engine_cls.remote(str(model_dir), {**ENGINE_ENV, "REFIT_VERIFY": "off"})
        actors += [engine, off]
        # both engines start at once; a method call returns once __init__ (the LLM build) is done
        assert ray.get([engine.mode.remote(), off.mode.remote()], timeout=START_TIMEOUT_S) == ["enforce", "off"]
        trainer = trainer_cls.remote(engine, str(model_dir), TRAINER_ENV)
        off_trainer = trainer_cls.remote(off, str(model_dir), TRAINER_ENV)
        actors += [trainer, off_trainer]
        yield {"engine": engine, "trainer": trainer, "off_trainer": off_trainer, "cfg": models.load_config(model_dir)}
    finally:
        for a in actors:
            ray.kill(a)
        ray.shutdown()
        for f in model_dir.iterdir():
            f.unlink()
        model_dir.rmdir()


def test_clean_refit_verified_through_the_handle(cluster):
    out = ray.get(cluster["trainer"].refit.remote(step=1, seed=11), timeout=RPC_TIMEOUT_S)
    assert out["ok"] and out["verified"] == 21 and out["version"] == 1 and out["session"] == out["trainer_session"]
    assert out["proven_bytes"] == TOTAL_BYTES and out["unproven_bytes"] == 0
    assert out["pushes"] == [[8], [8], [5]] and out["worker"] == "worker rank 0 (dp 0, tp 0, pp 0, cpu)"
    # what the engine holds, read back through the same handle, is the trainer's step-1 weights
    w = models.random_state_dict(cluster["cfg"], seed=11)
    names = ["model.embed_tokens.weight", "model.layers.1.input_layernorm.weight", "lm_head.weight"]
    (held,) = ray.get(cluster["engine"].collective_rpc.remote("refit_verify_param_digests", args=(names,)), timeout=RPC_TIMEOUT_S)
    assert held == digest_tensors((n, w[n]) for n in names)


def test_corrupted_tensor_named_across_ray(cluster):
    bad = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(RefitVerificationError) as ei:
        ray.get(cluster["trainer"].refit.remote(step=2, seed=12, corrupt=bad), timeout=RPC_TIMEOUT_S)
    err = ei.value
    assert err.mismatched == [bad] and err.missing == [] and err.unexpected == []
    assert err.report.version == 2 and err.report.verified == 20


def test_engine_that_does_not_verify_refused_in_enforce(cluster):
    with pytest.raises(RefitConfigError) as ei:
        ray.get(cluster["off_trainer"].refit.remote(step=1, seed=13), timeout=RPC_TIMEOUT_S)
    msg = str(ei.value)
    assert "does not verify" in msg and "REFIT_VERIFY=off in this vLLM worker" in msg
