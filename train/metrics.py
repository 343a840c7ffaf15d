"""Metrics: `WORKDIR/metrics.jsonl` (one JSON object per line), TensorBoard event files under
`WORKDIR/tensorboard`, a progress bar, and model FLOPs utilisation where the device's peak is
known.

A resumed run replays the steps after its checkpoint, so the records of those steps are
dropped from `metrics.jsonl` when it starts; a `metrics.jsonl` deleted or replaced while the
run writes is opened again."""

from __future__ import annotations

import json
import os
from typing import IO, Any

import jax
import tqdm

from bam_jax.config import ModelConfig

# Dense bfloat16 peak FLOP/s per device, by `device_kind` prefix.
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def device_peak_flops(device: jax.Device) -> float | None:
    kind = getattr(device, "device_kind", "")
    for prefix, peak in sorted(PEAK_FLOPS.items(), key=lambda kv: -len(kv[0])):
        if kind.startswith(prefix):
            return peak
    return None


def train_flops_per_token(config: ModelConfig, n_params: int) -> float:
    """Forward + backward FLOPs per token: 6 per weight plus causal attention scores."""
    embedding = config.vocab_size * config.dim
    attention = 6 * config.n_layers * config.max_seq_len * config.dim
    return 6.0 * (n_params - embedding) + attention


class MetricsWriter:
    """Writes on process 0 only; the other processes get a writer that does nothing."""

    def __init__(self, workdir: str, *, total_steps: int, start_step: int, progress_bar: bool):
        self.enabled = jax.process_index() == 0
        self._jsonl = None
        self._tb = None
        self._bar = None
        if not self.enabled:
            return
        self._path = os.path.join(workdir, "metrics.jsonl")
        keep_records_up_to(self._path, start_step)
        self._jsonl = _open_for_append(self._path)
        from tensorboardX import SummaryWriter

        self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        if progress_bar:
            self._bar = tqdm.tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True
            )

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **values}
        self._reopen_if_replaced()
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        for name, value in values.items():
            if isinstance(value, int | float):
                self._tb.add_scalar(name, value, step)
        if self._bar is not None and "loss" in values:
            postfix = {"loss": f"{values['loss']:.4f}"}
            if "tokens_per_s" in values:
                postfix["tok/s"] = f"{values['tokens_per_s']:.0f}"
            self._bar.set_postfix(postfix, refresh=False)

    def _reopen_if_replaced(self) -> None:
        try:
            same = os.path.samestat(os.stat(self._path), os.fstat(self._jsonl.fileno()))
        except FileNotFoundError:
            same = False
        if not same:
            self._jsonl.close()
            self._jsonl = _open_for_append(self._path)

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def print(self, message: str) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def _open_for_append(path: str) -> IO[str]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "a", encoding="utf-8")


def keep_records_up_to(path: str, step: int) -> None:
    """Drop the records of steps after `step` and unreadable lines (a write cut short) from
    a metrics file, atomically: the file is rewritten to a temporary name and renamed."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    steps = [_record_step(line) for line in lines]
    kept = [line for line, s in zip(lines, steps, strict=True) if s is not None and s <= step]
    if len(kept) == len(lines):
        return
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as f:
        f.writelines(line + "\n" for line in kept)
    os.replace(temporary, path)


def _record_step(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All records of `WORKDIR/metrics.jsonl`."""
    with open(os.path.join(workdir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
