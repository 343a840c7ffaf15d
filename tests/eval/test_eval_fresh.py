"""`--fresh`: a results file started anew, without the earlier runs it held; the old file
stays as it was until the first new result replaces it."""

from __future__ import annotations

import json
from types import SimpleNamespace

from bam_eval import api, tables
from bam_eval.cli import main
from bam_eval.results import ResultStore
from bam_quickstart import run as quickstart


def _passkey(run_dir: str, out, *extra: str) -> int:
    argv = (
        f"passkey m={run_dir} --tokenizer byte --lengths 300 --samples 2 --out {out} --quiet "
        "--no-plots"
    )
    return main([*argv.split(), *extra])


def _run_settings(out) -> list[tuple[int, str]]:
    runs = json.loads((out / "m" / "passkey.json").read_text())["runs"].values()
    return sorted((run["settings"]["seed"], run["settings"]["sampling"]) for run in runs)


def test_fresh_drops_the_earlier_runs(run_dir, tmp_path) -> None:
    out = tmp_path / "out"
    assert _passkey(run_dir, out, "--seed", "0") == 0
    assert _passkey(run_dir, out, "--seed", "1") == 0
    assert _run_settings(out) == [(0, "equidistant"), (1, "equidistant")]
    assert _passkey(run_dir, out, "--seed", "2", "--fresh") == 0
    assert _run_settings(out) == [(2, "equidistant")]


def test_fresh_keeps_every_sampling_of_the_run(run_dir, tmp_path) -> None:
    out = tmp_path / "out"
    assert _passkey(run_dir, out, "--seed", "0") == 0
    assert _passkey(run_dir, out, "--seed", "1", "--sampling", "equidistant,end", "--fresh") == 0
    assert _run_settings(out) == [(1, "end"), (1, "equidistant")]


def test_a_fresh_run_that_fails_leaves_the_old_file(run_dir, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    assert _passkey(run_dir, out) == 0
    before = (out / "m" / "passkey.json").read_bytes()
    assert _passkey(run_dir, out, "--fresh", "--memory-gb", "0.000001") == 2
    assert "raise --memory-gb" in capsys.readouterr().err
    assert (out / "m" / "passkey.json").read_bytes() == before


def test_a_fresh_store_does_not_read_the_file(tmp_path) -> None:
    path = tmp_path / "passkey.json"
    path.write_text("not json")
    store = ResultStore(str(path), fresh=True)
    assert path.read_text() == "not json"
    store.put({"seed": 0}, "300", {"accuracy": 1.0})
    assert json.loads(path.read_text())["runs"] == {
        "seed=0": {"settings": {"seed": 0}, "entries": {"300": {"accuracy": 1.0, "invocation": 0}}}
    }


def test_quickstart_passes_fresh_on(tmp_path, monkeypatch) -> None:
    evaluated = {}

    def run_passkey(models, **options):
        evaluated.update(options)
        return api.Evaluation({"bam_ssmax": []})

    trained = SimpleNamespace(preempted=False, interrupted=False, step=1)
    monkeypatch.setattr(quickstart, "train", lambda cfg, workdir: trained)
    model = SimpleNamespace(name="bam_ssmax", train_length=64)
    monkeypatch.setattr(api, "load_models", lambda specs: [model])
    monkeypatch.setattr(api, "run_passkey", run_passkey)
    monkeypatch.setattr(tables, "passkey_table", lambda results, lengths: "")
    assert quickstart.main(["--out", str(tmp_path), "--fresh", "--no-plots"]) == 0
    assert evaluated["fresh"] is True
