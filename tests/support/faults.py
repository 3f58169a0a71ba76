"""Fault-injection harness for the refit transport (a test utility: production code has no switches).

Faults act through :meth:`RefitSender._exchange`, the one point every request passes after the
sender digested and packed what it references and before the receiver reads it. A fault may
corrupt the staging bytes of a ``Buffer`` (bit flip, lane swap, tensor swap, stale slot) or rewrite
the message (dtype relabel, reshape, drop, add, duplicate name, shortened ``used_bytes``). Each
fault records the parameters it affected, so a test can demand that the verdict names exactly those.

Also here: seeded random tensor sets (all dtypes, 0-dim and 0-element, non-contiguous views, odd
storage offsets), buffer budgets that force buffer switches and oversized tensors, and a receiver
process that serves many refits and reports a SHA-256 of every tensor it loaded (a check
independent of the digest under test).
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing as mp
import os
import queue
import random
from collections.abc import Iterable

import msgspec
import torch

from refit_verify import RefitConfig
from refit_verify.digest.tensors import dtype_name
from refit_verify.errors import RefitTimeoutError
from refit_verify.stream.items import round_up as _round_up
from refit_verify.transport import RefitReceiver, RefitSender
from refit_verify.wire.staged import Buffer, Hello
from refit_verify.wire.fields import Entry

SPAWN = mp.get_context("spawn")
LANE = 8  # bytes per 64-bit digest lane


class NotApplicable(Exception):
    """The fault cannot be applied to this refit (e.g. no two lanes differ); a harness bug if raised in a test."""


# ------------------------------------------------------------------------------ faults


class Fault:
    """Base class. Subclasses override :meth:`on_buffer` (and maybe :meth:`begin_refit`).

    Attributes:
        kind: the class label used in tables. fired: whether it changed anything in this refit.
        affected: names the receiver's verdict must flag (and no others).
        expect: which report categories the names land in, e.g. ``{"mismatched"}``.
    """

    kind = "fault"
    expect: frozenset[str] = frozenset({"mismatched"})
    metadata = False  # a metadata fault is visible even in off mode (count / layout)

    def __init__(self, rng: random.Random | None = None) -> None:
        self.rng = rng or random.Random(0)
        self.fired = False
        self.affected: set[str] = set()

    def begin_refit(self, sender: RefitSender) -> None:
        self.fired = False
        self.affected = set()

    def on_buffer(self, msg: Buffer, staging: torch.Tensor, sender: RefitSender) -> Buffer:
        return msg

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in self.__dict__.items() if k not in ('rng', 'fired', 'affected', 'history'))})"


def _find(msg: Buffer, name: str | None) -> Entry | None:
    for e in msg.entries:
        if e.name == name:
            return e
    return None


class BitFlip(Fault):
    """Flip bit ``bit`` of byte ``byte`` (default: random) of ``target``'s staged slot."""

    kind = "bit flip"

    def __init__(self, target: str, byte: int | None = None, bit: int | None = None, rng=None) -> None:
        super().__init__(rng)
        self.target, self.byte, self.bit = target, byte, bit

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        if e.nbytes == 0:
            raise NotApplicable(f"{self.target} has no bytes to flip")
        byte = self.rng.randrange(e.nbytes) if self.byte is None else self.byte
        bit = self.rng.randrange(8) if self.bit is None else self.bit
        staging[e.offset + byte] ^= 1 << bit
        self.where = (byte, bit)
        self.fired, self.affected = True, {self.target}
        return msg


class LaneSwap(Fault):
    """Swap two different 64-bit lanes (8-byte groups from the tensor's first byte) of ``target``."""

    kind = "lane swap"

    def __init__(self, target: str, lanes: tuple[int, int] | None = None, rng=None) -> None:
        super().__init__(rng)
        self.target, self.lanes = target, lanes

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        n = e.nbytes // LANE
        slot = staging[e.offset : e.offset + n * LANE].view(n, LANE) if n else None
        if self.lanes is not None:
            i, j = self.lanes
        else:
            pairs = [(i, j) for i in range(n) for j in range(i + 1, n)] if n <= 64 else [tuple(sorted(self.rng.sample(range(n), 2))) for _ in range(256)]
            self.rng.shuffle(pairs)
            pair = next(((i, j) for i, j in pairs if not torch.equal(slot[i], slot[j])), None)
            if pair is None:
                raise NotApplicable(f"{self.target}: no two different lanes among {n}")
            i, j = pair
        if torch.equal(slot[i], slot[j]):
            raise NotApplicable(f"{self.target}: lanes {i} and {j} are equal")
        a = slot[i].clone()
        slot[i] = slot[j]
        slot[j] = a
        self.where = (i, j)
        self.fired, self.affected = True, {self.target}
        return msg


