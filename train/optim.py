"""The optimizer: RAdam with decoupled weight decay on >=2-D ordinary weights only, its own
learning rate for prior and SSMax parameters, a warmup + cosine schedule, and global-norm
clipping. Parameter groups are decided by the model's variable types.

`OptimConfig.numerics` chooses between two roundings of the same algorithm: "optax" adds eps
to sqrt(v_hat), the bias-corrected second moment, and clips by max_norm / norm; "torch", as
torch.optim.RAdam and torch.nn.utils.clip_grad_norm_ do, adds eps to sqrt(v) before the
bias correction (an eps of eps / sqrt(1 - b2^t) on sqrt(v_hat): about twice as large at the
first adaptive step, within 0.3% after 100 steps) and clips by max_norm / (norm + 1e-6)."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from bam_configs.training import OptimConfig

RADAM_THRESHOLD = 5.0
TORCH_CLIP_EPS = 1e-6


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

    torch = cfg.numerics == "torch"
    scale_by_radam = scale_by_torch_radam if torch else optax.scale_by_radam

    def radam(peak: float, weight_decay: float) -> optax.GradientTransformation:
        parts = [scale_by_radam(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps)]
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


def learning_rates(cfg: OptimConfig, total_steps: int, step: int) -> dict[str, float]:
    """Learning rate of each group at `step`, for logging."""
    peaks = {"lr": cfg.lr, "prior_lr": cfg.prior_lr, "ssmax_lr": cfg.ssmax_lr}
    return {name: float(schedule(p, cfg, total_steps)(step)) for name, p in peaks.items()}
