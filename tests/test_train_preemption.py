"""SIGTERM to `bam-train` saves a checkpoint, exits with status 0, and the run resumes from
it (the in-process variant is in test_train_loop.py)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _metric_steps(workdir: str) -> list[int]:
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def _command(workdir: str, steps: int) -> list[str]:
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


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    proc = subprocess.Popen(
        _command(workdir, steps=100000),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while len(_metric_steps(workdir)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM: saved step" in output
    stopped_at = _metric_steps(workdir)[-1]
    checkpoints = os.listdir(os.path.join(workdir, "checkpoints"))
    assert str(stopped_at) in checkpoints

    resumed = subprocess.run(
        _command(workdir, steps=stopped_at + 2),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout + resumed.stderr
    assert _metric_steps(workdir)[-2:] == [stopped_at + 1, stopped_at + 2]