class TensorSwap(Fault):
    """Swap the staged bytes of two equal-size tensors of one buffer (default: a random such pair
    with different bytes, in the first buffer that has one)."""

    kind = "tensor swap"

    def __init__(self, a: str | None = None, b: str | None = None, rng=None) -> None:
        super().__init__(rng)
        self.a, self.b = a, b

    def on_buffer(self, msg, staging, sender):
        if self.fired:
            return msg

        def data(e):
            return staging[e.offset : e.offset + e.nbytes]

        if self.a is not None:
            ea, eb = _find(msg, self.a), _find(msg, self.b)
            if ea is None and eb is None:
                return msg
            if ea is None or eb is None:
                raise NotApplicable(f"{self.a} and {self.b} are not in one buffer")
        else:
            pairs = [(x, y) for k, x in enumerate(msg.entries) for y in msg.entries[k + 1 :]
                     if x.nbytes == y.nbytes > 0 and not torch.equal(data(x), data(y))]
            if not pairs:
                return msg
            ea, eb = self.rng.choice(pairs)
        if ea.nbytes != eb.nbytes or torch.equal(data(ea), data(eb)):
            raise NotApplicable(f"{ea.name}, {eb.name}: not equal-size tensors with different bytes")
        tmp = data(ea).clone()
        data(ea).copy_(data(eb))
        data(eb).copy_(tmp)
        self.pair = (ea.name, eb.name)
        self.fired, self.affected = True, {ea.name, eb.name}
        return msg


class StaleSlot(Fault):
    """Overwrite ``target``'s slot with the bytes it held in the previous refit (the stale-reuse
    race). Records every refit; fires from refit number ``from_refit`` (1-based) on."""

    kind = "stale slot"

    def __init__(self, target: str, from_refit: int = 2, rng=None) -> None:
        super().__init__(rng)
        self.target, self.from_refit = target, from_refit
        self.history: list[torch.Tensor] = []
        self.refits = 0

    def begin_refit(self, sender):
        super().begin_refit(sender)
        self.refits += 1

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        slot = staging[e.offset : e.offset + e.nbytes]
        current = slot.clone().cpu()
        if self.refits >= self.from_refit and self.history:
            prev = self.history[-1]
            if prev.numel() != e.nbytes or torch.equal(prev, current):
                raise NotApplicable(f"{self.target}: previous refit's bytes are not a different slot of the same size")
            slot.copy_(prev.to(slot.device))
            self.fired, self.affected = True, {self.target}
        self.history = [current]
        return msg


RELABEL = {"bfloat16": "float16", "float16": "bfloat16", "int8": "float8_e4m3fn", "float8_e4m3fn": "int8"}


class DtypeRelabel(Fault):
    """Relabel ``target``'s dtype with the same bytes (bf16 ↔ fp16, int8 ↔ fp8 e4m3)."""

    kind = "dtype relabel"
    expect = frozenset({"mismatched"})

    def __init__(self, target: str, to: str | None = None, rng=None) -> None:
        super().__init__(rng)
        self.target, self.to = target, to

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        to = self.to or RELABEL.get(e.dtype)
        if to is None:
            raise NotApplicable(f"{self.target}: no same-size relabel for {e.dtype}")
        self.fired, self.affected = True, {self.target}
        self.change = (e.dtype, to)
        return _replace_entry(msg, e, dtype=to)


def other_shape(shape: list[int]) -> list[int]:
    """A different shape with the same number of elements."""
    numel = math.prod(shape)
    if len(shape) >= 2 and list(reversed(shape)) != list(shape):
        return list(reversed(shape))
    if len(shape) == 0:
        return [1]
    if len(shape) == 1:
        return [shape[0], 1]
    return [numel]


