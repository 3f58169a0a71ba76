"""The parameters and persistent buffers of one model, walked once and re-checked cheaply.

A verified refit reads an engine model's tensors several times (the loader tap's install at the
session open, read-back, the coverage of the manifest, the engine-state snapshot at the close).
Each ``named_parameters()`` / ``named_modules()`` walk is Python over every module and parameter.
:class:`ModelIndex` records the walk once, with the structure it came from: for every module its
own parameter, buffer and child dictionaries (keys, and the objects by identity) and its
non-persistent buffer names. :meth:`ModelIndex.fresh` compares that structure with the model's
now in a few C-level passes over all modules, no Python step per module (about 0.17 ms for 400
modules on the CI machine, a third of a per-module walk); anything added, removed or replaced (a
parameter object swapped by ``process_weights_after_loading``, a child module replaced, a buffer
registered) makes it stale and the walk runs again. The tensors are the live objects: a parameter whose
``.data`` was reassigned keeps its place and is read as it is now.
"""

from __future__ import annotations

import weakref
from itertools import chain
from operator import attrgetter, is_

import torch

__all__ = ["ModelIndex"]


_PARAMS, _BUFFERS, _CHILDREN = attrgetter("_parameters"), attrgetter("_buffers"), attrgetter("_modules")
_NON_PERSISTENT = attrgetter("_non_persistent_buffers_set")
_MISSING = object()


def _dicts(modules: list[torch.nn.Module]) -> list[dict]:
    """Every module's own parameter, buffer and child dictionaries, in order (C-level walks only)."""
    return list(chain.from_iterable(zip(map(_PARAMS, modules), map(_BUFFERS, modules), map(_CHILDREN, modules))))


class _Structure:
    """Modules' own structure, read without a Python step per module: their parameter, buffer and
    child dictionaries (the objects), each one's size, keys in order and values (held: compared by
    identity, so no object is ever compared with ``==`` and no id can be reused while it lives), and
    their non-persistent buffer names."""

    __slots__ = ("dicts", "full", "keys", "nonp", "sizes", "values")

    def __init__(self, modules: list[torch.nn.Module]) -> None:
        self.dicts = _dicts(modules)
        self.sizes = list(map(len, self.dicts))
        # most are empty (a leaf's children, a buffer-less module's buffers); chosen by the sizes the sizes pass compares
        self.full = [d for d, n in zip(self.dicts, self.sizes) if n]
        self.keys = list(chain.from_iterable(self.full))
        self.values = list(chain.from_iterable(map(dict.values, self.full)))
        self.nonp = list(map(frozenset, map(_NON_PERSISTENT, modules)))

    def same(self, modules: list[torch.nn.Module]) -> bool:
        """True iff nothing was added to, removed from or replaced in any of these dictionaries: the
        modules still hold the recorded dictionary objects, :meth:`quick` holds for them, and the
        non-persistent buffer names are the recorded ones."""
        return (all(map(is_, _dicts(modules), self.dicts)) and self.quick()
                and list(map(_NON_PERSISTENT, modules)) == self.nonp)

    def quick(self) -> bool:
        """The recorded dictionaries as they are now, not re-read from the modules: True iff none
        changed size and the non-empty ones hold the same keys with the same objects. Not seen: a
        module given another dictionary object, a buffer made (non-)persistent.

        Keys in another order, each with its recorded object (vLLM's first layerwise reload deletes
        and re-registers a linear layer's ``weight`` after its ``bias``), are the same structure: the
        new order is recorded (:meth:`_reordered`) and the index stays valid."""
        if list(map(len, self.dicts)) != self.sizes:
            return False
        full = self.full  # every other dictionary is still empty (its size is): its keys and values are those of these
        if list(chain.from_iterable(full)) != self.keys:
            return self._reordered()
        values = list(chain.from_iterable(map(dict.values, full)))
        return (len(values) == len(self.values) and all(map(is_, values, self.values))) or self._reordered()

    def _reordered(self) -> bool:
        """True iff every non-empty dictionary holds the recorded keys, each with its recorded object,
        in any order; the order found is then recorded (the fast check of :meth:`quick` holds again)."""
        at = 0
        for d in self.full:
            n = len(d)
            recorded = dict(zip(self.keys[at:at + n], self.values[at:at + n]))
            at += n
            if len(recorded) != n or any(recorded.get(k, _MISSING) is not v for k, v in d.items()):
                return False
        self.keys = list(chain.from_iterable(self.full))
        self.values = list(chain.from_iterable(map(dict.values, self.full)))
        return True


class ModelIndex:
    """One walk of ``model``'s tensors, and the structure it was taken from.

    Attributes:
        params: ``{name: parameter}`` as ``dict(model.named_parameters())`` (tied ones once).
        all_params: ``[(name, parameter)]`` as ``model.named_parameters(remove_duplicate=False)``.
        aliases: ``{name: name in params}`` of every other name of a tied parameter (``{"lm_head.weight":
            "model.embed_tokens.weight"}``); empty for an untied model.
        state: ``[(name, tensor, "param" | "buffer")]``: every parameter (tied ones once), then
            every persistent buffer that is not None, in ``named_modules()`` order.
        kept: what is worked out once for these tensors and valid as long as this index is
            (:mod:`refit_verify.engine.state`: the snapshot's kept digest set and the one it shares with
            the read-back; :mod:`refit_verify.engine.readback`: a replayed read-back's program).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self._model = weakref.ref(model)
        self._modules = [m for _, m in model.named_modules(remove_duplicate=False)]
        self._structure = _Structure(self._modules)
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self.all_params: list[tuple[str, torch.Tensor]] = list(model.named_parameters(remove_duplicate=False))
        self.aliases: dict[str, str] = {}
        if len(self.all_params) != len(self.params):
            first = {id(p): n for n, p in self.params.items()}
            self.aliases = {n: first[id(p)] for n, p in self.all_params if first.get(id(p), n) != n}
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
        return self._structure.same(self._modules)

    def unchanged(self, model: torch.nn.Module) -> bool:
        """A cheaper, partial :meth:`fresh` (about 40 % of its cost): True iff ``model`` is the indexed
        model and none of the parameter, buffer and child dictionaries recorded changed size, keys or
        objects. It does not see a module handed a new dictionary object or a buffer's persistence
        changed; for a check whose miss can only make a verdict fail, never pass (a session's open,
        whose close runs :meth:`fresh` and reads the live tensors)."""
        if self._model() is not model:
            return False
        return self._structure.quick()

