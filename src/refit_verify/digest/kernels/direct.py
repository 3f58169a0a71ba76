"""Kept launch plans launched through Triton's compiled kernels: no JIT dispatch after the check.

A kept plan (:class:`~refit_verify.digest.kernels.launch.Planned`, held by a
:class:`~refit_verify.digest.kept.DigestSet`) is run again at every refit: the worker's check before
loading, the engine-state snapshot, the read-back, a trainer's held tensors. Each run is up to four
Triton launches, and each ``kernel[grid](...)`` goes through ``JITFunction.run``: it binds the
arguments, specialises each one, builds the cache key, looks the compiled kernel up and checks the
kernel's globals before it launches: about 0.4 ms of host time per run of a plan on an H200 host,
however few bytes the plan reads.

Here a plan's launches go straight to compiled kernels (``JITFunction.run`` returns the
``CompiledKernel`` it launched): ``compiled[grid](*args, stream=...)``, Triton's own launcher of a
compiled kernel (``CompiledKernel.__getitem__``), which takes every argument in signature order,
``constexpr`` ones included (the launcher skips them). A plan whose every launch is of a kind
checked before in the process (:func:`_kind`: the same function, ``constexpr`` values, options and
argument types on the same device; the digest warm-up checks every kind a refit launches) launches
directly from its first run; any other plan is checked at its second run and launches directly
from its third.

Why the compiled kernel is still the right one:

* A kept plan's arguments never change between runs: its device plan tensor (same address), its
  counts (``V``, ``C``, offsets) and the kernels' ``constexpr`` values. Only the scratch tensors
  (``work``, ``out``) are fresh at each run. Every direct run checks this: the functions, grids,
  ``constexpr`` values, options, integer arguments and the other tensors' addresses and dtypes must
  be those of the checked run, else that run goes through ``JITFunction.run``.
* The kernels specialise on no integer value (``do_not_specialize`` on every integer argument; the
  integer's type, i32 / i64 / u64, still follows its range, and the values are checked) and on a
  pointer argument only through its dtype and 16-byte alignment. Every direct run checks that the
  scratch tensors are 16-byte aligned (the caching allocator gives at least 512); otherwise that
  run goes through ``JITFunction.run``.
* **Checked once per kind of launch.** At the second run of a plan with a launch of a kind not
  checked yet, the JIT launches run first (their result is the one returned). Then the work area is
  filled with a sentinel and the direct launches run into an output block filled with the same
  sentinel. The two outputs are compared on the device (``torch.equal``: one synchronisation). A
  mismatch keeps that plan on JIT launches (logged, each time). So does a launcher that raises (then
  direct launches are off for the whole process, logged once: a Triton whose launcher takes other
  arguments). A missed launch cannot pass the check: a missed leaf or upper launch leaves sentinel
  words in the work area for the chain to read, a missed chain launch leaves the sentinel output
  block. A passed check makes its launches' kinds known (:data:`_KNOWN`), with their compiled kernels.
* **What a kind is.** Plans of one kind differ only in argument values (their plan tensor's address,
  counts, offsets), which a direct launch passes as it gets them. Triton picks a compiled kernel by
  the function, ``constexpr`` values, options, each pointer's dtype and 16-byte alignment and each
  integer's type (its range: i32, i64, u64; no value, every integer being ``do_not_specialize``):
  :func:`_kind` keeps all of them, and an integer's value itself where Triton may specialise on it.
  Every JIT launch whose kind is known is compared with it: Triton returning another compiled kernel
  for a known kind (a Triton whose cache key holds more) empties the table for the process (logged
  once): plans are then checked one by one as above, those that went direct from the table too.
* Launch hooks (``triton.knobs.runtime.launch_enter_hook`` / ``launch_exit_hook``, e.g. a profiler)
  still run: the compiled kernel's launcher calls them as ``JITFunction.run`` does.

What a direct launch does not re-evaluate, unlike ``JITFunction.run`` at every launch: Triton
settings changed after the check of the plan or of its kinds (``knobs.runtime.debug``, a launch's
``debug``, the instrumentation mode), the function's pre-run hooks, and the check that the kernel's
globals did not change since it was compiled. None of them changes a digest (the kernels' globals are module constants); a process
that changes Triton's debug settings midway and wants them applied to kept plans sets
:data:`~refit_verify.config.DIRECT_LAUNCH_ENV_VAR` to ``0``. The caller makes ``p.device`` the
current device (both :func:`~refit_verify.digest.kernels.launch.run_plan` and
:func:`~refit_verify.digest.kernels.replay.replay` do); a run where another device is current goes through
the JIT.

Not used: under the Triton interpreter, for custom FAST launches (benchmarks), for a run whose
roots stay in the work area (``chunk_roots``), while a CUDA graph is being captured before the
plan's check, and when :data:`~refit_verify.config.DIRECT_LAUNCH_ENV_VAR` is ``0``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from refit_verify.config import direct_launch_enabled

__all__ = ["Launch", "MIN_RUNS", "run"]

logger = logging.getLogger("refit_verify")

MIN_RUNS = 2
"""A plan's direct launches are checked at this run and used from the next (the first run compiles
the kernels and may be the plan's only one)."""

