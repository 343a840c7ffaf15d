"""Flash-style blockwise attention with a positional prior gathered per tile.

Queries are processed one block at a time (a sequential loop), and each query block
runs an online softmax in float32 over the key blocks it can see: the trip count is
dynamic, so key blocks above the causal diagonal, outside the sliding window, or in
unfilled cache slots are never touched. No array of size T x S exists at any point;
apart from the inputs, the output and their gradients, memory is a few tiles plus
O(H (S + T)) for the prior.

The prior depends on the distance d = k_pos - q_pos only. It is evaluated once on
every distance a tile can hold (a table [H, X], X = S + T - 1); a tile's M + N - 1 values
are a slice of it, expanded to the tile as a Toeplitz matrix by a strided reshape
that XLA fuses into the logits. The gradient flows back the same way: sums along the
tile's diagonals are added into a table gradient, and one VJP of `prior.bias` on
the table gives the parameter gradients. Any prior with a `bias` method works (GGD,
ALiBi), and the query offset may be a traced value (it shifts the table's distances,
not the tile indexing).

A causal sliding window over a long key array (a local layer reading a KV cache) first
cuts the keys down to the span the window can reach (`window_keys`), aligned to whole key
blocks so that every tile holds the same keys as without the cut: the table, the SSMax
counts and the loops are then O(window + T), not O(S), bit for bit the same output.

The gradient is a custom VJP in the FlashAttention-2 style: probabilities are
recomputed from the saved log-sum-exp in one pass over key blocks (outer) and the
query blocks that see them (inner), accumulating dq in place. With a prior, a second,
lighter pass over the same tiles takes each query's rounding residue out of the table's
cotangent (`_prior_cotangent_residue`). The Pallas kernels' custom VJP runs the same
backward (`flash_backward`) on their output and log-sum-exp.

Tiles are [I, J, *] with I = K (a tile per key/value head) and J = G * M rows (the query
block of every query head sharing that key/value head), so every product is a plain
batched matmul and grouped-query heads share their key tile. The batch rows are a vmap
around the whole computation, forward and backward, never merged with the heads: under a
mesh that shards batch and heads, XLA keeps both sharded and each device computes its
own rows and heads, with no collective but the sum of the prior's and the SSMax scales'
gradients over the batch shards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from bam_jax.attention_inputs import AttentionInputs, checked_attention, keys_in_window
from bam_jax.attention_spec import AttentionSpec
from bam_jax.kernels.prior_table import prior_table_distances
from bam_jax.masking import (
    PADDING_SEGMENT,
    AttentionMask,
    all_known,
    log_visible_count,
    round_up_to,
)
from bam_jax.pytrees import vary_together

DEFAULT_BLOCK = 256
_NEG_INF = -jnp.inf
# dot_general dimension numbers for [I, a, b] operands batched over I.
_NT = (((2,), (2,)), ((0,), (0,)))  # x @ y^T
_NN = (((2,), (1,)), ((0,), (0,)))  # x @ y


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything that fixes the compiled program (hashable, not traced)."""

    mask: AttentionMask
    block_q: int
    block_k: int
    q_len_padded: int
    kv_heads: int
    groups: int
    prior_inside: bool


class _Padded(NamedTuple):
    """Inputs padded to whole tiles along the sequence axis (axis 1)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    q_seg: jax.Array | None
    k_seg: jax.Array | None
    offset: jax.Array
    log_n: jax.Array | None  # [B or 1, T]: SSMax's log(n_i), None without SSMax
    single_key: jax.Array  # bool [B or 1, T]: the query sees exactly one key (backward only)


def attend_blockwise(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec,
    inputs: AttentionInputs,
) -> jax.Array:
    """Same function as `reference_attention`, in memory linear in T and S.

    Tiles: `spec.block_q` x `spec.block_k` (None: DEFAULT_BLOCK), capped at the lengths
    where these are known (a symbolic length of `jax.export` is padded to whole tiles).
    """
    block_k = spec.block_k or DEFAULT_BLOCK
    key_BxSxKxD, value_BxSxKxD, inputs = keys_in_window(
        key_BxSxKxD,
        value_BxSxKxD,
        spec,
        inputs,
        q_len=query_BxTxHxD.shape[1],
        block_k=capped_block(block_k, key_BxSxKxD.shape[1]),
    )
    static = _static(
        spec.mask(key_BxSxKxD.shape[1]),
        spec.ssmax_prior_inside,
        query_BxTxHxD.shape,
        key_BxSxKxD.shape,
        spec.block_q or DEFAULT_BLOCK,
        block_k,
    )
    padded = _pad_inputs(static, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, inputs)
    scale_KxG = None
    if inputs.has_ssmax:
        scale_KxG = _scale_by_kv_head(static, inputs.ssmax_scale_H)
    bias_table = None
    if inputs.prior is not None:
        bias_table = inputs.prior.bias(_table_distances(static, padded))
    bias_table, scale_KxG, padded = vary_together((bias_table, scale_KxG, padded))
    out = _per_batch_row(_attention, static, bias_table, scale_KxG, padded)
    return out[:, : query_BxTxHxD.shape[1]]


blockwise_attention = checked_attention(attend_blockwise, "blockwise_attention")


def _per_batch_row(attention, static: _Static, bias_table, scale, padded: _Padded) -> jax.Array:
    """`attention` vmapped over the batch rows, so that tiles keep the batch apart from
    the kv heads: under a mesh that shards batch and heads, each device then computes its
    own rows and heads (tiles of B * K rows would be gathered first)."""
    axes = _row_axes(padded)

    def one_row(padded_row: _Padded) -> jax.Array:
        return attention(static, bias_table, scale, _with_batch(padded_row, axes))[0]

    return jax.vmap(one_row, in_axes=(axes,))(padded)


def _backward_per_row(static: _Static, residuals, d_out):
    """`_backward` vmapped over the batch rows (see `_per_batch_row`); the prior's and
    SSMax's gradients are summed over the rows."""
    bias_table, scale, padded, out, lse = residuals
    axes = _row_axes(padded)

    def one_row(padded_row: _Padded, out_row, lse_row, d_out_row):
        row = (bias_table, scale, _with_batch(padded_row, axes), out_row[None], lse_row[None])
        dq, dk, dv, d_table, d_scale = _backward(static, row, d_out_row[None])
        return dq[0], dk[0], dv[0], d_table, d_scale

    dq, dk, dv, d_table, d_scale = jax.vmap(one_row, in_axes=(axes, 0, 0, 0))(
        padded, out, lse, d_out
    )
    d_table, d_scale = jax.tree.map(lambda x: jnp.sum(x, axis=0), (d_table, d_scale))
    return dq, dk, dv, d_table, d_scale


