"""The jitted train and eval steps.

The step is `nnx.merge` -> `jax.value_and_grad` -> optax inside one `jax.jit`, with the
state's shardings as input and output shardings and the state donated. Gradients of the
`accum_steps` micro-batches are summed by a scan, so one call is one optimizer step; the
loss is the mean over all trained target tokens of the global batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from bam_configs.training import TrainConfig
from bam_jax.layer_inputs import LayerFactors
from bam_train.optim import ScheduleValues
from bam_train.state import ModelParts, TrainState

Batch = dict[str, Any]
# Folded into the seed's key for the SSMax jitter and prior dilation draws, apart from every
# other use of it.
SSMAX_JITTER_STREAM = 0x55AA
PRIOR_DILATION_STREAM = 0x5A5A


class NonFiniteLossError(RuntimeError):
    """The loss, the gradient norm or the updated state became NaN or infinite."""


def loss_sums(
    parts: ModelParts, params, consts, batch: Batch, factors: LayerFactors | None = None
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy over trained targets of a [batch, seq_len] micro-batch, and the
    number of trained targets.

    With `loss_positions` [batch, P] in the batch (rows trained on P known positions, such as
    passkey answers) only those P positions go through the output projection.
    `factors` are the step's per-layer SSMax scale factors and prior dilations
    (`layer_factors`).
    """
    model = parts.merge(params, consts)
    hidden_BxPxE = model.hidden_states(
        batch["inputs"], segment_ids_BxT=batch["segment_ids"], layer_factors=factors
    )
    targets_BxP, mask_BxP = batch["targets"], batch["loss_mask"]
    if "loss_positions" in batch:
        positions_BxP = batch["loss_positions"]
        hidden_BxPxE = jnp.take_along_axis(hidden_BxPxE, positions_BxP[..., None], axis=1)
        targets_BxP = jnp.take_along_axis(targets_BxP, positions_BxP, axis=1)
        mask_BxP = jnp.take_along_axis(mask_BxP, positions_BxP, axis=1)
    return model.cross_entropy_sum(hidden_BxPxE, targets_BxP, mask_BxP), jnp.sum(mask_BxP)


@struct.dataclass
class StepValues:
    """Every number of a run that the train step takes as an array argument rather than as
    a constant of its program: the learning-rate schedule, the seed of the per-step draws,
    the SSMax jitter and the log of the prior dilation. Runs that differ only in these share
    one compiled step. Whether the jitter and dilation are drawn at all is part of the
    program (a zero jitter or a dilation of 1 draws nothing)."""

    schedule: ScheduleValues
    seed: jax.Array  # int32 []
    ssmax_jitter: jax.Array  # float32 []
    log_prior_dilation: jax.Array  # float32 []

    @classmethod
    def of(cls, cfg: TrainConfig) -> StepValues:
        return cls(
            schedule=ScheduleValues.of(cfg.optim, cfg.steps),
            seed=np.int32(cfg.seed),
            ssmax_jitter=np.float32(cfg.ssmax_jitter),
            log_prior_dilation=np.float32(math.log(cfg.prior_dilation)),
        )


def layer_factors(
    cfg: TrainConfig, values: StepValues, step: jax.Array, micro_batches: int
) -> LayerFactors | None:
    """The per-layer factors of optimizer step `step`, each [micro_batches, n_layers] (None
    when the run draws neither), from the run's seed and the step:
    - `ssmax_scale_L` (with `ssmax_jitter`): one draw from U[1 - ssmax_jitter, 1] per
      micro-batch, shared by the layers whose key count grows with the prompt
      (`ModelConfig.ssmax_growing_layers`); 1 for the capped and windowed layers, whose key
      count stays the training one at any length.
    - `prior_dilation_L` (with `prior_dilation` > 1): one draw of exp(U[0, log
      prior_dilation]) per micro-batch, shared by the global layers; 1 for the windowed
      ones, which never see a distance beyond their window.
    `cfg` decides which are drawn and which layers they apply to; `values` holds the seed,
    the jitter and the dilation."""
    ssmax_AxL = dilation_AxL = None
    if cfg.ssmax_jitter:
        ssmax_AxL = _ssmax_jitter_factors(cfg, values, step, micro_batches)
    if cfg.prior_dilation > 1:
        dilation_AxL = _prior_dilations(cfg, values, step, micro_batches)
    if ssmax_AxL is None and dilation_AxL is None:
        return None
    return LayerFactors(ssmax_scale_L=ssmax_AxL, prior_dilation_L=dilation_AxL)


def _uniform_draws(values: StepValues, stream: int, step: jax.Array, count: int) -> jax.Array:
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(values.seed), stream), step)
    return jax.random.uniform(key, (count,), dtype=jnp.float32)


def _ssmax_jitter_factors(
    cfg: TrainConfig, values: StepValues, step: jax.Array, micro_batches: int
) -> jax.Array:
    draws_A = _uniform_draws(values, SSMAX_JITTER_STREAM, step, micro_batches)
    factors_Ax1 = (1.0 - values.ssmax_jitter * draws_A)[:, None]
    growing_L = jnp.asarray(cfg.model.ssmax_growing_layers())
    return jnp.where(growing_L[None, :], factors_Ax1, 1.0)


def _prior_dilations(
    cfg: TrainConfig, values: StepValues, step: jax.Array, micro_batches: int
) -> jax.Array:
    draws_A = _uniform_draws(values, PRIOR_DILATION_STREAM, step, micro_batches)
    dilations_Ax1 = jnp.exp(values.log_prior_dilation * draws_A)[:, None]
    global_L = jnp.asarray(cfg.model.global_layers())
    return jnp.where(global_L[None, :], dilations_Ax1, 1.0)


def make_train_step(
    parts: ModelParts, tx: optax.GradientTransformation, cfg: TrainConfig
) -> Callable:
    """`step(state, batch_AxBxT, values: StepValues) -> (state, metrics)`. Of `cfg`, the step
    reads only what shapes its program (the model and which factors are drawn); the numbers
    that change between runs come in `values`."""
    grad_fn = jax.value_and_grad(
        lambda p, c, b, f: loss_sums(parts, p, c, b, f), has_aux=True, argnums=0
    )

    def step(state: TrainState, batch_AxBxT: Batch, values: StepValues) -> tuple[TrainState, dict]:
        micro_batches = batch_AxBxT["inputs"].shape[0]
        factors = layer_factors(cfg, values, state.step, micro_batches)

        def micro(carry, batch_and_factors):
            loss_sum, count, grads = carry
            (loss, n), g = grad_fn(state.params, state.consts, *batch_and_factors)
            return (loss_sum + loss, count + n, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, count, grads), _ = jax.lax.scan(micro, init, (batch_AxBxT, factors))
        denom = jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        updates, opt_state = tx.update(
            grads, state.opt_state, state.params, schedule=values.schedule
        )
        params = optax.apply_updates(state.params, updates)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": optax.tree.norm(grads),
            "trained_tokens": count,
            "state_finite": all_finite((params, opt_state)),
        }
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state)
        return new_state, metrics

    return step


def all_finite(tree) -> jax.Array:
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]))


def make_eval_step(parts: ModelParts) -> Callable:
    def evaluate(params, consts, batch_AxBxT: Batch) -> tuple[jax.Array, jax.Array]:
        def micro(carry, batch_BxT):
            loss, n = loss_sums(parts, params, consts, batch_BxT)
            return (carry[0] + loss, carry[1] + n), None

        zero = jnp.zeros((), jnp.float32)
        (loss_sum, count), _ = jax.lax.scan(micro, (zero, zero), batch_AxBxT)
        return loss_sum, count

    return evaluate