_SENTINEL = -0x3C3C3C3C3C3C3C3D  # fills the work area and the direct output block at the check
_OFF: str | None = None  # why direct launches are off for the process (a launcher raised), None while they are not
_LOGGED: set[str] = set()
_KNOWN: dict[tuple, Any] = {}
"""A checked kind of launch (:func:`_kind`) -> the compiled kernel its check launched."""
_NO_KINDS: list[bool] = [False]  # True once Triton gave another compiled kernel for a known kind: plans checked one by one


class Launch(NamedTuple):
    """One Triton launch of a plan.

    Attributes:
        fn: the ``@triton.jit`` function.
        grid: the launch grid (1 to 3 ints).
        args: the runtime arguments, in signature order (tensors and ints).
        consts: ``((name, value), ...)`` of the ``constexpr`` arguments, in signature order, after ``args``.
        options: launch options (``num_warps``, ``maxnreg``...), not arguments.
    """

    fn: Any
    grid: tuple
    args: tuple
    consts: tuple = ()
    options: dict | None = None


def _log_once(key: str, msg: str, *args) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.warning(msg, *args)


def _turn_off(p: Any, e: Exception) -> None:
    """A compiled kernel's launcher raised: this plan, and every plan of the process, launch through the JIT."""
    global _OFF
    _OFF = f"{type(e).__name__}: {e}"[:300]
    p.direct = False
    _log_once("raised", "refit-verify: launching a compiled digest kernel directly failed (%s); "
              "JIT launches from now on in this process", _OFF)


def jit(launches: Sequence[Launch]) -> list:
    """Launch through ``JITFunction.run``; returns the compiled kernel of each launch (None where
    Triton returned none). Raises what Triton raises (a compile error, a launch error)."""
    out = []
    for la in launches:
        out.append(la.fn[la.grid](*la.args, **dict(la.consts), **(la.options or {})))
    return out


def direct(compiled: Sequence[Any], launches: Sequence[Launch], stream: int) -> None:
    """Launch each compiled kernel with its launch's grid and arguments on ``stream`` (a raw
    ``cudaStream_t`` as an int).

    Raises:
        ValueError: ``compiled`` and ``launches`` differ in length.
        Exception: what the compiled kernel's launcher raises (other arguments than it takes, a
            launch error); the launches before it were enqueued.
    """
    for ck, la in zip(compiled, launches, strict=True):
        g = la.grid
        ck[g if len(g) == 3 else (*g, 1, 1)[:3]](*la.args, *(v for _, v in la.consts), stream=stream)  # it reads grid[0..2]


def _stream(device: torch.device) -> int:
    """The raw current stream of ``device`` (what Triton's driver asks torch for)."""
    return torch._C._cuda_getCurrentRawStream(device.index)


