"""`bam-eval` refusals: each user error is one `bam-eval: error:` line, exit status 2, raised
before any work, naming what to fix; results files and checkpoints are left untouched."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import pytest
from flax import nnx

from bam_eval.cli import build_parser, main
from bam_eval.passkey import PasskeySettings, auto_batch_size, evaluate_passkey
from bam_eval.results import ResultStore
from bam_jax.config import ModelConfig
from bam_jax.inference import ChunkedForward
from bam_jax.io.checkpoints import quiet_orphaned_checkpoint_reads
from bam_jax.model import Transformer
from bam_jax.reference_checkpoint import export_reference_checkpoint
from bam_jax.tokenizers import ByteTokenizer
from tests.support import REPO_ROOT
from tests.support.checkpoint_damage import shift_floats

ROOT = REPO_ROOT
CONFIG = ModelConfig.of_size("nano", vocab_size=259, encoding="bam_ssmax", max_seq_len=64)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A training workdir with one checkpoint (step 3) of an untrained micro model."""
    from bam_configs.presets import preset
    from bam_configs.training import DataConfig
    from bam_train.checkpoint import Checkpointer
    from bam_train.optim import make_optimizer
    from bam_train.state import ModelParts, init_state

    cfg = preset("micro")
    cfg = cfg.replace(
        model=cfg.model.replace(vocab_size=259, max_seq_len=64),
        data=DataConfig(source="passkey", tokenizer="byte"),
    )
    parts, _, _ = ModelParts.from_config(cfg.model)
    state = init_state(cfg.model, parts, make_optimizer(cfg.optim, parts.labels), 0)
    path = tmp_path_factory.mktemp("workdir") / "run"
    checkpointer = Checkpointer(str(path), cfg)
    checkpointer.save(3, state, {}, cfg.to_dict())
    checkpointer.close()
    return path


def _copy(src: Path, dst: Path) -> Path:
    subprocess.run(["cp", "-r", str(src), str(dst)], check=True)
    return dst


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("bam-eval: error: ") and "\n" not in err, err
    return err


# ------------------------------------------------------------------------- memory budget


