"""Reading a training run's checkpoints without the training code: the saved run config and
the model parameters alone.

A run keeps its checkpoints in `WORKDIR/checkpoints/STEP/`, each with a `state` item (the
training state: step, params, consts, optimizer state), a `data` item (the data iterator
position) and a `config` item (the run config as JSON). `load_params` restores only the
`params` and `consts` subtrees of `state`: no optimizer is built and its moments are never
read, so any optimizer setting in the saved config is irrelevant here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.io.files import run_path
from bam_jax.model import Transformer

CHECKPOINT_DIR = "checkpoints"
_MAX_REASON_CHARS = 300

PyTree = Any


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


@contextlib.contextmanager
def checkpoint_reader(workdir: str | os.PathLike) -> Iterator[ocp.CheckpointManager]:
    """A manager that only reads: it creates no directory."""
    options = ocp.CheckpointManagerOptions(create=False)
    manager = ocp.CheckpointManager(epath.Path(checkpoint_dir(workdir)), options=options)
    try:
        yield manager
    finally:
        manager.close()


def checkpoint_steps(workdir: str | os.PathLike) -> list[int]:
    """Steps of the complete checkpoints of a run, ascending (none: an empty list)."""
    return sorted(ocp.utils.checkpoint_steps(checkpoint_dir(workdir)))


def read_run_config(workdir: str | os.PathLike, step: int | None = None) -> tuple[dict, int]:
    """The run config saved with a checkpoint (the latest when `step` is None), as the JSON
    dict it was written as, and its step."""
    with checkpoint_reader(workdir) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise ValueError(
                f"workdir: no checkpoint{'' if step is None else f' at step {step}'} in "
                f"{checkpoint_dir(workdir)} (steps: {list(manager.all_steps())})"
            )
        with explained_read_errors(os.path.join(checkpoint_dir(workdir), str(step))):
            args = ocp.args.Composite(config=ocp.args.JsonRestore())
            return manager.restore(step, args=args)["config"], step


@dataclasses.dataclass(frozen=True)
class SavedParams:
    """The parameters of one checkpoint and what they belong to.

    params / consts: nested dicts of arrays (trainable parameters and the other variables),
    as the training state holds them; run_config: the saved run config (a JSON dict).
    """

    config: ModelConfig
    step: int
    params: PyTree
    consts: PyTree
    run_config: dict

    def model(self) -> Transformer:
        """A Transformer holding these parameters."""
        graphdef, params, consts = _abstract_split(self.config)
        nnx.replace_by_pure_dict(params, self.params)
        nnx.replace_by_pure_dict(consts, self.consts)
        return nnx.merge(graphdef, params, consts)


def _abstract_split(config: ModelConfig) -> tuple[nnx.GraphDef, nnx.State, nnx.State]:
    abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param, ...)


def load_params(workdir: str | os.PathLike, step: int | None = None) -> SavedParams:
    """The model parameters of a run's checkpoint (latest when `step` is None), on one device.

    Only the `params` and `consts` subtrees of the saved state are read. A checkpoint that
    cannot be read is a CheckpointReadError naming its directory and the cause.
    """
    run_config, step = read_run_config(workdir, step)
    config = ModelConfig.from_dict(run_config["model"])
    _, params, consts = _abstract_split(config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
        {"params": nnx.to_pure_dict(params), "consts": nnx.to_pure_dict(consts)},
    )
    restore = ocp.args.PyTreeRestore(
        item=target,
        restore_args=ocp.checkpoint_utils.construct_restore_args(target),
        partial_restore=True,
    )
    args = ocp.args.Composite(state=restore)
    with (
        checkpoint_reader(workdir) as manager,
        explained_read_errors(os.path.join(checkpoint_dir(workdir), str(step))),
    ):
        state = manager.restore(step, args=args)["state"]
    return SavedParams(config, step, state["params"], state["consts"], run_config)


def load_model(
    workdir: str | os.PathLike, step: int | None = None
) -> tuple[ModelConfig, Transformer]:
    """The model of a run's checkpoint (latest when `step` is None), on one device."""
    saved = load_params(workdir, step)
    return saved.config, saved.model()
