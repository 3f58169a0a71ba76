"""vLLM's built-in CUDA ``ipc`` weight-transfer backend, verified end to end by the plugin alone.

The engine runs with ``REFIT_VERIFY=enforce`` and ``weight_transfer_config=ipc``; the trainer (this
process, colocated on the same GPU) pushes weights with the calls of vLLM's own examples
(``examples/rl/rlhf_ipc.py``), packed and unpacked, and never calls refit-verify. Shown: a clean
update is verified (per worker, every tensor) and lands in the engine; a corrupted tensor is named
with the worker rank. Corruptions: unpacked, the trainer flips a byte of a weight after it was
exported and before the worker reads it through its zero-copy IPC view; packed, the worker's
packed consumer flips a byte of one staged slice before ``load_weights``.

vLLM 0.26 drives ``LLM.start_weight_update`` / ``IPCWeightTransferEngine.trainer_send_weights`` /
``LLM.finish_weight_update``; vLLM >= 0.27 ``WeightTransferTrainerFactory.trainer_init(...)``
then ``send_weights()``. Needs a CUDA GPU and a CUDA vLLM (0.26 on the H200 via
``../shared/gpu-vllm/``); skipped otherwise.
"""

from __future__ import annotations

import threading
from dataclasses import asdict

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
vllm = pytest.importorskip("vllm")

from refit_verify import RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from refit_verify.vllm_plugin import native_trainer as native  # noqa: E402
from tests.gpu import native_ipc_faults as faults  # noqa: E402
from tests.gpu.native_env import native_llm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
TARGET = "model.layers.1.mlp.down_proj.weight"
BYTE = 1001
BUFFER = 192 << 10  # packed: ~5 chunks for the tiny model (largest tensor 128 KiB)
STATIC = "static" in native.detect()["sender"]  # vLLM 0.26: IPCWeightTransferEngine.trainer_send_weights


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with native_llm(tmp_path_factory, "ipc") as (llm, cfg):
        if STATIC:
            llm.init_weight_transfer_engine({"init_info": {}})
        yield llm, cfg


def _send(llm, weights: dict[str, torch.Tensor], packed: bool, before_update=None) -> None:
    """One native update through vLLM's ``ipc`` backend; ``before_update()`` runs before each chunk ships."""
    native._LAST["reports"] = []

    def forward(update_info: dict) -> None:
        if before_update is not None:
            before_update()
        llm.update_weights({"update_info": update_info})

    if STATIC:  # vLLM 0.26
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerSendWeightsArgs, IPCWeightTransferEngine

        llm.start_weight_update()
        try:
            IPCWeightTransferEngine.trainer_send_weights(
                iter(weights.items()),
                IPCTrainerSendWeightsArgs(send_mode=lambda info: forward(asdict(info)), packed=packed, packed_buffer_size_bytes=BUFFER))
        finally:
            llm.finish_weight_update()  # close the session whatever the verdict
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

    from tests.support.native_cpu_backend import DictSource, LLMClient

    class Client(LLMClient):
        def update_weights(self, update_info: dict) -> None:
            forward(update_info)

    eng = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(rank=0, packed=packed, packed_buffer_size_bytes=BUFFER),
                                                    client=Client(llm), source=DictSource(weights))
    eng.send_weights()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_clean_ipc_update_verified_and_loaded(engine, packed):
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=60 + packed, device="cuda")
    _send(llm, weights, packed)
    (report,) = native.last_reports()
    assert report.ok and report.verified == len(weights) == 21 and report.rank == 0
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert worker["verifying"] and worker["backend"] == "ipc" and digest_map(worker["manifest"]) == digest_tensors(weights.items())
    assert worker["calls"] > 1 if packed else worker["calls"] == 1  # one load_weights per packed chunk
    names = readback_names(weights)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, weights[n]) for n in names)


