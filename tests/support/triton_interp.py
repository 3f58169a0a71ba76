"""The Triton interpreter without its per-call re-patching, for the CPU kernel tests.

Under ``TRITON_INTERPRET=1`` a kernel launch (``GridExecutor.__call__``) patches ``triton.language``
for the run and restores it afterwards; every ``@triton.jit`` device-function call inside it
(``InterpretedFunction.__call__``) patches it again (``_patch_lang``: ``inspect.getmembers`` over
``tl``, ``tl.tensor`` and ``tl.math``), which finds the same module objects already patched and
only costs time: about a third of a digest kernel's interpreted run, whose helpers (``_node``,
``_lanes``, ``_tree16c``, ...) are called tens of thousands of times.

:func:`install` skips that second patch for a device function called inside a launch whose
kernel sees every language module the function sees (else the call goes the original way), and
changes nothing else: the kernels, their arguments and the interpreter's arithmetic are Triton's.
It does nothing when the interpreter is off or its internals are not the ones it knows.

Source: triton/runtime/interpreter.py (Triton 3.x)
"""

from __future__ import annotations

import functools
import inspect

_INSTALLED: list[bool] = []


def _langs(fn, tl) -> frozenset[int]:
    """ids of the language modules (``tl``, ``tl.core``) visible in ``fn``'s globals, as ``_patch_lang`` finds them."""
    return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and (v is tl or v is tl.core))


def install() -> bool:
    """Make device-function calls inside an interpreted launch skip ``_patch_lang`` (idempotent).

    Returns:
        bool: True when installed (now or before); False when the interpreter's internals differ
        (``GridExecutor.__call__``, ``InterpretedFunction.__call__``/``rewrite``, ``_patch_lang``,
        ``InterpreterError`` missing), leaving Triton as it is.
    """
    if _INSTALLED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    grid_cls, fn_cls = getattr(ti, "GridExecutor", None), getattr(ti, "InterpretedFunction", None)
    if not (grid_cls and fn_cls and hasattr(ti, "_patch_lang") and hasattr(ti, "InterpreterError")
            and hasattr(fn_cls, "rewrite")):
        return False
    patched: list[frozenset[int]] = []  # language modules patched by each launch in progress (innermost last)
    grid_call, fn_call = grid_cls.__call__, fn_cls.__call__

    @functools.wraps(grid_call)
    def launch(self, *args, **kwargs):
        patched.append(_langs(self.fn, tl))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    @functools.wraps(fn_call)
    def device_call(self, *args, **kwargs):
        if not patched or not _langs(self.fn, tl) <= patched[-1]:
            return fn_call(self, *args, **kwargs)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - as InterpretedFunction.__call__ reports it
            raise ti.InterpreterError(repr(e)) from e

    grid_cls.__call__, fn_cls.__call__ = launch, device_call
    _INSTALLED.append(True)
    return True


def kernel_module():
    """Set up a kernel test module: without CUDA the kernels run under the Triton interpreter
    (``TRITON_INTERPRET=1``, set here before triton is first imported) on CPU tensors; with CUDA the
    compiled kernels run on the GPU. Skips the module without triton.

    Returns:
        ``(launch module, "cpu" or "cuda", the module's skip mark)``: the mark skips a module whose
        triton was imported without the interpreter on a machine without CUDA.
    """
    import os

    import pytest
    import torch

    if not torch.cuda.is_available():  # CPU-only machine: the kernels run in the Triton interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    pytest.importorskip("triton")
    from refit_verify.digest.kernels import launch as kd

    dev = "cpu" if kd._INTERPRETED else "cuda"
    mark = pytest.mark.skipif(dev == "cuda" and not torch.cuda.is_available(),
                              reason="triton was imported without TRITON_INTERPRET=1 and there is no CUDA device")
    return kd, dev, mark
