"""Reading back the metrics a training run wrote."""

from __future__ import annotations

import json
import os
from typing import Any

from bam_jax.io.files import run_path
from bam_train.metrics import METRICS_FILE


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of `WORKDIR/metrics.jsonl`."""
    text = (run_path(workdir) / METRICS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def records_without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics records less the wall-clock time each record carries."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records]
