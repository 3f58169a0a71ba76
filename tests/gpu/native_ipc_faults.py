"""Fault injection inside a vLLM worker for tests/gpu/test_native_ipc_gpu.py (import-light: it is
unpickled in the worker by ``LLM.collective_rpc(callable)``)."""

from __future__ import annotations


def corrupt_staged_slice(worker, target: str, byte_index: int) -> bool:
    """Make the worker's ``ipc`` packed consumer flip one byte of ``target``'s staged slice.

    Models a staged slice corrupted between the shared buffer and ``model.load_weights`` (the
    bytes that get loaded differ from the bytes the trainer exported).
    """
    import torch
    from vllm.distributed.weight_transfer import ipc_engine

    original = getattr(ipc_engine, "_refit_test_original_consumer", None) or ipc_engine.packed_ipc_consumer
    ipc_engine._refit_test_original_consumer = original

    def packed_ipc_consumer(*args, **kwargs):
        weights = original(*args, **kwargs)
        for name, t in weights:
            if name == target:
                t.view(-1).view(torch.uint8)[byte_index] ^= 1
        return weights

    ipc_engine.packed_ipc_consumer = packed_ipc_consumer
    return True


def restore_staged_slice(worker) -> bool:
    """Undo :func:`corrupt_staged_slice`."""
    from vllm.distributed.weight_transfer import ipc_engine

    original = getattr(ipc_engine, "_refit_test_original_consumer", None)
    if original is not None:
        ipc_engine.packed_ipc_consumer = original
    return True
