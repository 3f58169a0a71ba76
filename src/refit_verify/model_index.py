"""The parameters and persistent buffers of one model, walked once and re-checked cheaply.

A verified refit reads an engine model's tensors several times (the loader tap's install at the
session open, read-back, the coverage of the manifest, the engine-state snapshot at the close).
Each ``named_parameters()`` / ``named_modules()`` walk is Python over every module and parameter.
:class:`ModelIndex` records the walk once, with the structure it came from: for every module its
own parameter, buffer and child dictionaries (keys, and the objects by identity) and its
non-persistent buffer names. :meth:`ModelIndex.fresh` compares that structure with the model's
now, at about one dictionary read per module; anything added, removed or replaced (a parameter
object swapped by ``process_weights_after_loading``, a child module replaced, a buffer registered)
makes it stale and the walk runs again. The tensors are the live objects: a parameter whose
``.data`` was reassigned keeps its place and is read as it is now.
"""

from __future__ import annotations

import operator
import weakref

import torch

__all__ = ["ModelIndex"]


def _shape_of(m: torch.nn.Module) -> tuple:
    """Module ``m``'s own structure: its parameter, buffer and child names in order, the objects
    bound to them by identity (``id``: the index holds every one of them, so no id is reused while
    it lives), and its non-persistent buffer names. Equal tuples (C-level str / int compares, never
    a tensor ``==``) mean nothing was added, removed or replaced."""
    p, b, c = m._parameters, m._buffers, m._modules
    return (tuple(p), tuple(map(id, p.values())), tuple(b), tuple(map(id, b.values())), tuple(c),
            tuple(map(id, c.values())), frozenset(m._non_persistent_buffers_set))


class ModelIndex:
    """One walk of ``model``'s tensors, and the structure it was taken from.

    Attributes:
        params: ``{name: parameter}`` as ``dict(model.named_parameters())`` (tied ones once).
        all_params: ``[(name, parameter)]`` as ``model.named_parameters(remove_duplicate=False)``.
        state: ``[(name, tensor, "param" | "buffer")]``: every parameter (tied ones once), then
            every persistent buffer that is not None, in ``named_modules()`` order.
        kept: what is worked out once for these tensors and valid as long as this index is
            (:mod:`refit_verify.engine_state`: the snapshot's kept digest set, a replayed read-back's program).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._modules = [m for _, m in model.named_modules(remove_duplicate=False)]
        self._shapes = [_shape_of(m) for m in self._modules]
        # the objects whose ids _shapes records, held so that no id is reused while this index lives
        self._held = [(tuple(m._parameters.values()), tuple(m._buffers.values())) for m in self._modules]
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.all_params: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
        state: list[tuple[str, torch.Tensor, str]] = [(n, p, "param") for n, p in self.params.items()]
        for mname, module in model.named_modules():
            for bname, buf in module.named_buffers(recurse=False):
                if buf is None or bname in module._non_persistent_buffers_set:
                    continue
                state.append((f"{mname}.{bname}" if mname else bname, buf, "buffer"))
        self.state = state
        self.kept: dict[str, object] = {}

    def fresh(self, model: torch.nn.Module) -> bool:
        """True iff ``model`` is the indexed model and no module's parameters, buffers or children
        were added, removed or replaced since the walk."""
        if self._model() is not model:
            return False
        return all(map(operator.eq, map(_shape_of, self._modules), self._shapes))

