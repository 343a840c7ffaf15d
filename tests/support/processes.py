"""Python in a fresh interpreter, for checks that could crash the process or must start
clean."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.support import REPO_ROOT

REPO = REPO_ROOT


def run_python(script: str, **env: str) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh interpreter (with this process's kernel cache and `env` added
    to the environment) and asserts it exits cleanly: a crash fails the test instead of
    killing pytest."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=REPO,
        env=dict(os.environ, PYTHONPATH=str(REPO), **env),
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, f"exit {result.returncode}:\n{result.stderr[-3000:]}"
    return result
