"""The ``refit-verify`` command: ``demo``, ``digest`` (a checkpoint to a manifest), ``compare``.

Modules: :mod:`.commands` (argument parsing, :func:`main`), :mod:`.demo`, :mod:`.checkpoint`.
May import everything.
"""

from refit_verify._lazy import face

_EXPORTS = {
    "main": "refit_verify.cli.commands",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = face(__name__, _EXPORTS)
