"""Backward pass of the Pallas attention: pure-JAX flash-style recomputation.

Loops over (key block, query block) tiles that can see each other, recomputes the tile
logits as a differentiable function of (queries, keys, prior, SSMax scales), forms the
probabilities from the forward pass's saved log-sum-exp, and pulls the logit cotangent
back with `jax.vjp`. Memory stays O(tile) beyond the gradients themselves.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from bam_jax.attention import visibility_mask, visible_key_counts
from bam_jax.kernels.tile_math import AuxInputs, KernelConfig, pad_to, round_up

BACKWARD_BLOCK = 512


def _tile_logits(
    config: KernelConfig, q_BxQxHxD, k_BxKxGxD, prior, ssmax_scale_H, q_pos_Q, k_pos_K, log_n_BxQ
) -> jax.Array:
    """Unmasked natural-unit logits [B, H, Q, K] as a differentiable function of the inputs."""
    batch, rows, num_heads, head_dim = q_BxQxHxD.shape
    cols, num_kv = k_BxKxGxD.shape[1], k_BxKxGxD.shape[2]
    q_grouped = q_BxQxHxD.reshape(batch, rows, num_kv, config.groups, head_dim)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", q_grouped, k_BxKxGxD, preferred_element_type=jnp.float32
    ).reshape(batch, num_heads, rows, cols) / jnp.float32(math.sqrt(head_dim))
    bias = None if prior is None else prior.bias(k_pos_K[None, :] - q_pos_Q[:, None])[None]
    if ssmax_scale_H is None:
        return scores if bias is None else scores + bias
    factor = (ssmax_scale_H.astype(jnp.float32)[None, :, None] * log_n_BxQ[:, None, :])[..., None]
    if bias is None:
        return scores * factor
    if config.prior_inside:
        return (scores + bias) * factor
    return scores * factor + bias


class _Padded(NamedTuple):
    """Backward inputs padded to whole tiles (sequence axis 1; 2 for lse and delta)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_out: jax.Array
    lse_BxHxT: jax.Array
    delta_BxHxT: jax.Array
    log_n_BxT: jax.Array | None
    q_seg_BxT: jax.Array | None
    k_seg_BxS: jax.Array | None
    offset: jax.Array
    single_key_BxT: jax.Array  # bool: the query sees exactly one key


class _Accumulators(NamedTuple):
    """float32 running gradients; dk_tile/dv_tile cover the current key block only."""

    dq: jax.Array
    dk_tile: jax.Array
    dv_tile: jax.Array
    dprior: object
    dscale: jax.Array | None


