"""Flash-style blockwise attention with a positional prior evaluated per tile.

Queries are processed one block at a time (a sequential map), and each query block
runs an online softmax over the key blocks it can see: the trip count is dynamic, so
key blocks above the causal diagonal, outside the sliding window, or in unfilled
cache slots are never touched. No array of size T x S exists at any point.

The prior of a (query block, key block) tile depends on the distance
d = k_pos - q_pos only. Inside one tile d takes bq + bk - 1 distinct values, so the
prior is evaluated on that vector (cheap: O(H (bq + bk)) instead of O(H bq bk)
transcendental functions) and expanded to the tile as a Toeplitz matrix by a
strided reshape that XLA fuses into the logits. The backward pass gets the
distance gradient as the transpose of that expansion (sums along diagonals) and
differentiates `prior.bias` on the vector, so any prior with a `bias` method works
(GGD, ALiBi) and the query offset may be a traced value.

The gradient is a custom VJP in the FlashAttention-2 style: probabilities are
recomputed from the saved log-sum-exp, one pass over key blocks (outer) and the
query blocks that see them (inner), accumulating dq in place.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from bam_jax.priors import Prior

_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that fixes the compiled program (hashable, not traced)."""

    causal: bool
    window: int | None
    block_q: int
    block_k: int
    kv_len: int
    prior_inside: bool
    key_padding: bool  # padded key slots exist beyond kv_len


