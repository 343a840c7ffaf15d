"""SIGTERM to `bam-train` saves a checkpoint, exits with status 0, and the run resumes from
it (the in-process variant is in test_train_loop.py)."""

import os
import signal

import pytest

from tests.support.train_runs import (
    metric_steps,
    micro_command,
    run_bam_train,
    signalled_run,
    subprocess_environment,
)


@pytest.mark.slow
def test_sigterm_saves_and_the_run_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    env = subprocess_environment()
    returncode, stdout, stderr = signalled_run(workdir, env, signal.SIGTERM)
    output = stdout + stderr
    assert returncode == 0, output[-3000:]
    assert "SIGTERM: saved step" in output
    stopped_at = metric_steps(workdir)[-1]
    checkpoints = os.listdir(os.path.join(workdir, "checkpoints"))
    assert str(stopped_at) in checkpoints

    resumed = run_bam_train(micro_command(workdir, steps=stopped_at + 2), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout + resumed.stderr
    assert metric_steps(workdir)[-2:] == [stopped_at + 1, stopped_at + 2]