class Reshape(Fault):
    """Change ``target``'s shape, keeping the number of elements."""

    kind = "shape change"

    def __init__(self, target: str, shape: list[int] | None = None, rng=None) -> None:
        super().__init__(rng)
        self.target, self.shape = target, shape

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        shape = self.shape if self.shape is not None else other_shape(e.shape)
        if math.prod(shape) != math.prod(e.shape) or list(shape) == list(e.shape):
            raise NotApplicable(f"{self.target}: {shape} is not another shape of {e.shape}")
        self.fired, self.affected = True, {self.target}
        self.change = (list(e.shape), list(shape))
        return _replace_entry(msg, e, shape=list(shape))


class Drop(Fault):
    """Remove ``target``'s entry from its ``Buffer`` (its bytes stay, unreferenced)."""

    kind = "dropped tensor"
    expect = frozenset({"missing"})
    metadata = True

    def __init__(self, target: str, rng=None) -> None:
        super().__init__(rng)
        self.target = target

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.target)
        if e is None:
            return msg
        self.fired, self.affected = True, {self.target}
        return msgspec.structs.replace(msg, entries=[x for x in msg.entries if x is not e])


class AddUnexpected(Fault):
    """Append an entry the sender never sent (random bytes in free space after ``used_bytes``,
    or, when the buffer is full, a 0-element tensor) to the first buffer."""

    kind = "unexpected tensor"
    expect = frozenset({"unexpected"})
    metadata = True

    def __init__(self, name: str = "injected.unexpected.weight", rng=None) -> None:
        super().__init__(rng)
        self.name = name

    def on_buffer(self, msg, staging, sender):
        if self.fired:
            return msg
        align = sender.config.alignment
        numel = self.rng.randrange(1, 64)
        nbytes = numel * 4
        off = msg.used_bytes
        if off + _round_up(nbytes, align) <= staging.numel():
            staging[off : off + nbytes] = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(self.rng.randrange(1 << 30))).to(staging.device)
            entry = Entry(name=self.name, dtype="float32", shape=[numel], offset=off, nbytes=nbytes)
            used = off + _round_up(nbytes, align)
        else:
            entry = Entry(name=self.name, dtype="float32", shape=[0], offset=off, nbytes=0)
            used = off
        self.fired, self.affected = True, {self.name}
        return msgspec.structs.replace(msg, entries=[*msg.entries, entry], used_bytes=used)


class DuplicateName(Fault):
    """Rename ``src``'s entry to ``dst`` (another tensor of the same refit): ``dst`` arrives twice,
    ``src`` never. Both are affected."""

    kind = "duplicate name"
    expect = frozenset({"missing", "rejected"})
    metadata = True

    def __init__(self, src: str, dst: str, rng=None) -> None:
        super().__init__(rng)
        self.src, self.dst = src, dst

    def on_buffer(self, msg, staging, sender):
        e = _find(msg, self.src)
        if e is None:
            return msg
        self.fired, self.affected = True, {self.src, self.dst}
        return _replace_entry(msg, e, name=self.dst)


class ShortenUsed(Fault):
    """Lower ``used_bytes`` of the buffer holding ``target`` by ``by`` bytes (default: random, from 1
    up to the last slot plus a random share of the rest). Every entry whose aligned slot no longer
    ends within ``used_bytes`` is affected."""

    kind = "shortened used_bytes"
    expect = frozenset({"missing", "rejected"})
    metadata = True

    def __init__(self, target: str, by: int | None = None, rng=None) -> None:
        super().__init__(rng)
        self.target, self.by = target, by

    def on_buffer(self, msg, staging, sender):
        if _find(msg, self.target) is None:
            return msg
        align = sender.config.alignment
        if self.by is not None:
            by = self.by
        else:
            last = msg.entries[-1]
            tail = msg.used_bytes - last.offset  # the last entry's slot
            by = self.rng.randrange(1, max(2, tail + 1)) if self.rng.random() < 0.6 else self.rng.randrange(1, msg.used_bytes + 1)
        used = max(0, msg.used_bytes - by)
        affected = {e.name for e in msg.entries if e.offset + _round_up(e.nbytes, align) > used}
        if not affected:
            raise NotApplicable(f"cutting {by} bytes off buffer {msg.seq} affects no entry")
        self.fired, self.affected = True, affected
        self.cut = (msg.used_bytes, used)
        return msgspec.structs.replace(msg, used_bytes=used)


