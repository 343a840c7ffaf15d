"""`bam-eval` end to end on a tiny exported reference run: results, figures, reuse, errors."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
from flax import nnx

from bam_eval import api
from bam_eval.cli import main, parse_count
from bam_eval.models import model_tokenizers, parse_model_arg
from bam_jax.config import ModelConfig
from bam_jax.model import Transformer
from bam_jax.reference_checkpoint import export_reference_checkpoint


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> str:
    config = ModelConfig.of_size(
        "nano",
        vocab_size=259,
        encoding="bam_ssmax",
        global_prior=False,
        prior_beta_init="linear",
        max_seq_len=64,
    )
    path = tmp_path_factory.mktemp("runs") / "bam"
    export_reference_checkpoint(Transformer(config, rngs=nnx.Rngs(0)), config, path, fmt="npz")
    return str(path)


def test_parse_model_and_counts() -> None:
    assert parse_model_arg("runs/a") == ("a", "runs/a", None)
    assert parse_model_arg("x=runs/a@120") == ("x", "runs/a", 120)
    assert parse_model_arg("runs/a@b/") == ("a@b", "runs/a@b", None)
    counts = [parse_count(t) for t in ("4096", "4k", "1.5m", "32_768")]
    assert counts == [4096, 4096, 1_572_864, 32_768]


def test_passkey_writes_results_and_figures_then_reuses(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    argv = (
        f"passkey m={run_dir} --tokenizer byte --lengths 300 --multiples 8 --samples 2 "
        f"--chunk-size 128 --out {out} --quiet"
    ).split()
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Passkey accuracy" in printed and "512 (8x)" in printed
    results = out / "m" / "passkey.json"
    data = json.loads(results.read_text())
    assert data["model"]["encoding"] == "bam_ssmax" and data["model"]["train_length"] == 64
    (run,) = data["runs"].values()
    assert sorted(run["entries"], key=int) == ["300", "512"]
    entry = run["entries"]["512"]
    assert len(entry["correct"]) == 2 and 0.0 <= entry["accuracy"] <= 1.0
    assert entry["seconds_per_sample"] > 0 and entry["multiple"] == 8.0
    assert (out / "passkey_accuracy_equidistant.png").stat().st_size > 0
    assert (out / "m" / "passkey_depth_equidistant.png").stat().st_size > 0
    before = os.stat(results).st_mtime_ns
    assert main(argv) == 0
    assert os.stat(results).st_mtime_ns == before  # nothing new computed or written


def test_passkey_results_follow_the_weights_not_the_path(tmp_path, capsys) -> None:
    config = ModelConfig.of_size("nano", vocab_size=259, encoding="bam_ssmax", max_seq_len=64)
    path, out = tmp_path / "run", tmp_path / "out"
    argv = f"passkey m={path} --tokenizer byte --lengths 300 --samples 2 --out {out} --quiet"
    for seed in (0, 1):  # a second model exported into the same folder
        export_reference_checkpoint(
            Transformer(config, rngs=nnx.Rngs(seed)), config, path, fmt="npz"
        )
        assert main(argv.split()) == 0
    runs = json.loads((out / "m" / "passkey.json").read_text())["runs"]
    checkpoints = {run["settings"]["checkpoint"] for run in runs.values()}
    assert len(checkpoints) == 2 and all(c.startswith(f"{path}#") for c in checkpoints)


def test_perplexity_and_prior(run_dir, tmp_path, capsys) -> None:
    text = tmp_path / "doc.txt"
    text.write_text("The grass is green. The sky is blue. " * 40)
    out = tmp_path / "out"
    argv = (
        f"perplexity {run_dir} --tokenizer byte --data {text} --seq-len 256 --window 64 "
        f"--sequences 2 --chunk-size 128 --out {out} --quiet"
    ).split()
    assert main(argv) == 0
    (run,) = json.loads((out / "bam" / "perplexity.json").read_text())["runs"].values()
    (entry,) = run["entries"].values()
    assert entry["positions"] == [64, 128, 192, 256] and len(entry["perplexity"]) == 4
    assert all(p > 1.0 for p in entry["perplexity"])
    assert (out / "perplexity.png").stat().st_size > 0

    assert main(["prior", run_dir, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "theta_beta" in printed and "retrieval" in printed
    (run,) = json.loads((out / "bam" / "prior.json").read_text())["runs"].values()
    table = run["entries"]["heads"]["table"]
    assert len(table) == 2 * 4  # micro: 2 layers x 4 heads, one prior per layer
    assert {r["class"] for r in table} == {"local", "retrieval"}  # linear beta from 0
    assert (out / "bam" / "prior.png").stat().st_size > 0


def test_clear_errors(run_dir, tmp_path, capsys) -> None:
    assert main(["passkey", str(tmp_path), "--lengths", "1k"]) == 2
    assert "neither a training workdir" in capsys.readouterr().err
    assert main(["passkey", str(tmp_path / "missing"), "--lengths", "1k"]) == 2
    assert "not a directory" in capsys.readouterr().err
    argv = ["passkey", run_dir, "--lengths", "100", "--tokenizer", "byte", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "below the passkey prompt's minimum" in capsys.readouterr().err
    argv = ["passkey", run_dir, "--lengths", "1k", "--out", str(tmp_path)]  # mistral: 32768 ids
    assert main(argv) == 2
    assert "do not match" in capsys.readouterr().err


def test_retrieval_task_keeps_its_own_results_and_figures(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    common = f"m={run_dir} --tokenizer byte --lengths 700 --samples 2 --chunk-size 128 --quiet"
    assert main(f"passkey {common} --out {out}".split()) == 0
    argv = f"retrieval {common} --task multikey --needles 3 --out {out}".split()
    assert main(argv) == 0
    assert "multikey (3 needles) accuracy (%)" in capsys.readouterr().out
    runs = json.loads((out / "m" / "passkey.json").read_text())["runs"].values()
    tasks = sorted(run["settings"].get("task", "passkey") for run in runs)
    assert tasks == ["multikey", "passkey"]
    assert (out / "multikey3_accuracy_equidistant.png").stat().st_size > 0
    assert (out / "passkey_accuracy_equidistant.png").stat().st_size > 0
    argv = f"retrieval {common} --task vartrack --needles 1 --out {out}".split()
    assert main(argv) == 2
    assert "needles must be in [2, 10]" in capsys.readouterr().err


def test_run_passkey_returns_what_the_command_stores(run_dir, tmp_path) -> None:
    argv = (
        f"passkey m={run_dir} --tokenizer byte --lengths 300,400 --samples 3 "
        f"--chunk-size 128 --out {tmp_path / 'out'} --quiet --no-plots"
    ).split()
    assert main(argv) == 0
    (run,) = json.loads((tmp_path / "out" / "m" / "passkey.json").read_text())["runs"].values()
    evaluation = api.run_passkey(
        api.load_models([f"m={run_dir}"]),
        lengths=[300, 400],
        samples=3,
        tokenizer="byte",
        inference=api.InferenceSettings(chunk_size=128),
        progress=False,
    )
    entries = evaluation.results["m"]
    assert [e["target_length"] for e in entries] == [300, 400]
    for entry in entries:
        stored = run["entries"][str(entry["target_length"])]
        assert entry["accuracy"] == stored["accuracy"]
        assert entry["correct"] == stored["correct"]
    assert evaluation.figures == []


def test_runs_with_different_tokenizers_each_get_their_own() -> None:
    def run(name: str, tokenizer: str, vocab: int) -> SimpleNamespace:
        config = SimpleNamespace(vocab_size=vocab)
        return SimpleNamespace(name=name, tokenizer=tokenizer, config=config)

    models = [run("a", "byte", 300), run("b", "passkey:mistral", 128), run("c", "", 32_768)]
    chosen = model_tokenizers(models, None)
    assert {name: t.name for name, t in chosen.items()} == {
        "a": "byte",
        "b": "passkey:mistral",
        "c": "mistral",
    }
    with pytest.raises(ValueError, match="model 'b' was trained with tokenizer 'passkey:mistral'"):
        model_tokenizers(models, "byte")
