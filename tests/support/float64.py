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
    `documents` (one row of ids, T == S) masks keys of other documents; id -1 is padding,
    which no query sees (a padding query sees nothing and outputs zeros)."""
    logits_BxHxTxS, visible_TxS = float64_logits(
        prior_inside, documents, q, k, alpha, beta, theta_mu, scale, query_offset
    )
    return float64_softmax_values(logits_BxHxTxS, visible_TxS, v)


def float64_logits(
    prior_inside: bool,
    documents: np.ndarray | None,
    q,
    k,
    alpha,
    beta,
    theta_mu,
    scale,
    query_offset: int = 0,
):
    """The logits of `float64_attention` [B, H, T, S] (finite everywhere) and which keys each
    query sees, bool [T, S]."""
    groups = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, groups, axis=2)
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / math.sqrt(q.shape[-1])
    query_positions = jnp.arange(q.shape[1]) + query_offset
    key_positions = jnp.arange(k.shape[1])
    distance = (key_positions[None, :] - query_positions[:, None]).astype(jnp.float64)
    gap = jnp.abs(distance[None] - (jnp.exp(theta_mu) - jnp.exp(-theta_mu))[:, None, None])
    bias = -jnp.exp(alpha)[:, None, None] * (gap + GGD_EPS) ** beta[:, None, None]
    visible = key_positions[None, :] <= query_positions[:, None]
    if documents is not None:
        same = documents[0][:, None] == documents[0][None, :]
        visible = visible & same & (documents[0][None, :] >= 0)
    log_n = jnp.log(jnp.maximum(visible.sum(-1), 1).astype(jnp.float64))[None, None, :, None]
    factor = scale[None, :, None, None] * log_n
    inside = (scores + bias[None]) * factor
    return (inside if prior_inside else scores * factor + bias[None]), visible


def float64_softmax_values(logits_BxHxTxS, visible_TxS, v):
    """softmax(logits) over the visible keys, times the values: [B, T, H, D]."""
    groups = logits_BxHxTxS.shape[1] // v.shape[2]
    v = jnp.repeat(v, groups, axis=2)
    seen = visible_TxS.any(-1)[:, None]
    logits = jnp.where(visible_TxS, logits_BxHxTxS, jnp.where(seen, -jnp.inf, 0.0))
    probs = jnp.where(seen, jax.nn.softmax(logits, axis=-1), 0.0)
    return jnp.einsum("bhts,bshd->bthd", probs, v)
