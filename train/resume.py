"""The run directory and resuming from its newest checkpoint that restores."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
from etils import epath

from bam_configs.training import TrainConfig
from bam_jax.io.checkpoints import (
    CheckpointReadError,
    checkpoint_dir,
    error_summary,
    explained_read_errors,
)
from bam_jax.io.files import is_url, run_path
from bam_train.checkpoint import Checkpointer
from bam_train.optim import make_optimizer
from bam_train.setup import Setup
from bam_train.state import TrainState
from bam_train.step import all_finite


def prepare_workdir(workdir: str) -> str:
    """The run directory as every writer takes it (URLs untouched, local paths absolute),
    created if local; a ValueError says what is wrong with it."""
    path = run_path(workdir)
    if is_url(path):
        _check_remote_workdir(path)
        return os.fspath(path)
    local = os.fspath(path)
    for directory in (local, checkpoint_dir(local)):
        if os.path.exists(directory) and not os.path.isdir(directory):
            raise ValueError(f"workdir: {directory!r} is a file, expected a directory")
    try:
        os.makedirs(local, exist_ok=True)
    except OSError as err:
        raise ValueError(f"workdir: cannot create {local!r}: {err.strerror or err}") from None
    if not os.access(local, os.W_OK | os.X_OK):
        raise ValueError(f"workdir: {local!r} is not writable")
    return local


def _check_remote_workdir(path: epath.Path) -> None:
    """One look at a URL workdir, so that a missing client library or an unreachable bucket
    stops the run before it builds anything; writing is left to the first write."""
    try:
        is_file = path.exists() and not path.is_dir()
    except ImportError as err:
        raise ValueError(f"workdir: {os.fspath(path)!r} needs a client library: {err}") from None
    except Exception as err:  # each storage client raises its own types
        raise ValueError(
            f"workdir: cannot reach {os.fspath(path)!r}: {error_summary(err)}"
        ) from None
    if is_file:
        raise ValueError(f"workdir: {os.fspath(path)!r} is a file, expected a directory")


def resume_state(
    setup: Setup, checkpointer: Checkpointer, data: Any, workdir: str
) -> tuple[TrainState, int, list[str]]:
    """The state of the newest checkpoint that restores, its step and notes for the user
    (a fresh state at step 0 when there is no checkpoint); `data` is set to the position
    saved with it.

    Newer checkpoints that fail to restore are moved aside to `checkpoints/STEP.broken`,
    never deleted, so the run trains and saves their steps again; the notes say which were
    moved and why. When none restores nothing is moved and a ValueError lists them all.
    """
    failures: list[tuple[int, str]] = []
    for step in sorted(checkpointer.steps(), reverse=True):
        try:
            state = _restore(setup, checkpointer, step, data, workdir)
        except CheckpointReadError as err:
            failures.append((step, str(err)))
            continue
        notes = [
            f"{why}; moved it to {checkpointer.set_aside(broken, 'broken')} and resumed "
            f"from step {step}"
            for broken, why in failures
        ]
        return state, step, notes
    if failures:
        raise ValueError(
            f"workdir: no checkpoint in {checkpointer.directory} can be restored "
            f"({'; '.join(why for _, why in failures)}); move them out of "
            f"{checkpointer.directory} to train from step 0"
        )
    return setup.init(), 0, []


def _restore(
    setup: Setup, checkpointer: Checkpointer, step: int, data: Any, workdir: str
) -> TrainState:
    saved = checkpointer.read_config(step)
    _check_same_model(setup.cfg, saved, workdir)
    state, data_state = checkpointer.restore(step, _abstract_as_saved(setup, saved))
    if not bool(jax.jit(all_finite)(state)):
        raise CheckpointReadError(
            f"checkpoint: {checkpointer.step_dir(step)} cannot be read: it holds NaN or "
            "infinite values (a damaged file that still decodes)"
        )
    with explained_read_errors(checkpointer.step_dir(step)):
        data.set_state(data_state)
    opt_leaves = jax.tree.leaves(state.opt_state)
    opt_treedef = jax.tree.structure(setup.abstract_state.opt_state)
    return state.replace(opt_state=jax.tree.unflatten(opt_treedef, opt_leaves))


def _check_same_model(cfg: TrainConfig, saved: TrainConfig, workdir: str) -> None:
    """Resuming needs the model of the checkpoint; other fields (steps, lr, ...) may change."""
    if saved.model != cfg.model:
        old, new = saved.model.to_dict(), cfg.model.to_dict()
        changed = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
        raise ValueError(
            f"workdir: {workdir!r} holds checkpoints of another model (changed model fields, "
            f"saved -> requested: {changed}); use a new workdir"
        )


def _abstract_as_saved(setup: Setup, saved: TrainConfig) -> TrainState:
    """The sharded abstract state in the tree structure of a checkpoint written with config
    `saved`. Turning `optim.clip_norm` or `optim.weight_decay` on or off adds or removes
    optimizer stages that hold no arrays: the arrays, and their order, stay the same."""
    abstract = setup.abstract_sharded_state()
    if saved.optim == setup.cfg.optim:
        return abstract
    saved_tx = make_optimizer(saved.optim, setup.parts.labels)
    saved_treedef = jax.tree.structure(jax.eval_shape(saved_tx.init, setup.abstract_state.params))
    leaves = jax.tree.leaves(abstract.opt_state)
    if saved_treedef.num_leaves != len(leaves):
        old, new = dataclasses.asdict(saved.optim), dataclasses.asdict(setup.cfg.optim)
        changed = {k: (old[k], new[k]) for k in new if old[k] != new[k]}
        raise ValueError(
            f"optim: the optimizer state in the checkpoints does not fit the requested "
            f"optimizer (changed optim fields, saved -> requested: {changed}); restore "
            f"those values or use a new workdir"
        )
    return abstract.replace(opt_state=jax.tree.unflatten(saved_treedef, leaves))
