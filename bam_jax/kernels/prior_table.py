"""The prior as a per-head table over distances, which blockwise attention and the fused
kernels read by Toeplitz slices instead of evaluating the prior per element
(`KernelConfig.prior_table`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bam_jax.kernels.tile_math import KernelConfig
from bam_jax.priors import Prior


def prior_table_distances(padded_q_len: int, padded_kv_len: int, offset: jax.Array) -> jax.Array:
    """The distances k_pos - q_pos of the prior table, ascending, float32 [X],
    X = padded_kv_len + padded_q_len - 1.

    Entry t is t - (padded_q_len - 1) - offset: the key at padded position k and the query
    at position offset + i (i < padded_q_len) meet at entry k - i + padded_q_len - 1,
    whatever the offset.
    """
    size = padded_kv_len + padded_q_len - 1
    first = -(padded_q_len - 1) - offset
    return (first + jnp.arange(size, dtype=jnp.int32)).astype(jnp.float32)


def prior_table(config: KernelConfig, prior: Prior, offset: jax.Array) -> jax.Array:
    """The prior's penalty (minus its bias) on every distance of the table, float32 [H, X].
    Constant to the kernels: the prior's gradient comes from the backward's own evaluation."""
    distances = prior_table_distances(config.padded_q_len, config.padded_kv_len, offset)
    return -jax.lax.stop_gradient(prior.bias(distances)).astype(jnp.float32)
