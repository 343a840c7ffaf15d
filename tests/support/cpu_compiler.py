"""Whether this machine can build the CPU kernel, for the tests that need it."""

from __future__ import annotations

import shutil

import pytest

from bam_jax.kernels import cpu

HAS_COMPILER = any(shutil.which(name) for name in cpu.COMPILERS)
needs_compiler = pytest.mark.skipif(
    not HAS_COMPILER,
    reason="the CPU kernel is compiled on first use and this machine has no C++ compiler",
)
