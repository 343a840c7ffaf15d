"""The optimizer: RAdam with decoupled weight decay on >=2-D ordinary weights only, its own
learning rate for prior and SSMax parameters, a warmup + cosine schedule, and global-norm
clipping. Parameter groups are decided by the model's variable types. The schedule's numbers
reach the update as values (`ScheduleValues`), not as constants of the compiled program.

`OptimConfig.numerics` chooses between two roundings of the same algorithm: "optax" adds eps
to sqrt(v_hat), the bias-corrected second moment, and clips by max_norm / norm; "torch", as
torch.optim.RAdam and torch.nn.utils.clip_grad_norm_ do, adds eps to sqrt(v) before the
bias correction (an eps of eps / sqrt(1 - b2^t) on sqrt(v_hat): about twice as large at the
first adaptive step, within 0.3% after 100 steps) and clips by max_norm / (norm + 1e-6)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct

from bam_configs.training import OptimConfig

RADAM_THRESHOLD = 5.0
TORCH_CLIP_EPS = 1e-6


@struct.dataclass
class ScheduleValues:
    """The numbers of the learning-rate schedule, which the train step takes as arrays, so
    that one compiled step serves every learning rate, warmup and run length.

    The schedule is written in the form XLA folds optax's warmup + cosine schedule into when
    its numbers are constants of the program (a division by a constant becomes a product
    with its float32 reciprocal, and products of constants are folded into one), and those
    constants are computed here in float32 as XLA computes them: with the jax that
    constraints.txt pins, a step taking these values gives the learning rates, and so the
    training, of a step compiled with the numbers as constants, bit for bit. Newer XLAs
    fold in another order (jax 0.12: reciprocals, but no merged products); there the two
    differ by a few float32 ulps."""

    peak_lr: dict[str, jax.Array]  # float32 [], per parameter group
    warmup_increment: dict[str, jax.Array]  # float32 []: peak / warmup_steps, per group
    warmup_steps: jax.Array  # int32 []
    decay_steps: jax.Array  # float32 []: steps of cosine decay after the warmup, at least 1
    cosine_angle_step: jax.Array  # float32 []: pi / decay_steps
    half_span: jax.Array  # float32 []: (1 - final_fraction) / 2
    final_fraction: jax.Array  # float32 []

    @classmethod
    def of(cls, cfg: OptimConfig, total_steps: int) -> ScheduleValues:
        peaks = {"decay": cfg.lr, "no_decay": cfg.lr, "prior": cfg.prior_lr, "ssmax": cfg.ssmax_lr}
        per_warmup_step = np.float32(1) / np.float32(max(cfg.warmup_steps, 1))
        decay_steps = np.float32(max(total_steps - cfg.warmup_steps, 1))
        return cls(
            peak_lr={group: np.float32(peak) for group, peak in peaks.items()},
            warmup_increment={
                group: np.float32(peak) * per_warmup_step for group, peak in peaks.items()
            },
            warmup_steps=np.int32(cfg.warmup_steps),
            decay_steps=decay_steps,
            cosine_angle_step=np.float32(np.pi) * (np.float32(1) / decay_steps),
            half_span=np.float32(0.5) * np.float32(1.0 - cfg.final_lr_fraction),
            final_fraction=np.float32(cfg.final_lr_fraction),
        )


def learning_rate(values: ScheduleValues, group: str, step: jax.Array) -> jax.Array:
    """The learning rate of `group` at optimizer step `step` (0 for the first): linear warmup
    to the peak over `warmup_steps` (first step at peak / warmup_steps), then cosine decay to
    `final_fraction * peak` at the run's last step."""
    ramp = (step + 1) * values.warmup_increment[group]
    decay_step = jnp.minimum(step - values.warmup_steps, values.decay_steps)
    cosine = 1 + jnp.cos(decay_step * values.cosine_angle_step)
    decayed_lr = (cosine * values.half_span + values.final_fraction) * values.peak_lr[group]
    return jnp.where(step < values.warmup_steps, ramp, decayed_lr)