def attention_backward(
    config: KernelConfig, q, k, v, prior, ssmax_scale_H, aux: AuxInputs, out, lse, d_out
):
    """Cotangents (dq, dk, dv, dprior, dssmax) by flash-style recomputation over tiles."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv = k.shape[1], k.shape[2]
    bq = min(BACKWARD_BLOCK, round_up(q_len, 8))
    bk = min(BACKWARD_BLOCK, round_up(kv_len, 8))
    q_pad, kv_pad = round_up(q_len, bq), round_up(kv_len, bk)
    padded = _pad_inputs(config, q, k, v, aux, out, lse, d_out, q_pad, kv_pad)

    def key_block(k_block, state):
        dq, dk, dv, dprior, dscale = state
        first, stop = _backward_query_range(
            config, k_block * bk, padded.offset, bq, bk, q_pad // bq
        )
        zeros = jnp.zeros((batch, bk, num_kv, head_dim), jnp.float32)

        def query_block(q_block, acc):
            return _tile_gradients(
                config, padded, prior, ssmax_scale_H, q_block, k_block, bq, bk, acc
            )

        acc = lax.fori_loop(
            first, stop, query_block, _Accumulators(dq, zeros, zeros, dprior, dscale)
        )
        dk = lax.dynamic_update_slice_in_dim(dk, acc.dk_tile, k_block * bk, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, acc.dv_tile, k_block * bk, 1)
        return acc.dq, dk, dv, acc.dprior, acc.dscale

    zeros_like_f32 = functools.partial(jax.tree.map, lambda x: jnp.zeros(x.shape, jnp.float32))
    init = (
        jnp.zeros((batch, q_pad, num_heads, head_dim), jnp.float32),
        jnp.zeros((batch, kv_pad, num_kv, head_dim), jnp.float32),
        jnp.zeros((batch, kv_pad, num_kv, head_dim), jnp.float32),
        zeros_like_f32(prior),
        zeros_like_f32(ssmax_scale_H),
    )
    dq, dk, dv, dprior, dscale = lax.fori_loop(0, kv_pad // bk, key_block, init)
    cast_like = functools.partial(jax.tree.map, lambda g, x: g.astype(x.dtype))
    return (
        dq[:, :q_len].astype(q.dtype),
        dk[:, :kv_len].astype(k.dtype),
        dv[:, :kv_len].astype(v.dtype),
        cast_like(dprior, prior),
        cast_like(dscale, ssmax_scale_H),
    )


def _pad_inputs(config, q, k, v, aux: AuxInputs, out, lse, d_out, q_pad: int, kv_pad: int):
    delta_BxHxT = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    segments = config.segments
    counts_BxT = visible_key_counts(
        q.shape[1],
        config.kv_len,
        aux.offset_1[0],
        aux.q_seg_BxT if segments else None,
        aux.k_seg_BxS if segments else None,
        causal=config.causal,
        window=config.window,
    )
    return _Padded(
        q=pad_to(q, 1, q_pad),
        k=pad_to(k, 1, kv_pad),
        v=pad_to(v, 1, kv_pad),
        d_out=pad_to(d_out, 1, q_pad),
        lse_BxHxT=pad_to(lse, 2, q_pad, jnp.inf),  # padded rows: zero probability
        delta_BxHxT=pad_to(delta_BxHxT, 2, q_pad),
        log_n_BxT=None if aux.log_n_BxT is None else pad_to(aux.log_n_BxT, 1, q_pad),
        q_seg_BxT=pad_to(aux.q_seg_BxT, 1, q_pad, -1) if segments else None,
        k_seg_BxS=pad_to(aux.k_seg_BxS, 1, kv_pad, -1) if segments else None,
        offset=aux.offset_1[0],
        single_key_BxT=pad_to(counts_BxT == 1, 1, q_pad),
    )


def _tile_gradients(
    config: KernelConfig,
    padded: _Padded,
    prior,
    ssmax_scale_H,
    q_block,
    k_block,
    bq: int,
    bk: int,
    acc: _Accumulators,
) -> _Accumulators:
    """Adds one (query block, key block) tile's contribution to the gradients."""
    batch, _, _, head_dim = padded.q.shape
    num_kv = padded.k.shape[2]
    q0, k0 = q_block * bq, k_block * bk

    def rows(x, axis=1):
        return None if x is None else lax.dynamic_slice_in_dim(x, q0, bq, axis)

    def cols(x):
        return None if x is None else lax.dynamic_slice_in_dim(x, k0, bk, 1)

    q_pos = padded.offset + q0 + jnp.arange(bq, dtype=jnp.int32)
    k_pos = k0 + jnp.arange(bk, dtype=jnp.int32)
    log_n = rows(padded.log_n_BxT)

    def logits_fn(q_, k_, prior_, scale_):
        return _tile_logits(config, q_, k_, prior_, scale_, q_pos, k_pos, log_n)

    logits, vjp_fn = jax.vjp(logits_fn, rows(padded.q), cols(padded.k), prior, ssmax_scale_H)
    mask = (
        visibility_mask(
            q_pos,
            k_pos,
            rows(padded.q_seg_BxT),
            cols(padded.k_seg_BxS),
            causal=config.causal,
            window=config.window,
        )
        & (k_pos < config.kv_len)[None, None, :]
    )
    # A row's logits can be ~1e30 (GGD prior at d = mu with theta_beta < 0, not scaled by
    # log(1) = 0). The forward kernel computed them with other rounding, so logits - lse is
    # only accurate to ~1e23 there: clamp at p <= 1, and a query with one key gives it p = 1.
    shifted = jnp.minimum(logits - rows(padded.lse_BxHxT, 2)[..., None], 0.0)
    probs = jnp.where(rows(padded.single_key_BxT)[:, None, :, None], 1.0, jnp.exp(shifted))
    probs = jnp.where(mask[:, None], probs, 0.0)
    probs_g = probs.reshape(batch, num_kv, config.groups, bq, bk)
    do_g = rows(padded.d_out).reshape(batch, bq, num_kv, config.groups, head_dim)
    do_g = do_g.astype(jnp.float32)
    dv_tile = acc.dv_tile + jnp.einsum("bkgqs,bqkgd->bskd", probs_g, do_g)
    dprobs = jnp.einsum("bqkgd,bskd->bkgqs", do_g, cols(padded.v).astype(jnp.float32))
    delta = rows(padded.delta_BxHxT, 2)[..., None]
    dlogits = probs * (dprobs.reshape(probs.shape) - delta)
    dq_t, dk_t, dprior_t, dscale_t = vjp_fn(dlogits)
    dq = lax.dynamic_update_slice_in_dim(acc.dq, rows(acc.dq) + dq_t.astype(jnp.float32), q0, 1)
    return _Accumulators(
        dq=dq,
        dk_tile=acc.dk_tile + dk_t.astype(jnp.float32),
        dv_tile=dv_tile,
        dprior=jax.tree.map(jnp.add, acc.dprior, dprior_t),
        dscale=jax.tree.map(jnp.add, acc.dscale, dscale_t),
    )


def _backward_query_range(config: KernelConfig, k_start, offset, bq: int, bk: int, num_q: int):
    """[first, stop) query blocks that can see any key in [k_start, k_start + bk)."""
    first = jnp.int32(0)
    stop = jnp.int32(num_q)
    if config.causal:
        first = jnp.clip((k_start - offset) // bq, 0, num_q)
    if config.window is not None:
        stop = jnp.clip((k_start + bk - 1 + config.window - offset) // bq + 1, first, num_q)
        if not config.causal:
            first = jnp.clip((k_start - config.window - offset) // bq, 0, stop)
    return first, stop
