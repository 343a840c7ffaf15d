"""Checkpoints with orbax: asynchronous, atomic (written to a temporary directory and renamed
when complete), keeping the last `keep_last` plus every `keep_every`-th step, plus the newest
step known to be good (see `Checkpointer.mark_good`).

Each checkpoint `WORKDIR/checkpoints/STEP/` holds (and `bam_jax.io.checkpoints` reads)
  state/      the TrainState (step, params, consts, optimizer state), sharded arrays
  data/       the grain iterator state, one JSON file per process
  config/     the resolved TrainConfig as JSON
  checksums/  a checksum of every array of state/ (JSON), checked when it is restored

A checkpoint that cannot be used is never deleted: `Checkpointer.set_aside` renames it to
`STEP.REASON` (orbax ignores names that are not a step number). A checkpoint is written in
`STEP.orbax-checkpoint-tmp` and renamed when complete; such unfinished folders, left by a
save that failed or a process that was killed, are removed when the next run starts. A save
that fails on a full disk stops the run with a `DiskFullError` saying how much space a
checkpoint needs.

WORKDIR may be a URL of any scheme etils.epath supports (gs://, s3://, ...), passed to orbax
untouched; `file://` URLs and everything else are local paths. The data position saved with
a checkpoint is the number of global batches read, the same on every process, so a
checkpoint restores on another mesh and on another number of processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import logging
import os
import shutil
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bam_configs.training import TrainConfig
from bam_jax.io.checkpoints import (
    CHECKSUMS_ITEM,
    array_checksums,
    checkpoint_dir,
    explained_read_errors,
    read_checksums,
    read_run_config,
    verify_checksums,
)
from bam_jax.io.files import is_url
from bam_train.state import TrainState

preservation = ocp.checkpoint_managers.preservation_policy
# How tensorstore reports a full disk; orbax raises it as a ValueError carrying this text.
FULL_DISK_TEXTS = ("No space left on device", "[os_error_code='28']")


class DiskFullError(RuntimeError):
    """A write failed because the disk is full; the message says where and what to do."""


def is_disk_full(err: BaseException) -> bool:
    """Whether `err`, or an error it was raised from or during, reports a full disk."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno == errno.ENOSPC:
            return True
        if _mentions_full_disk(str(current)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _mentions_full_disk(text: str) -> bool:
    return any(marker in text for marker in FULL_DISK_TEXTS)


class _FullDiskReports(logging.Filter):
    """Drops what orbax and asyncio log, with tracebacks, about writes that failed on a full
    disk: the run stops with one line saying so instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        full = _mentions_full_disk(record.getMessage()) or (
            error is not None and is_disk_full(error)
        )
        return not full


def quiet_full_disk_reports() -> None:
    """Keep orbax's and asyncio's logs of full-disk write failures out of the output."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _FullDiskReports) for f in logger.filters):
            logger.addFilter(_FullDiskReports())


@contextlib.contextmanager
def full_disk_stops_the_run(workdir: str) -> Iterator[None]:
    """A full disk met by any write inside (config, metrics, events) becomes one
    DiskFullError naming the file."""
    try:
        yield
    except DiskFullError:
        raise
    except Exception as err:
        if not is_disk_full(err):
            raise
        where = getattr(err, "filename", None) or workdir
        raise DiskFullError(
            f"disk full: no space left to write {where}; free space and run again"
        ) from None


def readable_size(n_bytes: int) -> str:
    if n_bytes < 2**30:
        return f"{n_bytes / 2**20:,.1f} MiB"
    return f"{n_bytes / 2**30:,.2f} GiB"


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
            cleanup_tmp_directories=True,
        )
        self.manager = ocp.CheckpointManager(epath.Path(self.directory), options=options)
        self._saving_step: int | None = None
        self._state_bytes = 0
        self._failed = False

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def step_dir(self, step: int) -> str:
        return os.fspath(epath.Path(self.directory) / str(step))

    def save(
        self, step: int, state: TrainState, data_state: dict, config: dict, force: bool = False
    ) -> bool:
        self.wait()  # a save still in flight fails under its own step
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(IteratorSnapshot(data_state)),
            config=ocp.args.JsonSave(config),
            **{CHECKSUMS_ITEM: ocp.args.JsonSave(array_checksums(state))},
        )
        self._saving_step = step
        self._state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state))
        with self._full_disk_explained():
            return self.manager.save(step, args=args, force=force)

    def read_config(self, step: int) -> TrainConfig:
        """The config saved at `step`; CheckpointReadError if it cannot be read."""
        args = ocp.args.Composite(config=ocp.args.JsonRestore())
        with explained_read_errors(self.step_dir(step)):
            return TrainConfig.from_dict(self.manager.restore(step, args=args)["config"])

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
        """State (with the shardings of `abstract_state`, on any mesh) and the data iterator
        state (written by any number of processes); CheckpointReadError if they cannot be
        read or the state differs from its saved checksums."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        with explained_read_errors(self.step_dir(step)):
            state = self.manager.restore(step, args=args)["state"]
            checksums = read_checksums(self.manager, step, self.step_dir(step))
            if checksums is not None:
                verify_checksums(state, checksums)
            data_state = read_data_state(epath.Path(self.step_dir(step)) / "data")
        return state, data_state

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
        with self._full_disk_explained():
            self.manager.wait_until_finished()

    def close(self) -> None:
        if self._failed:
            # The failure was reported; closing meets the same failure again.
            with contextlib.suppress(Exception):
                self.manager.close()
            return
        self.wait()
        self.manager.close()

    @contextlib.contextmanager
    def _full_disk_explained(self) -> Iterator[None]:
        try:
            yield
        except Exception as err:
            if not is_disk_full(err):
                raise
            self._failed = True
            # The writes the failure cancelled leave coroutines that never ran; Python warns
            # about each when it collects them.
            warnings.filterwarnings(
                "ignore", message="coroutine .* was never awaited", category=RuntimeWarning
            )
            raise DiskFullError(self._full_disk_message()) from None

    def _full_disk_message(self) -> str:
        """Where the disk is full, how much a checkpoint needs (the size of the newest one,
        or else the state's bytes), what is free, and where the rerun starts."""
        complete = sorted(ocp.utils.checkpoint_steps(self.directory))
        needed = _folder_bytes(self.step_dir(complete[-1])) if complete else 0
        needed = needed or self._state_bytes
        space, advice = f"a checkpoint needs about {readable_size(needed)}", "free space"
        if not is_url(self.directory):
            free = shutil.disk_usage(self.directory).free
            space += f", {readable_size(free)} free"
            if needed > free:
                advice = f"free at least {readable_size(needed - free)}"
        resume = (
            f"the rerun resumes from step {complete[-1]}"
            if complete
            else "no checkpoint is complete yet; the rerun starts from step 0"
        )
        return (
            f"disk full: no space left in {self.directory} while saving step "
            f"{self._saving_step} ({space}); {advice} and run again: {resume}"
        )


def _folder_bytes(directory: str) -> int:
    """The bytes of the files under a local folder (0 for a URL)."""
    if is_url(directory):
        return 0
    return sum(
        os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(directory)
        for name in names
    )


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
