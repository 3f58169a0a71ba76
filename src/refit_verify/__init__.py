"""refit-verify: prove that a refit (weight sync) into vLLM delivered exactly the trainer's bytes,
and that the engine holds them.

The trainer digests what it pushes, every vLLM worker digests what its model's ``load_weights``
receives (the model boundary) and reads its parameters back in the engine's layout; the manifests
are compared and every difference is named. The names below are imported lazily, so
``import refit_verify`` stays cheap (no torch, Triton or ZMQ until a name is used).
"""

from __future__ import annotations

import importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

from refit_verify import _moved
from refit_verify.digest import warm_start as _warm_start

try:
    __version__ = _metadata.version("refit-verify")
except _metadata.PackageNotFoundError:  # pragma: no cover - a source tree without installed metadata
    __version__ = "0+unknown"

_EXPORTS = {
    "AuditError": "refit_verify.errors",
    "ReplicaDisagreement": "refit_verify.errors",
    "audit": "refit_verify.trainer.audits",
    "audit_adapters": "refit_verify.trainer.adapters",
    "canary": "refit_verify.vllm_plugin.canary",
    "certificate": "refit_verify.trainer.audits",
    "Certificate": "refit_verify.manifest",
    "compare_replicas": "refit_verify.trainer.audits",
    "BroadcastReceiver": "refit_verify.collective.broadcast",
    "BroadcastSender": "refit_verify.collective.broadcast",
    "BroadcastVerificationError": "refit_verify.errors",
    "DigestBatch": "refit_verify.digest.batch",
    "RefitAbortedError": "refit_verify.errors",
    "RefitCheck": "refit_verify.trainer.refit",
    "RefitConfig": "refit_verify.config",
    "RefitConfigError": "refit_verify.errors",
    "RefitError": "refit_verify.errors",
    "RefitInputError": "refit_verify.errors",
    "RefitProtocolError": "refit_verify.errors",
    "RefitReceiveError": "refit_verify.errors",
    "RefitReceiver": "refit_verify.transport.receiver",
    "RefitSender": "refit_verify.transport.sender",
    "RefitTimeoutError": "refit_verify.errors",
    "RefitVerificationError": "refit_verify.errors",
    "RefitVerifyError": "refit_verify.errors",
    "SelftestError": "refit_verify.errors",
    "SelftestResult": "refit_verify.trainer.selftest",
    "SessionManifest": "refit_verify.manifest",
    "ShardLayoutError": "refit_verify.errors",
    "VerificationReport": "refit_verify.report",
    "VerifyMode": "refit_verify.config",
    "compare_manifests": "refit_verify.compare",
    "digest_tensors": "refit_verify.digest.batch",
    "logical_bytes": "refit_verify.digest.tensors",
    "mode_from_env": "refit_verify.config",
    "PushResult": "refit_verify.trainer.push",
    "push": "refit_verify.trainer.push",
    "refit": "refit_verify.trainer.refit",
    "restart_versions": "refit_verify.trainer.audits",
    "selftest": "refit_verify.trainer.selftest",
    "tensor_digest": "refit_verify.digest.batch",
    "verify_state": "refit_verify.trainer.refit",
    "verify_adapter": "refit_verify.trainer.adapters",
}

__all__ = sorted(_EXPORTS)

_moved.install()
_warm_start.install()  # a trainer's digest warm-up starts ahead of its first refit (torch imported first)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'refit_verify' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs
    from refit_verify.collective.broadcast import BroadcastReceiver, BroadcastSender
    from refit_verify.compare import compare_manifests
    from refit_verify.config import RefitConfig, VerifyMode, mode_from_env
    from refit_verify.digest.batch import DigestBatch, digest_tensors, tensor_digest
    from refit_verify.digest.tensors import logical_bytes
    from refit_verify.errors import (
        AuditError,
        BroadcastVerificationError,
        RefitAbortedError,
        RefitConfigError,
        RefitError,
        RefitInputError,
        RefitProtocolError,
        RefitReceiveError,
        RefitTimeoutError,
        RefitVerificationError,
        RefitVerifyError,
        ReplicaDisagreement,
        SelftestError,
        ShardLayoutError,
    )
    from refit_verify.manifest import Certificate, SessionManifest
    from refit_verify.report import VerificationReport
    from refit_verify.trainer.adapters import audit_adapters, verify_adapter
    from refit_verify.trainer.audits import audit, certificate, compare_replicas, restart_versions
    from refit_verify.trainer.push import PushResult, push
    from refit_verify.trainer.refit import RefitCheck, refit, verify_state
    from refit_verify.trainer.selftest import SelftestResult, selftest
    from refit_verify.transport.receiver import RefitReceiver
    from refit_verify.transport.sender import RefitSender
    from refit_verify.vllm_plugin.canary import canary
