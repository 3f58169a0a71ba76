"""The trainer's adds on CUDA tensors (``refit(copy=False)``'s held adds and ``copy=True``'s copies):
the digests equal :func:`tensor_digest`'s of the same bytes, the checks a held add leaves to the
launch still name what cannot be read, a kept set re-launched over the same tensors reads their
bytes as they are then, and a wrapper subclass with no memory of its own is refused at its add.
Needs a CUDA GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch

from refit_verify.digest.batch import tensor_digest
from refit_verify.digest.incremental import CopyingBatch, HeldBatch, digest_now
from refit_verify.errors import RefitInputError
from refit_verify.trainer.exports import StreamDigests

DEV = "cuda"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _set(n: int = 40) -> list[tuple[str, torch.Tensor]]:
    """``n`` CUDA tensors of the shapes a refit pushes: bf16 matrices, fp32 norms, a parameter, a
    strided view (transposed) and a slice at an offset; fixed seed, so a failure reproduces."""
    g = torch.Generator(device=DEV).manual_seed(7)
    out = []
    for i in range(n):
        k = i % 5
        if k == 0:
            t = torch.randn(64, 96, device=DEV, dtype=torch.bfloat16, generator=g)
        elif k == 1:
            t = torch.randn(96, device=DEV, generator=g)
        elif k == 2:
            t = torch.nn.Parameter(torch.randn(32, 32, device=DEV, dtype=torch.bfloat16, generator=g), requires_grad=False)
        elif k == 3:
            t = torch.randn(48, 80, device=DEV, dtype=torch.float16, generator=g).t()
        else:
            t = torch.randn(4096, device=DEV, generator=g)[1000:3000]
        out.append((f"layers.{i}.w{k}", t))
    return out


@pytest.mark.parametrize("copy", [False, True])
def test_stream_digests_of_cuda_tensors_equal_tensor_digest_and_follow_their_bytes(copy):
    pairs = _set()
    want = {n: tensor_digest(t) for n, t in pairs}
    for _ in range(3):  # the second and third reads go through the kept set (held) or the same copies' plan
        s = StreamDigests(copy=copy)
        for n, t in pairs:
            s.add(n, t)
        assert s.digests() == want and s.changed == {}
    name, t = pairs[5]  # a write after the add: held reads it at the launch, a copy keeps the add's bytes
    s = StreamDigests(copy=copy)
    for n, u in pairs:
        s.add(n, u)
    before = tensor_digest(t)
    with torch.no_grad():
        t.view(-1)[0] += 1
    got = s.digests()
    if copy:
        assert got[name] == before
    else:
        assert name not in got and "modified in place" in s.changed[name]  # its version moved since the add: never read


def test_a_held_cuda_tensor_freed_or_shrunk_after_its_add_is_named_at_the_launch_and_never_read():
    keep = torch.arange(256, device=DEV, dtype=torch.float32)
    freed = torch.nn.Parameter(torch.ones(1024, device=DEV), requires_grad=False)
    shrunk = torch.nn.Parameter(torch.ones(1024, device=DEV), requires_grad=False)
    hb = HeldBatch()
    hb.add("keep", keep)
    hb.add("freed", freed)
    hb.add("shrunk", shrunk)
    freed.untyped_storage().resize_(0)
    shrunk.untyped_storage().resize_(2048)
    assert hb.hexdigests() == {"keep": tensor_digest(keep)}
    assert "freed or resized" in hb.changed["freed"] and "freed or resized" in hb.changed["shrunk"]
    with pytest.raises(RefitInputError, match="'shrunk'"):
        digest_now([("keep", keep), ("shrunk", shrunk)])


def test_a_copying_batch_of_cuda_tensors_digests_the_bytes_at_each_add():
    pairs = _set(12)
    cb = CopyingBatch(1 << 30)
    want = {}
    for n, t in pairs:
        cb.add(n, t)
        want[n] = tensor_digest(t)
        with torch.no_grad():
            t.add_(1)  # overwritten at once (a staging slot reused): the copy keeps the add's bytes
    assert cb.hexdigests() == want


def test_a_cuda_wrapper_subclass_without_memory_of_its_own_is_refused():
    """A __torch_dispatch__ wrapper (TwoTensor; DTensor is one) on CUDA: elements, address 0."""
    two = pytest.importorskip("torch.testing._internal.two_tensor")
    t = two.TwoTensor(torch.ones(8, device=DEV), torch.zeros(8, device=DEV))
    assert t.numel() == 8 and t.data_ptr() == 0
    for s in (StreamDigests(copy=False), StreamDigests(copy=True)):
        with pytest.raises(RefitInputError, match="no memory of its own"):
            s.add("w", t)
        assert s.digests() == {} and "w" in s.changed