def _row_axes(padded: _Padded) -> _Padded:
    """vmap axes of the padded inputs: 0 for arrays with a batch axis, None for the offset
    and for SSMax counts shared by the rows ([1, T])."""
    batch = padded.q.shape[0]
    axes = jax.tree.map(lambda x: 0 if x.ndim and x.shape[0] == batch else None, padded)
    return axes._replace(offset=None)


def _with_batch(padded_row: _Padded, axes: _Padded) -> _Padded:
    """One row's inputs with their batch axis (of 1) restored."""
    return jax.tree.map(lambda x, axis: x if axis is None else x[None], padded_row, axes)


def capped_block(block: int, length) -> int:
    """A tile size along an axis of `length`: `block`, lowered to the length where that is
    known. A symbolic length (`jax.export` with shapes such as "b, t") keeps the whole
    block, and the axis is padded to whole tiles."""
    return min(block, length) if all_known(length) else block


def flash_backward(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec,
    inputs: AttentionInputs,
    out_BxTxHxD: jax.Array,
    lse_BxHxT: jax.Array,
    d_out_BxTxHxD: jax.Array,
    *,
    block: int,
):
    """Cotangents (dq, dk, dv, dprior, dssmax) of an attention forward computed elsewhere
    (the fused kernels), from its output and natural-log log-sum-exp (+inf for rows that
    see no key), by the blockwise backward on tiles of at most `block` rows/keys. The
    keys are those the forward read (a window's cut included): the mask is
    `spec.mask(key_BxSxKxD.shape[1])`."""
    q_len, kv_len = query_BxTxHxD.shape[1], key_BxSxKxD.shape[1]
    mask, prior_inside = spec.mask(kv_len), spec.ssmax_prior_inside
    static = _static(mask, prior_inside, query_BxTxHxD.shape, key_BxSxKxD.shape, block, block)
    padded = _pad_inputs(static, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, inputs)
    q_pad = static.q_len_padded - q_len
    out, d_out = (_pad_axis1(x, q_pad, 0) for x in (out_BxTxHxD, d_out_BxTxHxD))
    lse = jnp.pad(lse_BxHxT, ((0, 0), (0, 0), (0, q_pad)), constant_values=jnp.inf)
    # Inside shard_map the tiles vary over every axis that any input does (batch and heads);
    # the prior and the scales vary with the heads only, so they are cast to vary with the
    # tiles inside their VJPs, whose transposes then sum their gradients over the batch.
    padded, out, lse, d_out = vary_together((padded, out, lse, d_out))
    prior, ssmax_scale_H = inputs.prior, inputs.ssmax_scale_H
    scale_KxG, scale_vjp, bias_table, table_vjp = None, None, None, None
    if ssmax_scale_H is not None:
        scale_KxG, scale_vjp = jax.vjp(
            lambda s: vary_together(_scale_by_kv_head(static, s), padded), ssmax_scale_H
        )
    if prior is not None:
        distances = _table_distances(static, padded)
        bias_table, table_vjp = jax.vjp(lambda p: vary_together(p.bias(distances), padded), prior)
    dq, dk, dv, d_table, d_scale = _backward_per_row(
        static, (bias_table, scale_KxG, padded, out, lse), d_out
    )
    d_prior = None if prior is None else table_vjp(d_table)[0]
    d_scale = None if ssmax_scale_H is None else scale_vjp(d_scale)[0]
    return dq[:, :q_len], dk[:, :kv_len], dv[:, :kv_len], d_prior, d_scale


def _static(
    mask: AttentionMask,
    prior_inside: bool,
    q_shape: tuple[int, ...],
    k_shape: tuple[int, ...],
    block_q: int,
    block_k: int,
) -> _Static:
    q_len, num_heads = q_shape[1], q_shape[2]
    kv_len, num_kv_heads = k_shape[1], k_shape[2]
    bq, bk = capped_block(block_q, q_len), capped_block(block_k, kv_len)
    return _Static(
        mask=mask,
        block_q=bq,
        block_k=bk,
        q_len_padded=round_up_to(q_len, bq),
        kv_heads=num_kv_heads,
        groups=num_heads // num_kv_heads,
        prior_inside=prior_inside,
    )