def _shape(launches: Sequence[Launch], work: torch.Tensor, out: torch.Tensor | None) -> list:
    """What picks each compiled kernel, as Triton's cache key does, and what a run passes besides the
    scratch: the function, grid, ``constexpr`` values, options, every integer argument's value (its
    type, i32 / i64 / u64, follows its range) and every other tensor argument's address and dtype.
    A run whose shape differs from the checked one (a module constant changed since the check, e.g.
    a benchmark's warp count; a plan launched with other counts) goes through the JIT."""
    return [(la.fn, la.grid, la.consts, la.options,
             tuple(None if a is work or a is out else (a.data_ptr(), a.dtype) if isinstance(a, torch.Tensor) else a
                   for a in la.args)) for la in launches]


_I32, _I64, _U64 = 1 << 31, 1 << 63, 1 << 64


def _int_kind(v: int) -> str | None:
    """Triton's type of a non-specialised integer argument (its range), None outside every type."""
    return "i32" if -_I32 <= v < _I32 else "i64" if -_I64 <= v < _I64 else "u64" if 0 <= v < _U64 else None


def _kind(la: Launch, device: torch.device) -> tuple | None:
    """What picks launch ``la``'s compiled kernel on ``device``, as Triton's cache key does, without
    argument values where Triton does not specialise on them: the function, ``constexpr`` values,
    options, each tensor's dtype and 16-byte alignment, each integer's type where its parameter is
    ``do_not_specialize`` (its value elsewhere, and for a function without Triton's parameter list).
    None: an argument of another type, or a positional argument at a ``constexpr`` parameter."""
    params = getattr(la.fn, "params", None)
    out: list = []
    for i, a in enumerate(la.args):
        kp = params[i] if params is not None and i < len(params) else None
        if kp is not None and getattr(kp, "is_constexpr", False):
            return None
        if isinstance(a, torch.Tensor):
            out.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool) or not isinstance(a, int):
            return None
        elif kp is not None and getattr(kp, "do_not_specialize", False):
            k = _int_kind(a)
            if k is None:
                return None
            out.append(k)
        else:
            out.append(("=", a))
    return (la.fn, device.index, la.consts, tuple(sorted((la.options or {}).items())), tuple(out))


def _known(launches: Sequence[Launch], device: torch.device) -> list | None:
    """The compiled kernel of every launch when all their kinds were checked, else None."""
    if not _KNOWN or _NO_KINDS[0]:
        return None
    out = []
    for la in launches:
        k = _kind(la, device)
        ck = None if k is None else _KNOWN.get(k)
        if ck is None:
            return None
        out.append(ck)
    return out


def _learn(launches: Sequence[Launch], compiled: Sequence[Any], device: torch.device) -> None:
    """Make the kinds of checked ``launches`` known, with their ``compiled`` kernels."""
    if not _NO_KINDS[0]:
        for la, ck in zip(launches, compiled, strict=True):
            k = _kind(la, device)
            if k is not None:
                _KNOWN[k] = ck


def _agree(launches: Sequence[Launch], compiled: Sequence[Any], device: torch.device) -> None:
    """JIT launches of known kinds must have returned the known compiled kernels; else the kinds are
    coarser than Triton's cache key: the table is emptied for the process (logged once)."""
    if not _KNOWN or _NO_KINDS[0]:
        return
    for la, ck in zip(launches, compiled):
        k = _kind(la, device)
        known = None if k is None or ck is None else _KNOWN.get(k)
        if known is not None and known is not ck:
            _NO_KINDS[0] = True
            _KNOWN.clear()
            _log_once("kinds", "refit-verify: Triton launched another compiled kernel for a kind of digest launch "
                      "checked before (%s); each plan is checked at its second run from now on in this process. "
                      "Kind %s; the checked kernel %s, Triton's %s", getattr(la.fn, "__name__", la.fn), k[2:],
                      _describe(known), _describe(ck))
            return


def _describe(ck: Any) -> str:
    """What tells two compiled kernels apart, for the log: hash, signature, constants, attributes."""
    try:
        src = getattr(ck, "src", None)
        got = {"hash": getattr(ck, "hash", None), "signature": getattr(src, "signature", None),
               "constants": getattr(src, "constants", None), "attrs": getattr(src, "attrs", None)}
        return repr({k: v for k, v in got.items() if v is not None})[:600]
    except Exception as e:  # noqa: BLE001 - a log line never fails a launch
        return f"<not described: {type(e).__name__}>"