def scale_by_group_learning_rate(group: str) -> optax.GradientTransformationExtraArgs:
    """Scales by minus the learning rate of `group`, from the `schedule` (ScheduleValues)
    that `update` takes as a keyword. Its state is optax's `ScaleByScheduleState`, the step
    count, as `optax.scale_by_learning_rate` with a schedule keeps it."""

    def init(params: optax.Params) -> optax.ScaleByScheduleState:
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None, *, schedule: ScheduleValues | None = None, **extra):
        del params, extra
        if schedule is None:
            raise TypeError(
                "the optimizer's update needs schedule=ScheduleValues.of(optim_config, steps)"
            )
        step_size = -learning_rate(schedule, group, state.count)
        updates = jax.tree.map(lambda g: jnp.array(step_size, dtype=g.dtype) * g, updates)
        return updates, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


def make_optimizer(cfg: OptimConfig, labels: Callable | object) -> optax.GradientTransformation:
    """The full transformation; `labels` gives each parameter's group (`variable_group`).
    Its `update` takes the learning-rate schedule as `schedule=ScheduleValues`."""

    torch = cfg.numerics == "torch"
    scale_by_radam = scale_by_torch_radam if torch else optax.scale_by_radam

    def radam(group: str, weight_decay: float) -> optax.GradientTransformation:
        parts = [scale_by_radam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)]
        if weight_decay > 0:
            parts.append(optax.add_decayed_weights(weight_decay))
        parts.append(scale_by_group_learning_rate(group))
        return optax.chain(*parts)

    groups = optax.multi_transform(
        {
            "decay": radam("decay", cfg.weight_decay),
            "no_decay": radam("no_decay", 0.0),
            "prior": radam("prior", 0.0),
            "ssmax": radam("ssmax", 0.0),
        },
        labels,
    )
    if cfg.clip_norm > 0:
        clip = clip_by_global_norm_torch if torch else optax.clip_by_global_norm
        return optax.chain(clip(cfg.clip_norm), groups)
    return groups


def scale_by_torch_radam(b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    """RAdam as torch.optim.RAdam rounds it: the rectified step is
    m_hat * r_t * sqrt(1 - b2^t) / (sqrt(v) + eps), the plain m_hat while rho_t <= 5."""
    rho_inf = 2.0 / (1.0 - b2) - 1.0

    def init(params: optax.Params) -> optax.ScaleByAdamState:
        # Two trees: the train step donates the state, and one buffer cannot be donated twice.
        mu, nu = (jax.tree.map(jnp.zeros_like, params) for _ in range(2))
        return optax.ScaleByAdamState(count=jnp.zeros([], jnp.int32), mu=mu, nu=nu)

    def update(grads, state: optax.ScaleByAdamState, params=None):
        del params
        mu = optax.tree.update_moment(grads, state.mu, b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2)
        count = optax.safe_increment(state.count)
        t = count.astype(jnp.float32)
        b2_t = b2**t
        rho_t = rho_inf - 2.0 * t * b2_t / (1.0 - b2_t)
        rect = jnp.sqrt(
            jnp.maximum(rho_t - 4.0, 0.0)
            * jnp.maximum(rho_t - 2.0, 0.0)
            * rho_inf
            / ((rho_inf - 4.0) * (rho_inf - 2.0) * rho_t)
        )
        correction_1 = 1.0 - b1**t
        adaptive = rect * jnp.sqrt(1.0 - b2_t)

        def step(m, v):
            m_hat = m / correction_1
            rectified = m_hat * adaptive / (jnp.sqrt(v) + eps)
            return jnp.where(rho_t > RADAM_THRESHOLD, rectified, m_hat)

        updates = jax.tree.map(step, mu, nu)
        return updates, optax.ScaleByAdamState(count=count, mu=mu, nu=nu)

    return optax.GradientTransformation(init, update)


def clip_by_global_norm_torch(max_norm: float) -> optax.GradientTransformation:
    """Scales the gradients by min(1, max_norm / (norm + 1e-6)), as clip_grad_norm_ does."""

    def update(grads, state, params=None):
        del params
        factor = jnp.minimum(1.0, max_norm / (optax.tree.norm(grads) + TORCH_CLIP_EPS))
        return jax.tree.map(lambda g: g * factor.astype(g.dtype), grads), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def learning_rates(values: ScheduleValues, step: int) -> dict[str, float]:
    """Learning rate of each group at `step`, for logging."""
    groups = {"lr": "decay", "prior_lr": "prior", "ssmax_lr": "ssmax"}
    return {name: float(learning_rate(values, group, step)) for name, group in groups.items()}
