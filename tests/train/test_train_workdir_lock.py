"""One training per workdir: a second launch on a live run's workdir is refused with one
line naming the holder; a lock left by a killed run is taken over, with a note."""

import os
import signal
import socket
import subprocess
import sys

import pytest

from bam_train.cli import run
from bam_train.loop import train
from bam_train.workdir_lock import LOCK_FILE, WorkdirInUseError, hold_workdir
from tests.support.byte_runs import short_run_config, write_word_corpus

HOLD = """
import sys, time
from bam_train.workdir_lock import hold_workdir
with hold_workdir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 200)


@pytest.fixture
def holder(tmp_path):
    """A live process holding the lock of tmp_path / "run"."""
    workdir = tmp_path / "run"
    workdir.mkdir()
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(workdir)], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout.readline().strip() == "held"
    yield str(workdir), process
    process.kill()
    process.wait()


def test_a_second_training_is_refused_naming_the_holder(holder, corpus):
    workdir, process = holder
    expected = rf"{workdir}' is in use by another training \(pid {process.pid} on host "
    with pytest.raises(WorkdirInUseError, match=expected + socket.gethostname()):
        train(short_run_config(corpus), workdir)
    assert not os.path.exists(os.path.join(workdir, "checkpoints"))


def test_the_command_line_refuses_it_in_one_line(holder, capsys):
    workdir, process = holder
    assert run(["bam-train", "--config=micro", f"--workdir={workdir}"]) == 2
    err = capsys.readouterr().err.strip()
    in_use = f"error: workdir: '{workdir}' is in use by another training (pid {process.pid} "
    assert err.startswith(in_use)
    assert len(err.splitlines()) == 1


def test_a_lock_left_by_a_killed_run_is_taken_over(holder, corpus, capsys):
    workdir, process = holder
    process.send_signal(signal.SIGKILL)
    process.wait()
    result = train(short_run_config(corpus, steps=2), workdir)
    assert result.step == 2
    out = capsys.readouterr().out
    assert f"took over the lock of '{workdir}' from a training that ended" in out
    assert f"pid {process.pid}" in out


def test_a_clean_end_releases_it(tmp_path, corpus, capsys):
    workdir = str(tmp_path / "run")
    train(short_run_config(corpus, steps=2), workdir)
    assert os.path.getsize(os.path.join(workdir, LOCK_FILE)) == 0
    train(short_run_config(corpus, steps=3), workdir)
    assert "took over" not in capsys.readouterr().out
    with hold_workdir(workdir) as note:
        assert note is None