def _on_device(device: torch.device) -> bool:
    """True iff ``device`` is the current CUDA device (the compiled kernels were loaded there)."""
    return torch.cuda.current_device() == device.index


def _aligned(*ts: torch.Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in ts)


def run(p: Any, launches: Sequence[Launch], work: torch.Tensor, out: torch.Tensor | None) -> None:
    """Run plan ``p``'s ``launches`` (CUDA, current stream, the current device being ``p.device``):
    directly when ``p`` was checked or every launch is of a checked kind, else through
    ``JITFunction.run`` (and check at the plan's second run). ``p.runs`` (counted by the caller) and
    ``p.direct`` (None: not checked yet, False: JIT only, else ``(compiled kernels, their launches'
    shape, whether they came from the kinds table)``) are kept up to date here. A run whose launches differ from the checked ones
    (:func:`_shape`) goes through the JIT.

    Args:
        p: a CUDA :class:`~refit_verify.digest.kernels.launch.Planned`.
        launches: its launches, in order; ``work`` and ``out`` are among their arguments.
        work: its int64 work area. out: its int64 ``[V, 2]`` output block, or None (roots stay in
            ``work``: never launched directly, never checked).

    Raises what the JIT launches raise; a direct launch that raises is never raised (the plan runs
    through the JIT instead, and direct launches are off for the process).
    """
    d = p.direct
    if d and d[2] and _NO_KINDS[0]:  # direct from a table emptied since: this plan is checked on its own
        d = p.direct = None
    usable = out is not None and _OFF is None and direct_launch_enabled() and _aligned(work, out)
    if d is None and usable and _on_device(p.device):
        known = _known(launches, p.device)
        if known is not None:  # every launch of a checked kind: direct from this run
            d = p.direct = (known, _shape(launches, work, out), True)
    if d and usable and _shape(launches, work, out) == d[1] and _on_device(p.device):
        try:
            direct(d[0], launches, _stream(p.device))
            return
        except Exception as e:  # noqa: BLE001 - a launcher that takes other arguments: JIT from now on
            _turn_off(p, e)
            # the direct launches before the one that raised only wrote scratch: the JIT run redoes them all
    compiled = jit(launches)
    if _on_device(p.device):  # the JIT launched for the current device: another's kernels are other objects
        _agree(launches, compiled, p.device)
    if (d is not None or out is None or p.runs < MIN_RUNS or _OFF is not None or not direct_launch_enabled()
            or not _aligned(work, out) or not _on_device(p.device)):
        return
    if torch.cuda.is_current_stream_capturing():
        return  # a synchronising check cannot run inside a capture: checked at a later run
    if any(ck is None for ck in compiled):
        p.direct = False
        return
    try:
        probe = torch.full_like(out, _SENTINEL)  # what catches a missed chain launch: it only writes ``out``
        work.fill_(_SENTINEL)  # what catches a missed leaf or upper launch: the chain would read sentinels
        into_probe = [la._replace(args=tuple(probe if a is out else a for a in la.args)) for la in launches]
    except Exception:  # noqa: BLE001 - e.g. out of memory for the probe: the JIT result in ``out`` stands
        logger.debug("refit-verify: a digest plan's direct-launch check could not be set up", exc_info=True)
        return
    try:
        direct(compiled, into_probe, _stream(p.device))
    except Exception as e:  # noqa: BLE001 - as above; the JIT result in ``out`` stands
        _turn_off(p, e)
        return
    try:
        same = torch.equal(probe, out)
    except Exception:  # noqa: BLE001 - a device error surfacing at this synchronisation: the caller's read meets it too
        logger.debug("refit-verify: a digest plan's direct-launch check failed", exc_info=True)
        p.direct = False
        return
    if same:
        p.direct = (compiled, _shape(launches, work, out), False)
        _learn(launches, compiled, p.device)
    else:
        p.direct = False
        logger.warning("refit-verify: a digest plan (%d tensors, %d chunks) read twice at its check gave other words "
                       "through its compiled kernels than through the JIT: either the direct launches are wrong on "
                       "this Triton or the memory changed while it was read; that plan keeps JIT launches",
                       getattr(p, "V", -1), getattr(p, "C", -1))
