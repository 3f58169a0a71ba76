"""The loader tap (:class:`refit_verify.boundary.placement.LoaderTap`) around loaders that defer their write."""

from __future__ import annotations

import functools

import torch

from refit_verify.boundary.placement import LoaderTap


def _online_wrapper(original, buffered: list):
    """A stand-in for vLLM's ``make_online_process_loader``: it buffers each call (a meta parameter,
    nothing written) and is later unwrapped through ``__wrapped__`` past every such wrapper."""

    @functools.wraps(original, assigned=("__doc__", "__annotations__"))
    def online_process_loader(*args, **kwargs):
        buffered.append((args, kwargs))

    return online_process_loader


def _unwrap(loader):
    """What vLLM's layerwise reload calls at apply time (``_get_original_loader``)."""
    while loader.__name__ == "online_process_loader":
        loader = loader.__wrapped__
    return loader


def _copy_loader(param, loaded_weight):
    param.data.copy_(loaded_weight)


def test_the_loader_inside_a_deferring_wrapper_is_tapped():
    writes = []
    tap = LoaderTap(None, on_write=lambda pname, param, loaded, placement: writes.append((pname, placement.exact)))
    meta = torch.nn.Parameter(torch.empty(4, 3, device="meta"), requires_grad=False)
    buffered: list = []
    meta.weight_loader = _online_wrapper(_copy_loader, buffered)
    assert tap.install([("layer.weight", meta)]) == 2  # the wrapper, and the loader inside it
    assert tap.install([("layer.weight", meta)]) == 0  # idempotent
    w = torch.arange(12.0).reshape(4, 3)
    meta.weight_loader(meta, w)  # buffered: no write yet
    assert buffered and writes == []
    real = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    _unwrap(meta.weight_loader)(real, w)  # the apply: the write is seen
    assert writes == [("layer.weight", True)] and torch.equal(real, w)


def test_nested_deferring_wrappers_tap_the_innermost_loader_once():
    writes = []
    tap = LoaderTap(None, on_write=lambda *a: writes.append(a[0]))
    p = torch.nn.Parameter(torch.empty(2, device="meta"), requires_grad=False)
    p.weight_loader = _online_wrapper(_online_wrapper(_copy_loader, []), [])
    tap.install([("w", p)])
    tap.install([("w", p)])
    real = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
    _unwrap(p.weight_loader)(real, torch.ones(2))
    assert writes == ["w"]
