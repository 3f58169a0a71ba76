"""The layout map on a real CUDA engine (TP=1): direct parameter writes and out-of-band states judged by
what the engine holds, on the tiny Llama and on the Qwen3-1.7B-like layout (3.4 GB, dummy weights).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``); the "framework" writes each HF
tensor into its engine slice itself (``param.data[rows].copy_``, as SkyRL / NeMo-RL do: the mapping of
``tests/support/direct_writes.py``), never calling ``load_weights``. Each refit's wall time and the
close's passes over engine memory are printed (``-s``), the figures issue #51 asks for.
"""

from __future__ import annotations

import gc
import itertools
import json
import statistics
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

vllm = pytest.importorskip("vllm")

import refit_verify  # noqa: E402
from refit_verify import RefitVerificationError  # noqa: E402
from refit_verify.testing import models  # noqa: E402
from tests.support.direct_writes import DirectWriteExtension  # noqa: E402
from tests.support.engine_utils import engine_env, settle_device_memory  # noqa: E402

LAYOUTS = {"tiny": None, "qwen3-0.6b-like": models.BENCH_LAYOUTS["qwen3-0.6b-like"],
           "qwen3-1.7b-like": models.BENCH_LAYOUTS["qwen3-1.7b-like"]}
_VERSIONS = itertools.count(1)


@pytest.fixture(scope="module", params=list(LAYOUTS))
def engine(request, tmp_path_factory):
    cfg = LAYOUTS[request.param] or models.load_config(models.packaged_config_dir())
    d = tmp_path_factory.mktemp(request.param)
    (d / "config.json").write_text(json.dumps(cfg))
    settle_device_memory()
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="0"):
        from refit_verify.vllm_plugin import register
        from refit_verify.vllm_plugin.engine import start_dummy_engine

        register()
        # small fractions: in-process engines of earlier modules keep their memory in this process
        llm = start_dummy_engine(d, "cuda", gpu_memory_utilization=0.08 if request.param == "tiny" else 0.15)
        worker = llm.llm_engine.model_executor.driver_worker.worker
        yield request.param, llm, worker, models.load_config(d)
        del llm, worker
        gc.collect()
        torch.cuda.empty_cache()


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    return models.device_state_dict(cfg, seed=seed, device="cuda")


def _write(worker, w: dict[str, torch.Tensor], flip: str | None = None) -> None:
    """The framework's direct writes: each tensor into its engine slice; ``flip``: one bit of that slice."""
    for name, t in w.items():
        DirectWriteExtension._dw_slice(worker, name).copy_(t)
    if flip is not None:
        raw = DirectWriteExtension._dw_slice(worker, flip).view(torch.uint8).view(-1)
        raw[raw.numel() // 2] ^= 1
    torch.cuda.synchronize()


def _refit(llm, worker, w, flip=None):
    with refit_verify.refit(llm, version=next(_VERSIONS), mode="enforce") as r:
        for n, t in w.items():
            r.add(n, t)
        _write(worker, w, flip)
    return r.reports[0], r.manifests[0]


def _nbytes(w) -> int:
    return sum(t.numel() * t.element_size() for t in w.values())


def test_direct_writes_proven_with_every_byte_in_one_pass(engine):
    layout, llm, worker, cfg = engine
    w = _weights(cfg, 1)
    rep, man = _refit(llm, worker, w)  # the first close learns the map dry
    assert rep.ok, rep.describe()
    assert rep.verified == len(w) and (rep.proven_bytes, rep.unproven_bytes, dict(rep.not_proven)) == (_nbytes(w), 0, {})
    walls, passes = [], []
    for seed in range(2, 7):
        w = _weights(cfg, seed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rep, man = _refit(llm, worker, w)
        walls.append((time.perf_counter() - t0) * 1e3)
        assert rep.ok and rep.proven_bytes == _nbytes(w), rep.describe()
        passes.append(man.reads.passes if man.reads is not None else None)
    assert passes == [1] * 5, passes
    print(f"\n[layout map, CUDA] {layout}: {len(w)} tensors, {_nbytes(w) / 1e9:.2f} GB: direct-write refit in enforce "
          f"median {statistics.median(walls):.1f} ms (5 refits: {', '.join(f'{x:.1f}' for x in walls)}); passes per close {passes}")


def test_one_byte_in_the_k_slice_of_a_fused_qkv_named(engine):
    _, llm, worker, cfg = engine
    w = _weights(cfg, 11)
    k1 = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(RefitVerificationError) as ei:
        _refit(llm, worker, w, flip=k1)
    rep = ei.value.report
    assert rep.mismatched == (k1,) and rep.engine_mismatched == ("model.layers.1.self_attn.qkv_proj.weight",)
    assert any(k1 in p and "qkv_proj" in p and "worker rank 0" in p for p in rep.problems), rep.problems


def test_verify_state_after_an_out_of_band_write(engine):
    layout, llm, worker, cfg = engine
    w = _weights(cfg, 21)
    _write(worker, w)
    t0 = time.perf_counter()
    (rep,) = refit_verify.verify_state(llm, w, version=next(_VERSIONS), mode="enforce")
    ms = (time.perf_counter() - t0) * 1e3
    assert rep.ok and rep.proven_bytes == _nbytes(w), rep.describe()
    print(f"\n[layout map, CUDA] {layout}: verify_state {ms:.1f} ms")
    down = "model.layers.0.mlp.down_proj.weight"
    other = dict(w, **{down: w[down].clone().add_(1)})
    with pytest.raises(RefitVerificationError) as ei:
        refit_verify.verify_state(llm, other, version=next(_VERSIONS), mode="enforce")
    assert ei.value.report.mismatched == (down,)
