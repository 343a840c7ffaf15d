"""Ctrl-C (SIGINT) to `bam-train`: the first saves the current step and exits with status 130
and one line, the run resumes from it; a second stops the process at once."""

import os
import signal

import pytest

from bam_train.signals import StopRequests
from tests.support.train_runs import (
    metric_steps,
    micro_command,
    run_bam_train,
    signalled_run,
    subprocess_environment,
)


def _default_sigint() -> None:
    """A shell may start background jobs with SIGINT ignored; the child gets the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_saves_exits_130_with_one_line_and_the_run_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    env = subprocess_environment()
    returncode, stdout, stderr = signalled_run(
        workdir, env, signal.SIGINT, preexec_fn=_default_sigint
    )
    assert returncode == 130, stdout[-2000:] + stderr[-3000:]
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr[-3000:]
    stopped_at = metric_steps(workdir)[-1]
    assert lines[0] == (
        f"interrupted (Ctrl-C): saved step {stopped_at} to {workdir}; the same command resumes"
    )
    assert str(stopped_at) in os.listdir(os.path.join(workdir, "checkpoints"))

    resumed = run_bam_train(micro_command(workdir, steps=stopped_at + 2), env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {stopped_at}" in resumed.stdout
    assert metric_steps(workdir)[-2:] == [stopped_at + 1, stopped_at + 2]


@pytest.fixture
def sigint_handler():
    """Set SIGINT's handler for a test (a test runner may have its own), restored after."""
    previous = signal.getsignal(signal.SIGINT)
    yield lambda handler: signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_stops_at_once(sigint_handler):
    """The first SIGINT is a request to save; after it SIGINT has its default action again,
    which ends the process without running any more Python."""
    sigint_handler(signal.default_int_handler)
    with StopRequests() as requests:
        assert requests.requested(1) is None
        os.kill(os.getpid(), signal.SIGINT)
        assert requests.requested(1) == "SIGINT"
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)
        assert requests.requested(1) == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_an_ignored_sigint_stays_ignored(sigint_handler):
    sigint_handler(signal.SIG_IGN)
    with StopRequests():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
