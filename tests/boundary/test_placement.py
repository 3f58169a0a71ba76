"""The loader tap (:class:`refit_verify.boundary.placement.LoaderTap`) around loaders that defer their write."""

from __future__ import annotations

import functools

import pytest
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


class _Fused(torch.nn.Module):
    """A fused parameter whose loader (a bound method, as vLLM's) writes block ``shard`` of its rows."""

    def __init__(self) -> None:
        super().__init__()
        self.swap = False

    def loader(self, param, loaded_weight, shard):
        row = {"a": 0, "b": 2}[shard]
        if self.swap:  # a loader whose writes changed after the placement was learned
            row = 2 - row
        param.data.narrow(0, row, 2).copy_(loaded_weight)


def test_a_placement_learned_ahead_serves_another_wrapper_of_the_same_loader():
    """Learned ahead on the live parameter's wrapper, it is taken by the meta copy's wrapper (vLLM's
    layerwise reload materialises that one) for the same geometry and shard: nothing recorded again.
    Another geometry or shard still learns its own."""
    layer = _Fused()
    writes = []
    tap = LoaderTap(None, on_write=lambda pname, param, loaded, placement: writes.append(placement))
    tap.callable_ahead = lambda f: True  # the toy's loader stands in for vLLM's own (stock_loader)
    live = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    live.weight_loader = layer.loader
    meta = torch.nn.Parameter(torch.empty(4, 3, device="meta"), requires_grad=False)
    meta.weight_loader = layer.loader
    tap.install([("fused", live)], [("fused", meta)])
    assert live.weight_loader is not meta.weight_loader
    with tap.learning_ahead():
        live.weight_loader(live, torch.ones(2, 3), "b")
    assert len(tap.ahead) == 1 and tap.ahead_used == 0
    real = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    meta.weight_loader(real, torch.full((2, 3), 5.0), "b")
    assert tap.ahead_used == 1 and writes[1] is writes[0]  # the same Placement object: not learned again
    assert writes[1].copies[0].dest == (6, (2, 3), (3, 1))  # rows 2..3 of the parameter
    meta.weight_loader(real, torch.full((2, 3), 5.0), "a")  # another shard: learned now
    assert tap.ahead_used == 1 and writes[2].copies[0].dest == (0, (2, 3), (3, 1))
    other = _Fused()  # the same function bound to another object: not the same loader
    meta.weight_loader = other.loader
    tap.install([("fused", meta)])
    meta.weight_loader(real, torch.ones(2, 3), "b")
    assert tap.ahead_used == 1


def test_no_placement_is_learned_ahead_outside_learning_ahead():
    layer = _Fused()
    tap = LoaderTap(None, on_write=lambda *a: None)
    live = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
    live.weight_loader = layer.loader
    tap.install([("fused", live)])
    live.weight_loader(live, torch.ones(2, 3), "a")
    assert tap.ahead == {} and len(tap.placements) == 1


def test_learning_ahead_calls_only_vllms_own_loaders():
    """At engine start nothing but vLLM's own loaders runs (``stock_loader``): a replaced loader that
    counts its loads (a plugin's, a framework's) is not called while learning ahead, so its state is
    as if the engine had not been prepared; its placement is learned at the first refit."""
    from refit_verify.boundary.placement import stock_loader

    calls = []

    def counting(param, loaded):
        calls.append(1)
        param.data.copy_(loaded)

    vllm_loader = pytest.importorskip("vllm.model_executor.model_loader.weight_utils").default_weight_loader
    assert stock_loader(vllm_loader) and not stock_loader(counting) and not stock_loader(_Fused().loader)
    writes = []
    tap = LoaderTap(None, on_write=lambda pname, param, loaded, placement: writes.append(pname))
    p = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    p.weight_loader = counting
    tap.install([("w", p)])
    with tap.learning_ahead():
        assert p.weight_loader(p, torch.ones(4)) is None
    assert calls == [] and tap.ahead == {} and writes == [] and torch.equal(p, torch.zeros(4))
    p.weight_loader(p, torch.ones(4))  # the first refit's load: called, learned, reported
    assert calls == [1] and writes == ["w"] and torch.equal(p, torch.ones(4))


def test_learning_ahead_holds_for_its_own_thread_only():
    """A load another thread runs while one thread learns ahead (a load outside a session at engine
    start) is a load: its loader, vLLM's or not, is called and writes."""
    import threading

    calls = []

    def counting(param, loaded):
        calls.append(threading.get_ident())
        param.data.copy_(loaded)

    tap = LoaderTap(None, on_write=lambda *a: None)
    p = torch.nn.Parameter(torch.zeros(4), requires_grad=False)
    p.weight_loader = counting
    tap.install([("w", p)])
    with tap.learning_ahead():
        th = threading.Thread(target=p.weight_loader, args=(p, torch.ones(4)))
        th.start()
        th.join(10)
        assert p.weight_loader(p, torch.full((4,), 2.0)) is None  # this thread's: not called
    assert calls == [th.ident] and torch.equal(p, torch.ones(4)) and tap.ahead == {}
