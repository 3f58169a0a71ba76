"""Verification mode and refit configuration.

``REFIT_VERIFY`` is read and validated wherever it matters (trainer, engine core, every vLLM
worker through the plugin's ``register()``): a value outside ``off | log | enforce`` raises
:class:`~refit_verify.errors.RefitConfigError` listing the accepted values.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_verify.errors import RefitConfigError, RefitVerificationError
from refit_verify.report import VerificationReport

ENV_VAR = "REFIT_VERIFY"


class VerifyMode(str, enum.Enum):
    """What a refit does with digests.

    ``off``: no digest code runs; the wire carries no digests. ``log``: digests are compared and
    mismatches logged (``logging.WARNING``); the refit completes. ``enforce``: a mismatch raises
    :class:`~refit_verify.errors.RefitVerificationError` naming every affected parameter.
    """

    OFF = "off"
    LOG = "log"
    ENFORCE = "enforce"

    @property
    def verifies(self) -> bool:
        return self is not VerifyMode.OFF

    @classmethod
    def parse(cls, value: object, *, source: str = "mode") -> VerifyMode:
        """Return the mode named by ``value`` (a :class:`VerifyMode` or one of the exact strings).

        Raises:
            RefitConfigError: for anything else (case variants, ``"true"``, ``"1"``, ``""``, ``None``),
                naming ``source`` and listing the accepted values.
        """
        if isinstance(value, VerifyMode):
            return value
        accepted = ", ".join(repr(m.value) for m in cls)
        if isinstance(value, str):
            for m in cls:
                if value == m.value:
                    return m
        raise RefitConfigError(f"{source}={value!r} is not accepted; accepted values: {accepted}")


CUDA_GRAPHS_ENV_VAR = "REFIT_VERIFY_CUDA_GRAPHS"
"""``1`` / ``true`` / ``on`` / ``yes`` in a process's environment: replay kept digest plans as CUDA
graphs (:mod:`refit_verify.digest.kernels.replay`, torch >= 2.12 only) and take the layerwise reload's
copies from their own memory pool (``vllm_plugin.worker_copies.owned_copies``). ``force``: the same, and
replay also on torch older than 2.12, whose CUDA graphs share the device's random-number state
with eager code (``kernels.replay``'s docstring says what that risks). Off by default."""

_CUDA_GRAPHS_ON = ("1", "true", "on", "yes", "force")
_CUDA_GRAPHS_OFF = ("", "0", "false", "off", "no")


def _cuda_graphs_value(environ: Mapping[str, str] | None) -> str:
    """:data:`CUDA_GRAPHS_ENV_VAR`, stripped and lower-cased (``""`` when unset)."""
    return (os.environ if environ is None else environ).get(CUDA_GRAPHS_ENV_VAR, "").strip().lower()


def cuda_graphs_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """True iff :data:`CUDA_GRAPHS_ENV_VAR` is ``1`` / ``true`` / ``on`` / ``yes`` / ``force`` (read at each call)."""
    return _cuda_graphs_value(environ) in _CUDA_GRAPHS_ON


def cuda_graphs_forced(environ: Mapping[str, str] | None = None) -> bool:
    """True iff :data:`CUDA_GRAPHS_ENV_VAR` is ``force``: replay below the torch version gate too."""
    return _cuda_graphs_value(environ) == "force"


def check_cuda_graphs_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a :data:`CUDA_GRAPHS_ENV_VAR` value that means neither on, ``force`` nor off (a misspelt
    ``force`` would otherwise read as off). The plugin's ``register()`` calls it as the engine starts.

    Raises:
        RefitConfigError: any other value.
    """
    if _cuda_graphs_value(environ) not in (*_CUDA_GRAPHS_ON, *_CUDA_GRAPHS_OFF):
        raw = (os.environ if environ is None else environ)[CUDA_GRAPHS_ENV_VAR]
        raise RefitConfigError(f"{CUDA_GRAPHS_ENV_VAR}={raw!r} is not accepted; accepted values: 1 / true / on / yes, "
                               "force (also below torch 2.12), 0 / false / off / no or unset (off, the default)")


DIRECT_LAUNCH_ENV_VAR = "REFIT_VERIFY_DIRECT_LAUNCH"
"""``0`` / ``false`` / ``off`` / ``no`` in a process's environment: launch kept digest plans through
Triton's JIT dispatch at every run, never straight through their compiled kernels
(:mod:`refit_verify.digest.kernels.direct`; on by default). Read at each run."""


WARMUP_ENV_VAR = "REFIT_VERIFY_WARMUP"
"""``0`` / ``false`` / ``off`` / ``no`` in a process's environment: no background digest warm-up
(:func:`refit_verify.digest.backends.start_warmup`) when a vLLM worker loads its model or a trainer
starts a refit; the first refit then compiles the digests itself. On by default; read at each start."""

_SWITCH_ON, _SWITCH_OFF = ("", "1", "true", "on", "yes"), ("0", "false", "off", "no")


def _switched_on(var: str, environ: Mapping[str, str] | None) -> bool:
    """False iff ``var`` is ``0`` / ``false`` / ``off`` / ``no`` (stripped, any case) in ``environ`` (default ``os.environ``)."""
    return (os.environ if environ is None else environ).get(var, "").strip().lower() not in _SWITCH_OFF


def _check_switch(var: str, environ: Mapping[str, str] | None) -> None:
    """Refuse a value of on-by-default switch ``var`` that means neither on nor off (a misspelt ``off``
    would otherwise read as on).

    Raises:
        RefitConfigError: any value other than ``1`` / ``true`` / ``on`` / ``yes``, ``0`` / ``false`` / ``off`` / ``no`` or unset.
    """
    env = os.environ if environ is None else environ
    if env.get(var, "").strip().lower() not in (*_SWITCH_ON, *_SWITCH_OFF):
        raise RefitConfigError(f"{var}={env[var]!r} is not accepted; accepted values: "
                               "1 / true / on / yes or unset (on, the default), 0 / false / off / no")


def direct_launch_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False iff :data:`DIRECT_LAUNCH_ENV_VAR` is ``0`` / ``false`` / ``off`` / ``no`` (read at each call)."""
    return _switched_on(DIRECT_LAUNCH_ENV_VAR, environ)


def check_direct_launch_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a :data:`DIRECT_LAUNCH_ENV_VAR` value that means neither on nor off. The plugin's
    ``register()`` calls it as the engine starts.

    Raises:
        RefitConfigError: any other value.
    """
    _check_switch(DIRECT_LAUNCH_ENV_VAR, environ)


def warmup_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False iff :data:`WARMUP_ENV_VAR` is ``0`` / ``false`` / ``off`` / ``no`` (read at each call)."""
    return _switched_on(WARMUP_ENV_VAR, environ)


def check_warmup_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a :data:`WARMUP_ENV_VAR` value that means neither on nor off. The plugin's ``register()``
    calls it as the engine starts.

    Raises:
        RefitConfigError: any other value.
    """
    _check_switch(WARMUP_ENV_VAR, environ)


def check_version(version: object) -> int | None:
    """Return ``version`` (a weight version: the trainer's step, an int in [0, 2**63)) or None (unversioned).

    Versions travel as int64 (msgpack, vLLM's RPC) and order every later session on a worker, so a
    value past int64 is refused here rather than failing on the wire or blocking every later version.

    Raises:
        RefitConfigError: ``version`` is neither None nor an int in [0, 2**63) (a bool, a float, a str,
            a negative or too large int).
    """
    if version is None:
        return None
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version < MAX_VERSION:
        raise RefitConfigError(f"version must be an int >= 0 (the trainer's step) and below 2**63, or None, got {version!r}")
    return int(version)


MAX_VERSION = 1 << 63
"""Weight versions are below this (int64 on the wire)."""


def mode_from_env(environ: Mapping[str, str] | None = None) -> VerifyMode:
    """Return the mode from ``REFIT_VERIFY`` (unset means ``off``).

    Raises:
        RefitConfigError: the variable is set to anything but ``off``, ``log`` or ``enforce``
            (an explicit empty value included).
    """
    env = os.environ if environ is None else environ
    if ENV_VAR not in env:
        return VerifyMode.OFF
    return VerifyMode.parse(env[ENV_VAR], source=ENV_VAR)


def act_on(report: VerificationReport, mode: VerifyMode) -> VerificationReport:
    """Apply ``mode`` to ``report``: raise in ``enforce``, warn (``logging.WARNING``) in ``log``.

    Returns:
        VerificationReport: ``report`` itself (ok, ``off``, or ``log``).

    Raises:
        RefitVerificationError: ``mode`` is ``enforce`` and the report is not ok.
    """
    if report.ok or mode is VerifyMode.OFF:
        return report
    if mode is VerifyMode.ENFORCE:
        raise RefitVerificationError(report)
    logging.getLogger("refit_verify").warning("%s", report.describe())
    return report


def act_on_all(reports: list[VerificationReport], mode: VerifyMode) -> list[VerificationReport]:
    """Apply ``mode`` to the reports of every worker of one refit.

    In ``enforce`` the first failing report raises and every further failing one is logged first (a
    user sees every failing worker, not just the first); in ``log`` each failing report warns. No
    report at all (no worker was checked) is a failure too.

    Returns:
        list[VerificationReport]: ``reports`` itself; when empty, one failing report saying that no
        worker was checked.

    Raises:
        RefitVerificationError: ``mode`` is ``enforce`` and a report is not ok (the first failing one),
            or there is none.
    """
    if not reports and mode.verifies:
        reports = [VerificationReport.unchecked_because("no worker's report: no worker was checked, so nothing was verified")]
    failing = [r for r in reports if not r.ok]
    if failing and mode is VerifyMode.ENFORCE:
        for r in failing[1:]:
            logging.getLogger("refit_verify").warning("%s", r.describe())
        act_on(failing[0], mode)
    for r in failing:
        act_on(r, mode)
    return reports


_ACCEPTED = {
    "mode": "one of 'off', 'log', 'enforce'",
    "buffer_bytes": "an int > 0 (bytes)",
    "alignment": "a power-of-two int from 16 to 1048576 (bytes)",
    "timeout_s": "a finite number > 0 and <= 86400 (seconds)",
    "connect_timeout_s": "a finite number > 0 and <= 86400 (seconds)",
}
MAX_TIMEOUT_S = 86400.0


class RefitConfig(BaseModel):
    """Options of one refit channel, validated strictly wherever they are built.

    Every way of building one (``RefitConfig(...)``, :meth:`build`, :meth:`from_options`) rejects,
    with a :class:`~refit_verify.errors.RefitConfigError` naming the key and its accepted values:
    unknown keys, explicit ``None``, empty strings, booleans where a number is expected, ``False``
    or ``""`` as a mode, non-finite or out-of-range numbers. Nothing is silently defaulted.

    Attributes:
        mode: verification mode; defaults to ``REFIT_VERIFY`` (itself defaulting to ``off``). A
            receiver follows the mode of each refit's handshake instead.
        buffer_bytes: staging budget in bytes, split into two ping-pong buffers (default 256 MiB).
        alignment: byte alignment of each tensor's offset in a staging buffer (512). The sender's
            value travels in the handshake; a receiver's own value is not used.
        timeout_s: bound on every wait for the peer during a refit, in seconds (default 120, as
            NeMo-RL): each reply on the sender, each next message on the receiver.
        connect_timeout_s: bound on the first message of a refit (the receiver waiting for
            ``Hello``), in seconds (default 120).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mode: VerifyMode = Field(default_factory=mode_from_env)
    buffer_bytes: int = Field(default=256 << 20, gt=0)
    alignment: int = Field(default=512, ge=16, le=1 << 20)
    timeout_s: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)
    connect_timeout_s: float = Field(default=120.0, gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)

    def __init__(self, **options: object) -> None:
        fields = type(self).model_fields
        for k, v in options.items():
            if k not in fields:
                raise RefitConfigError(f"unknown refit option {k!r}; accepted keys: {', '.join(fields)}")
            if v is None:
                raise RefitConfigError(f"refit option {k}=None is not accepted (omit it to use the default); accepted: {_ACCEPTED[k]}")
            if k != "mode" and isinstance(v, (bool, str)):
                raise RefitConfigError(f"refit option {k}={v!r} is not accepted; accepted: {_ACCEPTED[k]}")
        if "mode" in options:
            options["mode"] = VerifyMode.parse(options["mode"], source="mode")
        try:
            super().__init__(**options)
        except ValidationError as e:
            err = e.errors()[0]
            key = ".".join(str(x) for x in err["loc"]) or "?"
            value = options.get(key, err.get("input"))
            raise RefitConfigError(f"refit option {key}={value!r} is not accepted ({err['msg']}); accepted: "
                                   f"{_ACCEPTED.get(key, 'see RefitConfig')}") from None
        if self.alignment & (self.alignment - 1):
            raise RefitConfigError(f"refit option alignment={self.alignment!r} is not accepted; accepted: {_ACCEPTED['alignment']}")

    @classmethod
    def build(cls, **options: object) -> RefitConfig:
        """Validate keyword options into a config (same rules as the constructor).

        Raises:
            RefitConfigError: an unknown key, a ``None`` value, or a value of the wrong type or range;
                the message names the key and the accepted values.
        """
        return cls(**options)

    @classmethod
    def from_options(cls, options: Mapping[str, object] | None, *, source: str = "options") -> RefitConfig:
        """Validate an options mapping received from elsewhere (an RPC argument, a parsed config file).

        ``None`` means "no options" (all defaults); anything but a mapping with string keys is rejected.

        Raises:
            RefitConfigError: ``options`` is not a mapping, has a non-string key, or fails :meth:`build`.
        """
        if options is None:
            return cls()
        if not isinstance(options, Mapping):
            raise RefitConfigError(f"{source} must be a mapping of refit options or None, got {type(options).__name__}; "
                                   f"accepted keys: {', '.join(cls.model_fields)}")
        bad = [k for k in options if not isinstance(k, str)]
        if bad:
            raise RefitConfigError(f"{source}: option keys must be strings, got {bad[0]!r}; accepted keys: {', '.join(cls.model_fields)}")
        return cls(**dict(options))
