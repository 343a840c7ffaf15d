"""Running a check on several fake host devices: the device count is fixed when jax starts,
so the check runs in a subprocess, which prints "RESULT" and a JSON object to return."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support import REPO_ROOT, host_device_flags

REPO = REPO_ROOT


def run_on_host_devices(
    code: str,
    *args: str,
    devices: int = 4,
    env: dict[str, str] | None = None,
    cwd: str | Path = REPO,
    timeout: int = 900,
) -> subprocess.CompletedProcess:
    """Runs `python -c code *args` on `devices` CPU devices (with `env` added); fails the
    test with the end of its stderr unless it exits 0."""
    environment = {
        **os.environ,
        "XLA_FLAGS": host_device_flags(devices),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(REPO),
        **(env or {}),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        env=environment,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def host_devices_result(code: str, *args: str, **options: Any) -> Any:
    """The JSON that `code` printed after "RESULT", run as `run_on_host_devices` runs it."""
    return json.loads(run_on_host_devices(code, *args, **options).stdout.split("RESULT", 1)[1])
