"""The fused copy+digest on CUDA (``DigestBatch.add_copy``, the compiled COPY leaf kernels): digests equal
the CPU oracle and the slots hold the logical bytes, for sizes up to several chunks, sources at odd
offsets and non-contiguous ones; a kept plan run again (direct launches, graph replay) copies and digests
the new bytes; the Packer copies grouped CUDA tensors only through it. Needs a CUDA GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton kernels)")]

if torch.cuda.is_available():
    from refit_verify.digest.batch import DigestBatch, fuses, tensor_digest
    from refit_verify.digest.tensors import logical_bytes
    from refit_verify.stream.pack import Packer

MiB = 1 << 20
FILL = 0xA5


def _lanes(n: int) -> int:
    return (n + 7) // 8 * 8


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(1)
    raw = torch.randint(0, 256, (24 * MiB + 64,), dtype=torch.uint8, device="cuda", generator=g)
    out = [(f"u8.{n}", raw[:n].clone()) for n in (0, 1, 7, 8, 9, 4095, 4096 * 16 + 3, 65537 * 8 + 3, 8 * MiB + 5, 24 * MiB)]
    out += [(f"offset.{o}", raw[o : o + 8 * MiB + 13]) for o in (1, 4, 7)]
    f = torch.randn(1000, 700, device="cuda", generator=g)
    out += [("transposed", f.t()), ("bf16.slice", f.to(torch.bfloat16)[3:, 5:]), ("scalar", torch.tensor(2.5, device="cuda"))]
    return out


def _slots(cases: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, list[int]]:
    offs, used = [], 0
    for _, t in cases:
        offs.append(used)
        used += (t.numel() * t.element_size() + 511) // 512 * 512
    return torch.full((used + 512,), FILL, dtype=torch.uint8, device="cuda"), offs


def _check(buf: torch.Tensor, offs: list[int], cases: list[tuple[str, torch.Tensor]]) -> None:
    for (name, t), o in zip(cases, offs):
        n = t.numel() * t.element_size()
        assert torch.equal(buf[o : o + n], logical_bytes(t)), name
        assert bool((buf[o + n : o + _lanes(n)] == 0).all()), name
        assert bool((buf[o + _lanes(n) : o + (n + 511) // 512 * 512] == FILL).all()), name


def test_add_copy_on_cuda_matches_the_cpu_digests_and_copies_the_logical_bytes():
    cases = _cases()
    assert fuses(cases[0][1])
    buf, offs = _slots(cases)
    b = DigestBatch()
    for (name, t), o in zip(cases, offs):
        b.add_copy(name, t, buf[o : o + _lanes(t.numel() * t.element_size())])
    got = b.hexdigests()
    assert got == {name: tensor_digest(t.cpu()) for name, t in cases}
    _check(buf, offs, cases)


def test_a_kept_copy_plan_copies_and_digests_new_bytes_at_every_run():
    """The same sources and slots four times (the kept plan: JIT, then direct launches / graph replay)."""
    cases = _cases()[:9]
    buf, offs = _slots(cases)
    for k in range(4):
        for _, t in cases:
            if t.numel() > k:
                t.view(-1)[k] += 1
        buf.fill_(FILL)
        b = DigestBatch()
        for (name, t), o in zip(cases, offs):
            b.add_copy(name, t, buf[o : o + _lanes(t.numel() * t.element_size())])
        assert b.hexdigests() == {name: tensor_digest(t.cpu()) for name, t in cases}, k
        _check(buf, offs, cases)


class _CudaSink:
    def __init__(self, capacity: int) -> None:
        self.capacity, self.buf, self.posts = capacity, None, []

    def buffer(self, like):
        if self.buf is None:
            self.buf = torch.empty(self.capacity, dtype=torch.uint8, device="cuda")
        return self.buf

    def post(self, entries, used):
        self.posts.append(("group", list(entries), self.buf[:used].cpu()))
        self.buf.fill_(0xEE)  # the next group must not depend on what was here

    def post_alone(self, u8, entry, aligned, meanwhile=None):
        self.posts.append(("alone", [entry], u8.cpu()))
        if meanwhile is not None:
            meanwhile()


def test_the_packer_copies_grouped_cuda_tensors_through_the_fused_op():
    cases = _cases()
    cap = 32 * MiB
    sink = _CudaSink(cap)
    p = Packer(sink, capacity=cap, alignment=512, digests=DigestBatch(), digests_ahead=True)
    p.digest_first(cases)
    p.add_all(cases)
    want = {name: tensor_digest(t.cpu()) for name, t in cases}
    assert {e.name: e.digest for _, ents, _ in sink.posts for e in ents} == want and p.manifest() == want
    assert p.fused == len(cases)  # none is over a group
    sent = dict(cases)
    for _, ents, data in sink.posts:
        for e in ents:
            assert torch.equal(data[e.offset : e.offset + e.nbytes], logical_bytes(sent[e.name]).cpu()), e.name


def test_the_cuda_warm_up_runs_a_verifying_packer_and_first_sight_on_the_device(monkeypatch, caplog):
    """``backends.warm_paths("cuda")`` (the end of every CUDA warm-up: the trainer's ``warmup``, the
    worker's prepare) packs throwaway CUDA tensors through a verifying Packer, every grouped one through
    the fused op, and digests them at first sight, moved and expected ahead (:func:`check_warm_paths`)."""
    from tests.support.warmups import check_warm_paths

    check_warm_paths(monkeypatch, caplog, "cuda")
