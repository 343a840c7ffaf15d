"""x64 mode for one block, and attention computed in float64 with every [T, S] array
materialised: the yardstick of precision tests."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.priors import GGD_EPS


@contextlib.contextmanager
def x64_mode() -> Iterator[None]:
    """x64 mode inside the block only (`jax.enable_x64`; jax.experimental's before jax 0.8)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:
        from jax.experimental import enable_x64 as enable
    with enable(True):
        yield


def float64_attention(
    prior_inside: bool,
    documents: np.ndarray | None,
    q,
    k,
    v,
    alpha,
    beta,
    theta_mu,
    scale,
    query_offset: int = 0,
):
    """The causal attention of docs/spec.md in float64 (x64 mode), with a GGD prior and SSMax,
    every [T, S] array materialised; queries sit at query_offset + t among the S keys.
    `documents` (one row of ids, T == S) masks keys of other documents."""
    groups = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(x, groups, axis=2) for x in (k, v))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    query_positions = jnp.arange(q.shape[1]) + query_offset
    key_positions = jnp.arange(k.shape[1])
    distance = (key_positions[None, :] - query_positions[:, None]).astype(jnp.float64)
    gap = jnp.abs(distance[None] - (jnp.exp(theta_mu) - jnp.exp(-theta_mu))[:, None, None])
    bias = -jnp.exp(alpha)[:, None, None] * (gap + GGD_EPS) ** beta[:, None, None]
    visible = key_positions[None, :] <= query_positions[:, None]
    if documents is not None:
        visible = visible & (documents[0][:, None] == documents[0][None, :])
    log_n = jnp.log(visible.sum(-1).astype(jnp.float64))[None, None, :, None]
    factor = scale[None, :, None, None] * log_n
    inside = (scores + bias[None]) * factor
    logits = inside if prior_inside else scores * factor + bias[None]
    probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", probs, v)
