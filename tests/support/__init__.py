"""What several test files share: case definitions, plain references, runs and fixtures'
helpers. Test files import from here, never from each other."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

# The suite's programs are small, so XLA's CPU backend spends its time compiling them, not
# running them: LLVM at -O2 instead of its default -O3 compiles them about 15% faster. XLA
# keeps IEEE semantics at every level (no fast math), and the values and gradients of
# blockwise attention and of a model are bit for bit the same.
SUITE_XLA_FLAGS = "--xla_backend_optimization_level=2"


def host_device_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess on `devices` fake CPU devices, with the suite's flags."""
    return f"{SUITE_XLA_FLAGS} --xla_force_host_platform_device_count={devices}"
