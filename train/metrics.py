"""Metrics: `WORKDIR/metrics.jsonl` (one JSON object per line, each with the wall-clock `time`
it was written), TensorBoard event files under `WORKDIR/tensorboard`, progress (a bar on a
terminal, else one line per logged step on the "bam.train" logger), and model FLOPs
utilisation where the device's peak is known. WORKDIR may be a URL (see
`bam_jax.io.files.run_path`).

A resumed run replays the steps after its checkpoint, so the records of those steps are
dropped from `metrics.jsonl` when it starts, and its TensorBoard event file opens with a
purge at the first replayed step (a SessionLog.START there, after which TensorBoard drops
the earlier files' events of that step and later ones); a `metrics.jsonl` deleted or
replaced while the run writes is opened again."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import IO, Any

import jax
import tqdm
from etils import epath

from bam_jax.config import ModelConfig
from bam_jax.io.files import is_url, run_path, write_text_atomically
from bam_jax.provenance import provenance

METRICS_FILE = "metrics.jsonl"
# One record per launch of a run and one when it ends: what produced its metrics and
# checkpoints (bam_jax.provenance), the steps it ran and its wall time.
LAUNCHES_FILE = "launches.jsonl"
logger = logging.getLogger("bam.train")

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


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of `WORKDIR/metrics.jsonl`, in the order written."""
    text = (run_path(workdir) / METRICS_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def append_launch_record(workdir: str | os.PathLike, record: dict[str, Any]) -> None:
    """Add one JSON line to `WORKDIR/launches.jsonl` (rewritten whole, atomically)."""
    path = run_path(workdir) / LAUNCHES_FILE
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    write_text_atomically(path, before + json.dumps(record) + "\n")


def launch_record(start_step: int, steps: int) -> dict[str, Any]:
    return {"event": "launch", "start_step": start_step, "steps": steps, **provenance()}


def end_record(
    step: int, last_loss: float | None, stopped_by: str | None, started: float
) -> dict[str, Any]:
    """The record of a launch that ends at `step`; `started` is its `time.perf_counter()`."""
    return {
        "event": "end",
        "step": step,
        "last_loss": last_loss,
        "stopped_by": stopped_by,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }


def read_launches(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """Every record of `WORKDIR/launches.jsonl`, in the order written."""
    text = (run_path(workdir) / LAUNCHES_FILE).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


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
    """Writes on process 0 only; the other processes get a writer that does nothing.

    Progress shows as a bar when `progress_bar` is set and standard error is a terminal, and
    otherwise as one log line per record (step, loss, val_loss, tokens/s, ETA).
    """

    def __init__(
        self, workdir: str | os.PathLike, *, total_steps: int, start_step: int, progress_bar: bool
    ):
        self.enabled = jax.process_index() == 0
        self.total_steps = total_steps
        self._jsonl: _LocalLines | _RewrittenLines | None = None
        self._tb = None
        self._bar = None
        if not self.enabled:
            return
        run = run_path(workdir)
        keep_records_up_to(run / METRICS_FILE, start_step)
        self._jsonl = _RewrittenLines(run) if is_url(run) else _LocalLines(run)
        self._tb, notice = _tensorboard_writer(run / "tensorboard", first_step=start_step + 1)
        if progress_bar and sys.stderr.isatty():
            self._bar = tqdm.tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True
            )
        if notice:
            self.print(notice)

    def write(self, step: int, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._jsonl.append(
            json.dumps({"step": step, "time": round(time.time(), 3), **values}) + "\n"
        )
        if self._tb is not None:
            for name, value in values.items():
                if isinstance(value, int | float):
                    self._tb.add_scalar(name, value, step)
        if self._bar is not None:
            self._bar.set_postfix(_postfix(values), refresh=False)
        else:
            logger.info(progress_line(step, self.total_steps, values))

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


def _postfix(values: dict[str, Any]) -> dict[str, str]:
    shown = {"loss": "{:.4f}", "val_loss": "{:.4f}", "tokens_per_s": "{:.0f}"}
    return {name: form.format(values[name]) for name, form in shown.items() if name in values}


def progress_line(step: int, total_steps: int, values: dict[str, Any]) -> str:
    """`step 400/5000 loss 0.7759 val_loss 0.7012 tokens/s 15604 eta 20m05s`, with the
    fields the record has."""
    parts = [f"step {step}/{total_steps}"]
    for name in ("loss", "val_loss"):
        if name in values:
            parts.append(f"{name} {values[name]:.4f}")
    if "tokens_per_s" in values:
        parts.append(f"tokens/s {values['tokens_per_s']:.0f}")
    if "step_time_s" in values:
        parts.append(f"eta {_duration((total_steps - step) * values['step_time_s'])}")
    return " ".join(parts)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"


class _LocalLines:
    """`metrics.jsonl` on a local disk, appended to; opened again when it was deleted or
    replaced while the run writes."""

    def __init__(self, run: epath.Path):
        self._path = os.fspath(run / METRICS_FILE)
        self._file = _open_for_append(self._path)

    def append(self, line: str) -> None:
        self._reopen_if_replaced()
        self._file.write(line)
        self._file.flush()

    def _reopen_if_replaced(self) -> None:
        try:
            same = os.path.samestat(os.stat(self._path), os.fstat(self._file.fileno()))
        except FileNotFoundError:
            same = False
        if not same:
            self._file.close()
            self._file = _open_for_append(self._path)

    def close(self) -> None:
        self._file.close()


class _RewrittenLines:
    """`metrics.jsonl` under a URL: object stores cannot append, so each record writes the
    whole file again (its records from before the run started plus the new ones)."""

    def __init__(self, run: epath.Path):
        self._path = run / METRICS_FILE
        self._text = self._path.read_text(encoding="utf-8") if self._path.exists() else ""

    def append(self, line: str) -> None:
        self._text += line
        self._path.write_text(self._text, encoding="utf-8")

    def close(self) -> None:
        """Every record is already written."""


def _tensorboard_writer(logdir: epath.Path, first_step: int) -> tuple[Any, str | None]:
    """A TensorBoard writer for `logdir` whose events hide those of `first_step` and after
    written before (by a run that went past its last checkpoint), or None and a notice
    saying why there is none: tensorboardX writes local directories, and gs:// or s3:// URLs
    when google-cloud-storage or boto3 is installed."""
    from tensorboardX import SummaryWriter, record_writer

    location = os.fspath(logdir)
    if is_url(location):
        scheme = location.split("://", 1)[0]
        needs = {"gs": ("GCS_ENABLED", "google-cloud-storage"), "s3": ("S3_ENABLED", "boto3")}
        flag, package = needs.get(scheme, ("", ""))
        if not getattr(record_writer, flag, False):
            reason = f"install {package}" if package else f"it cannot write {scheme}:// URLs"
            return None, (
                f"metrics: no TensorBoard events under {location} (tensorboardX: {reason}); "
                f"{METRICS_FILE} has every record"
            )
    # Event files are named after the second they open in and read in name order: the
    # nanoseconds keep a restart within that second from writing over the last file.
    suffix = f".{time.time_ns()}"
    return SummaryWriter(location, purge_step=first_step, filename_suffix=suffix), None


def _open_for_append(path: str) -> IO[str]:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return open(path, "a", encoding="utf-8")


def keep_records_up_to(path: str | os.PathLike, step: int) -> None:
    """Drop the records of steps after `step` and unreadable lines (a write cut short) from
    a metrics file, atomically: the file is rewritten to a temporary name and renamed."""
    path = epath.Path(path)
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    steps = [_record_step(line) for line in lines]
    kept = [line for line, s in zip(lines, steps, strict=True) if s is not None and s <= step]
    ends_complete = not text or text.endswith("\n")
    if len(kept) == len(lines) and ends_complete:
        return
    write_text_atomically(path, "".join(line + "\n" for line in kept))


def _record_step(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) else None
