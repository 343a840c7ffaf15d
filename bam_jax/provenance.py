"""What produced a result: the code version, the machine and the command.

Every results file the commands write carries `provenance()`: the package version and, where
the code is a git checkout, its commit and whether the tree had changes; the machine's CPU,
core count, accelerator and float32 matmul rate measured when the command started (a shared
or throttled machine shows as a lower rate); the command line, and when it started.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

PACKAGE = "bam-jax"
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def matmul_gflops(n: int = 2048, repeats: int = 10, dtype: jnp.dtype = jnp.float32) -> float:
    """Median rate of jitted n x n products at matmul precision "highest" (true float32 for
    float32, no TF32), GFLOP/s: the yardstick every timing is divided by."""
    a = jnp.ones((n, n), dtype)
    with jax.default_matmul_precision("highest"):
        matmul = jax.jit(lambda x: x @ x)
        jax.block_until_ready(matmul(a))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(matmul(a))
            times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def code_version() -> dict[str, Any]:
    """The package version; with a git checkout, its commit and whether it had changes
    (tracked files only), else None for both."""
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        version = None
    commit = _git("rev-parse", "HEAD")
    changes = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "package": PACKAGE,
        "version": version,
        "commit": commit,
        "dirty": None if changes is None else bool(changes),
    }


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", SOURCE_ROOT, *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.cache
def machine() -> dict[str, Any]:
    """This machine: CPU model and cores, the devices jax uses, and the float32 matmul rate
    (measured once per process, on jax's default device)."""
    device = jax.devices()[0]
    return {
        "host": platform.node(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": device.platform,
        "accelerator": None if device.platform == "cpu" else device.device_kind,
        "device_count": jax.device_count(),
        "float32_matmul_gflops": round(matmul_gflops(n=1024, repeats=5), 1),
        "python": platform.python_version(),
        "jax": jax.__version__,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _command_line(argv: list[str]) -> str:
    """`argv` as a shell line, the program by its name rather than its installed path."""
    return shlex.join([os.path.basename(argv[0]), *argv[1:]]) if argv else ""


def provenance(argv: list[str] | None = None) -> dict[str, Any]:
    """The code, the machine and the command line of this process, and the time now (UTC)."""
    return {
        "code": code_version(),
        "machine": machine(),
        "command": _command_line(sys.argv if argv is None else argv),
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
