"""Checkpoints with orbax: asynchronous, atomic (written to a temporary directory and renamed
when complete), keeping the last `keep_last` plus every `keep_every`-th step, plus the newest
step known to be good (see `Checkpointer.mark_good`).

Each checkpoint `WORKDIR/checkpoints/STEP/` holds
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

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import re
import sys
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit
from urllib.request import url2pathname

import grain
import jax
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from bam_jax.config import ModelConfig
from bam_jax.model import Transformer
from train.config import TrainConfig
from train.optim import make_optimizer
from train.state import ModelParts, TrainState, init_state

CHECKPOINT_DIR = "checkpoints"
_MAX_REASON_CHARS = 300
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

preservation = ocp.checkpoint_managers.preservation_policy


class IteratorSnapshot:
    """An iterator state captured when the save starts, so an asynchronous save cannot see
    the iterator after it has moved on."""

    def __init__(self, state: dict):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` is a URL (`scheme://...`); `run:1` or `a:b` are local names."""
    return _URL.match(os.fspath(location)) is not None


def run_path(location: str | os.PathLike) -> epath.Path:
    """A workdir (or a file in it) as an epath: URLs untouched, `file://` URLs and other
    locations as absolute local paths. ValueError for a scheme epath cannot write to."""
    text = os.fspath(location)
    if not text:
        raise ValueError("workdir: empty; expected a directory or a URL")
    if text.lower().startswith("file://"):
        return epath.Path(pathlib.Path(local_path_of_file_url(text, "workdir")))
    if not is_url(text):
        # Through pathlib, so that a local name holding "://" is never taken for a URL.
        return epath.Path(pathlib.Path(os.path.abspath(text)))
    try:
        return epath.Path(text)
    except KeyError:
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"workdir: {text!r} has the URL scheme {scheme}://, which etils.epath does not "
            "support; use gs://, s3://, az://, hf://, file:// or a local path"
        ) from None


def local_path_of_file_url(url: str, field: str) -> str:
    """The local path of a `file://` URL (`file:///tmp/x`, `file://localhost/tmp/x`)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(
            f"{field}: {url!r} is not a local file URL; expected file:///ABSOLUTE/PATH"
        )
    return url2pathname(parts.path)


def checkpoint_dir(workdir: str | os.PathLike) -> str:
    return os.fspath(run_path(workdir) / CHECKPOINT_DIR)


def error_summary(err: BaseException) -> str:
    """One line saying why a checkpoint failed to load. Orbax wraps tensorstore's message
    (which names the file and the damage) in an exception whose own text is a page of spec,
    so the innermost cause is the informative one."""
    seen = {id(err)}
    while (inner := _cause(err)) is not None and id(inner) not in seen:
        err = inner
        seen.add(id(err))
    lines = str(err).strip().splitlines()
    text = f"{type(err).__name__}: {lines[0] if lines else 'no message'}"
    return text if len(text) <= _MAX_REASON_CHARS else text[: _MAX_REASON_CHARS - 3] + "..."


def _cause(err: BaseException) -> BaseException | None:
    """What `err` was raised from, or during (`raise ... from None` hides the latter)."""
    if err.__cause__ is not None or err.__suppress_context__:
        return err.__cause__
    return err.__context__


def quiet_orphaned_checkpoint_reads() -> None:
    """After a checkpoint fails to load, TensorStore finishes the reads still in flight and
    hands them to Orbax's event loop, which is closed by then; each would print a traceback
    after the one-line error. Those, and only those, are dropped."""
    default_hook = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        default_hook(unraisable)

    sys.unraisablehook = hook


class CheckpointReadError(ValueError):
    """A checkpoint's files could not be read; the message names its directory and why."""


@contextlib.contextmanager
def explained_read_errors(step_dir: str) -> Iterator[None]:
    """Any failure inside becomes a one-line CheckpointReadError naming `step_dir`."""
    try:
        yield
    except Exception as err:  # orbax, tensorstore and json raise many types for one cause
        message = f"checkpoint: {step_dir} cannot be read: {error_summary(err)}"
        raise CheckpointReadError(message) from err


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


@contextlib.contextmanager
def _reader(workdir: str | os.PathLike) -> Iterator[ocp.CheckpointManager]:
    """A manager that only reads: it creates no directory."""
    options = ocp.CheckpointManagerOptions(create=False)
    manager = ocp.CheckpointManager(epath.Path(checkpoint_dir(workdir)), options=options)
    try:
        yield manager
    finally:
        manager.close()


def read_config(workdir: str | os.PathLike, step: int | None = None) -> tuple[TrainConfig, int]:
    """The config stored with a checkpoint (the latest when `step` is None) and its step."""
    with _reader(workdir) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise ValueError(
                f"workdir: no checkpoint{'' if step is None else f' at step {step}'} in "
                f"{checkpoint_dir(workdir)} (steps: {list(manager.all_steps())})"
            )
        with explained_read_errors(os.path.join(checkpoint_dir(workdir), str(step))):
            args = ocp.args.Composite(config=ocp.args.JsonRestore())
            return TrainConfig.from_dict(manager.restore(step, args=args)["config"]), step


def load_model(
    workdir: str | os.PathLike, step: int | None = None
) -> tuple[ModelConfig, Transformer]:
    """The model of a training run's checkpoint (latest when `step` is None), on one device."""
    cfg, step = read_config(workdir, step)
    parts, _, _ = ModelParts.from_config(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, parts.labels)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(functools.partial(init_state, cfg.model, parts, tx, cfg.seed))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    with (
        _reader(workdir) as manager,
        explained_read_errors(os.path.join(checkpoint_dir(workdir), str(step))),
    ):
        state: Any = manager.restore(step, args=args)["state"]
    return cfg.model, parts.merge(state.params, state.consts)
