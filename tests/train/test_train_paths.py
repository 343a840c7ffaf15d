"""Workdirs and data paths: URLs pass through untouched (written through epath and orbax),
`file://` URLs and names with a colon are local paths, shards are read from a file system
(a bucket through its gcsfuse mount), and a checkpoint's data position restores on another
number of processes."""

import importlib.util
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
from etils.epath import testing as epath_testing

from bam_configs.presets import preset
from bam_configs.training import DataConfig, validate_for_runtime
from bam_jax.io.checkpoints import CheckpointReadError, checkpoint_dir, load_model
from bam_jax.io.files import run_path
from bam_jax.io.shards import open_shards, read_meta
from bam_jax.tokenizers import get_tokenizer
from bam_train.checkpoint import Checkpointer, read_config
from bam_train.loop import train
from bam_train.metrics import MetricsWriter, read_metrics
from bam_train.resume import prepare_workdir
from bam_train.shards import write_shards
from tests.support.byte_runs import SHORT_RUN_STEPS, short_run_config, write_word_corpus
from tests.support.run_metrics import records_without_time

STEPS = SHORT_RUN_STEPS


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    return write_word_corpus(tmp_path_factory, 100)


def small_config(corpus: str):
    return short_run_config(corpus, checkpoint_every=STEPS)


def test_urls_pass_through_and_local_paths_become_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_dir("gs://bucket/run") == "gs://bucket/run/checkpoints"
    assert os.fspath(run_path("s3://bucket/a/b")) == "s3://bucket/a/b"
    assert os.fspath(run_path("file:///tmp/x")) == "/tmp/x"
    assert os.fspath(run_path("file://localhost/tmp/a%20b")) == "/tmp/a b"
    for name in ("run:1", "a:b", "file:x"):
        assert os.fspath(run_path(name)) == str(tmp_path / name)


@pytest.mark.parametrize(
    "location, problem",
    [
        ("nosuch://bucket/run", "URL scheme nosuch://"),
        ("file://otherhost/run", "not a local file URL"),
        ("", "empty"),
    ],
)
def test_a_workdir_that_cannot_be_a_run_directory_is_a_one_line_error(location, problem):
    with pytest.raises(ValueError, match=f"^workdir: .*{problem}"):
        run_path(location)


@pytest.mark.skipif(
    any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")),
    reason="a gs:// client is installed",
)
def test_a_gs_workdir_without_its_client_stops_before_the_build(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"workdir: 'gs://bucket/run' needs .*gcsfs"):
        prepare_workdir("gs://bucket/run")
    assert os.listdir(tmp_path) == []


def _assert_trained_run(run: str) -> None:
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == [str(STEPS)]
    assert [r["step"] for r in read_metrics(run) if "loss" in r] == list(range(1, STEPS + 1))
    config = json.loads(pathlib.Path(run, "config.json").read_text())
    assert config["steps"] == STEPS
    assert os.listdir(os.path.join(run, "tensorboard"))


def test_training_in_a_file_url_workdir(tmp_path, monkeypatch, corpus):
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    url = f"file://{run}"
    result = train(small_config(corpus), url)
    assert result.step == STEPS
    assert os.listdir(tmp_path) == ["run"]
    _assert_trained_run(str(run))
    assert read_config(url) == read_config(str(run))
    config, _ = load_model(url)
    assert config == small_config(corpus).model


def test_training_in_a_local_folder_named_like_a_scheme(tmp_path, monkeypatch, corpus):
    """tensorboardX reads `s3:` at the start of a path as S3: the folder must stay local."""
    monkeypatch.chdir(tmp_path)
    assert train(small_config(corpus), "s3:run").step == STEPS
    _assert_trained_run(str(tmp_path / "s3:run"))


@pytest.fixture
def fake_bucket(tmp_path, monkeypatch):
    """gs://bucket/... read and written through epath lands under tmp_path/bucket; anything
    written around epath (open(), os) would land under the working directory, tmp_path/cwd."""
    root = tmp_path / "bucket"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)

    def redirect(original, path, *args, **kwargs):
        return original(str(path).replace("gs://bucket", str(root)), *args, **kwargs)

    def redirect_two(original, path, dst, *args, **kwargs):
        local = [str(p).replace("gs://bucket", str(root)) for p in (path, dst)]
        return original(*local, *args, **kwargs)

    one = ("exists", "isdir", "makedirs", "mkdir", "open", "remove", "stat", "glob", "listdir")
    mocks = {name: redirect for name in one}
    mocks.update(rename=redirect_two, replace=redirect_two)
    with epath_testing.mock_epath(**mocks):
        yield root, cwd