def _pad_inputs(
    static: _Static, q: jax.Array, k: jax.Array, v: jax.Array, inputs: AttentionInputs
) -> _Padded:
    q_len = q.shape[1]
    q_pad = static.q_len_padded - q_len
    kv_pad = round_up_to(k.shape[1], static.block_k) - k.shape[1]
    offset = jnp.asarray(inputs.query_offset, jnp.int32)
    q_seg, k_seg = inputs.query_segment_ids_BxT, inputs.key_segment_ids_BxS
    if q_seg is not None:
        q_seg = _pad_axis1(q_seg.astype(jnp.int32), q_pad, PADDING_SEGMENT)
        k_seg = _pad_axis1(k_seg.astype(jnp.int32), kv_pad, PADDING_SEGMENT)
    # Counted once for SSMax and the backward (a forward alone drops what it does not use).
    counts_BxT = static.mask.visible_counts(static.q_len_padded, offset, q_seg, k_seg)
    log_n = None
    if inputs.has_ssmax:
        log_n = log_visible_count(counts_BxT, inputs.ssmax_max_count)
    return _Padded(
        q=_pad_axis1(q, q_pad, 0),
        k=_pad_axis1(k, kv_pad, 0),
        v=_pad_axis1(v, kv_pad, 0),
        q_seg=q_seg,
        k_seg=k_seg,
        offset=offset,
        log_n=log_n,
        single_key=counts_BxT == 1,
    )


def _scale_by_kv_head(static: _Static, ssmax_scale_H: jax.Array) -> jax.Array:
    return ssmax_scale_H.astype(jnp.float32).reshape(static.kv_heads, static.groups)


def _pad_axis1(x: jax.Array, pad: int, value: int | float) -> jax.Array:
    if all_known(pad) and not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


# ----------------------------------------------------------------------------- layout


def _rows_tile(static: _Static, x_BxTxHxD: jax.Array, start, size: int) -> jax.Array:
    """float32 [I, J, D] tile (J = G * size) of a [B, T, H, D] array (rows ordered by group)."""
    batch, _, _, head_dim = x_BxTxHxD.shape
    tile = lax.dynamic_slice_in_dim(x_BxTxHxD, start, size, axis=1).astype(jnp.float32)
    tile = tile.reshape(batch, size, static.kv_heads, static.groups, head_dim)
    tile = jnp.transpose(tile, (0, 2, 3, 1, 4))
    return tile.reshape(batch * static.kv_heads, static.groups * size, head_dim)


def _keys_tile(x_BxSxKxD: jax.Array, start, size: int) -> jax.Array:
    """float32 [I, size, D] tile of a [B, S, K, D] array."""
    batch, _, kv_heads, head_dim = x_BxSxKxD.shape
    tile = lax.dynamic_slice_in_dim(x_BxSxKxD, start, size, axis=1).astype(jnp.float32)
    return jnp.transpose(tile, (0, 2, 1, 3)).reshape(batch * kv_heads, size, head_dim)


def _rows_to_bthd(static: _Static, x_IxJxD: jax.Array, batch: int) -> jax.Array:
    """Inverse of `_rows_tile`'s layout change: [I, J, D] -> [B, M, H, D]."""
    head_dim = x_IxJxD.shape[-1]
    x = x_IxJxD.reshape(batch, static.kv_heads, static.groups, -1, head_dim)
    x = jnp.transpose(x, (0, 3, 1, 2, 4))
    return x.reshape(batch, x.shape[1], static.kv_heads * static.groups, head_dim)


# ----------------------------------------------------------------------------- tiles


def _tile_mask(static: _Static, q_pos_M, k_pos_N, q_seg_BxM, k_seg_BxN) -> jax.Array:
    """Boolean [B or 1, M, N]: may query row attend to key column."""
    if q_seg_BxM is None:
        return static.mask.visible(q_pos_M[None, :, None], k_pos_N[None, None, :])
    return static.mask.visible(
        q_pos_M[None, :, None], k_pos_N[None, None, :], q_seg_BxM[:, :, None], k_seg_BxN[:, None, :]
    )


def _expand_rows(static: _Static, x_BxMxN: jax.Array, batch: int) -> jax.Array:
    """[B or 1, M, N] per-query values -> [I, J, N] (shared by the heads)."""
    x = jnp.broadcast_to(
        x_BxMxN[:, None, None],
        (batch, static.kv_heads, static.groups, *x_BxMxN.shape[1:]),
    )
    return x.reshape(batch * static.kv_heads, -1, x_BxMxN.shape[-1])


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _toeplitz(vec_HxX: jax.Array, rows: int, cols: int) -> jax.Array:
    """out[h, i, j] = vec[h, j - i + rows - 1], by a strided reshape (no gather).

    Broadcasting the (padded) vector to `rows` copies of period p and reading the
    flat result with row stride p - 1 shifts each row one step to the right. p is a
    power of two so that the fused index arithmetic is shifts and masks (with p =
    rows + cols - 1 the integer division makes the prior cost 2.5x the attention).
    """
    heads, length = vec_HxX.shape
    period = _power_of_two_at_least(max(length, cols + 1))
    padded_HxX = jnp.pad(vec_HxX, ((0, 0), (0, period - length)))
    flat = jnp.broadcast_to(padded_HxX[:, None, :], (heads, rows, period)).reshape(heads, -1)
    flat = flat[:, rows - 1 : rows - 1 + rows * (period - 1)]
    return flat.reshape(heads, rows, period - 1)[:, :, :cols]