def _replace_entry(msg: Buffer, e: Entry, **changes) -> Buffer:
    new = msgspec.structs.replace(e, **changes)
    return msgspec.structs.replace(msg, entries=[new if x is e else x for x in msg.entries])


CLASSES = [BitFlip, LaneSwap, TensorSwap, StaleSlot, DtypeRelabel, Reshape, Drop, AddUnexpected, DuplicateName, ShortenUsed]


class FaultySender(RefitSender):
    """A :class:`RefitSender` that applies ``faults`` to every ``Buffer`` between packing and sending.

    ``faults`` may be reassigned between refits; each fault is told when a refit starts.
    """

    def __init__(self, *args, faults: Iterable[Fault] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.faults = list(faults)
        self.staging_names: list[str] = []  # shared-memory objects this sender sent

    def _exchange(self, msg, staging=None):
        if isinstance(msg, Buffer) and hasattr(msg.handle, "name"):
            self.staging_names.append(msg.handle.name)
        if isinstance(msg, Hello):
            for f in self.faults:
                f.begin_refit(self)
        elif isinstance(msg, Buffer) and staging is not None:
            for f in self.faults:
                msg = f.on_buffer(msg, staging, self)
            if staging.is_cuda:
                torch.cuda.synchronize(staging.device)
        return super()._exchange(msg, staging)


# ------------------------------------------------------------------------------ random tensors

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, torch.uint8, torch.int16, torch.int32,
          torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64]


