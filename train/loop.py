"""The training loop: `train` builds the run (bam_train.setup), resumes it (bam_train.resume)
and runs the jitted step (bam_train.step), with checkpoints, validation, metrics and stop
requests (bam_train.signals) around each step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Any

import jax

from bam_configs.training import TrainConfig
from bam_jax.io.files import run_path, write_text_atomically
from bam_jax.model_state import count_params
from bam_train.checkpoint import Checkpointer, full_disk_stops_the_run
from bam_train.data import train_iterator
from bam_train.metrics import (
    MetricsWriter,
    append_launch_record,
    device_peak_flops,
    end_record,
    launch_record,
    train_flops_per_token,
)
from bam_train.optim import learning_rates
from bam_train.resume import prepare_workdir, resume_state
from bam_train.setup import Setup, build, run_summary, validation_set
from bam_train.signals import StopRequests
from bam_train.state import TrainState
from bam_train.step import (
    Batch,
    NonFiniteLossError,
)
from bam_train.workdir_lock import hold_workdir


@dataclasses.dataclass
class TrainResult:
    step: int
    state: TrainState
    last_loss: float | None
    preempted: bool = False  # stopped by SIGTERM, the current step saved
    interrupted: bool = False  # stopped by Ctrl-C (SIGINT), the current step saved

    @property
    def stopped_by(self) -> str | None:
        return "SIGTERM" if self.preempted else "SIGINT" if self.interrupted else None


def train(cfg: TrainConfig, workdir: str, *, stop_after: int | None = None) -> TrainResult:
    """Train to `cfg.steps` (or stop after `stop_after` steps, saving), resuming from the
    newest checkpoint in `workdir` that restores (see `resume_state`). A full disk stops the run
    with a `DiskFullError`; a workdir another live training holds is a `WorkdirInUseError`
    (bam_train.workdir_lock)."""
    workdir = prepare_workdir(workdir)
    with hold_workdir(workdir) as lock_note, full_disk_stops_the_run(workdir):
        return _train(cfg, workdir, stop_after, [lock_note] if lock_note else [])


def _train(
    cfg: TrainConfig, workdir: str, stop_after: int | None, lock_notes: list[str]
) -> TrainResult:
    setup = build(cfg)
    layout = setup.layout()
    data = train_iterator(cfg.data, cfg.seq_len, cfg.seed, layout)
    val = validation_set(setup, layout)
    with contextlib.closing(Checkpointer(workdir, cfg)) as checkpointer:
        state, start, notes = resume_state(setup, checkpointer, data, workdir)
        if jax.process_index() == 0:
            config_json = json.dumps(cfg.to_dict(), indent=2)
            write_text_atomically(run_path(workdir) / "config.json", config_json)
            append_launch_record(workdir, launch_record(start, cfg.steps))
        writer = MetricsWriter(
            workdir, total_steps=cfg.steps, start_step=start, progress_bar=cfg.progress_bar
        )
        with contextlib.closing(writer):
            writer.print(run_summary(setup, workdir))
            for note in lock_notes + notes:
                writer.print(note)
            if start:
                writer.print(f"resumed from step {start} in {workdir}")
            run = _Run(setup, workdir, data, val, checkpointer, writer)
            end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
            started = time.perf_counter()
            with StopRequests() as stop_requests:
                result = run.loop(state, start, end, stop_requests)
            if jax.process_index() == 0:
                end = end_record(result.step, result.last_loss, result.stopped_by, started)
                append_launch_record(workdir, end)
            return result


@dataclasses.dataclass
class _Run:
    """The loop of one `train` call and the bookkeeping around each step.

    Steps are dispatched without waiting for the device: their metrics stay on the device
    until a step that logs, validates, checkpoints or ends the run, where all of them are
    read back at once and checked in order. A non-finite step is so found at most
    `log_every` steps late, and always before a checkpoint is written, so a non-finite
    state is never saved.
    """

    setup: Setup
    workdir: str
    data: Any
    val: Batch | None
    checkpointer: Checkpointer
    writer: MetricsWriter
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    last_loss: float | None = None

    def loop(self, state: TrainState, step: int, end: int, stop_requests: StopRequests):
        cfg = self.setup.cfg
        profiler = _ProfilerWindow(cfg.profile_start, cfg.profile_steps, self.workdir)
        self._window_start, self._window_steps = time.perf_counter(), 0
        first = step + 1
        try:
            while step < end:
                profiler.before(step)
                batch = self.setup.global_batch(next(self.data))
                state, metrics = self.setup.train_step(state, batch, self.setup.step_values)
                step += 1
                profiler.after(step)
                if step == first:
                    self._restart_window_after(metrics)
                else:
                    self._window_steps += 1
                self._after_step(step, end, state, metrics)
                stop_signal = stop_requests.requested(step)
                if stop_signal is not None:
                    return self._save_and_stop(step, end, state, stop_signal)
        finally:
            profiler.close()
        self._flush(end)
        self._save_unless_saved(step, state)
        self.checkpointer.wait()
        return TrainResult(step, state, self.last_loss)

    def _save_and_stop(
        self, step: int, end: int, state: TrainState, stop_signal: str
    ) -> TrainResult:
        if stop_signal == "SIGINT":
            self.writer.print(f"Ctrl-C: saving step {step} (Ctrl-C again stops at once, unsaved)")
        self._flush(end)
        self._save_unless_saved(step, state)
        self.checkpointer.wait()
        if stop_signal == "SIGTERM":
            self.writer.print(f"SIGTERM: saved step {step} to {self.workdir}, exiting")
        return TrainResult(
            step,
            state,
            self.last_loss,
            preempted=stop_signal == "SIGTERM",
            interrupted=stop_signal == "SIGINT",
        )

    def _restart_window_after(self, metrics: dict) -> None:
        """Start timing once the first step, which compiles, has run."""
        jax.block_until_ready(metrics)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _after_step(self, step: int, end: int, state: TrainState, metrics: dict) -> None:
        """Check, log, validate and checkpoint after a step."""
        cfg = self.setup.cfg
        self.pending.append((step, metrics))
        validate = self.val is not None and step % cfg.eval_every == 0
        save = step % cfg.checkpoint_every == 0
        if validate or save or _logs(step, end, cfg.log_every):
            self._flush(end)
        if validate:
            started = time.perf_counter()
            self.writer.write(step, {"val_loss": self._validate(state)})
            self._window_start += time.perf_counter() - started
        self.writer.advance()
        if save:
            self._save(step, state)

    def _flush(self, end: int) -> None:
        """Read back the metrics of the steps not yet checked; check and log them in order."""
        pending, self.pending = self.pending, []
        values = jax.device_get([metrics for _, metrics in pending])
        for (step, _), metrics in zip(pending, values, strict=True):
            loss, grad_norm = float(metrics["loss"]), float(metrics["grad_norm"])
            self._check_finite(step, loss, grad_norm, bool(metrics["state_finite"]))
            self.last_loss = loss
            if _logs(step, end, self.setup.cfg.log_every):
                self._log(step, loss, grad_norm, metrics)

    def _save(self, step: int, state: TrainState, force: bool = False) -> None:
        config = self.setup.cfg.to_dict()
        self.checkpointer.save(step, state, self.data.get_state(), config, force=force)

    def _save_unless_saved(self, step: int, state: TrainState) -> None:
        if self.checkpointer.latest_step() != step:
            self._save(step, state, force=True)

    def _check_finite(self, step: int, loss: float, grad_norm: float, state_finite: bool) -> None:
        """Stop on a non-finite loss, gradient norm or updated state, leaving only checkpoints
        known to be good.

        A checkpoint is good when the loss and gradient norm computed from its parameters (by
        the step after it) are finite: parameters can be finite yet so large that the next
        loss or gradient overflows. So a non-finite loss or gradient norm at step `step`
        condemns the checkpoint of step `step - 1`, which is moved aside to
        `checkpoints/STEP.nonfinite` (never deleted); a non-finite updated state is never
        saved. Every checkpoint left is then one whose next step was finite.
        """
        if math.isfinite(loss) and math.isfinite(grad_norm):
            if state_finite:
                self.checkpointer.mark_good(step - 1)
                return
            cause = f"the update of step {step} made parameters or optimizer state non-finite"
            moved = ""
        else:
            cause = f"loss {loss}, grad norm {grad_norm} at step {step}"
            moved = self._set_aside_nonfinite(step - 1)
        latest = self.checkpointer.latest_step()
        if latest is None:
            resume = f"no good checkpoint is left in {self.workdir}; a new run starts from step 0"
        else:
            resume = f"the last good checkpoint is step {latest} in {self.workdir}"
        raise NonFiniteLossError(f"{cause}: training stopped; {resume}{moved}")

    def _set_aside_nonfinite(self, step: int) -> str:
        """Move the checkpoint of `step`, whose parameters gave a non-finite loss or gradient,
        out of the way of resuming; returns a note for the error message."""
        self.checkpointer.wait()
        if step not in self.checkpointer.steps():
            return ""
        path = self.checkpointer.set_aside(step, "nonfinite")
        return f" (checkpoint step {step}, whose parameters gave this, was moved to {path})"

    def _log(self, step: int, loss: float, grad_norm: float, metrics: dict) -> None:
        """Write the record of a log step.

        tokens_per_s, step_time_s and mfu are over the steps since the last record, leaving
        out the first step of a `train` call (it compiles) and the time spent validating; a
        record whose window holds no other step has none of them.
        """
        record = {
            "loss": loss,
            "grad_norm": grad_norm,
            **learning_rates(self.setup.step_values.schedule, step - 1),
            "trained_tokens": float(metrics["trained_tokens"]),
        }
        if self._window_steps:
            record.update(self._throughput(time.perf_counter() - self._window_start))
        self.writer.write(step, record)
        self._window_start, self._window_steps = time.perf_counter(), 0

    def _throughput(self, elapsed: float) -> dict[str, float]:
        cfg = self.setup.cfg
        tokens_per_step = cfg.accum_steps * cfg.batch_size * cfg.seq_len
        record = {
            "tokens_per_s": self._window_steps * tokens_per_step / elapsed,
            "step_time_s": elapsed / self._window_steps,
        }
        peak = device_peak_flops(jax.devices()[0])
        if peak is not None:
            n_params = count_params(self.setup.abstract_state.params)
            flops = train_flops_per_token(cfg.model, n_params) * tokens_per_step
            record["mfu"] = flops * self._window_steps / elapsed / (peak * jax.device_count())
        return record

    def _validate(self, state: TrainState) -> float:
        loss_sum, count = self.setup.eval_step(state.params, state.consts, self.val)
        return float(loss_sum) / max(float(count), 1.0)


def _logs(step: int, end: int, log_every: int) -> bool:
    return step % log_every == 0 or step == end


class _ProfilerWindow:
    """A jax.profiler trace over steps [start, start + steps) into WORKDIR/profile."""

    def __init__(self, start: int, steps: int, workdir: str):
        self.start, self.stop, self.workdir = start, start + steps, workdir
        self.active = False

    def before(self, step: int) -> None:
        if step == self.start and self.stop > self.start:
            jax.profiler.start_trace(os.path.join(self.workdir, "profile"))
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.stop:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
