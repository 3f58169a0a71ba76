"""vLLM's built-in ``nccl`` weight-transfer backend (non-colocated), verified by the plugin alone.

The trainer is this process on ``cuda:0``; the vLLM engine's worker runs on the second GPU (its
processes start with ``CUDA_VISIBLE_DEVICES=1``). They form vLLM's trainer/worker NCCL group
(``NCCLWeightTransferEngine.trainer_init`` / ``LLM.init_weight_transfer_engine``) and push weights
with the calls of vLLM's own example (``examples/rl/rlhf_nccl.py``), packed and unpacked; the test
never calls refit-verify. Shown: a clean update is verified (every tensor, worker rank 0) and lands
in the engine; a tensor changed after it was exported (the trainer's ``post_iter_func`` hands a
corrupted copy to the broadcast) is named with the worker rank.

Written against vLLM 0.26's static ``NCCLWeightTransferEngine.trainer_send_weights`` (the vLLM on
our GPU machine); skipped without two CUDA GPUs or on other vLLM releases.
"""

from __future__ import annotations

import threading

import pytest
import torch

if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (trainer on cuda:0, the vLLM worker on cuda:1)", allow_module_level=True)
vllm = pytest.importorskip("vllm")

from refit_verify import RefitVerificationError  # noqa: E402

from refit_verify.testing import models  # noqa: E402
from refit_verify.cli.demo import readback_names  # noqa: E402
from refit_verify.digest.batch import digest_tensors  # noqa: E402
from refit_verify.manifest import digest_map  # noqa: E402
from refit_verify.vllm_plugin import native_trainer as native  # noqa: E402
from tests.support.dist_utils import free_port  # noqa: E402
from tests.gpu.native_env import native_llm  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]
TARGET = "model.layers.1.mlp.down_proj.weight"
BYTE = 1001
BUFFER = 192 << 10  # packed: several buffers for the tiny model (largest tensor 128 KiB)

if "static" not in native.detect()["sender"]:
    pytest.skip("written against vLLM 0.26's static NCCLWeightTransferEngine.trainer_send_weights", allow_module_level=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    torch.cuda.set_device(0)
    torch.zeros(1, device="cuda:0")  # the trainer's CUDA context sees both GPUs before the engine's env is set
    with native_llm(tmp_path_factory, "nccl", env={"CUDA_VISIBLE_DEVICES": "1"}) as (llm, cfg):
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        port = free_port()
        joined: dict[str, object] = {}

        def join_workers() -> None:
            try:
                llm.init_weight_transfer_engine({"init_info": {"master_address": "127.0.0.1", "master_port": port,
                                                               "rank_offset": 1, "world_size": 2}})
                joined["ok"] = True
            except BaseException as e:  # noqa: BLE001 - checked below
                joined["ok"] = e

        th = threading.Thread(target=join_workers, daemon=True)
        th.start()
        group = NCCLWeightTransferEngine.trainer_init({"master_address": "127.0.0.1", "master_port": port, "world_size": 2})
        th.join(timeout=120)
        assert joined.get("ok") is True, joined
        yield llm, cfg, group


def _send(llm, group, weights: dict[str, torch.Tensor], packed: bool, corrupt: str | None = None) -> None:
    """One native update through vLLM's ``nccl`` backend, as in vLLM's rlhf_nccl example."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerSendWeightsArgs, NCCLWeightTransferEngine

    native._LAST["reports"] = []

    def post_iter(item: tuple[str, torch.Tensor]) -> torch.Tensor:
        name, t = item
        if name != corrupt:
            return t
        bad = t.clone()  # bytes changed after export: what goes on the wire is not what was digested
        bad.view(-1).view(torch.uint8)[BYTE] ^= 1
        return bad

    info = {"names": list(weights), "dtype_names": [str(t.dtype).removeprefix("torch.") for t in weights.values()],
            "shapes": [list(t.shape) for t in weights.values()], "packed": packed, "packed_buffer_size_bytes": BUFFER}
    llm.start_weight_update()
    receiving = threading.Thread(target=llm.update_weights, args=({"update_info": info},), daemon=True)
    try:
        receiving.start()
        NCCLWeightTransferEngine.trainer_send_weights(
            iter(weights.items()), NCCLTrainerSendWeightsArgs(group=group, packed=packed, packed_buffer_size_bytes=BUFFER,
                                                              post_iter_func=post_iter))
    finally:
        receiving.join(timeout=120)
        llm.finish_weight_update()


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_clean_nccl_update_verified_and_loaded(engine, packed):
    llm, cfg, group = engine
    weights = models.random_state_dict(cfg, seed=80 + packed, device="cuda:0")
    _send(llm, group, weights, packed)
    (report,) = native.last_reports()
    assert report.ok and report.verified == len(weights) == 21 and report.rank == 0
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert worker["verifying"] and worker["backend"] == "nccl" and digest_map(worker["manifest"]) == digest_tensors(weights.items())
    assert worker["calls"] > 1 if packed else worker["calls"] == 21  # one load_weights per packed buffer / per tensor
    names = readback_names(weights)
    assert llm.collective_rpc("refit_verify_param_digests", args=(names,))[0] == digest_tensors((n, weights[n]) for n in names)


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_corrupted_nccl_tensor_named(engine, packed):
    llm, cfg, group = engine
    weights = models.random_state_dict(cfg, seed=90 + packed, device="cuda:0")
    with pytest.raises(RefitVerificationError) as ei:
        _send(llm, group, weights, packed, corrupt=TARGET)
    assert (ei.value.mismatched, ei.value.missing, ei.value.unexpected) == ([TARGET], [], [])
    assert "worker rank 0" in str(ei.value)
    (worker,) = llm.collective_rpc(native.MANIFEST_METHOD)
    assert worker["tensors"] == 21 and digest_map(worker["manifest"])[TARGET] != digest_tensors({TARGET: weights[TARGET]})[TARGET]