def _random_base(gen: torch.Generator, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """``numel`` elements of ``dtype`` with random bit patterns (NaN payloads, -0.0 included)."""
    if dtype is torch.bool:
        return torch.randint(0, 2, (numel,), generator=gen, dtype=torch.uint8).bool()
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


def random_tensor(rng: random.Random, gen: torch.Generator, dtype: torch.dtype, max_numel: int) -> torch.Tensor:
    """A tensor of ``dtype`` with random bits: 0-dim, 0-element, contiguous or one of several
    non-contiguous views (transpose, stepped slice, odd storage offset, expand, permute)."""
    kind = rng.choices(["scalar", "empty", "flat", "2d", "transpose", "step", "offset", "expand", "permute"],
                       weights=[1, 1, 3, 3, 2, 2, 2, 1, 1])[0]
    if kind == "scalar":
        return _random_base(gen, dtype, 1).reshape(())
    if kind == "empty":
        return _random_base(gen, dtype, 0).reshape(rng.choice([(0,), (3, 0), (0, 5, 2)]))
    n = rng.randint(1, max(1, max_numel))
    if kind == "flat":
        return _random_base(gen, dtype, n)
    r = rng.randint(1, max(1, int(math.sqrt(n))))
    c = max(1, n // r)
    if kind == "2d":
        return _random_base(gen, dtype, r * c).reshape(r, c)
    if kind == "transpose":
        return _random_base(gen, dtype, r * c).reshape(r, c).t()
    if kind == "step":
        return _random_base(gen, dtype, 2 * n + 1)[1::2]
    if kind == "offset":
        off = rng.randint(1, 7)
        return _random_base(gen, dtype, n + off)[off:]
    if kind == "expand":
        return _random_base(gen, dtype, c).reshape(1, c).expand(r, c)
    a, b = max(1, r // 2), 2
    return _random_base(gen, dtype, a * b * c).reshape(a, b, c).permute(2, 0, 1)


def random_tensor_set(seed: int, *, n_min: int = 1, n_max: int = 24, max_numel: int = 700,
                      dtypes: list[torch.dtype] | None = None) -> list[tuple[str, torch.Tensor]]:
    """A seeded random state dict: names ``p{i}.<dtype>``, random dtypes, shapes and layouts."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dts = dtypes or DTYPES
    out = []
    for i in range(rng.randint(n_min, n_max)):
        dt = rng.choice(dts)
        t = random_tensor(rng, gen, dt, max_numel if rng.random() < 0.85 else max_numel * 8)
        out.append((f"layers.{i}.{dtype_name(dt)}", t))
    return out


def random_budget(seed: int, tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """Alignment and a staging budget that forces buffer switches and, often, oversized tensors."""
    rng = random.Random(seed ^ 0x5EED)
    align = rng.choice([16, 64, 512, 512, 4096])
    sizes = sorted(_round_up(t.numel() * t.element_size(), align) for _, t in tensors) or [align]
    pick = rng.choice(["tiny", "median", "large", "huge"])
    half = {"tiny": align, "median": max(align, sizes[len(sizes) // 2]), "large": max(align, sum(sizes) // 3),
            "huge": max(align, 2 * sum(sizes))}[pick]
    half = max(align, half + rng.randrange(0, align))
    return {"alignment": align, "buffer_bytes": 2 * half}


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes in logical order, computed without :func:`refit_verify.digest.tensors.logical_bytes`
    (an independent reference for the tests)."""
    x = t.detach().clone(memory_format=torch.contiguous_format).reshape(-1)
    if x.dtype.is_complex:
        x = torch.view_as_real(x).reshape(-1)
    return x.clone().view(torch.uint8)


def sha(dtype: torch.dtype, shape, data: bytes) -> str:
    h = hashlib.sha256()
    h.update(f"{dtype_name(dtype)}|{tuple(shape)}|".encode())
    h.update(data)
    return h.hexdigest()


def tensor_sha(t: torch.Tensor) -> str:
    return sha(t.dtype, tuple(t.shape), raw_bytes(t).cpu().numpy().tobytes())


# ------------------------------------------------------------------------------ receiver process


def serve(endpoint: str, cfg: dict, results, stop_after: int | None = None, verify: bool = True) -> None:
    """Receive refits until killed (or ``stop_after`` refits); put one result dict per refit.

    The result holds the refit id, agreed mode, error, rejected entries, counts, the manifest, and
    ``got``: ``{name: sha256(dtype, shape, bytes)}`` of every tensor handed to ``load``.
    """
    import logging

    logging.basicConfig(level=logging.ERROR)
    done = 0
    with RefitReceiver(endpoint, config=RefitConfig.build(**cfg), verify=verify) as rx:
        while stop_after is None or done < stop_after:
            got: dict[str, str] = {}

            def load(batch):
                for name, t in batch:
                    got[name] = tensor_sha(t)

            try:
                res = rx.receive(load)
            except RefitTimeoutError as e:
                if e.progress.get("stage") == "waiting for Hello":
                    continue  # idle between tests
                results.put({"raised": f"{type(e).__name__}: {e}", "progress": e.progress})
                continue
            except Exception as e:  # noqa: BLE001 - report, keep serving
                results.put({"raised": f"{type(e).__name__}: {e}", "progress": getattr(e, "progress", {})})
                continue
            done += 1
            results.put({"refit_id": res.refit_id, "mode": res.mode.value, "error": res.error, "rejected": res.rejected,
                         "tensors": res.tensors, "bytes": res.bytes, "buffers": res.buffers, "manifest": res.manifest, "got": got})


class ReceiverProcess:
    """A spawned :func:`serve` process."""

    def __init__(self, endpoint: str, *, stop_after: int | None = None, verify: bool = True, **cfg) -> None:
        cfg.setdefault("timeout_s", 30.0)
        cfg.setdefault("connect_timeout_s", 5.0)
        self.q = SPAWN.Queue()
        self.proc = SPAWN.Process(target=serve, args=(endpoint, cfg, self.q, stop_after, verify), daemon=True)
        self.proc.start()

    def result(self, timeout: float = 60.0) -> dict:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"receiver process produced nothing (alive={self.proc.is_alive()}, exitcode={self.proc.exitcode})") from None

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)


def shm_leftovers(names: Iterable[str]) -> list[str]:
    """Those of ``names`` (shared-memory staging objects) still present in /dev/shm."""
    return sorted(n for n in set(names) if os.path.exists(os.path.join("/dev/shm", n)))


def mapped_staging(pid: int | str = "self") -> list[str]:
    """Staging objects still mapped by process ``pid``."""
    with open(f"/proc/{pid}/maps") as f:
        return sorted({line.split()[-2] if line.rstrip().endswith("(deleted)") else line.split()[-1]
                       for line in f if "/dev/shm/rv_" in line})


# ------------------------------------------------------------------------------ seeded cases


class Case:
    """One seeded fault case: a tensor set, a budget, and the fault (for a stale slot also the
    tensors of the refit before, whose bytes go stale)."""

    def __init__(self, cls: type[Fault], seed: int) -> None:
        self.cls, self.seed = cls, seed
        rng = random.Random(seed * 7919 + CLASSES.index(cls))
        gen = torch.Generator().manual_seed(seed)
        tensors = random_tensor_set(seed, n_min=2)
        names = [n for n, _ in tensors]
        nbytes = {n: t.numel() * t.element_size() for n, t in tensors}
        self.previous: list[tuple[str, torch.Tensor]] | None = None
        budget = random_budget(seed, tensors)

        def pick(ok) -> str:
            cands = [n for n in names if ok(n)]
            return rng.choice(cands) if cands else None

        def add(dtype: torch.dtype, numel: int) -> str:
            name = f"extra.{len(tensors)}.{dtype_name(dtype)}"
            t = _random_base(gen, dtype, numel)
            tensors.insert(rng.randrange(len(tensors) + 1), (name, t))
            names.insert(0, name)
            nbytes[name] = t.numel() * t.element_size()
            return name

        def lanes_differ(n: str) -> bool:
            b = raw_bytes(dict(tensors)[n])
            k = b.numel() // LANE
            return k >= 2 and not bool((b[: k * LANE].view(k, LANE) == b[:LANE]).all())

        if cls is BitFlip:
            target = pick(lambda n: nbytes[n] > 0) or add(torch.float32, 16)
            fault = BitFlip(target, rng=rng)
        elif cls is LaneSwap:
            target = pick(lanes_differ) or add(torch.float32, 64)
            fault = LaneSwap(target, rng=rng)
        elif cls is TensorSwap:
            dt = rng.choice(DTYPES[:-1])
            numel = rng.randint(1, 64)
            a, b = _random_base(gen, dt, numel), _random_base(gen, dt, numel)
            while torch.equal(raw_bytes(a), raw_bytes(b)):
                b = _random_base(gen, dt, numel)
            tensors[:0] = [(f"pair.a.{dtype_name(dt)}", a), (f"pair.b.{dtype_name(dt)}", b)]
            slot = _round_up(a.numel() * a.element_size(), budget["alignment"])
            budget["buffer_bytes"] = max(budget["buffer_bytes"], 4 * slot)
            fault = TensorSwap(rng=rng)
        elif cls is StaleSlot:
            target = pick(lambda n: nbytes[n] >= 8) or add(torch.float32, 8)
            self.previous = [(n, _random_base(gen, t.dtype, t.numel()).reshape(t.shape)) for n, t in tensors]
            while torch.equal(raw_bytes(dict(self.previous)[target]), raw_bytes(dict(tensors)[target])):
                t = dict(tensors)[target]
                self.previous = [(n, x if n != target else _random_base(gen, t.dtype, t.numel()).reshape(t.shape)) for n, x in self.previous]
            fault = StaleSlot(target, rng=rng)
        elif cls is DtypeRelabel:
            target = pick(lambda n: dtype_name(dict(tensors)[n].dtype) in RELABEL) or add(rng.choice([torch.bfloat16, torch.float16, torch.int8, torch.float8_e4m3fn]), rng.randint(1, 40))
            fault = DtypeRelabel(target, rng=rng)
        elif cls is Reshape:
            fault = Reshape(pick(lambda n: True), rng=rng)
        elif cls is Drop:
            fault = Drop(pick(lambda n: True), rng=rng)
        elif cls is AddUnexpected:
            fault = AddUnexpected(rng=rng)
        elif cls is DuplicateName:
            src, dst = rng.sample(names, 2)
            fault = DuplicateName(src, dst, rng=rng)
        elif cls is ShortenUsed:  # a buffer with bytes in it (one of only empty tensors has used_bytes 0)
            fault = ShortenUsed(pick(lambda n: nbytes[n] > 0) or add(torch.float32, 16), rng=rng)
        else:  # pragma: no cover
            raise ValueError(cls)
        self.tensors, self.budget, self.fault = tensors, budget, fault

    def __repr__(self) -> str:
        return f"Case({self.cls.__name__}, seed={self.seed}, {len(self.tensors)} tensors, {self.budget}, {self.fault!r})"
