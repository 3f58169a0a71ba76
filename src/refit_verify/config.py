"""Verification mode and refit configuration.

``REFIT_VERIFY`` is read and validated wherever it matters (trainer, engine core, every vLLM
worker through the plugin's ``register()``): a value outside ``off | log | enforce`` raises
:class:`~refit_verify.errors.RefitConfigError` listing the accepted values.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from refit_verify.errors import RefitConfigError

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


class RefitConfig(BaseModel):
    """Options of one refit channel. Unknown keys and explicit ``None`` values are rejected.

    Attributes:
        mode: verification mode; defaults to ``REFIT_VERIFY`` (itself defaulting to ``off``).
        buffer_bytes: staging budget in bytes, split into two ping-pong buffers (default 256 MiB).
        alignment: byte alignment of each tensor's offset in a staging buffer (512).
        timeout_s: bound on every wait for the peer, in seconds (default 120, as NeMo-RL).
        connect_timeout_s: bound on the first message of a refit, in seconds (default 120).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    mode: VerifyMode = Field(default_factory=mode_from_env)
    buffer_bytes: int = Field(default=256 << 20, gt=0)
    alignment: int = Field(default=512, gt=0)
    timeout_s: float = Field(default=120.0, gt=0)
    connect_timeout_s: float = Field(default=120.0, gt=0)

    @classmethod
    def build(cls, **options: object) -> RefitConfig:
        """Validate keyword options into a config.

        Raises:
            RefitConfigError: an unknown key, a ``None`` value, or a value of the wrong type or range;
                the message names the key and the accepted values.
        """
        if "mode" in options:
            options["mode"] = VerifyMode.parse(options["mode"], source="mode")
        for k, v in options.items():
            if v is None:
                raise RefitConfigError(f"refit option {k}=None is not accepted; omit it to use the default")
        try:
            cfg = cls(**options)
        except ValidationError as e:
            fields = ", ".join(cls.model_fields)
            raise RefitConfigError(f"invalid refit options: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}; accepted keys: {fields}") from None
        if cfg.alignment & (cfg.alignment - 1) or cfg.alignment < 16:
            raise RefitConfigError(f"alignment={cfg.alignment} must be a power of two >= 16")
        return cfg