def _diagonal_sums(x_HxMxN: jax.Array) -> jax.Array:
    """Transpose of `_toeplitz`: g[h, r] = sum_i x[h, i, r - (M - 1) + i], [H, M + N - 1].

    Row i belongs at column offset M - 1 - i. Rows are added in pairs, the upper one one
    step to the right, and the pairs' sums then belong two steps apart: log2(M) halvings,
    each one elementwise pass over half the rows before it.
    """
    x, step = x_HxMxN, 1
    while x.shape[1] > 1:
        if x.shape[1] % 2:
            x = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))
        x = jnp.pad(x[:, 0::2], ((0, 0), (0, 0), (step, 0))) + jnp.pad(
            x[:, 1::2], ((0, 0), (0, 0), (0, step))
        )
        step *= 2
    return x[:, 0, : x_HxMxN.shape[1] + x_HxMxN.shape[2] - 1]


def _sum_leading(x: jax.Array) -> jax.Array:
    """jnp.sum(x, axis=0) by pairwise halving, which XLA fuses into one elementwise pass:
    its CPU backend's reduction over a leading axis is slow (docs/benchmarks.md)."""
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        odd = x[2 * half :]
        x = x[:half] + x[half : 2 * half]
        if odd.shape[0]:
            x = x.at[:1].add(odd)
    return x[0]


def _power_of_two_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


_toeplitz.defvjp(
    lambda vec, rows, cols: (_toeplitz(vec, rows, cols), None),
    lambda rows, cols, _, g: (_diagonal_sums(g),),
)


def _table_distances(static: _Static, padded: _Padded) -> jax.Array:
    """Every distance k_pos - q_pos a tile can hold, ascending, float32 [X], X = S + T - 1:
    the tile of (q_start, k_start) starts at entry `_table_start` whatever the offset is."""
    return prior_table_distances(static.q_len_padded, padded.k.shape[1], padded.offset)


def _table_start(static: _Static, q_start, k_start) -> jax.Array:
    return k_start - q_start + static.q_len_padded - static.block_q


def _bias_vector(static: _Static, bias_table_HxX, q_start, k_start) -> jax.Array:
    """The M + N - 1 prior values of a tile, [H, M + N - 1]."""
    length = static.block_q + static.block_k - 1
    start = _table_start(static, q_start, k_start)
    return lax.dynamic_slice_in_dim(bias_table_HxX, start, length, axis=1)


def _tile_bias(static: _Static, bias_vec_HxX: jax.Array, batch: int) -> jax.Array:
    """Prior bias of one tile, [I, J, N]."""
    bias_HxMxN = _toeplitz(bias_vec_HxX, static.block_q, static.block_k)
    bias = bias_HxMxN.reshape(1, static.kv_heads, static.groups * static.block_q, -1)
    bias = jnp.broadcast_to(bias, (batch, *bias.shape[1:]))
    return bias.reshape(batch * static.kv_heads, static.groups * static.block_q, -1)


def _tile_bias_transposed(static: _Static, bias_vec_HxX: jax.Array) -> jax.Array:
    """Prior bias of one tile with keys as rows, [K, N, J] (not broadcast over batch)."""
    # out[j, i] = vec[j - i + bq - 1] = reversed_vec[i - j + bk - 1]
    bias_HxNxM = _toeplitz(bias_vec_HxX[:, ::-1], static.block_k, static.block_q)
    bias = bias_HxNxM.reshape(static.kv_heads, static.groups, static.block_k, static.block_q)
    return jnp.transpose(bias, (0, 2, 1, 3)).reshape(static.kv_heads, static.block_k, -1)


def _tile_logits(
    static: _Static,
    q_IxJxD: jax.Array,
    k_IxNxD: jax.Array,
    bias_table: jax.Array | None,
    scale_KxG: jax.Array | None,
    log_n_BxT: jax.Array | None,
    q_start: jax.Array,
    k_start: jax.Array,
) -> jax.Array:
    """Unmasked float32 logits [I, J, N] of one tile, in the order of operations the
    backward pass recomputes them in (so that its probabilities sum to 1 as the forward's)."""
    batch = q_IxJxD.shape[0] // static.kv_heads
    logits = lax.dot_general(q_IxJxD, k_IxNxD, _NT) / jnp.float32(math.sqrt(q_IxJxD.shape[-1]))
    bias = None
    if bias_table is not None:
        bias_vec = _bias_vector(static, bias_table, q_start, k_start)
        bias = _tile_bias(static, bias_vec, batch)
    if scale_KxG is not None:
        factor_IxJx1 = _ssmax_factor(static, scale_KxG, log_n_BxT, q_start, batch)[..., None]
        if bias is not None and static.prior_inside:
            return (logits + bias) * factor_IxJx1
        logits = logits * factor_IxJx1
    return logits if bias is None else logits + bias


def _slice_or_none(x: jax.Array | None, start, size: int, axis: int = 1) -> jax.Array | None:
    return None if x is None else lax.dynamic_slice_in_dim(x, start, size, axis=axis)


# ----------------------------------------------------------------------------- passes


