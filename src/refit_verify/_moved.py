"""Old module paths of refit-verify 0.1's flat layout, kept for one release.

``import refit_verify.check`` (and every other path in :data:`MOVED`) still works: it gives a module
that forwards attribute reads to the new home and warns once with a ``DeprecationWarning``. New code
imports from the new paths (or from ``refit_verify`` itself). Remove after 0.2.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings

MOVED = {
    "refit_verify.audits": "refit_verify.trainer.audits",
    "refit_verify.backends": "refit_verify.digest.backends",
    "refit_verify.broadcast": "refit_verify.collective.broadcast",
    "refit_verify.check": "refit_verify.trainer.refit",
    "refit_verify.checkpoint": "refit_verify.cli.checkpoint",
    "refit_verify.colocated": "refit_verify.trainer.push",
    "refit_verify.delivery": "refit_verify.boundary.record",
    "refit_verify.demo": "refit_verify.cli.demo",
    "refit_verify.digest_set": "refit_verify.digest.kept",
    "refit_verify.digest_stream": "refit_verify.digest.incremental",
    "refit_verify.dist_wire": "refit_verify.wire.collective",
    "refit_verify.engine_state": "refit_verify.engine.state",
    "refit_verify.engines": "refit_verify.trainer.channel",
    "refit_verify.held_sets": "refit_verify.digest.kept",
    "refit_verify.integrations": "refit_verify.vllm_plugin",
    "refit_verify.integrations.trl": "refit_verify.vllm_plugin.trl",
    "refit_verify.kernels": "refit_verify.digest.kernels",
    "refit_verify.model_boundary": "refit_verify.boundary.model",
    "refit_verify.model_index": "refit_verify.boundary.model_index",
    "refit_verify.models": "refit_verify.testing.models",
    "refit_verify.pack": "refit_verify.stream.pack",
    "refit_verify.placement": "refit_verify.boundary.placement",
    "refit_verify.readback": "refit_verify.engine.readback",
    "refit_verify.reference": "refit_verify.digest.reference",
    "refit_verify.refit_plan": "refit_verify.boundary.plan",
    "refit_verify.shadow": "refit_verify.trainer.overlap",
    "refit_verify.sharded": "refit_verify.collective.sharded",
    "refit_verify.staging": "refit_verify.transport.staging",
    "refit_verify.stream": None,  # a package now: refit_verify.stream.unpack / .items / .pack
    "refit_verify.trainer_digests": "refit_verify.trainer.exports",
    "refit_verify.vllm_plugin.native": "refit_verify.vllm_plugin.native_trainer",
    "refit_verify.vllm_plugin.sessions": "refit_verify.vllm_plugin.worker_sessions",
    "refit_verify.vllm_plugin.trainer": "refit_verify.vllm_plugin.broadcast_trainer",
    "refit_verify.vllm_plugin.worker": "refit_verify.vllm_plugin.worker_methods",
    "refit_verify.write_regions": "refit_verify.boundary.regions",
}
MOVED = {k: v for k, v in MOVED.items() if v is not None}
_PACKAGES = {"refit_verify.kernels", "refit_verify.integrations"}


class _Alias(types.ModuleType):
    """A module whose attributes are the new module's (reads and writes both go there)."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):  # the import system's own attributes stay this module's
            raise AttributeError(name)
        return getattr(importlib.import_module(MOVED[self.__name__]), name)

    def __setattr__(self, name: str, value) -> None:
        if name.startswith("__") and name.endswith("__"):
            super().__setattr__(name, value)
        else:
            setattr(importlib.import_module(MOVED[self.__name__]), name, value)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=fullname in _PACKAGES)
        return None

    def create_module(self, spec):
        return _Alias(spec.name)

    def exec_module(self, module) -> None:
        warnings.warn(f"{module.__name__} moved to {MOVED[module.__name__]}; the old path goes after refit-verify 0.2",
                      DeprecationWarning, stacklevel=2)
        importlib.import_module(MOVED[module.__name__])


def install() -> None:
    """Put the finder on ``sys.meta_path`` once; idempotent."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())  # before the path finder: an old path never loads a file twice
