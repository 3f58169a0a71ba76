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


def check_warm_paths(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, device: str) -> None:
    """Run ``backends.warm_paths(device)`` on a kernel device and assert what it must do: a verifying
    Packer, with and without digests ahead, takes every grouped throwaway tensor (on ``device``) through
    the fused op; ``digest_now`` reads them at first sight, moved and expected ahead; every digest is the
    reference's; nothing is logged as failed and nothing stays kept under the warm-up's space."""
    import logging

    import torch

    from refit_verify.digest import incremental, reference
    from refit_verify.digest import kept as held
    from refit_verify.stream import pack

    packed, sights = [], []
    real_manifest, real_now = pack.Packer.manifest, incremental.digest_now

    def manifest(self):
        out = real_manifest(self)
        packed.append((self.tensors, self.fused, self.ahead, out))
        return out

    def now(items, *a, **k):
        out = real_now(items, *a, **k)
        sights.append((k.get("space"), {t.device.type for _, t in items}, out))
        return out

    monkeypatch.setattr(pack.Packer, "manifest", manifest)
    monkeypatch.setattr(incremental, "digest_now", now)
    with caplog.at_level(logging.WARNING, logger="refit_verify"):
        backends.warm_paths(device)
    assert [r.getMessage() for r in caplog.records if "warming" in r.getMessage()] == []
    zeros = {f"{i}.{j}": reference.digest_bytes(bytes(torch.zeros(shape, dtype=dt).numel() * dt.itemsize), str(dt)[6:], shape)
             for i, dt in enumerate((torch.bfloat16, torch.float16, torch.float32)) for j, shape in enumerate(((4, 8), (8,)))}
    assert [p[:3] for p in packed] == [(6, 6, True), (6, 6, False)] and all(p[3] == zeros for p in packed)
    warm = [(devices, out) for space, devices, out in sights if space == incremental._WARM_SPACE]
    assert len(warm) == 3 and all(devices == {torch.device(device).type} and out == zeros for devices, out in warm)
    assert incremental._WARM_SPACE not in held._EXPECTED and not [k for k in held._HELD_SETS if k and k[0] == incremental._WARM_SPACE]
