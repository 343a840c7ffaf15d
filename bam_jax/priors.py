"""Positional priors over attention: the generalized Gaussian (GGD) prior and ALiBi.

A prior is a small pytree of per-head parameters with a `bias(distance)` method that
returns the float32 log-prior for relative distances `d = key_pos - query_pos`
(d <= 0 under the causal mask). Attention adds it to the content logits.

The GGD prior has two forms (`GGDPrior.form`, docs/spec.md section 2): "training",
-exp(a) * (|d - mu| + eps) ** b, what the authors' models train with, and "inference",
-(|d - mu| * exp(a) + eps) ** b, what their evaluation copy of the model without SSMax
computes from the same parameters.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.pytrees import export_serializable

GGD_EPS = 1e-5
# |bias| saturates at 2 ** GGD_MAX_LOG2_MAGNITUDE. Past it float32 would reach inf (at d = mu
# once theta_beta < -6), and inf * log(1) or inf - inf is NaN on a document's first token and
# in every gradient. A saturated key's prior weight is exp(-2 ** 100) = 0 either way.
GGD_MAX_LOG2_MAGNITUDE = 100.0
GGDForm = Literal["training", "inference"]
GGD_FORMS: tuple[str, ...] = ("training", "inference")


class Prior(Protocol):
    """Anything attention accepts as a prior: per-head parameters plus a bias function."""

    @property
    def num_heads(self) -> int: ...

    def bias(self, distance: jax.Array) -> jax.Array:
        """float32 bias of shape [H, *distance.shape] for integer or float distances."""
        ...


@export_serializable
@flax.struct.dataclass
class GGDPrior:
    """Generalized Gaussian prior, with a = theta_alpha, b = theta_beta, mu_h =
    exp(theta_mu_h) - exp(-theta_mu_h) and eps = GGD_EPS:

    form "training" (the default): bias_h(d) = -exp(a_h) * (|d - mu_h| + eps) ** b_h
    form "inference": bias_h(d) = -(|d - mu_h| * exp(a_h) + eps) ** b_h

    `form` is static (not a pytree leaf). theta_beta is never clipped: zero or negative
    shapes (priors that grow with distance) are legal. |bias| saturates at
    2 ** GGD_MAX_LOG2_MAGNITUDE (where float32 would overflow), with zero gradient there.
    """

    theta_alpha_H: jax.Array
    theta_beta_H: jax.Array
    theta_mu_H: jax.Array
    form: GGDForm = flax.struct.field(pytree_node=False, default="training")

    def __post_init__(self) -> None:
        check_ggd_form("form", self.form)

    @property
    def num_heads(self) -> int:
        return self.theta_alpha_H.shape[0]

    def bias(self, distance: jax.Array) -> jax.Array:
        return ggd_bias(
            self.theta_alpha_H, self.theta_beta_H, self.theta_mu_H, distance, form=self.form
        )

    def dilated(self, factor: float | jax.Array) -> GGDPrior:
        """The prior seen at `factor` times every distance.

        Training form: exp(a_h) grows by factor ** b_h, so local heads (b_h > 0) narrow and
        heads flat with distance (b_h <= 0) stay flat; exact for mu_h = 0, up to eps.
        Inference form: exp(a_h) grows by factor and mu_h shrinks by it, which is exact, since
        |factor * d - mu| * exp(a) = |d - mu / factor| * factor * exp(a)."""
        log_factor = jnp.log(factor)
        if self.form == "training":
            return self.replace(theta_alpha_H=self.theta_alpha_H + self.theta_beta_H * log_factor)
        mu_H = ggd_mu(jnp.asarray(self.theta_mu_H, jnp.float32)) / factor
        return self.replace(
            theta_alpha_H=self.theta_alpha_H + log_factor, theta_mu_H=jnp.arcsinh(mu_H / 2)
        )


@export_serializable
@flax.struct.dataclass
class AlibiPrior:
    """ALiBi: bias_h(d) = -slope_h * |d|."""

    slopes_H: jax.Array

    def dilated(self, factor: float | jax.Array) -> AlibiPrior:
        """The prior seen at `factor` times every distance: every slope times `factor`."""
        return self.replace(slopes_H=jnp.asarray(self.slopes_H, jnp.float32) * factor)

    @property
    def num_heads(self) -> int:
        return self.slopes_H.shape[0]

    def bias(self, distance: jax.Array) -> jax.Array:
        distance = jnp.asarray(distance, jnp.float32)
        slopes = jnp.asarray(self.slopes_H, jnp.float32)
        return -slopes.reshape((-1,) + (1,) * distance.ndim) * jnp.abs(distance)[None]


def ggd_bias(
    theta_alpha_H: jax.Array,
    theta_beta_H: jax.Array,
    theta_mu_H: jax.Array,
    distance: jax.Array,
    *,
    form: GGDForm = "training",
) -> jax.Array:
    """GGD log-prior in float32, shape [H, *distance.shape], of either form (`GGDPrior`)."""
    check_ggd_form("form", form)
    expand = (-1,) + (1,) * jnp.ndim(distance)
    alpha = jnp.asarray(theta_alpha_H, jnp.float32).reshape(expand)
    beta = jnp.asarray(theta_beta_H, jnp.float32).reshape(expand)
    theta_mu = jnp.asarray(theta_mu_H, jnp.float32).reshape(expand)
    mu = ggd_mu(theta_mu)
    d = jnp.asarray(distance, jnp.float32)[None]
    if form == "training":
        gap = _abs_zero_subgradient(d - mu) + GGD_EPS
        log2_coef = alpha * math.log2(math.e)
    else:
        gap = _abs_zero_subgradient(d - mu) * jnp.exp(alpha) + GGD_EPS
        log2_coef = jnp.zeros_like(alpha)
    # Saturated entries take gap = 1 inside the power so that no inf reaches the gradient.
    log2_magnitude = log2_coef + beta * jnp.log2(gap)
    saturated = jax.lax.stop_gradient(log2_magnitude > GGD_MAX_LOG2_MAGNITUDE)
    power = jnp.power(jnp.where(saturated, 1.0, gap), beta)
    bias = -jnp.exp(alpha) * power if form == "training" else -power
    return jnp.where(saturated, -(2.0**GGD_MAX_LOG2_MAGNITUDE), bias)


def check_ggd_form(name: str, form: object) -> None:
    """A ValueError naming `name` unless `form` is one of GGD_FORMS."""
    if not isinstance(form, str) or form not in GGD_FORMS:
        raise ValueError(f"{name} must be one of {GGD_FORMS}, got {form!r}")


def ggd_mu(theta_mu: jax.Array) -> jax.Array:
    """The GGD location mu = exp(theta_mu) - exp(-theta_mu), elementwise, in theta_mu's dtype."""
    return jnp.exp(theta_mu) - jnp.exp(-theta_mu)