@pytest.mark.skipif(not STATIC, reason="the shadow of update_weights is vLLM 0.26's static sender's")
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_exported_parameters_digested_in_the_shadow_of_update_weights(engine, packed, monkeypatch):
    """The trainer exports its nn.Parameters (held, not copied): their digest work runs in a helper
    thread on this thread's stream while each update_weights waits for the engine core (another
    process), the digests are read in the last window, the update is verified whole; a parameter
    written in place after its export is named."""
    from refit_verify.vllm_plugin.native_sender import NativeSendVerifier

    llm, cfg = engine
    assert native._engine_elsewhere(llm)
    seen, me = [], threading.get_ident()
    raw_work = NativeSendVerifier.shadow_work
    monkeypatch.setattr(NativeSendVerifier, "shadow_work",
                        lambda v: (seen.append((threading.get_ident() != me, v.exhausted)), raw_work(v))[1])
    params = {n: torch.nn.Parameter(t, requires_grad=False)
              for n, t in models.random_state_dict(cfg, seed=80 + packed, device="cuda").items()}
    _send(llm, params, packed)
    (report,) = native.last_reports()
    assert report.ok and report.verified == len(params) == 21 and report.unchecked == ()
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert len(seen) == worker["calls"] == (1 if not packed else worker["calls"]) and (worker["calls"] > 1) == packed
    assert all(helper for helper, _ in seen) and [last for _, last in seen] == [False] * (len(seen) - 1) + [True]
    names = readback_names(params)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, params[n]) for n in names)

    def touch():
        with torch.no_grad():
            params[TARGET].view(-1)[7] += 1  # after its export, before the digest work read it
        torch.cuda.synchronize()

    seen.clear()
    with pytest.raises(RefitVerificationError, match="modified in place after it was added") as ei:
        _send(llm, params, packed, before_update=touch)
    assert TARGET in str(ei.value) and ei.value.report.verified == 20 and seen


def test_corrupted_ipc_tensor_named_unpacked(engine):
    """The trainer changes a byte of an exported weight while the worker reads it through IPC."""
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=70, device="cuda")

    def flip():
        weights[TARGET].view(-1).view(torch.uint8)[BYTE] ^= 1
        torch.cuda.synchronize()

    with pytest.raises(RefitVerificationError) as ei:
        _send(llm, weights, packed=False, before_update=flip)
    assert (ei.value.mismatched, ei.value.missing, ei.value.unexpected) == ([TARGET], [], [])
    assert "worker rank 0" in str(ei.value)


def test_corrupted_ipc_tensor_named_packed(engine):
    """A staged slice of the packed consumer changes before ``load_weights``."""
    llm, cfg = engine
    weights = models.random_state_dict(cfg, seed=71, device="cuda")
    assert llm.collective_rpc(faults.corrupt_staged_slice, args=(TARGET, BYTE)) == [True]
    try:
        with pytest.raises(RefitVerificationError) as ei:
            _send(llm, weights, packed=True)
    finally:
        llm.collective_rpc(faults.restore_staged_slice)
    assert (ei.value.mismatched, ei.value.missing, ei.value.unexpected) == ([TARGET], [], [])
    assert "worker rank 0" in str(ei.value)


@pytest.mark.skipif(not STATIC, reason="vLLM 0.26's one-line finish_weight_update")
@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_from_the_second_update_one_rpc_finishes_and_returns_the_manifest(engine, packed, monkeypatch):
    """The calls of vLLM's own example with the trainer's nn.Parameters: once the workers said they
    answer refit_verify_native_finish, each update closes with that one RPC (no finish_weight_update,
    no manifest fetch after it) and is verified whole."""
    from refit_verify.vllm_plugin.native_sender import NativeSendVerifier

    llm, cfg = engine
    calls, fetches = [], []
    rpc, raw_fetch = llm.llm_engine.collective_rpc, NativeSendVerifier.fetch
    monkeypatch.setattr(llm.llm_engine, "collective_rpc", lambda method, *a, **k: (calls.append(method), rpc(method, *a, **k))[1])
    monkeypatch.setattr(NativeSendVerifier, "fetch", lambda v: (fetches.append(1), raw_fetch(v))[1])
    params = {n: torch.nn.Parameter(t, requires_grad=False)
              for n, t in models.random_state_dict(cfg, seed=90 + packed, device="cuda").items()}
    for update in range(3):
        calls.clear()
        fetches.clear()
        _send(llm, params, packed)
        (report,) = native.last_reports()
        assert report.ok and report.verified == 21 and report.unchecked == () and report.proven_bytes > 0
        if update:
            finish = [m for m in calls if "finish" in m or m == native.MANIFEST_METHOD]
            assert (finish, fetches) == ([native.FINISH_METHOD], []), (update, calls)
