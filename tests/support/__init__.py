"""What several test files share: case definitions, plain references, runs and fixtures'
helpers. Test files import from here, never from each other."""

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# The suite's programs are small, so XLA's CPU backend spends the suite's time compiling
# them, not running them. Two settings compile them faster: LLVM at -O2 instead of its
# default -O3, and the elemental fusion emitters instead of the MLIR ones, where the installed
# XLA still offers that choice (newer ones have only the MLIR emitters, and XLA aborts on a
# flag it does not know). Neither allows fast math: values and gradients move by rounding
# only (a few ulp, in some of a prior's gradients), and every test compares within a
# tolerance, or two programs built under the same flags.
_OPTIMIZATION_LEVEL = "--xla_backend_optimization_level=2"
_ELEMENTAL_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


@functools.cache
def suite_xla_flags() -> str:
    """The suite's compiler flags, those the installed XLA knows."""
    if not _xla_accepts(_ELEMENTAL_EMITTERS):
        return _OPTIMIZATION_LEVEL
    return f"{_OPTIMIZATION_LEVEL} {_ELEMENTAL_EMITTERS}"


def _xla_accepts(flag: str) -> bool:
    probe = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices('cpu')"],
        env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        timeout=300,
    )
    return probe.returncode == 0


def host_device_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess on `devices` fake CPU devices: this process's flags (the
    suite's, which conftest puts there) and the device count."""
    flags = os.environ.get("XLA_FLAGS", "")
    return f"{flags} --xla_force_host_platform_device_count={devices}".strip()
