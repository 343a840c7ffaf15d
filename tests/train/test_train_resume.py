"""Resuming a run whose workdir was damaged or left behind by a killed process: a damaged
checkpoint is skipped (and kept), optimizer options may change, metrics are not duplicated,
SIGTERM right after a checkpoint exits cleanly, and a bad workdir is a one-line error."""

import dataclasses
import glob
import os
import pathlib
import shutil
import signal
import threading
import time

import jax
import numpy as np
import pytest

from bam_jax.io.checkpoints import error_summary, load_model, quiet_orphaned_checkpoint_reads
from bam_train import loop
from bam_train.checkpoint import read_config
from bam_train.loop import train
from bam_train.metrics import MetricsWriter, read_metrics
from bam_train.state import ModelParts
from tests.support.byte_runs import SHORT_RUN_STEPS, short_run_config, write_word_corpus
from tests.support.checkpoint_damage import rewrite_floats, shift_floats
from tests.support.grids import slow_unless
from tests.support.run_metrics import records_without_time, tensorboard_scalars

STEPS = SHORT_RUN_STEPS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 200)


def small_config(corpus, **changes):
    return short_run_config(corpus, **{**dict(checkpoint_every=2), **changes})


@pytest.fixture(scope="module")
def base_run(tmp_path_factory, corpus):
    """A finished run with checkpoints at steps 2 and 4."""
    workdir = str(tmp_path_factory.mktemp("base"))
    return workdir, train(small_config(corpus), workdir)


@pytest.fixture
def workdir(base_run, tmp_path):
    """A copy of the base run to damage."""
    copy = str(tmp_path / "run")
    shutil.copytree(base_run[0], copy)
    return copy


def largest_array_file(step_dir: str) -> str:
    return max(glob.glob(f"{step_dir}/state/ocdbt.process_0/d/*"), key=os.path.getsize)


def truncate_array_file(step_dir: str) -> None:
    open(largest_array_file(step_dir), "w").close()


def flip_array_bytes(step_dir: str) -> None:
    path = largest_array_file(step_dir)
    data = bytearray(pathlib.Path(path).read_bytes())
    for i in range(100, len(data), 997):
        data[i] ^= 0xFF
    pathlib.Path(path).write_bytes(bytes(data))


