"""SIGTERM to `bam-train` saves a checkpoint, exits with status 0, and the run resumes from
it (the in-process variant is in test_train_loop.py)."""

import os
import signal
import subprocess
import time

import pytest

from tests.train_runs import REPO, metric_steps, micro_command, subprocess_environment


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    env = subprocess_environment(tmp_path)
    proc = subprocess.Popen(
        micro_command(workdir, steps=100000),
        env=env,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.time() + 300
    while len(metric_steps(workdir)) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, output[-3000:]
    assert "SIGTERM: saved step" in output
    stopped_at = metric_steps(workdir)[-1]
    checkpoints = os.listdir(os.path.join(workdir, "checkpoints"))
    assert str(stopped_at) in checkpoints

    resumed = subprocess.run(
        micro_command(workdir, steps=stopped_at + 2),
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout + resumed.stderr
    assert metric_steps(workdir)[-2:] == [stopped_at + 1, stopped_at + 2]
