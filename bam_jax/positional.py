"""Positional encodings as pure functions, usable from NNX, Linen or plain JAX.

- `apply_rope`: rotary embedding on adjacent channel pairs (2k, 2k+1) of each head, the
  Llama "complex pairs" layout.
- `sinusoidal_embedding`: the additive table of the reference code; the cosine of odd
  channel 2k+1 uses the frequency exp(-(2k+1) ln(theta) / D) (docs/spec.md section 6).
- `alibi_prior`: the fixed ALiBi prior for a head count.

Frequencies are computed on the host in float64 and rounded once to float32; the angles
and the rotation are computed in float32 whatever the input dtype.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.priors import AlibiPrior, alibi_slopes


def rope_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """float32 [head_dim // 2]: theta ** (-2k / head_dim)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.float64)[: head_dim // 2] / head_dim
    return (1.0 / theta**exponents).astype(np.float32)


def apply_rope(x_BxTxHxD: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
    """Rotates channel pairs (2k, 2k+1) of every head by positions * theta ** (-2k / D).

    positions: [T] or [B, T] (integer or float). Returns x's dtype.
    """
    head_dim = x_BxTxHxD.shape[-1]
    if head_dim % 2:
        raise ValueError(f"rope needs an even head_dim, got {head_dim}")
    freqs_R = jnp.asarray(rope_frequencies(head_dim, theta))
    angles = jnp.asarray(positions, jnp.float32)[..., None] * freqs_R  # [(B,) T, R]
    if angles.ndim == 2:
        angles = angles[None]
    cos_Bx1xTx1xR = jnp.cos(angles)[:, :, None, :]
    sin_Bx1xTx1xR = jnp.sin(angles)[:, :, None, :]
    pairs = x_BxTxHxD.astype(jnp.float32).reshape(*x_BxTxHxD.shape[:-1], head_dim // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated_even = even * cos_Bx1xTx1xR - odd * sin_Bx1xTx1xR
    rotated_odd = even * sin_Bx1xTx1xR + odd * cos_Bx1xTx1xR
    rotated = jnp.stack([rotated_even, rotated_odd], axis=-1).reshape(x_BxTxHxD.shape)
    return rotated.astype(x_BxTxHxD.dtype)


def sinusoidal_frequencies(dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """float32 frequencies of the even (sine) and odd (cosine) channels."""
    log_theta_over_dim = math.log(theta) / dim
    sin_freqs = np.exp(np.arange(0, dim, 2, dtype=np.float64) * -log_theta_over_dim)
    cos_freqs = np.exp(np.arange(1, dim, 2, dtype=np.float64) * -log_theta_over_dim)
    return sin_freqs.astype(np.float32), cos_freqs.astype(np.float32)


def sinusoidal_embedding(positions: jax.Array, dim: int, *, theta: float = 10000.0) -> jax.Array:
    """float32 [*positions.shape, dim]: sin on even channels, cos on odd ones."""
    if dim % 2:
        raise ValueError(f"sinusoidal embedding needs an even dim, got {dim}")
    sin_freqs, cos_freqs = sinusoidal_frequencies(dim, theta)
    p = jnp.asarray(positions, jnp.float32)[..., None]
    sin = jnp.sin(p * jnp.asarray(sin_freqs))
    cos = jnp.cos(p * jnp.asarray(cos_freqs))
    return jnp.stack([sin, cos], axis=-1).reshape(*sin.shape[:-1], dim)


def alibi_prior(num_heads: int) -> AlibiPrior:
    """The fixed ALiBi prior: bias_h(d) = -slope_h * |d| (docs/spec.md section 3)."""
    return AlibiPrior(jnp.asarray(alibi_slopes(num_heads)))