def _forward(static: _Static, bias_table, scale, padded: _Padded):
    """Output [B, T, H, D] (q.dtype) and natural-log log-sum-exp [B, H, T] (+inf for rows
    that see no key, so that every probability recomputed from it is 0)."""
    q, k, v, q_seg, k_seg, offset, log_n, _ = padded
    batch, q_len, num_heads, _ = q.shape
    bq, bk = static.block_q, static.block_k
    num_q_blocks = q_len // bq

    def query_block(qb, carry):
        out, lse = carry
        q_start = qb * bq
        q_tile = _rows_tile(static, q, q_start, bq)
        q_seg_tile = _slice_or_none(q_seg, q_start, bq)
        q_pos = q_start + offset + jnp.arange(bq, dtype=jnp.int32)

        def key_block(kb, state, *, masked: bool):
            m, denom, acc = state
            k_start = kb * bk
            k_tile, v_tile = _keys_tile(k, k_start, bk), _keys_tile(v, k_start, bk)
            logits = _tile_logits(
                static, q_tile, k_tile, bias_table, scale, log_n, q_start, k_start
            )
            if masked:
                k_seg_tile = _slice_or_none(k_seg, k_start, bk)
                k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
                mask = _tile_mask(static, q_pos, k_pos, q_seg_tile, k_seg_tile)
                logits = jnp.where(_expand_rows(static, mask, batch), logits, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
            m_safe = jnp.where(m_new == _NEG_INF, 0.0, m_new)
            # XLA may compute the max and the exponent from two fusions of the logits, and
            # at |logits| ~ 1e9 (a steep prior far back) their ulp is 1e2: the clamp keeps
            # that rounding from overflowing exp.
            p = jnp.exp(jnp.minimum(logits - m_safe[..., None], 0.0))
            correction = jnp.exp(m - m_safe)
            denom = denom * correction + jnp.sum(p, axis=-1)
            acc = acc * correction[..., None] + lax.dot_general(p, v_tile, _NN)
            return m_new, denom, acc

        stats_shape = q_tile.shape[:-1]
        init = (
            jnp.full(stats_shape, _NEG_INF, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros(q_tile.shape, jnp.float32),
        )
        init = vary_together(init, padded.q)
        lo, hi = static.mask.key_blocks(q_start + offset, bq, bk)
        # Blocks every query of the block sees whole need no mask (bit for bit the same).
        full = static.mask.full_key_blocks_stop(q_start + offset, bk, lo, hi, q_seg is not None)
        state = lax.fori_loop(lo, full, functools.partial(key_block, masked=False), init)
        m, denom, acc = lax.fori_loop(full, hi, functools.partial(key_block, masked=True), state)
        seen = denom > 0
        safe_denom = jnp.where(seen, denom, 1.0)
        out_tile = _rows_to_bthd(static, acc / safe_denom[..., None], batch).astype(out.dtype)
        lse_tile = jnp.where(seen, m + jnp.log(safe_denom), jnp.inf)
        out = lax.dynamic_update_slice_in_dim(out, out_tile, q_start, axis=1)
        lse_tile = lse_tile.reshape(batch, num_heads, bq)
        lse = lax.dynamic_update_slice_in_dim(lse, lse_tile, q_start, axis=2)
        return out, lse

    init = (jnp.zeros(q.shape, q.dtype), jnp.zeros((batch, num_heads, q_len), jnp.float32))
    return lax.fori_loop(0, num_q_blocks, query_block, vary_together(init, q))


def _backward(static: _Static, residuals, d_out):
    """FlashAttention-2 backward over tiles held transposed ([I, N, J], keys as rows).

    With keys as rows all five products are x @ y or x @ y^T, which XLA's CPU
    backend runs faster than the x^T @ y form the row layout needs.

    A query that sees exactly one key has probability 1 on it and a zero softmax
    gradient; both are taken exactly rather than recomputed from the log-sum-exp,
    which for a saturated GGD prior (logits near -2 ** 100, not scaled by SSMax's
    log(1) = 0) is only accurate to ~1e23. Elsewhere exp(logit - lse) is clamped at 1
    against the rounding of a log-sum-exp computed by another forward (Pallas, log2
    units).
    """
    bias_table, scale, padded, out, lse = residuals
    q, k, v = padded.q, padded.k, padded.v
    batch, q_len, _, head_dim = q.shape
    bq, bk = static.block_q, static.block_k
    num_q_blocks = q_len // bq
    sqrt_d = jnp.float32(math.sqrt(head_dim))
    delta_BxHxT = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    zeros = functools.partial(jax.tree.map, jnp.zeros_like)
    tile_at = functools.partial(_TransposedTile.at, static, bias_table, scale, padded, lse)

    def key_block(carry, kb):
        k_start = kb * bk
        k_tile, v_tile = _keys_tile(k, k_start, bk), _keys_tile(v, k_start, bk)
        k_tile_t = jnp.swapaxes(k_tile, 1, 2)

        def query_block(qb, inner):
            dk, dv, dq, d_table, row_sums, prior_row_sums = inner
            q_start = qb * bq
            q_tile = _rows_tile(static, q, q_start, bq)
            do_tile = _rows_tile(static, d_out, q_start, bq)
            delta_row = _row_stats(static, delta_BxHxT, q_start, bq)[:, None, :]
            tile = tile_at(q_tile, k_tile, q_start, k_start)
            p_t = tile.probs
            dv = dv + lax.dot_general(p_t, do_tile, _NN)
            dp_t = lax.dot_general(v_tile, do_tile, _NT)
            ds_t = jnp.where(tile.single_key_row, 0.0, p_t * (dp_t - delta_row))

            d_bias_t = ds_t
            if scale is not None:
                row_sums = _add_row_sums(static, row_sums, ds_t, p_t, tile.pre_scale, q_start)
                ds_t = ds_t * tile.factor_row
                if static.prior_inside:
                    d_bias_t = ds_t
            if bias_table is not None:
                d_table = _add_to_table(
                    static, d_table, tile.bias_cotangent(static, d_bias_t), q_start, k_start
                )
            if prior_row_sums is not None:
                prior_row_sums = _add_prior_row_sums(static, prior_row_sums, d_bias_t, p_t, q_start)
            dk = dk + lax.dot_general(ds_t, q_tile, _NN) / sqrt_d
            dq_tile_t = lax.dot_general(k_tile_t, ds_t, _NN) / sqrt_d
            dq_tile = _rows_to_bthd(static, jnp.swapaxes(dq_tile_t, 1, 2), batch)
            dq_old = lax.dynamic_slice_in_dim(dq, q_start, bq, axis=1)
            dq = lax.dynamic_update_slice_in_dim(dq, dq_old + dq_tile, q_start, axis=1)
            return dk, dv, dq, d_table, row_sums, prior_row_sums

        dq, d_table, row_sums, prior_row_sums = carry
        lo, hi = static.mask.query_blocks(k_start, bk, padded.offset, bq, num_q_blocks)
        init = vary_together(
            (zeros(k_tile), zeros(v_tile), dq, d_table, row_sums, prior_row_sums), q
        )
        dk, dv, dq, d_table, row_sums, prior_row_sums = lax.fori_loop(lo, hi, query_block, init)
        return (dq, d_table, row_sums, prior_row_sums), (dk, dv)

    row_sums = None
    if scale is not None:
        row_sums = _RowSums(*(jnp.zeros(lse.shape, jnp.float32) for _ in _RowSums._fields))
    prior_row_sums = None
    if bias_table is not None and scale is None:
        prior_row_sums = _PriorRowSums(
            *(jnp.zeros(lse.shape, jnp.float32) for _ in _PriorRowSums._fields)
        )
    init = (jnp.zeros(q.shape, jnp.float32), zeros(bias_table), row_sums, prior_row_sums)
    (dq, d_table, row_sums, prior_row_sums), (dk_blocks, dv_blocks) = lax.scan(
        key_block, vary_together(init, q), _key_block_indices(static, k)
    )
    dk, dv = (_key_blocks_to_bskd(x, k.shape) for x in (dk_blocks, dv_blocks))
    d_scale = None if scale is None else _ssmax_scale_grad(static, row_sums, padded.log_n)
    if bias_table is not None:
        if scale is not None:
            prior_row_sums = _prior_row_sums_from_ssmax(static, row_sums, scale, padded.log_n)
        residue = _prior_cotangent_residue(static, tile_at, padded, prior_row_sums, zeros(d_table))
        d_table = d_table - residue
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_table, d_scale


def _key_block_indices(static: _Static, k: jax.Array) -> jax.Array:
    return jnp.arange(k.shape[1] // static.block_k, dtype=jnp.int32)


class _TransposedTile(NamedTuple):
    """One tile's recomputed probabilities [I, N, J] (keys as rows) and what the backward
    needs beside them: what the SSMax factor multiplies, the factor [I, 1, J], the
    single-key rows [I, 1, J] and the VJP of the tile's prior bias."""

    probs: jax.Array
    pre_scale: jax.Array | None
    factor_row: jax.Array | None
    single_key_row: jax.Array
    bias_vjp: Callable | None

    @classmethod
    def at(
        cls,
        static: _Static,
        bias_table: jax.Array | None,
        scale: jax.Array | None,
        padded: _Padded,
        lse_BxHxT: jax.Array,
        q_IxJxD: jax.Array,
        k_IxNxD: jax.Array,
        q_start: jax.Array,
        k_start: jax.Array,
    ) -> _TransposedTile:
        batch = padded.q.shape[0]
        bq, bk = static.block_q, static.block_k
        sqrt_d = jnp.float32(math.sqrt(padded.q.shape[-1]))
        q_pos = q_start + padded.offset + jnp.arange(bq, dtype=jnp.int32)
        k_pos = k_start + jnp.arange(bk, dtype=jnp.int32)
        mask = _tile_mask(
            static,
            q_pos,
            k_pos,
            _slice_or_none(padded.q_seg, q_start, bq),
            _slice_or_none(padded.k_seg, k_start, bk),
        )
        scores_t = lax.dot_general(k_IxNxD, q_IxJxD, _NT) / sqrt_d
        bias_t, bias_vjp = None, None
        if bias_table is not None:
            bias_vec = _bias_vector(static, bias_table, q_start, k_start)
            bias_t, bias_vjp = jax.vjp(functools.partial(_tile_bias_transposed, static), bias_vec)
        factor_row = None
        if scale is not None:
            factor_row = _ssmax_factor(static, scale, padded.log_n, q_start, batch)[:, None, :]
        pre_scale, logits_t = _combine_transposed(static, scores_t, bias_t, factor_row)
        single_key_row = _query_rows(static, padded.single_key, q_start, batch)[:, None, :]
        lse_row = _row_stats(static, lse_BxHxT, q_start, bq)[:, None, :]
        p_t = jnp.where(single_key_row, 1.0, jnp.exp(jnp.minimum(logits_t - lse_row, 0.0)))
        p_t = jnp.where(_expand_transposed(static, mask, batch), p_t, 0.0)
        return cls(p_t, pre_scale, factor_row, single_key_row, bias_vjp)

    def bias_cotangent(self, static: _Static, d_bias_t: jax.Array) -> jax.Array:
        """The tile's [I, N, J] cotangent of its bias as one of the table's slices, [H, X']."""
        return self.bias_vjp(_sum_leading(_split_batch(static, d_bias_t)))[0]


class _PriorRowSums(NamedTuple):
    """Per-query sums over keys, [B, H, T], of the bias's cotangent and of P (accumulated
    only without SSMax; with it they follow from `_RowSums`)."""

    d_bias: jax.Array
    probs: jax.Array


def _prior_row_sums_from_ssmax(
    static: _Static, sums: _RowSums, scale_KxG: jax.Array, log_n_BxT: jax.Array
) -> _PriorRowSums:
    """The prior's row sums from SSMax's, which hold the same sums of dS and P: the bias
    sees dS times the query's factor s_h log(n_i) when the prior is inside SSMax."""
    d_bias = sums.d_logits
    if static.prior_inside:
        d_bias = d_bias * (scale_KxG.reshape(-1)[None, :, None] * log_n_BxT[:, None, :])
    return _PriorRowSums(d_bias, sums.probs)


def _add_prior_row_sums(
    static: _Static, sums: _PriorRowSums, d_bias_t: jax.Array, p_t: jax.Array, q_start
) -> _PriorRowSums:
    return _PriorRowSums(*_added_row_sums(static, sums, (d_bias_t, p_t), q_start))


def _prior_cotangent_residue(
    static: _Static,
    tile_at: Callable[..., _TransposedTile],
    padded: _Padded,
    sums: _PriorRowSums,
    zero_table_HxX: jax.Array,
) -> jax.Array:
    """What the table's cotangent holds of each query's rounding residue.

    A softmax's gradient sums to zero over each query's keys, but the recomputed dS sums to
    about 1e-6 of dP (delta = rowsum(dO * O) against probabilities recomputed from the
    log-sum-exp), and the table's VJP multiplies that residue by the bias's derivative,
    large and of one sign. The residue of query i, r_i = sum_j dS_ij / sum_j P_ij, is
    returned spread over its keys in proportion to P: sum_i r_i P_ij along each distance,
    one more pass over the tiles that recomputes P, so that only the table moves.
    """
    residue_BxHxT = sums.d_bias / jnp.where(sums.probs > 0, sums.probs, 1.0)
    q, k = padded.q, padded.k
    bq, bk = static.block_q, static.block_k
    num_q_blocks = q.shape[1] // bq

    def key_block(table, kb):
        k_start = kb * bk
        k_tile = _keys_tile(k, k_start, bk)

        def query_block(qb, table):
            q_start = qb * bq
            tile = tile_at(_rows_tile(static, q, q_start, bq), k_tile, q_start, k_start)
            residue_row = _row_stats(static, residue_BxHxT, q_start, bq)[:, None, :]
            vec = tile.bias_cotangent(static, tile.probs * residue_row)
            return _add_to_table(static, table, vec, q_start, k_start)

        lo, hi = static.mask.query_blocks(k_start, bk, padded.offset, bq, num_q_blocks)
        return lax.fori_loop(lo, hi, query_block, table), None

    table = vary_together(zero_table_HxX, q)
    return lax.scan(key_block, table, _key_block_indices(static, k))[0]


def _add_to_table(static: _Static, table_HxX, vec_HxX, q_start, k_start) -> jax.Array:
    start = _table_start(static, q_start, k_start)
    old = lax.dynamic_slice_in_dim(table_HxX, start, vec_HxX.shape[1], axis=1)
    return lax.dynamic_update_slice_in_dim(table_HxX, old + vec_HxX, start, axis=1)


def _row_stats(static: _Static, x_BxHxT: jax.Array, start, size: int) -> jax.Array:
    """[I, J] tile (J = G * size) of per-row values stored as [B, H, T] (H = K*G, K major)."""
    tile = lax.dynamic_slice_in_dim(x_BxHxT, start, size, axis=2)
    return tile.reshape(tile.shape[0] * static.kv_heads, -1)


def _split_batch(static: _Static, tile: jax.Array) -> jax.Array:
    """[I, ...] -> [B, K, ...]."""
    return tile.reshape(-1, static.kv_heads, *tile.shape[1:])


def _ssmax_factor(static: _Static, scale_KxG, log_n_BxT, q_start, batch: int) -> jax.Array:
    """s_h * log(n_i) of a query block's rows as [I, J]."""
    log_n_BxM = lax.dynamic_slice_in_dim(log_n_BxT, q_start, static.block_q, axis=1)
    factor = scale_KxG[None, :, :, None] * log_n_BxM[:, None, None, :]
    factor = jnp.broadcast_to(factor, (batch, *factor.shape[1:]))
    return factor.reshape(batch * static.kv_heads, -1)


def _query_rows(static: _Static, x_BxT: jax.Array, q_start, batch: int) -> jax.Array:
    """A query block's per-query values [B or 1, T] laid out as rows, [I, J]."""
    x_BxM = lax.dynamic_slice_in_dim(x_BxT, q_start, static.block_q, axis=1)
    x = jnp.broadcast_to(
        x_BxM[:, None, None, :], (batch, static.kv_heads, static.groups, static.block_q)
    )
    return x.reshape(batch * static.kv_heads, -1)


class _RowSums(NamedTuple):
    """Per-query sums over keys, [B, H, T], from which the backward takes d loss / d factor
    (the SSMax factor s_h log n_i of query i): of dS * x, dS, P and P * x, with dS the
    logits' gradient and x what the factor multiplies."""

    d_logits_pre: jax.Array
    d_logits: jax.Array
    probs: jax.Array
    probs_pre: jax.Array


def _add_row_sums(static: _Static, sums: _RowSums, ds_t, p_t, pre_scale_t, q_start) -> _RowSums:
    """sums plus the sums over one tile's keys ([I, N, J] tiles, keys as rows)."""
    tiles = (ds_t * pre_scale_t, ds_t, p_t, p_t * pre_scale_t)
    return _RowSums(*_added_row_sums(static, sums, tiles, q_start))


def _added_row_sums(static: _Static, totals, tiles_IxNxJ, q_start) -> tuple[jax.Array, ...]:
    """Each [B, H, T] total plus its tile's sums over the tile's keys."""
    batch = tiles_IxNxJ[0].shape[0] // static.kv_heads

    def add(total_BxHxT, tile_IxNxJ):
        rows_BxHxM = jnp.sum(tile_IxNxJ, axis=1).reshape(batch, -1, static.block_q)
        old = lax.dynamic_slice_in_dim(total_BxHxT, q_start, static.block_q, axis=2)
        return lax.dynamic_update_slice_in_dim(total_BxHxT, old + rows_BxHxM, q_start, axis=2)

    return tuple(add(total, tile) for total, tile in zip(totals, tiles_IxNxJ, strict=True))


def _ssmax_scale_grad(static: _Static, sums: _RowSums, log_n_BxT: jax.Array) -> jax.Array:
    """d loss / d scale [K, G] = sum_i log(n_i) d_i, d_i = sum_j dS_ij (x_ij - c_i) with
    c_i = E_P[x_i] = sum_j P_ij x_ij / sum_j P_ij.

    c_i changes nothing exactly (a softmax's gradient sums to zero over the keys), but
    under sharp attention x at the attended key is as large as the logits while d_i is
    small: the rounding of dS there (of dP, of delta = rowsum(dO * O), of a log-sum-exp
    from another forward) would be multiplied by |x|; centred on E_P[x], by about zero.
    """
    mean_pre = sums.probs_pre / jnp.where(sums.probs > 0, sums.probs, 1.0)
    d_factor_BxHxT = sums.d_logits_pre - sums.d_logits * mean_pre
    d_scale_H = jnp.sum(d_factor_BxHxT * log_n_BxT[:, None, :], axis=(0, 2))
    return d_scale_H.reshape(static.kv_heads, static.groups)


def _combine_transposed(static: _Static, scores_t, bias_t, factor_row):
    """Logits [I, N, J] from scores, bias [K, N, J] and SSMax factor [I, 1, J], in the
    forward's order of operations; also returns what the factor multiplies."""

    def add_bias(x):
        if bias_t is None:
            return x
        return (_split_batch(static, x) + bias_t[None]).reshape(x.shape)

    if factor_row is None:
        return None, add_bias(scores_t)
    if static.prior_inside:
        pre_scale = add_bias(scores_t)
        return pre_scale, pre_scale * factor_row
    return scores_t, add_bias(scores_t * factor_row)


def _expand_transposed(static: _Static, mask_BxMxN: jax.Array, batch: int) -> jax.Array:
    """[B or 1, M, N] mask -> [I, N, J] (keys as rows)."""
    mask_t = jnp.swapaxes(mask_BxMxN, 1, 2)[:, None, :, None, :]
    shape = (batch, static.kv_heads, mask_t.shape[2], static.groups, mask_t.shape[4])
    return jnp.broadcast_to(mask_t, shape).reshape(batch * static.kv_heads, shape[2], -1)


def _key_blocks_to_bskd(key_blocks: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Stacked key-block tiles [S / N, I, N, D] -> [B, S, K, D]."""
    batch, _, kv_heads, head_dim = shape
    x = key_blocks.reshape(key_blocks.shape[0], batch, kv_heads, -1, head_dim)
    return jnp.transpose(x, (1, 0, 3, 2, 4)).reshape(shape)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _Static, bias_table, scale, padded: _Padded):
    return _forward(static, bias_table, scale, padded)[0]


def _attention_fwd(static: _Static, bias_table, scale, padded: _Padded):
    out, lse = _forward(static, bias_table, scale, padded)
    return out, (bias_table, scale, padded, out, lse)


def _attention_bwd(static: _Static, residuals, d_out):
    dq, dk, dv, d_table, d_scale = _backward(static, residuals, d_out)
    padded = residuals[2]
    d_padded = jax.tree.map(lambda _: None, padded)._replace(q=dq, k=dk, v=dv)
    if padded.log_n is not None:
        d_padded = d_padded._replace(log_n=jnp.zeros_like(padded.log_n))
    return d_table, d_scale, d_padded


_attention.defvjp(_attention_fwd, _attention_bwd)
