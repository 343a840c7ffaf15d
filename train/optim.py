"""The optimizer: RAdam with decoupled weight decay on >=2-D ordinary weights only, its own
learning rate for prior and SSMax parameters, a warmup + cosine schedule, and global-norm
clipping. Parameter groups are decided by the model's variable types."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from bam_jax.model import PriorParam, SSMaxParam
from bam_train.config import OptimConfig


def variable_group(variable: nnx.Variable) -> str:
    """Optimizer group of one parameter."""
    if isinstance(variable, PriorParam):
        return "prior"
    if isinstance(variable, SSMaxParam):
        return "ssmax"
    return "decay" if jnp.ndim(variable.get_value()) >= 2 else "no_decay"


def schedule(peak: float, cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup to `peak` over `warmup_steps` (first step at peak / warmup_steps), then
    cosine decay to `final_lr_fraction * peak` at `total_steps`."""
    warmup = cfg.warmup_steps
    cosine = optax.cosine_decay_schedule(
        peak, decay_steps=max(total_steps - warmup, 1), alpha=cfg.final_lr_fraction
    )
    if warmup == 0:
        return cosine

    def warmup_then_cosine(step: jax.Array) -> jax.Array:
        ramp = peak * (step + 1) / warmup
        return jnp.where(step < warmup, ramp, cosine(step - warmup))

    return warmup_then_cosine


def make_optimizer(
    cfg: OptimConfig, total_steps: int, labels: Callable | object
) -> optax.GradientTransformation:
    """The full transformation; `labels` gives each parameter's group (`variable_group`)."""

    def radam(peak: float, weight_decay: float) -> optax.GradientTransformation:
        parts = [optax.scale_by_radam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)]
        if weight_decay > 0:
            parts.append(optax.add_decayed_weights(weight_decay))
        parts.append(optax.scale_by_learning_rate(schedule(peak, cfg, total_steps)))
        return optax.chain(*parts)

    groups = optax.multi_transform(
        {
            "decay": radam(cfg.lr, cfg.weight_decay),
            "no_decay": radam(cfg.lr, 0.0),
            "prior": radam(cfg.prior_lr, 0.0),
            "ssmax": radam(cfg.ssmax_lr, 0.0),
        },
        labels,
    )
    if cfg.clip_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), groups)
    return groups


def learning_rates(cfg: OptimConfig, total_steps: int, step: int) -> dict[str, float]:
    """Learning rate of each group at `step`, for logging."""
    peaks = {"lr": cfg.lr, "prior_lr": cfg.prior_lr, "ssmax_lr": cfg.ssmax_lr}
    return {name: float(schedule(p, cfg, total_steps)(step)) for name, p in peaks.items()}
