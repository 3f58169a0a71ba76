"""Digest tests: under the Triton interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` on a
machine without CUDA) device-function calls skip the interpreter's repeated language patching
(``tests/support/triton_interp.py``); the kernels and their results are unchanged."""

from __future__ import annotations

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from tests.support import triton_interp

    triton_interp.install()