def test_a_sample_over_the_memory_budget_is_refused_before_any_work(run_dir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = f"passkey {run_dir} --tokenizer byte --lengths 20k --memory-gb 0.001 --out {out}"
    assert main([*argv.split(), "--quiet", "--no-plots"]) == 2
    err = _error(capsys)
    assert "passkey length 20480" in err and "1.02 MB" in err
    assert "--memory-gb" in err and "--lengths" in err
    assert not (out / "bam" / "passkey.json").exists()


def test_evaluate_passkey_checks_one_sample_against_the_budget(tmp_path):
    scorer = ChunkedForward(
        Transformer(CONFIG, rngs=nnx.Rngs(0)), lambda b, c: None, chunk_size=128
    )
    store = ResultStore(str(tmp_path / "p.json"))
    with pytest.raises(ValueError, match=r"passkey length 2000 .*KV cache of 2048 slots"):
        evaluate_passkey(
            scorer,
            ByteTokenizer(),
            [1000, 2000],
            PasskeySettings(n_samples=1),
            store,
            cache_bytes_per_slot=1024,
            memory_budget_bytes=1 << 20,
            progress=False,
        )
    assert scorer.stats.sequences == 0


def test_perplexity_sequence_over_the_memory_budget_is_refused(run_dir, tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text("The grass is green. " * 10)
    argv = f"perplexity {run_dir} --tokenizer byte --data {text} --seq-len 64k --window 1k"
    assert main([*argv.split(), "--memory-gb", "0.01", "--out", str(tmp_path / "o")]) == 2
    err = _error(capsys)
    assert "--seq-len 65536" in err and "10.24 MB" in err and "--memory-gb" in err


def test_automatic_batches_count_activations() -> None:
    assert auto_batch_size(10, 100, 1000, 1_000_000) == 10
    assert auto_batch_size(10, 100, 1000, 1_000_000, activation_bytes=400_000) == 2


@pytest.mark.parametrize(
    "option",
    [
        "--batch-size 0",
        "--batch-size -2",
        "--samples 0",
        "--chunk-size 0",
        "--block-q 0",
        "--block-k -1",
        "--patience 0",
        "--step -1",
        "--seed -1",
        "--prefix-digits -1",
        "--memory-gb nan",
        "--memory-gb inf",
        "--multiples nan",
        "--sampling middle",
    ],
)
def test_out_of_range_options_are_usage_errors(option, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["passkey", "run", *option.split()])
    assert exit_info.value.code == 2
    assert f"argument {option.split()[0]}: expected" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--window 0", "--seq-len 0", "--sequences 0"])
def test_perplexity_counts_must_be_positive(option, capsys) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["perplexity", "run", "--data", "x.txt", *option.split()])
    assert f"argument {option.split()[0]}: expected" in capsys.readouterr().err


def test_nan_weights_are_refused_naming_the_parameters(tmp_path, capsys) -> None:
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    kernel = model.layers[1].feed_forward.w1.kernel
    kernel[...] = kernel[...].at[0, :3].set(jnp.nan)
    path = tmp_path / "nan"
    export_reference_checkpoint(model, CONFIG, path, fmt="npz")
    argv = ["passkey", str(path), "--tokenizer", "byte", "--lengths", "300"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = _error(capsys)
    assert "NaN or inf" in err and "layers.1.feed_forward.w1.kernel (3 of" in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------- model arguments


def test_empty_npz_weights_are_one_line(run_dir, tmp_path, capsys) -> None:
    path = _copy(Path(run_dir), tmp_path / "empty")
    (path / "model.npz").write_bytes(b"")
    assert main(["prior", f"e={path}", "--out", str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert f"model 'e={path}'" in err and f"{path}/model.npz: the file is empty" in err


def test_cut_npz_weights_are_one_line(run_dir, tmp_path, capsys) -> None:
    path = _copy(Path(run_dir), tmp_path / "cut")
    weights = path / "model.npz"
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["prior", str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"{weights}: not a .npz archive" in _error(capsys)


def test_workdir_without_checkpoints_or_step(workdir, tmp_path, capsys) -> None:
    empty = tmp_path / "fresh"
    (empty / "checkpoints").mkdir(parents=True)
    assert main(["prior", str(empty), "--out", str(tmp_path / "out")]) == 2
    assert "holds no complete checkpoint; train the run first" in _error(capsys)
    assert main(["prior", f"{workdir}@7", "--out", str(tmp_path / "out")]) == 2
    assert f"model '{workdir}@7': no checkpoint at step 7 (steps: [3])" in _error(capsys)


@pytest.mark.parametrize("damaged", ["state/ocdbt.process_0/d", "state/manifest.ocdbt", "config"])
def test_a_damaged_checkpoint_is_named(workdir, tmp_path, capsys, damaged) -> None:
    path = _copy(workdir, tmp_path / "run")
    target = path / "checkpoints" / "3" / damaged
    for file in [target] if target.is_file() else sorted(target.rglob("*")):
        if file.is_file():
            file.write_bytes(b"")
    assert main(["prior", f"m={path}", "--out", str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert f"model 'm={path}': checkpoint {path}/checkpoints/3 cannot be read (" in err
    assert "damaged or incomplete" in err
    assert (path / "checkpoints" / "3").is_dir()  # never removed


def test_a_checkpoint_whose_values_changed_is_refused(workdir, tmp_path, capsys) -> None:
    """Values that still decode, into finite numbers, differ from the saved checksums."""
    path = _copy(workdir, tmp_path / "run")
    shift_floats(str(path / "checkpoints" / "3"))
    assert main(["prior", f"m={path}", "--out", str(tmp_path / "out")]) == 2
    err = _error(capsys)
    assert f"model 'm={path}': checkpoint {path}/checkpoints/3 cannot be read (" in err
    assert "differs from the checksum saved with it" in err


def test_a_damaged_checkpoint_prints_no_traceback(workdir, tmp_path) -> None:
    """TensorStore finishes its reads after the failure: no traceback may follow the line."""
    path = _copy(workdir, tmp_path / "run")
    for file in (path / "checkpoints" / "3" / "state" / "d").iterdir():
        file.write_bytes(b"")
    argv = [sys.executable, "-m", "bam_eval", "prior", str(path), "--out", str(tmp_path / "out")]
    result = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "Event loop is closed" not in result.stderr
    assert f"checkpoint {path}/checkpoints/3 cannot be read" in result.stderr


# ------------------------------------------------------------------------ results files

MALFORMED = {
    "not json": "{'runs':",
    "a list": "[1, 2]",
    "runs not an object": '{"runs": [1]}',
    "a run without entries": '{"runs": {"k": 5}}',
    "an entry not an object": '{"runs": {"k": {"entries": {"300": 1}}}}',
    "an entry without accuracy": '{"runs": {"k": {"entries": {"300": {"target_length": 300}}}}}',
}


@pytest.mark.parametrize("content", MALFORMED.values(), ids=MALFORMED.keys())
def test_a_malformed_results_file_is_refused_and_kept(run_dir, tmp_path, capsys, content):
    out = tmp_path / "out"
    results = out / "bam" / "passkey.json"
    results.parent.mkdir(parents=True)
    results.write_text(content)
    argv = f"passkey {run_dir} --tokenizer byte --lengths 300 --samples 1 --out {out} --quiet"
    assert main(argv.split()) == 2
    err = _error(capsys)
    assert f"results file {results} is malformed" in err and "--out" in err
    assert results.read_text() == content
    assert os.listdir(results.parent) == ["passkey.json"]


def test_a_results_file_that_is_a_folder(tmp_path) -> None:
    (tmp_path / "passkey.json").mkdir()
    with pytest.raises(ValueError, match=r"passkey.json cannot be read: Is a directory"):
        ResultStore(str(tmp_path / "passkey.json"))


def test_out_that_is_a_file_is_refused_up_front(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out.txt"
    out.write_text("keep me")
    argv = ["passkey", run_dir, "--tokenizer", "byte", "--lengths", "300", "--out", str(out)]
    assert main(argv) == 2
    assert f"--out '{out}' is a file" in _error(capsys)
    assert out.read_text() == "keep me"


def test_valid_results_still_load(tmp_path) -> None:
    path = tmp_path / "r.json"
    store = ResultStore(str(path), {"name": "m"}, entry_fields=("accuracy",))
    store.put({"seed": 0}, "300", {"accuracy": 0.5})
    again = ResultStore(str(path), entry_fields=("accuracy",))
    assert again.get({"seed": 0}, "300") == {"accuracy": 0.5, "invocation": 0}
    assert json.loads(path.read_text())["model"] == {"name": "m"}


def test_unretrieved_orbax_read_failures_are_not_logged() -> None:
    """A read that failed after the load had already failed is not reported again."""
    quiet_orphaned_checkpoint_reads()
    logger = logging.getLogger("asyncio")

    def record(message: str) -> logging.LogRecord:
        return logger.makeRecord("asyncio", logging.ERROR, __file__, 1, message, (), None)

    orphaned = record("Task exception was never retrieved\nfuture: <Task coro=<orbax read>>")
    other_task = record("Task exception was never retrieved\nfuture: <Task coro=<mine>>")
    assert not all(f.filter(orphaned) for f in logger.filters)
    assert all(f.filter(other_task) for f in logger.filters)
