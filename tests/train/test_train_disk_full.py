"""A disk that fills up while a checkpoint is written: one line naming the folder and the
space needed, the previous checkpoint intact, and the rerun (after freeing space) removes
the unfinished checkpoint, resumes and saves. The full disk is simulated: the data
iterator's state, which orbax writes with every checkpoint, fails to be written."""

import errno
import gc
import glob
import os
import sys
import textwrap

import pytest

from bam_train import checkpoint
from bam_train.checkpoint import DiskFullError, is_disk_full
from bam_train.loop import train
from tests.support.byte_runs import short_run_config, write_word_corpus
from tests.support.train_runs import run_bam_train, subprocess_environment

# Tensorstore's report of a full disk, as orbax raises it from an array write.
TENSORSTORE_FULL = (
    'RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "/x/": '
    "Failed to write 7331840 bytes to file 18: No space left on device [os_error_code='28']"
)
# Runs bam-train with every save after the first one failing as on a full disk.
FAILING_RUN = textwrap.dedent(
    """
    import errno, sys
    from bam_train import checkpoint
    from bam_train.cli import main

    saves = []

    def full_disk_after_the_first_save(self):
        saves.append(self)
        if len(saves) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self)

    original = checkpoint.IteratorSnapshot.get_state
    checkpoint.IteratorSnapshot.get_state = full_disk_after_the_first_save
    main(sys.argv)
    """
)


def _command(workdir: str) -> list[str]:
    return [
        "--config=micro",
        f"--workdir={workdir}",
        "--config.steps=4",
        "--config.checkpoint_every=2",
    ]


def _files(directory: str) -> dict[str, bytes]:
    paths = glob.glob(f"{directory}/**", recursive=True)
    return {p: open(p, "rb").read() for p in paths if os.path.isfile(p)}


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_the_rerun_resumes(tmp_path):
    workdir = str(tmp_path / "run")
    checkpoints = os.path.join(workdir, "checkpoints")
    env = subprocess_environment()
    failed = run_bam_train([sys.executable, "-c", FAILING_RUN, *_command(workdir)], env)
    assert failed.returncode == 1, failed.stdout[-2000:] + failed.stderr[-3000:]
    lines = failed.stderr.splitlines()
    assert len(lines) == 1, failed.stderr[-3000:]
    assert lines[0].startswith(f"error: disk full: no space left in {checkpoints} ")
    assert "saving step 4" in lines[0] and "MiB" in lines[0]
    assert "resumes from step 2" in lines[0]
    saved_step, unfinished = sorted(os.listdir(checkpoints))
    assert saved_step == "2" and unfinished.startswith("4.orbax-checkpoint-tmp")
    saved = _files(os.path.join(checkpoints, "2"))

    resumed = run_bam_train([sys.executable, "-m", "bam_train", *_command(workdir)], env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from step 2" in resumed.stdout
    assert sorted(os.listdir(checkpoints)) == ["2", "4"]
    assert _files(os.path.join(checkpoints, "2")) == saved


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 200)


# The writes a failed save cancelled leave coroutines that never ran.
@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_tensorstores_full_disk_error_stops_the_run_with_the_space_needed(
    tmp_path, corpus, monkeypatch
):
    def full_disk(self):
        raise ValueError(TENSORSTORE_FULL)

    monkeypatch.setattr(checkpoint.IteratorSnapshot, "get_state", full_disk)
    cfg = short_run_config(corpus, checkpoint_every=2)
    with pytest.raises(DiskFullError, match=r"saving step 2 .* needs about [\d.]+ MiB") as err:
        train(cfg, str(tmp_path))
    assert "no checkpoint is complete yet; the rerun starts from step 0" in str(err.value)
    assert "\n" not in str(err.value)
    gc.collect()  # the cancelled writes' coroutines, while their warning is ignored


def test_disk_full_errors_are_recognised_through_their_causes():
    assert is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert is_disk_full(ValueError(TENSORSTORE_FULL))
    try:
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as inner:
            raise RuntimeError("save failed") from inner
    except RuntimeError as outer:
        assert is_disk_full(outer)
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not is_disk_full(ValueError("RESOURCE_EXHAUSTED: out of memory"))
