"""Test-session set-up shared by every module.

On a machine without CUDA the Triton digest kernels can only run under the interpreter, and
Triton reads ``TRITON_INTERPRET`` once, when it is first imported. The kernel test modules set it
at their import, which is too late if an earlier module (a vLLM engine test) imported Triton
first; setting it here, before any test module is imported, makes the test order irrelevant.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
