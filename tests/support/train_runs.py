"""Running `bam-train` in a subprocess, as the signal and disk tests do."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

from tests.support import REPO_ROOT, host_device_flags

REPO = str(REPO_ROOT)


def metric_steps(workdir: str) -> list[int]:
    """The steps metrics.jsonl has recorded so far (none before it exists)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def micro_command(workdir: str, steps: int) -> list[str]:
    """bam-train on the micro preset, logging every step and never checkpointing on its own."""
    return [
        sys.executable,
        "-m",
        "bam_train",
        "--config=micro",
        f"--workdir={workdir}",
        f"--config.steps={steps}",
        "--config.log_every=1",
        "--config.checkpoint_every=100000",
    ]


def subprocess_environment() -> dict[str, str]:
    """CPU only, this checkout importable, compilations in the session's shared cache
    (tests/conftest.py)."""
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}


def run_bam_train(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """A whole bam-train run (`argv` from the program on), its output captured."""
    return subprocess.run(argv, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)


def signalled_run(
    workdir: str, env: dict[str, str], signum: int, **popen_options: Any
) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of a long micro run sent `signum` after two steps."""
    proc = subprocess.Popen(
        micro_command(workdir, steps=100000),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen_options,
    )
    deadline = time.time() + 300
    while len(metric_steps(workdir)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=300)
    return proc.returncode, stdout, stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def start_two_processes(
    workdir: str, steps: int, *extra: str, port: int | None = None
) -> list[subprocess.Popen]:
    """Both processes of a two-process micro run (one CPU device each, over gloo), logging
    every step; their stdout and stderr are pipes."""
    port = port or free_port()
    env = {**subprocess_environment(), "XLA_FLAGS": host_device_flags(1)}
    command = [
        *micro_command(workdir, steps),
        "--noconfig.progress_bar",
        f"--coordinator=localhost:{port}",
        "--num_processes=2",
        *extra,
    ]
    return [
        subprocess.Popen(
            [*command, f"--process_id={i}"],
            env=env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]


def wait_for(condition, timeout_s: float = 300, every_s: float = 0.02) -> None:
    """Polls `condition()` until it is true; a TimeoutError after `timeout_s`."""
    deadline = time.time() + timeout_s
    while not condition():
        if time.time() > deadline:
            raise TimeoutError(f"not reached in {timeout_s} s")
        time.sleep(every_s)
