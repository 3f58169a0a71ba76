"""Tensor and parameter classes whose ``__torch_function__`` sends every op to another tensor.

``x._live`` is what every op on ``x`` sees (loaders' writes included); ``x``'s own storage is
never touched by them. Not a class vLLM has: it is what refit-verify's plain-tensor-ops
bookkeeping must not be fooled by (``refit_verify.digest.tensors.plain_tensor_ops``).
"""

from __future__ import annotations

import torch


class _Redirect:
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        def sub(a):
            return a._live if isinstance(a, _Redirect) else a

        with torch._C.DisableTorchFunctionSubclass():
            return func(*[sub(a) for a in args], **{k: sub(v) for k, v in (kwargs or {}).items()})


class RedirectingTensor(_Redirect, torch.Tensor):
    """A tensor whose ops see ``self._live`` (set it after ``as_subclass``)."""


class RedirectingParameter(_Redirect, torch.nn.Parameter):
    """A parameter whose ops see ``self._live`` (set it after construction)."""