def test_metrics_under_a_url_are_written_through_epath(fake_bucket, capsys):
    root, cwd = fake_bucket
    (root / "run").mkdir(parents=True)
    (root / "run" / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 4.0}\n{"step": 2, "loss": 3.0}\n{"step": 3, "lo'
    )
    writer = MetricsWriter("gs://bucket/run", total_steps=3, start_step=1, progress_bar=False)
    writer.write(2, {"loss": 2.0})
    writer.write(3, {"loss": 1.0})
    writer.close()
    assert "no TensorBoard events under gs://bucket/run/tensorboard" in capsys.readouterr().out
    assert records_without_time(read_metrics("gs://bucket/run")) == [
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 2.0},
        {"step": 3, "loss": 1.0},
    ]
    assert os.listdir(cwd) == []


def test_a_metrics_file_cut_short_after_a_record_gets_its_line_end(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 4.0}')
    writer = MetricsWriter(str(tmp_path), total_steps=2, start_step=1, progress_bar=False)
    writer.write(2, {"loss": 3.0})
    writer.close()
    assert records_without_time(read_metrics(str(tmp_path))) == [
        {"step": 1, "loss": 4.0},
        {"step": 2, "loss": 3.0},
    ]


@pytest.fixture
def shard_dir(tmp_path) -> str:
    out = str(tmp_path / "shards")
    write_shards(["one document", "another one"], out, get_tokenizer("byte"))
    return out


def test_shards_are_read_from_a_file_url(shard_dir):
    assert read_meta(f"file://{shard_dir}") == read_meta(shard_dir)
    (tokens, starts), *_ = open_shards(f"file://{shard_dir}")
    (expected_tokens, expected_starts), *_ = open_shards(shard_dir)
    np.testing.assert_array_equal(tokens, expected_tokens)
    np.testing.assert_array_equal(starts, expected_starts)


def test_shards_behind_a_url_are_refused_with_the_mount_to_use(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for read in (read_meta, open_shards):
        with pytest.raises(ValueError, match=r"data.path: 'gs://bucket/shards' is a URL.*gcsfuse"):
            read("gs://bucket/shards")
    with pytest.raises(ValueError, match=r"--out: 'gs://bucket/new' is a URL.*gcsfuse"):
        write_shards(["text"], "gs://bucket/new", get_tokenizer("byte"))
    assert os.listdir(tmp_path) == []


def test_the_runtime_check_reads_shard_urls_as_the_readers_do(shard_dir):
    micro = preset("micro")
    model = micro.model.replace(vocab_size=259, max_seq_len=8)

    def config(path: str):
        data = DataConfig(source="shards", path=path, val_rows=1)
        return micro.replace(model=model, data=data, eval_every=0)

    validate_for_runtime(config(f"file://{shard_dir}"), 1)
    with pytest.raises(ValueError, match=r"data.path: 'gs://bucket/shards' is a URL.*gcsfuse"):
        validate_for_runtime(config("gs://bucket/shards"), 1)


def _saved_checkpoint(workdir: str, data_state: dict) -> tuple[Checkpointer, dict]:
    cfg = preset("micro").replace(async_checkpoint=False)
    checkpointer = Checkpointer(workdir, cfg)
    state = {"w": jnp.arange(4.0)}
    checkpointer.save(3, state, data_state, cfg.to_dict())
    checkpointer.wait()
    return checkpointer, state


def _as_saved_by_two_processes(workdir: str, states: list[dict]) -> None:
    data_dir = epath.Path(checkpoint_dir(workdir)) / "3" / "data"
    (data_dir / "process_0-of-1.json").unlink()
    for index, state in enumerate(states):
        (data_dir / f"process_{index}-of-2.json").write_text(json.dumps(state))


def test_a_data_position_saved_by_two_processes_restores_on_one(tmp_path):
    checkpointer, state = _saved_checkpoint(str(tmp_path), {"next_index": 3})
    _as_saved_by_two_processes(str(tmp_path), [{"next_index": 3}, {"next_index": 3}])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    restored, data_state = checkpointer.restore(3, abstract)
    checkpointer.close()
    assert data_state == {"next_index": 3}
    np.testing.assert_array_equal(restored["w"], state["w"])


def test_data_positions_that_differ_by_process_are_a_one_line_error(tmp_path):
    checkpointer, state = _saved_checkpoint(str(tmp_path), {"next_index": 3})
    _as_saved_by_two_processes(str(tmp_path), [{"next_index": 3}, {"next_index": 2}])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    with pytest.raises(CheckpointReadError, match=r"checkpoints/3 cannot be read: .*process count"):
        checkpointer.restore(3, abstract)
    checkpointer.close()
