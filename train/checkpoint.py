"""Checkpoints with orbax: asynchronous, atomic (written to a temporary directory and renamed
when complete), keeping the last `keep_last` plus every `keep_every`-th step, plus the newest
step known to be good (see `Checkpointer.mark_good`).

Each checkpoint `WORKDIR/checkpoints/STEP/` holds (and `bam_jax.io.checkpoints` reads)
  state/   the TrainState (step, params, consts, optimizer state), sharded arrays
  data/    the grain iterator state, one JSON file per process
  config/  the resolved TrainConfig as JSON

A checkpoint that cannot be used is never deleted: `Checkpointer.set_aside` renames it to
`STEP.REASON` (orbax ignores names that are not a step number).

WORKDIR may be a URL of any scheme etils.epath supports (gs://, s3://, ...), passed to orbax
untouched; `file://` URLs and everything else are local paths. The data position saved with
a checkpoint is the number of global batches read, the same on every process, so a
checkpoint restores on another mesh and on another number of processes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bam_jax.io.checkpoints import checkpoint_dir, explained_read_errors, read_run_config
from bam_train.config import TrainConfig
from bam_train.state import TrainState

preservation = ocp.checkpoint_managers.preservation_policy


class IteratorSnapshot:
    """An iterator state captured when the save starts, so an asynchronous save cannot see
    the iterator after it has moved on."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


@dataclasses.dataclass
class _KeepStep:
    """Orbax preservation policy keeping the checkpoint of one step (None: none)."""

    step: int | None = None

    def should_preserve(self, checkpoints: Sequence[Any], *, context: Any) -> list[bool]:
        return [info.step == self.step for info in checkpoints]


class Checkpointer:
    def __init__(self, workdir: str | os.PathLike, cfg: TrainConfig):
        self.directory = checkpoint_dir(workdir)
        self._keep_good = _KeepStep()
        policies = [preservation.LatestN(cfg.keep_last), self._keep_good]
        if cfg.keep_every:
            policies.append(preservation.EveryNSteps(cfg.keep_every))
        options = ocp.CheckpointManagerOptions(
            preservation_policy=preservation.AnyPreservationPolicy(policies),
            enable_async_checkpointing=cfg.async_checkpoint,
            create=True,
        )
        self.manager = ocp.CheckpointManager(epath.Path(self.directory), options=options)

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> str:
        return os.fspath(epath.Path(self.directory) / str(step))

    def save(
        self, step: int, state: TrainState, data_state: dict, config: dict, force: bool = False
    ) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(IteratorSnapshot(data_state)),
            config=ocp.args.JsonSave(config),
        )
        return self.manager.save(step, args=args, force=force)

    def read_config(self, step: int) -> TrainConfig:
        """The config saved at `step`; CheckpointReadError if it cannot be read."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        with explained_read_errors(self.step_dir(step)):
            return TrainConfig.from_dict(self.manager.restore(step, args=args)["config"])

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
        """State (with the shardings of `abstract_state`, on any mesh) and the data iterator
        state (written by any number of processes); CheckpointReadError if they cannot be
        read."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        with explained_read_errors(self.step_dir(step)):
            restored = self.manager.restore(step, args=args)
            data_state = read_data_state(epath.Path(self.step_dir(step)) / "data")
        return restored["state"], data_state

    def mark_good(self, step: int) -> None:
        """The state saved at `step` gave a finite loss: keep it even past `keep_last` until a
        newer checkpoint is known good, so a newer bad one never leaves none good."""
        if step in self.manager.all_steps():
            self._keep_good.step = step

    def set_aside(self, step: int, reason: str) -> str:
        """Rename checkpoint `step` to `STEP.REASON` (or `STEP.REASON-N` if taken) so that
        resuming and saving skip it; returns the new path."""
        self.wait()
        base = f"{self.step_dir(step)}.{reason}"
        target, n = base, 1
        while epath.Path(target).exists():
            n += 1
            target = f"{base}-{n}"
        if jax.process_index() == 0:
            epath.Path(self.step_dir(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint set aside {step}")
        self.manager.reload()
        if self._keep_good.step == step:
            self._keep_good.step = None
        return target

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def read_data_state(data_dir: epath.Path) -> dict:
    """The data iterator state saved in `data_dir` (one `process_I-of-N.json` per process).

    This process's own file when the process count is unchanged; otherwise the state every
    saving process wrote, which is the same on all of them (the number of global batches
    read), so a run may resume on another number of processes.
    """
    own = data_dir / f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    if own.exists():
        return json.loads(own.read_text())
    files = sorted(data_dir.glob("process_*-of-*.json"))
    states = {file.name: json.loads(file.read_text()) for file in files}
    distinct = {json.dumps(state, sort_keys=True) for state in states.values()}
    if len(distinct) != 1:
        found = ", ".join(f"{name}: {state}" for name, state in states.items()) or "no files"
        raise ValueError(
            f"{data_dir} does not hold one data position for all processes ({found}); "
            "resume with the process count that wrote it"
        )
    return next(iter(states.values()))


def read_config(workdir: str | os.PathLike, step: int | None = None) -> tuple[TrainConfig, int]:
    """The config stored with a checkpoint (the latest when `step` is None) and its step."""
    saved, step = read_run_config(workdir, step)
    return TrainConfig.from_dict(saved), step
