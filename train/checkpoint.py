"""Checkpoints with orbax: asynchronous, atomic (written to a temporary directory and renamed
when complete), keeping the last `keep_last` plus every `keep_every`-th step.

Each checkpoint `WORKDIR/checkpoints/STEP/` holds
  state/   the TrainState (step, params, consts, optimizer state), sharded arrays
  data/    the grain iterator state, one JSON file per process
  config/  the resolved TrainConfig as JSON
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from bam_jax.config import ModelConfig
from bam_jax.model import Transformer
from train.config import TrainConfig
from train.optim import make_optimizer
from train.state import ModelParts, TrainState, init_state

CHECKPOINT_DIR = "checkpoints"


class IteratorSnapshot:
    """An iterator state captured when the save starts, so an asynchronous save cannot see
    the iterator after it has moved on."""

    def __init__(self, state: dict | None = None):
        self.state = state

    def get_state(self) -> bytes:
        return json.dumps(self.state).encode()

    def set_state(self, state: bytes) -> None:
        self.state = json.loads(state)

    def start_prefetch(self) -> None:
        """Part of the interface grain's restore calls; nothing to prefetch."""


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), CHECKPOINT_DIR)


class Checkpointer:
    def __init__(self, workdir: str, cfg: TrainConfig):
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep_last,
            keep_period=cfg.keep_every or None,
            enable_async_checkpointing=cfg.async_checkpoint,
            create=True,
        )
        self.manager = ocp.CheckpointManager(checkpoint_dir(workdir), options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(
        self, step: int, state: TrainState, data_state: dict, config: dict, force: bool = False
    ) -> bool:
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(IteratorSnapshot(data_state)),
            config=ocp.args.JsonSave(config),
        )
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: TrainState) -> tuple[TrainState, dict]:
        """State (with the shardings of `abstract_state`) and the data iterator state."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state),
                data=grain.checkpoint.CheckpointRestore(IteratorSnapshot()),
            ),
        )
        return restored["state"], restored["data"].state

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def read_config(workdir: str, step: int | None = None) -> tuple[TrainConfig, int]:
    """The config stored with a checkpoint (the latest when `step` is None) and its step."""
    manager = ocp.CheckpointManager(checkpoint_dir(workdir))
    step = manager.latest_step() if step is None else step
    if step is None or step not in manager.all_steps():
        raise ValueError(
            f"workdir: no checkpoint{'' if step is None else f' at step {step}'} in "
            f"{checkpoint_dir(workdir)} (steps: {list(manager.all_steps())})"
        )
    config = manager.restore(step, args=ocp.args.Composite(config=ocp.args.JsonRestore()))
    manager.close()
    return TrainConfig.from_dict(config["config"]), step


def load_model(workdir: str, step: int | None = None) -> tuple[ModelConfig, Transformer]:
    """The model of a training run's checkpoint (latest when `step` is None), on one device."""
    cfg, step = read_config(workdir, step)
    parts, _, _ = ModelParts.from_config(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, parts.labels)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    abstract = jax.eval_shape(functools.partial(init_state, cfg.model, parts, tx, cfg.seed))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), abstract
    )
    manager = ocp.CheckpointManager(checkpoint_dir(workdir))
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    )
    manager.close()
    state: Any = restored["state"]
    return cfg.model, parts.merge(state.params, state.consts)