def blockwise_attention(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    *,
    prior: Prior | None,
    ssmax_scale_H: jax.Array | None,
    ssmax_prior_inside: bool,
    query_segment_ids_BxT: jax.Array | None,
    key_segment_ids_BxS: jax.Array | None,
    query_offset: int | jax.Array,
    causal: bool,
    window: int | None,
    block_q: int,
    block_k: int,
) -> jax.Array:
    """Same function as `reference_attention`, in memory linear in T and S."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")
    batch, q_len, num_heads, head_dim = query_BxTxHxD.shape
    kv_len, num_kv_heads = key_BxSxKxD.shape[1], key_BxSxKxD.shape[2]
    groups = num_heads // num_kv_heads
    bq, bk = min(block_q, q_len), min(block_k, kv_len)
    q_pad, kv_pad = -q_len % bq, -kv_len % bk
    static = _Static(causal, window, bq, bk, kv_len, ssmax_prior_inside, kv_pad > 0)
    offset = jnp.asarray(query_offset, jnp.int32)

    q_BxKxGxTxD = _to_blocked_layout(query_BxTxHxD, num_kv_heads, groups, q_pad)
    k_BxKxSxD = _to_blocked_layout(key_BxSxKxD, num_kv_heads, 1, kv_pad)[:, :, 0]
    v_BxKxSxD = _to_blocked_layout(value_BxSxKxD, num_kv_heads, 1, kv_pad)[:, :, 0]
    q_seg, k_seg = None, None
    if query_segment_ids_BxT is not None:
        q_seg = _pad_axis1(query_segment_ids_BxT.astype(jnp.int32), q_pad, -1)
        k_seg = _pad_axis1(key_segment_ids_BxS.astype(jnp.int32), kv_pad, -1)
    log_n = None
    if ssmax_scale_H is not None:
        log_n = _log_visible_counts(static, q_len + q_pad, offset, q_seg, k_seg)
        ssmax_scale_H = ssmax_scale_H.astype(jnp.float32).reshape(num_kv_heads, groups)

    out_BxKxGxTxD = _attention(
        static, q_BxKxGxTxD, k_BxKxSxD, v_BxKxSxD, prior, ssmax_scale_H, log_n, q_seg, k_seg, offset
    )
    out_BxTxKxGxD = jnp.moveaxis(out_BxKxGxTxD[:, :, :, :q_len], 3, 1)
    out = out_BxTxKxGxD.reshape(batch, q_len, num_heads, head_dim)
    return out.astype(query_BxTxHxD.dtype)


def _pad_axis1(x: jax.Array, pad: int, value: int | float) -> jax.Array:
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _to_blocked_layout(x_BxLxHxD: jax.Array, kv_heads: int, groups: int, pad: int) -> jax.Array:
    """[B, L, K*G, D] -> float32 [B, K, G, L + pad, D]."""
    batch, length, _, head_dim = x_BxLxHxD.shape
    x = _pad_axis1(x_BxLxHxD.astype(jnp.float32), pad, 0.0)
    x = x.reshape(batch, length + pad, kv_heads, groups, head_dim)
    return jnp.transpose(x, (0, 2, 3, 1, 4))


# ----------------------------------------------------------------------------- ranges


def _key_block_range(static: _Static, q_start: jax.Array, num_k_blocks: int):
    """[lo, hi) key blocks that query rows q_start .. q_start + bq - 1 may see."""
    first_pos, last_pos = q_start, q_start + static.block_q - 1
    lo_pos = first_pos - static.window if static.window is not None else jnp.int32(0)
    if static.causal:
        hi_pos = last_pos
    elif static.window is not None:
        hi_pos = last_pos + static.window
    else:
        hi_pos = jnp.int32(static.kv_len - 1)
    lo = jnp.clip(lo_pos // static.block_k, 0, num_k_blocks)
    hi = jnp.clip(hi_pos // static.block_k + 1, 0, num_k_blocks)
    return lo, hi


def _query_block_range(static: _Static, k_start: jax.Array, offset: jax.Array, num_q_blocks: int):
    """[lo, hi) query blocks whose rows may see keys k_start .. k_start + bk - 1."""
    first_key, last_key = k_start, k_start + static.block_k - 1
    if static.causal:
        lo_pos = first_key
    elif static.window is not None:
        lo_pos = first_key - static.window
    else:
        lo_pos = None
    lo = jnp.int32(0) if lo_pos is None else jnp.clip((lo_pos - offset) // static.block_q, 0, None)
    hi = jnp.int32(num_q_blocks)
    if static.window is not None:
        hi = jnp.clip((last_key + static.window - offset) // static.block_q + 1, None, hi)
    lo = jnp.minimum(lo, num_q_blocks)
    return lo, jnp.maximum(hi, lo)


# ----------------------------------------------------------------------------- tiles


def _tile_mask(static: _Static, q_pos_Q, k_pos_K, q_seg_BxQ, k_seg_BxK) -> jax.Array:
    """Boolean [B or 1, 1, 1, bq, bk]: may query row attend to key column."""
    distance_QxK = q_pos_Q[:, None] - k_pos_K[None, :]
    mask = jnp.ones(distance_QxK.shape, bool)
    if static.causal:
        mask &= distance_QxK >= 0
    if static.window is not None:
        mask &= jnp.abs(distance_QxK) <= static.window
    if static.key_padding:
        mask &= (k_pos_K < static.kv_len)[None, :]
    mask = mask[None]
    if q_seg_BxQ is not None:
        same = q_seg_BxQ[:, :, None] == k_seg_BxK[:, None, :]
        mask = mask & same & (k_seg_BxK >= 0)[:, None, :]
    return mask[:, None, None]


def _toeplitz(vec_HxL: jax.Array, rows: int, cols: int) -> jax.Array:
    """out[h, i, j] = vec[h, j - i + rows - 1], by a strided reshape (no gather).

    Broadcasting the (padded) vector to `rows` copies of period P and reading the
    flat result with row stride P - 1 shifts each row one step to the right. P is a
    power of two so that the fused index arithmetic is shifts and masks (with P =
    rows + cols - 1 the integer division makes the prior cost 2.5x the attention).
    """
    heads, length = vec_HxL.shape
    period = 1 << (max(length, cols + 1) - 1).bit_length()
    vec_HxP = jnp.pad(vec_HxL, ((0, 0), (0, period - length)))
    flat = jnp.broadcast_to(vec_HxP[:, None, :], (heads, rows, period)).reshape(heads, -1)
    flat = flat[:, rows - 1 : rows - 1 + rows * (period - 1)]
    return flat.reshape(heads, rows, period - 1)[:, :, :cols]


def _tile_bias(prior: Prior, q_start: jax.Array, k_start: jax.Array, rows: int, cols: int):
    """Prior bias of one tile, [H, rows, cols], from its rows + cols - 1 distances."""
    first = k_start - q_start - (rows - 1)
    distance_L = (first + jnp.arange(rows + cols - 1, dtype=jnp.int32)).astype(jnp.float32)
    return _toeplitz(prior.bias(distance_L), rows, cols)


def _tile_logits(
    static: _Static,
    q_BxKxGxQxD: jax.Array,
    k_BxKxCxD: jax.Array,
    prior: Prior | None,
    scale_KxG: jax.Array | None,
    log_n_BxQ: jax.Array | None,
    q_start: jax.Array,
    k_start: jax.Array,
) -> jax.Array:
    """Unmasked float32 logits [B, K, G, bq, bk] of one tile."""
    kv_heads, groups, head_dim = q_BxKxGxQxD.shape[1], q_BxKxGxQxD.shape[2], q_BxKxGxQxD.shape[4]
    logits = jnp.einsum("bkgqd,bksd->bkgqs", q_BxKxGxQxD, k_BxKxCxD)
    logits = logits / jnp.float32(math.sqrt(head_dim))
    bias = None
    if prior is not None:
        bias_HxQxC = _tile_bias(prior, q_start, k_start, static.block_q, static.block_k)
        bias = bias_HxQxC.reshape(kv_heads, groups, static.block_q, static.block_k)
    if scale_KxG is not None:
        factor = (scale_KxG[None, :, :, None] * log_n_BxQ[:, None, None, :])[..., None]
        if bias is not None and static.prior_inside:
            return (logits + bias) * factor
        logits = logits * factor
    return logits if bias is None else logits + bias


# ----------------------------------------------------------------------------- counts


def _log_visible_counts(static: _Static, q_len: int, offset, q_seg_BxT, k_seg_BxS) -> jax.Array:
    """log(max(n_i, 1)) in float32, [B or 1, T]: n_i = keys query i may see."""
    if q_seg_BxT is None:
        counts_T = _closed_form_counts(static, q_len, offset)
        return jnp.log(jnp.maximum(counts_T, 1).astype(jnp.float32))[None]
    counts_BxT = _counted_visible(static, offset, q_seg_BxT, k_seg_BxS)
    return jnp.log(jnp.maximum(counts_BxT, 1).astype(jnp.float32))


def _closed_form_counts(static: _Static, q_len: int, offset) -> jax.Array:
    pos_T = jnp.arange(q_len, dtype=jnp.int32) + offset
    lo = pos_T - static.window if static.window is not None else jnp.zeros_like(pos_T)
    if static.causal:
        hi = pos_T
    elif static.window is not None:
        hi = pos_T + static.window
    else:
        hi = jnp.full_like(pos_T, static.kv_len - 1)
    lo, hi = jnp.maximum(lo, 0), jnp.minimum(hi, static.kv_len - 1)
    return jnp.maximum(hi - lo + 1, 0)


def _counted_visible(static: _Static, offset, q_seg_BxT, k_seg_BxS) -> jax.Array:
    """Blockwise count of visible keys per query (documents make it data dependent)."""
    bq, bk = static.block_q, static.block_k
    num_q_blocks, num_k_blocks = q_seg_BxT.shape[1] // bq, k_seg_BxS.shape[1] // bk

    def query_block(qb):
        q_start = qb * bq
        q_seg = lax.dynamic_slice_in_dim(q_seg_BxT, q_start, bq, axis=1)
        q_pos = q_start + offset + jnp.arange(bq, dtype=jnp.int32)

        def key_block(kb, counts_BxQ):
            k_start = kb * bk
            k_seg = lax.dynamic_slice_in_dim(k_seg_BxS, k_start, bk, axis=1)
            k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
            mask = _tile_mask(static, q_pos, k_pos, q_seg, k_seg)[:, 0, 0]
            return counts_BxQ + jnp.sum(mask, axis=-1, dtype=jnp.int32)

        lo, hi = _key_block_range(static, q_start + offset, num_k_blocks)
        init = jnp.zeros(q_seg.shape, jnp.int32)
        return lax.fori_loop(lo, hi, key_block, init)

    counts = lax.map(query_block, jnp.arange(num_q_blocks))
    return jnp.moveaxis(counts, 0, 1).reshape(q_seg_BxT.shape)


# ----------------------------------------------------------------------------- passes


def _forward(static, q, k, v, prior, scale, log_n, q_seg, k_seg, offset):
    """Output [B, K, G, T, D] and log-sum-exp [B, K, G, T] (-inf for rows that see nothing)."""
    bq, bk = static.block_q, static.block_k
    num_q_blocks, num_k_blocks = q.shape[3] // bq, k.shape[2] // bk

    def query_block(qb):
        q_start = qb * bq
        q_tile = lax.dynamic_slice_in_dim(q, q_start, bq, axis=3)
        q_seg_tile = _slice_or_none(q_seg, q_start, bq)
        log_n_tile = _slice_or_none(log_n, q_start, bq)
        q_pos = q_start + offset + jnp.arange(bq, dtype=jnp.int32)

        def key_block(kb, carry):
            m, denom, acc = carry
            k_start = kb * bk
            k_tile = lax.dynamic_slice_in_dim(k, k_start, bk, axis=2)
            v_tile = lax.dynamic_slice_in_dim(v, k_start, bk, axis=2)
            k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
            mask = _tile_mask(static, q_pos, k_pos, q_seg_tile, _slice_or_none(k_seg, k_start, bk))
            logits = _tile_logits(
                static, q_tile, k_tile, prior, scale, log_n_tile, q_start + offset, k_start
            )
            logits = jnp.where(mask, logits, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            p = jnp.exp(logits - m_safe[..., None])
            correction = jnp.exp(m - m_safe)
            denom = denom * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + jnp.einsum("bkgqs,bksd->bkgqd", p, v_tile)
            return m_new, denom, acc

        stats_shape = q_tile.shape[:-1]
        init = (
            jnp.full(stats_shape, _NEG_INF, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(q_tile.shape, jnp.float32),
        )
        lo, hi = _key_block_range(static, q_start + offset, num_k_blocks)
        m, denom, acc = lax.fori_loop(lo, hi, key_block, init)
        seen = denom > 0
        out = acc / jnp.where(seen, denom, 1.0)[..., None]
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), _NEG_INF)
        return out, lse

    out_blocks, lse_blocks = lax.map(query_block, jnp.arange(num_q_blocks))
    out = jnp.moveaxis(out_blocks, 0, 3).reshape(q.shape)
    lse = jnp.moveaxis(lse_blocks, 0, 3).reshape(q.shape[:-1])
    return out, lse


def _slice_or_none(x: jax.Array | None, start, size: int) -> jax.Array | None:
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=1)


def _backward(static, residuals, d_out):
    q, k, v, prior, scale, log_n, q_seg, k_seg, offset, out, lse = residuals
    bq, bk = static.block_q, static.block_k
    num_q_blocks, num_k_blocks = q.shape[3] // bq, k.shape[2] // bk
    delta = jnp.sum(d_out * out, axis=-1)
    lse = jnp.where(jnp.isfinite(lse), lse, 0.0)
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)

    def key_block(carry, kb):
        k_start = kb * bk
        k_tile = lax.dynamic_slice_in_dim(k, k_start, bk, axis=2)
        v_tile = lax.dynamic_slice_in_dim(v, k_start, bk, axis=2)
        k_seg_tile = _slice_or_none(k_seg, k_start, bk)
        k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)

        def query_block(qb, inner):
            dk, dv, dq, d_prior, d_scale = inner
            q_start = qb * bq
            q_tile = lax.dynamic_slice_in_dim(q, q_start, bq, axis=3)
            do_tile = lax.dynamic_slice_in_dim(d_out, q_start, bq, axis=3)
            lse_tile = lax.dynamic_slice_in_dim(lse, q_start, bq, axis=3)
            delta_tile = lax.dynamic_slice_in_dim(delta, q_start, bq, axis=3)
            log_n_tile = _slice_or_none(log_n, q_start, bq)
            q_pos = q_start + offset + jnp.arange(bq, dtype=jnp.int32)
            mask = _tile_mask(static, q_pos, k_pos, _slice_or_none(q_seg, q_start, bq), k_seg_tile)

            def logits_fn(q_t, k_t, prior_t, scale_t):
                return _tile_logits(
                    static, q_t, k_t, prior_t, scale_t, log_n_tile, q_start + offset, k_start
                )

            logits, logits_vjp = jax.vjp(logits_fn, q_tile, k_tile, prior, scale)
            p = jnp.where(mask, jnp.exp(logits - lse_tile[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, do_tile)
            dp = jnp.einsum("bkgqd,bksd->bkgqs", do_tile, v_tile)
            # A key holding the whole probability has a zero softmax gradient; taking it
            # as exactly zero keeps the rounding of delta out of large prior derivatives.
            ds = jnp.where(p == 1.0, 0.0, p * (dp - delta_tile[..., None]))
            dq_tile, dk_tile, dprior_tile, dscale_tile = logits_vjp(ds)
            dq_old = lax.dynamic_slice_in_dim(dq, q_start, bq, axis=3)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_old + dq_tile, q_start, axis=3)
            d_prior = jax.tree.map(jnp.add, d_prior, dprior_tile)
            d_scale = jax.tree.map(jnp.add, d_scale, dscale_tile)
            return dk + dk_tile, dv, dq, d_prior, d_scale

        dq, d_prior, d_scale = carry
        lo, hi = _query_block_range(static, k_start, offset, num_q_blocks)
        init = (zeros(k_tile), zeros(v_tile), dq, d_prior, d_scale)
        dk, dv, dq, d_prior, d_scale = lax.fori_loop(lo, hi, query_block, init)
        return (dq, d_prior, d_scale), (dk, dv)

    init = (zeros(q), zeros(prior), zeros(scale))
    (dq, d_prior, d_scale), (dk_blocks, dv_blocks) = lax.scan(
        key_block, init, jnp.arange(num_k_blocks)
    )
    dk = jnp.moveaxis(dk_blocks, 0, 2).reshape(k.shape)
    dv = jnp.moveaxis(dv_blocks, 0, 2).reshape(v.shape)
    return dq, dk, dv, d_prior, d_scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, prior, scale, log_n, q_seg, k_seg, offset):
    return _forward(static, q, k, v, prior, scale, log_n, q_seg, k_seg, offset)[0]


def _attention_fwd(static, q, k, v, prior, scale, log_n, q_seg, k_seg, offset):
    out, lse = _forward(static, q, k, v, prior, scale, log_n, q_seg, k_seg, offset)
    return out, (q, k, v, prior, scale, log_n, q_seg, k_seg, offset, out, lse)


def _attention_bwd(static, residuals, d_out):
    dq, dk, dv, d_prior, d_scale = _backward(static, residuals, d_out)
    log_n = residuals[5]
    d_log_n = None if log_n is None else jnp.zeros_like(log_n)
    return dq, dk, dv, d_prior, d_scale, d_log_n, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)
