"""What a run builds before it touches data: mesh, optimizer, shardings and jitted steps."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding

from bam_configs.training import TrainConfig, validate_for_runtime
from bam_jax.model import count_params
from bam_train.data import BatchLayout, loss_positions_per_row, val_batches
from bam_train.optim import make_optimizer
from bam_train.sharding import batch_sharding, local_rows, make_mesh, replicated
from bam_train.state import ModelParts, TrainState, init_state, state_shardings
from bam_train.step import Batch, make_eval_step, make_train_step


@dataclasses.dataclass
class Setup:
    """Everything a run needs before it touches data or parameters."""

    cfg: TrainConfig
    mesh: Mesh
    parts: ModelParts
    tx: optax.GradientTransformation
    abstract_state: TrainState
    shardings: TrainState
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    init: Callable

    @property
    def global_batch_shape(self) -> tuple[int, int, int]:
        return (self.cfg.accum_steps, self.cfg.batch_size, self.cfg.seq_len)

    def layout(self) -> BatchLayout:
        start, count = local_rows(self.batch_sharding, self.global_batch_shape)
        return BatchLayout(self.cfg.accum_steps, self.cfg.batch_size, start, count)

    def global_batch(self, local: Batch) -> Batch:
        """Device arrays of this process's [micro-batches, local rows, ...] arrays."""
        batch = self.cfg.batch_size
        return {
            k: jax.make_array_from_process_local_data(
                self.batch_sharding, np.asarray(v), (np.shape(v)[0], batch, *np.shape(v)[2:])
            )
            for k, v in local.items()
        }

    def abstract_batch(self) -> Batch:
        shape, sharding = self.global_batch_shape, self.batch_sharding
        batch = {
            k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
            for k in ("inputs", "targets", "segment_ids", "positions")
        }
        batch["loss_mask"] = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding)
        scored = loss_positions_per_row(self.cfg.data)
        if scored is not None:
            batch["loss_positions"] = jax.ShapeDtypeStruct(
                (*shape[:2], scored), jnp.int32, sharding=sharding
            )
        return batch

    def abstract_sharded_state(self) -> TrainState:
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.abstract_state,
            self.shardings,
        )


def build(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> Setup:
    """Validate against the runtime, then build mesh, optimizer, shardings and jitted steps
    (on `devices`, default all)."""
    devices = jax.devices() if devices is None else devices
    validate_for_runtime(cfg, len(devices), jax.process_count())
    mesh = make_mesh(cfg.mesh, devices)
    parts, _, _ = ModelParts.from_config(cfg.model)
    tx = make_optimizer(cfg.optim, cfg.steps, parts.labels)
    init_fn = functools.partial(init_state, cfg.model, parts, tx, cfg.seed)
    abstract_state = jax.eval_shape(init_fn)
    shardings = state_shardings(parts, abstract_state, tx, mesh)
    b_sharding = batch_sharding(mesh)
    rep = replicated(mesh)
    train_step = jax.jit(
        make_train_step(parts, tx, cfg),
        in_shardings=(shardings, b_sharding),
        out_shardings=(shardings, rep),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(parts),
        in_shardings=(shardings.params, shardings.consts, b_sharding),
        out_shardings=rep,
    )
    init = jax.jit(init_fn, out_shardings=shardings)
    return Setup(
        cfg, mesh, parts, tx, abstract_state, shardings, b_sharding, train_step, eval_step, init
    )


def validation_set(setup: Setup, layout: BatchLayout) -> Batch | None:
    """The validation micro-batches as one global batch that the eval step scans over, put
    on the devices once for the whole run; None when `eval_every` is 0."""
    cfg = setup.cfg
    if not cfg.eval_every:
        return None
    batches = val_batches(cfg.data, cfg.seq_len, cfg.seed, layout, cfg.eval_batches)
    return setup.global_batch({k: np.concatenate([b[k] for b in batches]) for k in batches[0]})


def run_summary(setup: Setup, workdir: str) -> str:
    """What a run is about to do, in a few lines: devices and mesh, model, data, output."""
    cfg, model = setup.cfg, setup.cfg.model
    mesh = " x ".join(f"{name} {size}" for name, size in setup.mesh.shape.items())
    devices = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    precision = "float32" if model.dtype == "float32" else f"{model.dtype} matmuls"
    n_params = count_params(setup.abstract_state.params)
    tokens = cfg.accum_steps * cfg.batch_size * cfg.seq_len
    rows = f"{cfg.accum_steps} x {cfg.batch_size} rows x {cfg.seq_len}"
    data = cfg.data.source + (f" {cfg.data.path}" if cfg.data.path else "")
    return "\n".join(
        [
            f"devices: {devices} in {jax.process_count()} process(es); mesh {mesh}",
            f"model: {model.encoding}, {n_params:,} parameters, {precision}",
            f"steps: {cfg.steps} of {tokens:,} tokens ({rows})",
            f"data: {data}, tokenizer {cfg.data.tokenizer}; workdir: {workdir}",
        ]
    )
