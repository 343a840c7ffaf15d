"""Running `bam-train` in a subprocess, as the signal and disk tests do."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

REPO = str(Path(__file__).resolve().parent.parent)


def metric_steps(workdir: str) -> list[int]:
    """The steps metrics.jsonl has recorded so far (none before it exists)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line)["step"] for line in f if line.strip()]


def micro_command(workdir: str, steps: int) -> list[str]:
    """bam-train on the micro preset, logging every step and never checkpointing on its own."""
    return [
        sys.executable,
        "-m",
        "bam_train",
        "--config=micro",
        f"--workdir={workdir}",
        f"--config.steps={steps}",
        "--config.log_every=1",
        "--config.checkpoint_every=100000",
    ]


def subprocess_environment(tmp_path: Path) -> dict[str, str]:
    """CPU only, this checkout importable, compilations cached under tmp_path."""
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": REPO,
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
