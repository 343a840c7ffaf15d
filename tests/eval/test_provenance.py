"""Every results file the commands write says what produced it: the model's training config
and fingerprint, the code version, the machine, the command line and the wall time."""

from __future__ import annotations

import json
import re

import pytest

from bam_configs.presets import preset
from bam_eval.cli import main as bam_eval
from bam_train.loop import train
from bam_train.metrics import read_launches

CODE_FIELDS = {"package", "version", "commit", "dirty"}
MACHINE_FIELDS = {"cpu", "cores", "platform", "accelerator", "float32_matmul_gflops"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("run") / "micro")
    cfg = preset("micro").replace(steps=2, checkpoint_every=2, progress_bar=False)
    train(cfg, path)
    return path


def _check_provenance(record: dict) -> None:
    assert set(record["code"]) >= CODE_FIELDS and record["code"]["version"]
    commit = record["code"]["commit"]
    assert commit is None or re.fullmatch(r"[0-9a-f]{40}", commit)
    assert commit is None or isinstance(record["code"]["dirty"], bool)
    assert set(record["machine"]) >= MACHINE_FIELDS
    assert record["machine"]["float32_matmul_gflops"] > 0 and record["machine"]["cores"] >= 1
    assert record["command"] and record["started"]


def test_training_records_each_launch_and_its_end(workdir):
    launch, end = read_launches(workdir)
    assert launch["event"] == "launch" and (launch["start_step"], launch["steps"]) == (0, 2)
    _check_provenance(launch)
    assert end["event"] == "end" and end["step"] == 2 and end["wall_seconds"] > 0
    assert end["stopped_by"] is None and end["last_loss"] > 0


@pytest.mark.parametrize(
    ("task", "arguments"),
    [
        ("passkey", ["--lengths", "96", "--samples", "1"]),
        ("copy", ["--lengths", "96", "--samples", "2"]),
        ("perplexity", ["--data", "python-stdlib:held-out", "--seq-len", "64", "--window", "32"]),
        ("prior", []),
    ],
)
def test_every_results_file_carries_its_provenance(workdir, tmp_path, task, arguments):
    out = tmp_path / "out"
    assert bam_eval([task, f"m={workdir}", "--out", str(out), "--no-plots", *arguments]) == 0
    results = json.loads((out / "m" / f"{task}.json").read_text())
    model = results["model"]
    assert model["training"]["model"] == model["config"] and model["training"]["steps"] == 2
    assert re.fullmatch(r"[0-9a-f]{12}", model["fingerprint"])
    (invocation,) = results["invocations"]
    _check_provenance(invocation)
    assert invocation["wall_seconds"] > 0
    for run in results["runs"].values():
        assert all(entry["invocation"] == 0 for entry in run["entries"].values())


def test_the_learning_curve_scores_every_kept_checkpoint(workdir, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["curve", f"m={workdir}", "--out", str(out), "--samples", "2"]
    assert bam_eval(argv) == 0
    printed = capsys.readouterr().out
    assert "Learning curve of m" in printed and "copy 1x" in printed and "piece 1x" in printed
    results = json.loads((out / "m" / "curve.json").read_text())
    (run,) = results["runs"].values()
    assert sorted(run["entries"], key=int) == ["2"]
    point = run["entries"]["2"]
    assert point["tokens"] == 2 * 4 * 96 and set(point["passkey"]) == {"1x"}
    assert 0 <= point["copy_letters"]["1x"] <= 1 and 0 <= point["piece_letters"]["1x"] <= 1
    copy_runs = json.loads((out / "m" / "copy.json").read_text())["runs"].values()
    assert {r["settings"]["form"] for r in copy_runs} == {"program", "piece"}
    _check_provenance(results["invocations"][0])
    assert (out / "m" / "curve.png").stat().st_size > 0
