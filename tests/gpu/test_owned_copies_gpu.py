"""The layerwise reload's copies on CUDA (``vllm_plugin.worker.owned_copies``): their own memory
pool gives the same addresses back refit after refit (from the second: the first grows the pool),
whatever else the device allocated in between, each copy still its own storage. Needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (memory pools)")]


@pytest.fixture(autouse=True)
def _graphs_on(monkeypatch):
    """Graph replay and the copies' pool are opt-in (``REFIT_VERIFY_CUDA_GRAPHS=1``): on for these tests."""
    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")


def _batch(seed: int) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    shapes = [(3072, 1024), (1024,), (151, 1024), (8, 128), (3072, 1024)]
    staging = torch.randn(sum(map(math.prod, shapes)), generator=g, device="cuda").to(torch.bfloat16)
    out, off = [], 0
    for i, shape in enumerate(shapes):
        n = math.prod(shape)
        out.append((f"layers.{i}.weight", staging[off : off + n].view(shape)))  # views of one staging slot, as the transport's
        off += n
    return out


def test_copies_are_own_storages_at_the_same_addresses_each_refit():
    from refit_verify.vllm_plugin import worker

    batch = _batch(1)
    seen = []
    keep = []
    for r in range(4):  # the first refit grows the pool; from the second on it hands the same blocks back
        copies = worker.owned_copies(batch)
        assert [n for n, _ in copies] == [n for n, _ in batch]
        for (_, c), (_, v) in zip(copies, batch):
            assert torch.equal(c, v) and c.dtype == v.dtype and c.shape == v.shape
            assert c.untyped_storage().data_ptr() == c.data_ptr()  # its own storage, from its start
            assert c.untyped_storage().nbytes() == c.numel() * c.element_size()
        seen.append([c.data_ptr() for _, c in copies])
        del copies, c, v  # nothing of this refit's copies stays referenced (as after a layerwise reload)
        keep.append(torch.empty((r + 1) * (3 << 20), dtype=torch.uint8, device="cuda"))  # other allocations in between
    assert seen[1] == seen[2] == seen[3]
    assert len(set(seen[1])) == len(seen[1])


def test_a_device_without_pools_gets_plain_clones(monkeypatch, caplog):
    from refit_verify.vllm_plugin import worker

    def no_pools(*_a, **_k):
        raise RuntimeError("expandable segments do not support memory pools")

    monkeypatch.setattr(worker, "_POOLS", {})
    monkeypatch.setattr(torch.cuda, "use_mem_pool", no_pools)
    batch = _batch(2)
    with caplog.at_level("WARNING", logger="refit_verify"):
        copies = worker.owned_copies(batch)
    assert all(torch.equal(c, v) for (_, c), (_, v) in zip(copies, batch))
    assert any("no memory pool" in r.getMessage() for r in caplog.records)
    assert worker.owned_copies(batch)[0][1].data_ptr() != batch[0][1].data_ptr()
