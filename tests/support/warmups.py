"""A process with no digest backend chosen and no digest warm-up started or running, for tests of
``refit_verify.digest.backends``' warm-up and its callers."""

from __future__ import annotations

import pytest

from refit_verify.digest import backends


def forget_warmups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget the chosen backends and every warm-up (restored by ``monkeypatch``); warm-up on."""
    monkeypatch.setattr(backends, "_CHOSEN", {})
    monkeypatch.setattr(backends, "_WARMUPS", {})
    monkeypatch.setattr(backends, "_WARMING", {})
    monkeypatch.setattr(backends, "_CPU", [None])
    monkeypatch.delenv("REFIT_VERIFY_WARMUP", raising=False)
