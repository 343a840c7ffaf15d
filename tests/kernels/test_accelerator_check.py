"""bench/accelerator_check/ on CPU: refusal, the gate's verdict, deadline, incremental table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from bam_jax.attention import reference_attention
from bench import pallas_bench
from bench.accelerator_check import cli, gate, report, settings, throughput
from tests.support import REPO_ROOT

ROOT = REPO_ROOT

SMOKE_SETTINGS = settings.make_settings(cli.parse_args(["--smoke"]))


def run_script(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", "bench.accelerator_check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="refusal is for machines without one")
@pytest.mark.parametrize("main", [cli.main, pallas_bench.main])
def test_refuses_without_an_accelerator_in_one_line(main, tmp_path: Path, capsys) -> None:
    out = tmp_path / "table.md"
    assert main(["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no GPU or TPU found") and "--smoke" in err
    assert len(err.splitlines()) == 1
    assert not out.exists()


def test_failed_gate_prints_fail_skips_kernel_rows_and_exits_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def checks(case, settings):
        yield "values float32", 1e-6, 2e-3
        yield "gradient dq", float("nan"), 1e-2  # NaN must fail, not slip through a comparison

    monkeypatch.setattr(gate, "gate_checks", checks)
    out = tmp_path / "table.md"
    argv = ["--smoke", "--sections", "gate", "throughput", "--lengths", "32"]
    rc = cli.main([*argv, "--variants", "pallas", "xla", "--out", str(out)])
    text = out.read_text()
    assert rc == 1
    assert "Gate: FAIL" in text
    assert "| nan | 0.01 | FAIL |" in text
    pallas_rows = [line for line in text.splitlines() if line.startswith("| pallas |")]
    assert len(pallas_rows) == 2
    assert all("skipped: the gate failed" in line for line in pallas_rows)
    xla_rows = [line for line in text.splitlines() if line.startswith("| xla |")]
    assert len(xla_rows) == 2 and not any("skipped" in line for line in xla_rows)


def test_gate_fails_a_kernel_that_ignores_the_prior(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def kernel_without_prior(q, k, v, spec, *, prior, backend, interpret, prior_table, **options):
        return reference_attention(q, k, v, spec, prior=None, **options)

    first_case = gate.gate_cases(smoke=True)[:1]
    monkeypatch.setattr(gate, "gate_cases", lambda smoke: first_case)
    monkeypatch.setattr(gate, "fused_attention", kernel_without_prior)
    table = report.Report(tmp_path / "table.md")
    assert not gate.run_gate(table, SMOKE_SETTINGS)
    text = table.path.read_text()
    assert "| values float32 |" in text and "Gate: FAIL" in text
    value_row = next(line for line in text.splitlines() if "| values float32 |" in line)
    assert value_row.endswith("| FAIL |")


def test_rows_that_would_pass_the_deadline_or_memory_are_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = report.Report(tmp_path / "table.md")
    deadline = report.Deadline(limit_s=1.0)
    run = throughput.ThroughputRun(table, SMOKE_SETTINGS, deadline, 1.0, True)
    run.measure("pallas", 64, backward=False)
    assert "skipped: would pass the deadline" in table.path.read_text()
    monkeypatch.setattr(throughput, "device_memory_bytes", lambda: 141e9)
    reason = run.skip_reason("xla", 131072, backward=True)
    assert reason is not None and reason.startswith("skipped: needs ~")


def test_table_is_on_disk_after_every_row(tmp_path: Path) -> None:
    table = report.Report(tmp_path / "sub" / "table.md")
    table.table("title", ("a", "b"))
    table.row("x", 1.0)
    assert table.path.read_text().splitlines()[-1] == "| x | 1 |"
    table.row("y|z", 2)
    assert table.path.read_text().splitlines()[-1] == "| y/z | 2 |"


def test_deadline_stops_the_run_and_leaves_the_table(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    result = run_script("--smoke", "--deadline-s", "6", "--out", str(out), timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    text = out.read_text()
    assert text.startswith("# Accelerator check: ")
    assert text.rstrip().endswith("STOPPED: the deadline of 6 s was reached.")


def test_default_out_path_names_device_and_date() -> None:
    import datetime

    path = settings.default_out_path(datetime.date(2026, 3, 1))
    assert path.parent == Path("results/accelerator_check")
    assert path.name.endswith("-2026-03-01.md") and " " not in path.name


def test_pallas_bench_is_a_front_end_of_the_check() -> None:
    compiled = pallas_bench.check_arguments(["--out", "x.md"])
    assert compiled[:4] == ["--sections", "gate", "throughput", "--variants"]
    assert "131072" in compiled and "--smoke" not in compiled
    interpret = pallas_bench.check_arguments(["--interpret"])
    assert "--smoke" in interpret and "--interpret" not in interpret
    args = cli.parse_args(pallas_bench.check_arguments(["--lengths", "4096"]))
    assert args.lengths == [4096] and args.sections == ["gate", "throughput"]


@pytest.mark.slow
def test_smoke_run_covers_every_section(tmp_path: Path) -> None:
    out = tmp_path / "table.md"
    sections = ("gate", "throughput", "training", "autotune")
    result = run_script("--smoke", "--sections", *sections, "--out", str(out), timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    text = out.read_text()
    assert "Gate: PASS" in text and "| FAIL |" not in text
    for section in ("## a. Gate", "## b. Attention throughput", "## c. Training step"):
        assert section in text
    assert "## d. Autotune" in text and "Fastest: `GPU_DEFAULTS[32] = GpuDefaults(64, 32" in text
    variants = ("pallas+ggd", "pallas", "pallas+ggd-table", "pallas+ggd-bwdblockwise")
    for variant in (*variants, "blockwise+ggd", "jax-mha", "xla"):
        rows = [line for line in text.splitlines() if line.startswith(f"| {variant} | 64 |")]
        assert len(rows) == 2 and not any("failed" in line for line in rows), rows
    blockwise_step = next(line for line in text.splitlines() if line.startswith("| blockwise |"))
    assert "M |" in blockwise_step and "skipped" not in blockwise_step
    assert "Finished in" in text