def _abs_zero_subgradient(x: jax.Array) -> jax.Array:
    """|x| whose derivative at x = 0 is 0 (jnp.abs uses +1 there).

    At d = mu the GGD has a kink where (|d - mu| + eps) ** (beta - 1) is as large as
    1e8 for beta < 0; with mu = 0 every query's own position sits on it. The
    symmetric subgradient 0 (PyTorch's convention too) keeps that spike out of the
    gradient of theta_mu.
    """
    return jnp.sign(x) * x


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi slopes for any head count, float32 [H] (docs/spec.md section 3)."""
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")

    def power_of_two_slopes(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(num_heads).is_integer():
        slopes = power_of_two_slopes(num_heads)
    else:
        closest = 2 ** math.floor(math.log2(num_heads))
        extra = alibi_slopes(2 * closest).tolist()[0::2][: num_heads - closest]
        slopes = power_of_two_slopes(closest) + extra
    return np.asarray(slopes, np.float32)


AlphaInit = Literal["slope", "sampled"] | float
BetaInit = Literal["linear", "sampled"] | float


def init_ggd_prior(
    num_heads: int,
    *,
    alpha_init: AlphaInit = 1.0,
    beta_init: BetaInit = 0.0,
    mu_init: float = 0.0,
    key: jax.Array | None = None,
) -> GGDPrior:
    """Initial GGD parameters, following the reference code's options.

    alpha_init: "slope" (exp(theta_alpha) = ALiBi slopes), "sampled" (theta_alpha drawn
        from a standard normal) or a positive float, the value of exp(theta_alpha).
    beta_init: "linear" (linspace(0, 1, H)), "sampled" (standard normal) or a float.
    mu_init: the value of theta_mu for every head.
    The defaults (1.0, 0.0) are the `uniform` prior: a constant bias, i.e. NoPE.
    """
    if key is None:
        key = jax.random.key(0)
    alpha_key, beta_key = jax.random.split(key)
    if alpha_init == "slope":
        theta_alpha = jnp.log(jnp.asarray(alibi_slopes(num_heads)))
    elif alpha_init == "sampled":
        theta_alpha = jax.random.normal(alpha_key, (num_heads,), jnp.float32)
    elif isinstance(alpha_init, int | float) and alpha_init > 0:
        theta_alpha = jnp.full((num_heads,), math.log(alpha_init), jnp.float32)
    else:
        raise ValueError(
            f"alpha_init must be 'slope', 'sampled' or a positive number, got {alpha_init!r}"
        )
    if beta_init == "linear":
        theta_beta = jnp.linspace(0.0, 1.0, num_heads, dtype=jnp.float32)
    elif beta_init == "sampled":
        theta_beta = jax.random.normal(beta_key, (num_heads,), jnp.float32)
    elif isinstance(beta_init, int | float):
        theta_beta = jnp.full((num_heads,), float(beta_init), jnp.float32)
    else:
        raise ValueError(f"beta_init must be 'linear', 'sampled' or a number, got {beta_init!r}")
    theta_mu = jnp.full((num_heads,), float(mu_init), jnp.float32)
    return GGDPrior(theta_alpha, theta_beta, theta_mu)


PRIOR_PRESETS: dict[str, dict[str, float | str]] = {
    "uniform": {"alpha_init": 1.0, "beta_init": 0.0},
    "slope": {"alpha_init": "slope", "beta_init": 1.0},
    "linear": {"alpha_init": "slope", "beta_init": "linear"},
    "sampled": {"alpha_init": "sampled", "beta_init": "sampled"},
}
