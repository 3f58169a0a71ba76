"""The layerwise reload's copies on CUDA (``vllm_plugin.worker_copies.owned_copies``): their own memory
pool gives the same addresses back refit after refit (from the second: the first grows the pool),
whatever else the device allocated in between, each copy still its own storage. Needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (memory pools)")]


@pytest.fixture(autouse=True)
def _graphs_on(monkeypatch):
    """Graph replay and the copies' pool are opt-in (``REFIT_VERIFY_CUDA_GRAPHS=1``): on for these
    tests, the torch gate of replay opened (see ``test_graph_replay_gpu.py``), pools and graphs
    dropped after each test."""
    from refit_verify.digest.kernels import replay
    from refit_verify.vllm_plugin import worker_copies as worker

    monkeypatch.setenv("REFIT_VERIFY_CUDA_GRAPHS", "1")
    monkeypatch.setattr(replay, "_TORCH_OK", True)
    monkeypatch.setattr(replay, "_OFF", None)
    yield
    replay.release_all()
    worker.release_pools()


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
    from refit_verify.vllm_plugin import worker_copies as worker

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
    from refit_verify.vllm_plugin import worker_copies as worker

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


def test_pooled_copies_at_the_same_addresses_with_new_bytes_digest_as_the_new_bytes():
    """The false-pass surface of the pool: a kept set (and its graph) hit at the same addresses must
    read the bytes there now."""
    from refit_verify.digest import incremental as digest_stream
    from refit_verify.digest import kept as held_sets
    from refit_verify.digest.batch import tensor_digest
    from refit_verify.digest.kept import DigestSet
    from refit_verify.digest.kernels import replay
    from refit_verify.vllm_plugin import worker_copies as worker

    space = "checked before loading"
    seen, digests = [], []
    for r in range(7):  # pool grows; signatures noted; set built; captured; replays
        batch = _batch(100 + r)  # new staging contents every refit
        copies = worker.owned_copies(batch)
        got = digest_stream.digest_now(copies, space=space)
        want = {n: tensor_digest(c) for n, c in copies}
        assert got == want, f"refit {r}"
        assert want == {n: tensor_digest(v) for n, v in batch}
        seen.append([c.data_ptr() for _, c in copies])
        digests.append(got)
        del copies, batch
    assert seen[1] == seen[-1]  # the same addresses ...
    assert digests[-1] != digests[-2]  # ... different bytes, different digests
    key = (space, *[f"layers.{i}.weight" for i in range(5)])
    kept = held_sets._HELD_SETS.get(key)
    assert isinstance(kept, DigestSet)
    assert any(isinstance(getattr(g[1], "graph", None), replay.Graph) for g in kept._groups), "no graph captured"


def test_a_pooled_clone_out_of_memory_gives_plain_clones_and_the_pool_stays(monkeypatch, caplog):
    from refit_verify.vllm_plugin import worker_copies as worker

    batch = _batch(3)
    worker.owned_copies(batch)  # the pool exists and is warm
    index = batch[0][1].device.index or 0
    mp = worker._POOLS[index]
    real_clone, real_use = torch.Tensor.clone, torch.cuda.use_mem_pool
    state = {"in_pool": False, "clones": 0, "raised": 0}

    @contextlib.contextmanager
    def use(pool, device=None):
        with real_use(pool, device=device):
            state["in_pool"] = True
            try:
                yield
            finally:
                state["in_pool"] = False

    def clone(self, *a, **k):
        if state["in_pool"]:
            state["clones"] += 1
            if state["clones"] == 2:  # after one pooled clone succeeded
                state["raised"] += 1
                raise torch.OutOfMemoryError("CUDA out of memory (simulated in the copies pool)")
        return real_clone(self, *a, **k)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use)
    monkeypatch.setattr(torch.Tensor, "clone", clone)
    with caplog.at_level("WARNING", logger="refit_verify"):
        copies = worker.owned_copies(batch)
    assert state["raised"] == 1 and not state["in_pool"]
    assert [n for n, _ in copies] == [n for n, _ in batch]
    assert all(torch.equal(c, v) and c.data_ptr() != v.data_ptr() for (_, c), (_, v) in zip(copies, batch))
    assert any("ran out of memory in their pool" in r.getMessage() for r in caplog.records)
    assert worker._POOLS[index] is mp  # kept for the next refit
    if hasattr(mp, "use_count"):
        assert mp.use_count() == 1  # the context gave its reference back: only _POOLS holds the pool
    probe = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the allocator no longer routes to the pool
    monkeypatch.setattr(torch.Tensor, "clone", real_clone)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", real_use)
    again = worker.owned_copies(batch)  # the pool works at the next refit
    assert all(torch.equal(c, v) for (_, c), (_, v) in zip(again, batch))
    if hasattr(mp, "snapshot"):
        pooled = {(seg["address"], seg["address"] + seg["total_size"]) for seg in mp.snapshot()}
        assert not any(lo <= probe.data_ptr() < hi for lo, hi in pooled)
        assert all(any(lo <= c.data_ptr() < hi for lo, hi in pooled) for _, c in again)


def test_release_pools_gives_the_pools_memory_back():
    from refit_verify.vllm_plugin import worker_copies as worker

    batch = _batch(4)
    copies = worker.owned_copies(batch)
    nbytes = sum(c.numel() * c.element_size() for _, c in copies)
    del copies
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    assert worker.release_pools() == 1
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= before - nbytes
    again = worker.owned_copies(batch)  # a new pool
    assert all(torch.equal(c, v) for (_, c), (_, v) in zip(again, batch))