def flip_one_bit(step_dir: str) -> None:
    """One bit in the middle of the largest array file: it still decodes, into other finite
    values, which only the checkpoint's checksums reveal."""
    path = largest_array_file(step_dir)
    data = bytearray(pathlib.Path(path).read_bytes())
    data[len(data) // 2] ^= 0x01
    pathlib.Path(path).write_bytes(bytes(data))


def empty_metadata(step_dir: str) -> None:
    open(f"{step_dir}/state/_METADATA", "w").close()


def break_iterator_json(step_dir: str) -> None:
    pathlib.Path(f"{step_dir}/data/process_0-of-1.json").write_text('{"next_index": 1')


def nan_values(step_dir: str) -> None:
    """Arrays that decode without error into NaN, as damage inside a value can."""
    rewrite_floats(step_dir, lambda x: x * np.nan)


DAMAGES = {
    "array_file_truncated": truncate_array_file,
    "array_bytes_flipped": flip_array_bytes,
    "one_bit_flipped": flip_one_bit,
    "empty_metadata": empty_metadata,
    "broken_iterator_json": break_iterator_json,
    "nan_values": nan_values,
    "other_finite_values": shift_floats,
}


def params_of(workdir: str) -> list[np.ndarray]:
    config, model = load_model(workdir)
    params, _ = ModelParts.from_config(config)[0].split(model)
    return [np.asarray(x) for x in jax.tree.leaves(params)]


# Bits flipped in an array and changed finite values are caught as a flipped bit is.
@pytest.mark.parametrize(
    "damage", slow_unless(DAMAGES, set(DAMAGES) - {"array_bytes_flipped", "other_finite_values"})
)
def test_resume_skips_a_damaged_checkpoint_and_keeps_it(base_run, workdir, corpus, damage, capsys):
    step_dir = os.path.join(workdir, "checkpoints", str(STEPS))
    DAMAGES[damage](step_dir)
    damaged = {
        p: pathlib.Path(p).read_bytes()
        for p in glob.glob(f"{step_dir}/**", recursive=True)
        if os.path.isfile(p)
    }
    result = train(small_config(corpus), workdir)
    output = capsys.readouterr().out
    assert f"checkpoints/{STEPS} cannot be read" in output and "resumed from step 2" in output
    assert result.step == STEPS and read_config(workdir)[1] == STEPS
    for path, content in damaged.items():
        assert pathlib.Path(path.replace(step_dir, step_dir + ".broken")).read_bytes() == content
    for a, b in zip(params_of(workdir), params_of(base_run[0]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_checkpoint_without_checksums_still_loads_and_resumes(base_run, workdir, corpus, capsys):
    """Checkpoints written before checksums were kept are read unchecked."""
    shutil.rmtree(os.path.join(workdir, "checkpoints", str(STEPS), "checksums"))
    for a, b in zip(params_of(workdir), params_of(base_run[0]), strict=True):
        np.testing.assert_array_equal(a, b)
    result = train(small_config(corpus, steps=STEPS + 2), workdir)
    output = capsys.readouterr().out
    assert f"resumed from step {STEPS}" in output and "cannot be read" not in output
    assert result.step == STEPS + 2


def test_no_restorable_checkpoint_is_an_error_that_moves_nothing(workdir, corpus):
    for step in (2, 4):
        empty_metadata(os.path.join(workdir, "checkpoints", str(step)))
    with pytest.raises(
        ValueError,
        match=r"no checkpoint .* can be restored .*checkpoints/4 .*"
        r"checkpoints/2 cannot be read",
    ):
        train(small_config(corpus), workdir)
    assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["2", "4"]


def test_load_model_names_the_damaged_checkpoint(workdir):
    empty_metadata(os.path.join(workdir, "checkpoints", str(STEPS)))
    with pytest.raises(ValueError, match=rf"checkpoints/{STEPS} cannot be read: JSONDecodeError"):
        load_model(workdir)


def test_read_config_names_the_damaged_checkpoint(workdir):
    pathlib.Path(workdir, "checkpoints", "2", "config", "metadata").write_text("{")
    with pytest.raises(ValueError, match=r"checkpoints/2 cannot be read: JSONDecodeError"):
        read_config(workdir, 2)


@pytest.mark.parametrize(
    "field", ["clip_norm", pytest.param("weight_decay", marks=pytest.mark.slow)]
)
def test_optimizer_options_may_be_switched_off_on_resume(base_run, workdir, corpus, field):
    cfg = small_config(corpus)
    changed = cfg.replace(optim=dataclasses.replace(cfg.optim, **{field: 0.0}))
    restored = train(changed, workdir).state
    for a, b in zip(
        jax.tree.leaves(restored.opt_state),
        jax.tree.leaves(base_run[1].state.opt_state),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    result = train(changed.replace(steps=STEPS + 1), workdir)
    assert result.step == STEPS + 1 and np.isfinite(result.last_loss)
    switched_back = train(cfg.replace(steps=STEPS + 2), workdir)
    assert switched_back.step == STEPS + 2 and np.isfinite(switched_back.last_loss)


def test_resume_drops_metrics_of_replayed_steps(workdir, corpus):
    """A run killed after step 6 with its last checkpoint at step 4 logged steps 5 and 6 and
    began a line; resuming replays 5 and 6 and must not keep them twice."""
    with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
        f.write('{"step": 5, "loss": 1.0}\n{"step": 6, "loss": 1.0}\n{"step": 7, "lo')
    train(small_config(corpus, steps=6), workdir)
    steps = [r["step"] for r in read_metrics(workdir)]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] != 1.0 for r in read_metrics(workdir))


def test_resume_shows_each_step_once_in_tensorboard(workdir, corpus):
    """As above: TensorBoard events of steps 5 and 6 from the killed run; after the resume
    TensorBoard shows every step once, with the values of the resumed run."""
    from tensorboardX import SummaryWriter

    killed = SummaryWriter(
        os.path.join(workdir, "tensorboard"), filename_suffix=f".{time.time_ns()}"
    )
    for step in (5, 6):
        killed.add_scalar("loss", 1.0, step)
    killed.close()
    train(small_config(corpus, steps=6), workdir)
    losses = [(step, value) for tag, step, value in tensorboard_scalars(workdir) if tag == "loss"]
    assert [step for step, _ in losses] == [1, 2, 3, 4, 5, 6]
    assert all(value != 1.0 for _, value in losses)


def test_a_deleted_metrics_file_is_written_again(tmp_path):
    writer = MetricsWriter(str(tmp_path), total_steps=3, start_step=0, progress_bar=False)
    writer.write(1, {"loss": 3.0})
    os.remove(tmp_path / "metrics.jsonl")
    writer.write(2, {"loss": 2.0})
    writer.close()
    assert records_without_time(read_metrics(str(tmp_path))) == [{"step": 2, "loss": 2.0}]


def test_sigterm_on_a_checkpointed_step_saves_and_stops(tmp_path, corpus):
    workdir = str(tmp_path)

    def send_sigterm_after_two_steps():
        deadline = time.time() + 120
        path = pathlib.Path(workdir, "metrics.jsonl")
        while time.time() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=send_sigterm_after_two_steps)
    sender.start()
    result = train(small_config(corpus, steps=100, checkpoint_every=1), workdir)
    sender.join()
    assert result.preempted and read_config(workdir)[1] == result.step


def _refuse_to_build(cfg):
    raise AssertionError("the workdir is checked before the run is built")


@pytest.mark.parametrize(
    "relative, problem", [("file", "is a file"), ("file/sub", "cannot create")]
)
def test_an_unusable_workdir_is_a_one_line_error(tmp_path, corpus, monkeypatch, relative, problem):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setattr(loop, "build", _refuse_to_build)
    with pytest.raises(ValueError, match=rf"workdir: .*{problem}"):
        train(small_config(corpus), str(tmp_path / relative))


def test_reads_orphaned_by_a_failed_restore_print_nothing(monkeypatch):
    import sys
    import types

    passed_on = []
    monkeypatch.setattr(sys, "unraisablehook", passed_on.append)
    quiet_orphaned_checkpoint_reads()

    def unraisable(error: BaseException):
        return types.SimpleNamespace(
            exc_type=type(error), exc_value=error, exc_traceback=None, err_msg=None, object=None
        )

    sys.unraisablehook(unraisable(RuntimeError("Event loop is closed")))
    assert passed_on == []
    sys.unraisablehook(unraisable(RuntimeError("something else")))
    assert [str(u.exc_value) for u in passed_on] == ["something else"]
    # An Orbax read that a failed restore left unfinished, collected later.
    namespace: dict = {}
    exec(compile("async def read(): pass", "/lib/orbax/checkpoint/reads.py", "exec"), namespace)
    orbax_read = namespace["read"]()
    collected = vars(unraisable(ValueError("FAILED_PRECONDITION: Error reading ...")))
    sys.unraisablehook(types.SimpleNamespace(**{**collected, "object": orbax_read}))
    orbax_read.close()
    assert len(passed_on) == 1, "an unfinished Orbax read was reported"

    try:
        try:
            raise OSError("tensorstore: byte range [7, 9) of a file of size 0")
        except OSError:
            raise ValueError("a page of orbax spec\n...") from None
    except ValueError as hidden:
        assert error_summary(hidden) == "ValueError: a page of orbax spec"
    try:
        try:
            raise OSError("tensorstore: byte range [7, 9) of a file of size 0")
        except OSError:
            raise ValueError("a page of orbax spec\n...")  # noqa: B904
    except ValueError as wrapped:
        assert error_summary(wrapped).startswith("OSError: tensorstore: byte range")
