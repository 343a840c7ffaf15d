"""`bam-train --dry-run` is a full preflight, and every preset's validation set exists."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from bam_configs.presets import PAPER_CONTEXTS, PAPER_SIZES, TRAINING_PRESETS, preset
from bam_configs.training import DataConfig, validate_for_runtime
from bam_jax.tokenizers import get_tokenizer
from bam_train import dry_run as dry_run_module
from bam_train.data import BatchLayout, val_batches
from bam_train.dry_run import dry_run, format_dry_run
from bam_train.setup import build
from bam_train.shards import write_shards
from tests.support import REPO_ROOT, host_device_flags
from tests.support.byte_runs import short_run_config

REPO = str(REPO_ROOT)
PAPER_PRESETS = [f"{size}_{context}" for size in PAPER_SIZES for context in PAPER_CONTEXTS]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """Byte-level shards of about 4.2M tokens: more than the paper's held-out prefix."""
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghij klmnopqrst", np.uint8)
    texts = (rng.choice(letters, 100_000).tobytes().decode() for _ in range(42))
    path = str(tmp_path_factory.mktemp("data") / "shards")
    write_shards(texts, path, get_tokenizer("byte"))
    return path


def small_config(corpus: str, **changes):
    return short_run_config(corpus, **{**dict(eval_every=4, eval_batches=2), **changes})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(200):
            f.write(json.dumps({"text": f"document {i} " + "word " * (i % 17 + 3)}) + "\n")
    return str(path)


@pytest.mark.parametrize("name", sorted(TRAINING_PRESETS))
def test_every_preset_has_the_validation_batches_it_asks_for(name, shards):
    cfg = preset(name)
    if not cfg.eval_every:
        pytest.skip("no validation")
    if cfg.data.source == "shards":
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, path=shards))
        cfg = cfg.replace(model=cfg.model.replace(vocab_size=259))
    validate_for_runtime(cfg, n_devices=8)
    layout = BatchLayout(cfg.accum_steps, cfg.batch_size)
    batches = val_batches(cfg.data, cfg.seq_len, cfg.seed, layout, cfg.eval_batches)
    assert len(batches) == cfg.eval_batches
    assert all(b["inputs"].shape == (1, cfg.batch_size, cfg.seq_len) for b in batches)


def test_too_few_validation_rows_is_refused_before_the_start(corpus):
    cfg = small_config(corpus, eval_batches=3)
    with pytest.raises(
        ValueError, match=r"eval_batches: 3 validation batches .* data.val_rows >= 12, got 8"
    ):
        validate_for_runtime(cfg, n_devices=1)


def test_preflight_reads_the_data_and_compiles_both_steps(corpus):
    report = dry_run(build(small_config(corpus)))
    assert report["train_batch"] == (1, 4, 64)
    assert report["validation_batch"] == (2, 4, 64)
    assert report["eval_per_device_bytes"]["total"] > 0
    assert report["peak_bytes"] >= report["per_device_bytes"]["total"]
    text = format_dry_run(report)
    assert "eval step compile time" in text and "device memory unknown" in text


def test_preflight_fails_on_data_that_fails_at_step_one(corpus):
    cfg = small_config(
        corpus,
        eval_batches=1000,
        data=DataConfig(source="text", path=corpus, tokenizer="byte", val_rows=4000),
    )
    with pytest.raises(ValueError, match=r"data.path: .* not more than data.val_rows=4000"):
        dry_run(build(cfg))


def test_preflight_refuses_a_run_that_does_not_fit(corpus, monkeypatch):
    monkeypatch.setattr(dry_run_module, "device_memory_bytes", lambda: 2**20)
    expected = r"memory: one device needs .* at its peak .* has 1.0 MiB; raise mesh.fsdp"
    with pytest.raises(ValueError, match=expected):
        dry_run(build(small_config(corpus)))


def run_dry_run(args: list[str], timeout: int = 1200) -> subprocess.CompletedProcess:
    """`bam-train --dry-run` on 8 CPU devices laid out as (data 2, fsdp 4)."""
    env = {
        **os.environ,
        "XLA_FLAGS": host_device_flags(8),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
    }
    command = [sys.executable, "-m", "bam_train", "--dry-run", "--config.mesh.data=2"]
    return subprocess.run(
        [*command, "--config.mesh.fsdp=4", *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_preflight_on_a_2x4_mesh_of_8_devices():
    args = ["--config=micro", "--config.batch_size=8", "--config.eval_every=4"]
    proc = run_dry_run([*args, "--config.eval_batches=2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "{'data': 2, 'fsdp': 4, 'tensor': 1} on 8 devices" in proc.stdout
    assert "validation set: (2, 8, 96)" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", PAPER_PRESETS)
def test_every_paper_preset_passes_the_preflight(name):
    """Compiles on CPU take from about a minute (l6_512) to several (l24); a preset that does
    not fit is an `error: memory: ...` line, never a traceback."""
    proc = run_dry_run([f"--config={name}", "--config.data.source=passkey"])
    if proc.returncode == 2:
        assert proc.stderr.startswith("error: memory:"), proc.stderr[-3000:]
        return
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "per-device peak:" in proc.stdout and "Traceback" not in proc.stderr
