"""``triton_interp.install``: an interpreted launch patches ``triton.language`` once, the calls of its own
device functions do not (Triton's library functions, which see ``tl.core`` where the kernel sees ``tl``,
still do), and the digest is the reference's."""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import triton_interp

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter is off")


def test_a_launch_patches_the_language_once_and_digests_as_the_reference(monkeypatch) -> None:
    ti = pytest.importorskip("triton.runtime.interpreter")
    from refit_verify.digest import reference as ref
    from refit_verify.digest.kernels import launch as kd

    assert triton_interp.install() and triton_interp.install()  # idempotent
    patched = []
    real = ti._patch_lang
    monkeypatch.setattr(ti, "_patch_lang", lambda fn: (patched.append((fn.__globals__["__name__"], fn.__name__)), real(fn))[1])
    u = (torch.arange(5003, dtype=torch.int64) * 7 % 251).to(torch.uint8)  # one small chunk with a byte tail
    words = kd.digest_views([u], [ref.seed("uint8", (u.numel(),), u.numel())])
    assert kd.to_hex(words) == [ref.digest_bytes(u.numpy().tobytes(), "uint8", (u.numel(),))]
    ours = [(m.rsplit(".", 1)[-1], n) for m, n in patched if m.startswith("refit_verify.")]
    assert ours == [("_leaf", "_digest_leaf_kernel"), ("_upper", "_digest_upper_kernel"), ("_upper", "_digest_chain_kernel")]
    assert all(m.startswith("triton.language") for m, _ in patched if not m.startswith("refit_verify."))
