"""The prior as a per-head table over distances, which a kernel reads by Toeplitz slices
instead of evaluating the prior per element (`KernelConfig.prior_table`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bam_jax.kernels.tile_math import KernelConfig
from bam_jax.priors import Prior


def prior_table_distances(config: KernelConfig, offset: jax.Array) -> jax.Array:
    """The distances k_pos - q_pos of the prior table, ascending, float32 [X].

    Entry t is t - (T_pad - 1) - offset: the key at padded position k and the query at
    position offset + i (i < T_pad) meet at entry k - i + T_pad - 1, whatever the offset.
    """
    size = config.padded_kv_len + config.padded_q_len - 1
    first = -(config.padded_q_len - 1) - offset
    return (first + jnp.arange(size, dtype=jnp.int32)).astype(jnp.float32)


def prior_table(config: KernelConfig, prior: Prior, offset: jax.Array) -> jax.Array:
    """The prior's penalty (minus its bias) on every distance of the table, float32 [H, X].
    Constant to the kernels: the prior's gradient comes from the backward's own evaluation."""
    distances = prior_table_distances(config, offset)
    return -jax.lax.stop_gradient(prior.bias(distances)).astype(jnp.float32)
