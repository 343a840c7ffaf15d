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

from bam_configs.training import OptimConfig, TrainConfig, validate_for_runtime
from bam_jax.model_state import count_params
from bam_train.data import BatchLayout, loss_positions_per_row, val_batches
from bam_train.optim import make_optimizer
from bam_train.sharding import batch_sharding, local_rows, make_mesh, replicated
from bam_train.state import ModelParts, TrainState, init_state, state_shardings
from bam_train.step import Batch, StepValues, make_eval_step, make_train_step


@dataclasses.dataclass
class _Programs:
    """The parts of a Setup that depend only on `program_config(cfg)` and the devices."""

    mesh: Mesh
    parts: ModelParts
    tx: optax.GradientTransformation
    abstract_state: TrainState
    shardings: TrainState
    batch_sharding: NamedSharding
    train_step: Callable
    eval_step: Callable
    init: Callable


@dataclasses.dataclass
class Setup(_Programs):
    """Everything a run needs before it touches data or parameters: its config, the jitted
    programs (shared between runs with one `program_config`), and the values the train
    step takes (`init` here takes none: it starts the run's seed)."""

    cfg: TrainConfig
    step_values: StepValues

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


# Fields that are values to the compiled programs (the step takes them in `StepValues`) or
# that only the loop and the data read; `program_config` sets them to their defaults.
_VALUE_FIELDS = (
    "steps",
    "seed",
    "batch_size",
    "tokens_per_step",
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_last",
    "keep_every",
    "async_checkpoint",
    "profile_start",
    "profile_steps",
    "progress_bar",
    "data",
)
_OPTIM_VALUE_FIELDS = ("lr", "prior_lr", "ssmax_lr", "warmup_steps", "final_lr_fraction")


def program_config(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with every field that does not shape the compiled programs at its default:
    runs whose program configs are equal share their jitted steps. SSMax jitter and prior
    dilation keep only whether they are on."""
    defaults, optim_defaults = TrainConfig(model=cfg.model), OptimConfig()
    optim = dataclasses.replace(
        cfg.optim, **{name: getattr(optim_defaults, name) for name in _OPTIM_VALUE_FIELDS}
    )
    return cfg.replace(
        optim=optim,
        ssmax_jitter=0.5 if cfg.ssmax_jitter else 0.0,
        prior_dilation=2.0 if cfg.prior_dilation > 1 else 1.0,
        **{name: getattr(defaults, name) for name in _VALUE_FIELDS},
    )


def build(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> Setup:
    """Validate against the runtime, then build mesh, optimizer, shardings and jitted steps
    (on `devices`, default all). The jitted functions are shared with earlier builds in this
    process whose `program_config` and devices are the same, so a learning-rate sweep or a
    longer run compiles nothing new."""
    devices = jax.devices() if devices is None else devices
    validate_for_runtime(cfg, len(devices), jax.process_count())
    programs = _programs(program_config(cfg), tuple(devices))
    values = jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(replicated(programs.mesh), x),
        StepValues.of(cfg),
    )
    shared = {field.name: getattr(programs, field.name) for field in dataclasses.fields(programs)}
    shared["init"] = functools.partial(programs.init, values.seed)
    return Setup(**shared, cfg=cfg, step_values=values)


@functools.lru_cache(maxsize=8)
def _programs(cfg: TrainConfig, devices: tuple[jax.Device, ...]) -> _Programs:
    mesh = make_mesh(cfg.mesh, list(devices))
    parts, _, _ = ModelParts.from_config(cfg.model)
    tx = make_optimizer(cfg.optim, parts.labels)
    init_fn = functools.partial(init_state, cfg.model, parts, tx)
    abstract_state = jax.eval_shape(init_fn, jnp.int32(0))
    shardings = state_shardings(parts, abstract_state, tx, mesh)
    b_sharding = batch_sharding(mesh)
    rep = replicated(mesh)
    train_step = jax.jit(
        make_train_step(parts, tx, cfg),
        in_shardings=(shardings, b_sharding, rep),
        out_shardings=(shardings, rep),
        donate_argnums=0,
    )
    eval_step = jax.jit(
        make_eval_step(parts),
        in_shardings=(shardings.params, shardings.consts, b_sharding),
        out_shardings=rep,
    )
    init = jax.jit(init_fn, out_shardings=shardings)
    return _Programs(
        mesh, parts, tx, abstract_state, shardings, b_sharding, train_step, eval_step, init
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
