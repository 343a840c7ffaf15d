"""The GPU (Triton lowering) backward kernels.

Two kernels recompute the probabilities from the forward's log-sum-exp, with the logits
formed by the forward's tile math (`tile_logits_log2`) so that they match it:

- dK/dV: grid (key blocks, batch, query heads); each program holds its key block and loops
  over the query blocks that see it (`AttentionMask.query_blocks`). Grouped-query heads
  write their own dK/dV ([B, S, H, D]), summed over the group outside the kernel.
- dQ: grid (query blocks, batch, heads); each program holds its query block and loops over
  the key blocks it sees (`AttentionMask.key_blocks`). It also writes the gradient of the
  per-head parameters (`head_param_columns`: coef, beta, mu, SSMax scale) as one partial
  sum per program, [query blocks, B, H, NUM_HEAD_PARAMS], summed outside. The SSMax
  scale's is combined per query from row sums centred on E_P[x] (`_factor_gradient`).

Nothing is accumulated across programs in place, so the result is deterministic.
Conventions are those of `bam_jax.blockwise._backward`: a row that sees one key has
probability 1 on it and a zero softmax gradient, exp(logit - lse) is clamped at 1, and a
row that sees no key (lse = +inf) has zero probabilities. Saturated GGD entries (the clamp
of `ggd_unit`) give the prior's parameters no gradient.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bam_jax.kernels.gpu import _gpu_math
from bam_jax.kernels.partitioning import offset_operand
from bam_jax.kernels.tile_math import (
    BETA,
    COEF,
    LN_2,
    LOG2_E,
    MU,
    NUM_HEAD_PARAMS,
    SSMAX_SCALE,
    DerivedInputs,
    HeadScalars,
    KernelConfig,
    MathOps,
    RowCoefficients,
    ggd_unit,
    load_head,
    pad_to,
    row_coefficients,
    tile_distance,
    tile_logits_log2,
)
from bam_jax.priors import GGD_EPS, GGD_MAX_LOG2_MAGNITUDE
from bam_jax.pytrees import varying_results

if TYPE_CHECKING:
    from bam_jax.attention_inputs import AttentionInputs

_NT = (((1,), (1,)), ((), ()))  # x @ y^T
_NN = (((1,), (0,)), ((), ()))  # x @ y
_TN = (((0,), (0,)), ((), ()))  # x^T @ y


class _Rows(NamedTuple):
    """Per-query values of one query block, each [M, 1]."""

    lse_log2: jax.Array
    delta: jax.Array
    single_key: jax.Array  # True where the query sees exactly one key
    log_n: jax.Array | None
    seg: jax.Array | None


class _Tile(NamedTuple):
    """What both kernels derive from one (query block, key block) tile."""

    probs_MxN: jax.Array
    ds_MxN: jax.Array  # d loss / d natural-log logit
    ggd_unit_MxN: jax.Array | None


def fused_gpu_backward(
    config: KernelConfig,
    q_BxTxHxD: jax.Array,
    k_BxSxKxD: jax.Array,
    v_BxSxKxD: jax.Array,
    inputs: AttentionInputs,
    derived: DerivedInputs,
    head_params_Hx8: jax.Array,
    out_BxTxHxD: jax.Array,
    lse_BxHxT: jax.Array,
    d_out_BxTxHxD: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """dq, dk, dv (the inputs' dtypes) and the gradient of `head_params_Hx8` (float32) by
    batch row, [B, H, 8], from the forward's output and natural-log log-sum-exp (the
    segment ids and the query offset, an int32 scalar, of `inputs`; SSMax's log(n_i) of
    `derived`)."""
    batch, q_len, _, head_dim = q_BxTxHxD.shape
    kv_len = k_BxSxKxD.shape[1]
    q_pad, kv_pad = config.padded_q_len, config.padded_kv_len
    d_pad = pl.next_power_of_2(head_dim)

    def pad_rows(x, length):
        return pad_to(pad_to(x, 1, length), 3, d_pad)

    q, d_out = pad_rows(q_BxTxHxD, q_pad), pad_rows(d_out_BxTxHxD, q_pad)
    k, v = pad_rows(k_BxSxKxD, kv_pad), pad_rows(v_BxSxKxD, kv_pad)
    delta_BxHxT = jnp.einsum(
        "bthd,bthd->bht", d_out_BxTxHxD.astype(jnp.float32), out_BxTxHxD.astype(jnp.float32)
    )
    rows = _padded_rows(config, inputs, derived, lse_BxHxT, delta_BxHxT, batch)
    kernel_inputs = _KernelInputs(
        offset_operand(inputs.query_offset), head_params_Hx8, q, k, v, d_out, *rows
    )
    dq, d_params_QxBxHx8 = _dq_call(config, kernel_inputs)
    dk_BxSxHxD, dv_BxSxHxD = _dkdv_call(config, kernel_inputs)
    dk, dv = (_sum_groups(config, x)[:, :kv_len, :, :head_dim] for x in (dk_BxSxHxD, dv_BxSxHxD))
    return (
        dq[:, :q_len, :, :head_dim],
        dk.astype(k_BxSxKxD.dtype),
        dv.astype(v_BxSxKxD.dtype),
        jnp.sum(d_params_QxBxHx8, axis=0),
    )


class _KernelInputs(NamedTuple):
    offset_1: jax.Array
    head_params_Hx8: jax.Array
    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_out: jax.Array
    lse_log2_BxHxTx1: jax.Array
    delta_BxHxTx1: jax.Array
    single_key_BxTx1: jax.Array
    log_n_BxTx1: jax.Array | None
    q_seg_BxTx1: jax.Array | None
    k_seg_Bx1xS: jax.Array | None


def _padded_rows(
    config: KernelConfig,
    inputs: AttentionInputs,
    derived: DerivedInputs,
    lse_BxHxT,
    delta_BxHxT,
    batch: int,
):
    """Per-row kernel inputs padded to whole blocks; padded queries see nothing
    (lse = +inf) and have no cotangent (delta = 0)."""
    q_pad, kv_pad = config.padded_q_len, config.padded_kv_len
    lse_log2 = pad_to(lse_BxHxT * jnp.float32(LOG2_E), 2, q_pad, jnp.inf)[..., None]
    delta = pad_to(delta_BxHxT, 2, q_pad)[..., None]
    q_seg = k_seg = None
    if config.segments:
        q_seg = pad_to(inputs.query_segment_ids_BxT.astype(jnp.int32), 1, q_pad, -1)
        k_seg = pad_to(inputs.key_segment_ids_BxS.astype(jnp.int32), 1, kv_pad, -1)
    counts = config.mask.visible_counts(q_pad, inputs.query_offset, q_seg, k_seg)
    single_key = jnp.broadcast_to(counts == 1, (batch, q_pad))[..., None].astype(jnp.int32)
    log_n = None
    if config.ssmax:
        log_n = jnp.broadcast_to(pad_to(derived.log_n_BxT, 1, q_pad), (batch, q_pad))[..., None]
    if config.segments:
        q_seg, k_seg = q_seg[..., None], k_seg[:, None, :]
    return lse_log2, delta, single_key, log_n, q_seg, k_seg


def _sum_groups(config: KernelConfig, x_BxSxHxD: jax.Array) -> jax.Array:
    """Per-query-head key gradients -> per-key/value-head, float32 [B, S, K, D]."""
    batch, length, num_heads, head_dim = x_BxSxHxD.shape
    x = x_BxSxHxD.astype(jnp.float32)
    if config.groups == 1:
        return x
    grouped = x.reshape(batch, length, num_heads // config.groups, config.groups, head_dim)
    return jnp.sum(grouped, axis=3)


# ----------------------------------------------------------------------------- tile math


def _ssmax_factor(config: KernelConfig, head: HeadScalars, log_n_Mx1) -> jax.Array | None:
    return head.ssmax_scale * log_n_Mx1 if config.ssmax else None


def _tile_gradients(
    config: KernelConfig,
    math_ops: MathOps,
    head: HeadScalars,
    coefficients: RowCoefficients,
    q_MxD,
    k_NxD,
    v_NxD,
    do_MxD,
    q_start,
    k_start,
    rows: _Rows,
    k_seg_1xN,
    *,
    masked: bool = True,
) -> _Tile:
    """Probabilities and softmax gradient of one tile, float32 [M, N]."""
    shape = (q_MxD.shape[0], k_NxD.shape[0])
    unit = None
    if config.prior_kind == "ggd":
        unit = ggd_unit(math_ops, head, k_start - q_start, shape)
    logits = tile_logits_log2(
        config,
        math_ops,
        q_MxD,
        k_NxD,
        q_start,
        k_start,
        head,
        coefficients,
        rows.seg,
        k_seg_1xN,
        unit,
        masked=masked,
    )
    probs = math_ops.exp2(jnp.minimum(logits - rows.lse_log2, 0.0))
    single_key = rows.single_key != 0
    probs = jnp.where(single_key, jnp.where(logits == -jnp.inf, 0.0, 1.0), probs)
    dp = lax.dot_general(do_MxD, v_NxD, _NT, preferred_element_type=jnp.float32)
    ds = jnp.where(single_key, 0.0, probs * (dp - rows.delta))
    return _Tile(probs, ds, unit)


def _load_rows(config: KernelConfig, refs: dict, rows) -> _Rows:
    def load(name):
        ref = refs.get(name)
        return None if ref is None else ref[rows, :]

    return _Rows(
        lse_log2=load("lse"),
        delta=load("delta"),
        single_key=load("single"),
        log_n=load("log_n") if config.ssmax else None,
        seg=load("q_seg") if config.segments else None,
    )


def _named_refs(config: KernelConfig, refs) -> dict:
    """The kernels' refs by name (inputs in `_KernelInputs` order, then outputs)."""
    names = ["offset", "head", "q", "k", "v", "do", "lse", "delta", "single"]
    names += ["log_n"] if config.ssmax else []
    names += ["q_seg", "k_seg"] if config.segments else []
    return dict(zip(names, refs, strict=False)) | {"outputs": refs[len(names) :]}


# ----------------------------------------------------------------------------- dK / dV


def _dkdv_kernel(config: KernelConfig, *refs):
    """dK and dV of one key block for one query head."""
    named = _named_refs(config, refs)
    dk_ref, dv_ref = named["outputs"]
    math_ops = _gpu_math(config)
    bq, bk = config.block_q, config.block_k
    k_start = pl.multiple_of(pl.program_id(0) * bk, bk)
    offset = named["offset"][0]
    head = load_head(lambda j: named["head"][j])
    k_NxD, v_NxD = named["k"][...], named["v"][...]
    k_seg = named["k_seg"][...] if config.segments else None
    num_q_blocks = config.padded_q_len // bq

    def body(q_block, carry):
        dk_NxD, dv_NxD = carry
        local = pl.multiple_of(q_block * bq, bq)
        rows = pl.ds(local, bq)
        row_values = _load_rows(config, named, rows)
        q_MxD, do_MxD = named["q"][rows, :], named["do"][rows, :]
        coefficients = row_coefficients(config, head, row_values.log_n)
        tile = _tile_gradients(
            config,
            math_ops,
            head,
            coefficients,
            q_MxD,
            k_NxD,
            v_NxD,
            do_MxD,
            offset + local,
            k_start,
            row_values,
            k_seg,
        )
        ds = tile.ds_MxN
        factor = _ssmax_factor(config, head, row_values.log_n)
        if factor is not None:
            ds = ds * factor
        dv_NxD = dv_NxD + lax.dot_general(
            tile.probs_MxN.astype(do_MxD.dtype), do_MxD, _TN, preferred_element_type=jnp.float32
        )
        dk_NxD = dk_NxD + lax.dot_general(
            ds.astype(q_MxD.dtype), q_MxD, _TN, preferred_element_type=jnp.float32
        )
        return dk_NxD, dv_NxD

    start, stop = config.mask.query_blocks(k_start, bk, offset, bq, num_q_blocks)
    zeros = jnp.zeros(k_NxD.shape, jnp.float32)
    dk_NxD, dv_NxD = lax.fori_loop(start, stop, body, (zeros, zeros))
    dk_ref[...] = (dk_NxD * jnp.float32(1.0 / math.sqrt(config.head_dim))).astype(dk_ref.dtype)
    dv_ref[...] = dv_NxD.astype(dv_ref.dtype)


def _dkdv_call(config: KernelConfig, inputs: _KernelInputs) -> tuple[jax.Array, jax.Array]:
    batch, q_pad, num_heads, d_pad = inputs.q.shape
    bk, groups = config.block_k, config.groups

    def kv_head(h):
        return lax.div(h, jnp.int32(groups))

    full_rows = pl.BlockSpec((None, q_pad, None, d_pad), lambda j, b, h: (b, 0, h, 0))
    key_block = pl.BlockSpec((None, bk, None, d_pad), lambda j, b, h: (b, j, kv_head(h), 0))
    row_stats = pl.BlockSpec((None, None, q_pad, 1), lambda j, b, h: (b, h, 0, 0))
    query_rows = pl.BlockSpec((None, q_pad, 1), lambda j, b, h: (b, 0, 0))
    specs = [
        pl.BlockSpec((1,), lambda j, b, h: (0,)),
        pl.BlockSpec((None, NUM_HEAD_PARAMS), lambda j, b, h: (h, 0)),
        full_rows,
        key_block,
        key_block,
        full_rows,
        row_stats,
        row_stats,
        query_rows,
        query_rows,
        query_rows,
        pl.BlockSpec((None, 1, bk), lambda j, b, h: (b, 0, j)),
    ]
    out_block = pl.BlockSpec((None, bk, None, d_pad), lambda j, b, h: (b, j, h, 0))
    out_dtype = inputs.k.dtype if groups == 1 else jnp.float32
    out_shape = jax.ShapeDtypeStruct((batch, config.padded_kv_len, num_heads, d_pad), out_dtype)
    return _call(
        config,
        _dkdv_kernel,
        "bam_attention_dkdv",
        (config.num_k_blocks, batch, num_heads),
        inputs,
        specs,
        [out_block, out_block],
        [out_shape, out_shape],
    )


# ----------------------------------------------------------------------------- dQ


class _ParamSums(NamedTuple):
    """Per-row sums over keys feeding the prior parameters' gradients, each [M, 1]."""

    prior_coef: jax.Array  # GGD: sum g * unit; ALiBi: sum g * |d|
    prior_log: jax.Array  # GGD: sum g * unit * log2(gap)
    prior_mu: jax.Array  # GGD: sum g * unit / gap * sign(d - mu)


class _FactorSums(NamedTuple):
    """Per-row sums over keys from which the SSMax factor's gradient is taken, each [M, 1]:
    of dS * x, dS, P and P * x, with dS the natural-log logits' gradient and x what the
    factor s_h log(n_i) multiplies (the scores, plus the prior when it is inside)."""

    ds_x: jax.Array
    ds: jax.Array
    probs: jax.Array
    probs_x: jax.Array


def _ggd_sums(
    math_ops: MathOps,
    head: HeadScalars,
    unit_MxN,
    d_bias_MxN,
    relative_start,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row sums of the GGD parameter gradients' integrands, zero where saturated."""
    distance = tile_distance(relative_start, unit_MxN.shape) - head.mu
    gap = jnp.abs(distance) + jnp.float32(GGD_EPS)
    log2_gap = math_ops.log2(gap)
    limit = jnp.float32(GGD_MAX_LOG2_MAGNITUDE) - jnp.log2(head.coef)
    g_unit = jnp.where(head.beta * log2_gap <= limit, d_bias_MxN * unit_MxN, 0.0)
    return (
        jnp.sum(g_unit, axis=1, keepdims=True),
        jnp.sum(g_unit * log2_gap, axis=1, keepdims=True),
        jnp.sum(g_unit / gap * jnp.sign(distance), axis=1, keepdims=True),
    )


def _param_sums(
    config: KernelConfig,
    math_ops: MathOps,
    head: HeadScalars,
    tile: _Tile,
    factor_Mx1,
    relative_start,
) -> _ParamSums:
    """This tile's contribution to the prior parameters' sums."""
    zeros = jnp.zeros((tile.ds_MxN.shape[0], 1), jnp.float32)
    inside = factor_Mx1 is not None and config.prior_inside
    d_bias = tile.ds_MxN * factor_Mx1 if inside else tile.ds_MxN
    if config.prior_kind == "ggd":
        return _ParamSums(*_ggd_sums(math_ops, head, tile.ggd_unit_MxN, d_bias, relative_start))
    if config.prior_kind == "alibi":
        abs_distance = jnp.abs(tile_distance(relative_start, tile.ds_MxN.shape))
        return _ParamSums(jnp.sum(d_bias * abs_distance, axis=1, keepdims=True), zeros, zeros)
    return _ParamSums(zeros, zeros, zeros)


def _factor_input(
    config: KernelConfig, head: HeadScalars, q_MxD, k_NxD, tile: _Tile, relative_start
) -> jax.Array:
    """x, what the SSMax factor multiplies, over one tile, float32 [M, N]."""
    # The same product as the logits' (`tile_logits_log2`), which the compiler can share.
    scores = lax.dot_general(q_MxD, k_NxD, _NT, preferred_element_type=jnp.float32)
    scores = scores * jnp.float32(1.0 / math.sqrt(config.head_dim))
    if not config.prior_inside or config.prior_kind == "none":
        return scores
    if config.prior_kind == "ggd":
        return scores - head.coef * tile.ggd_unit_MxN
    return scores - head.coef * jnp.abs(tile_distance(relative_start, scores.shape))


def _factor_sums(tile: _Tile, x_MxN) -> _FactorSums:
    """This tile's contribution to the SSMax factor's sums."""
    ds, probs = tile.ds_MxN, tile.probs_MxN
    return _FactorSums(
        *(jnp.sum(y, axis=1, keepdims=True) for y in (ds * x_MxN, ds, probs, probs * x_MxN))
    )


def _factor_gradient(sums: _FactorSums) -> jax.Array:
    """d loss / d factor [M, 1] = sum_j dS_ij (x_ij - c_i) with c_i = E_P[x_i].

    c_i changes nothing exactly (dS sums to zero over the keys), but under sharp attention
    x at the attended key is as large as the logits while the sum is small: the rounding of
    dS there (of dP, delta and the log-sum-exp) would be multiplied by |x|; centred on
    E_P[x], by about zero.
    """
    mean_x = sums.probs_x / jnp.where(sums.probs > 0, sums.probs, 1.0)
    return sums.ds_x - sums.ds * mean_x


def _param_gradients(
    config: KernelConfig, head: HeadScalars, sums: _ParamSums, d_factor_Mx1, log_n_Mx1
) -> jax.Array:
    """The query block's gradient of the per-head parameter columns, [NUM_HEAD_PARAMS]."""
    columns = {COEF: -sums.prior_coef}
    if config.prior_kind == "ggd":
        columns[BETA] = -head.coef * jnp.float32(LN_2) * sums.prior_log
        columns[MU] = head.coef * head.beta * sums.prior_mu
    if config.ssmax:
        columns[SSMAX_SCALE] = d_factor_Mx1 * log_n_Mx1
    shape = (sums.prior_coef.shape[0], NUM_HEAD_PARAMS)
    column = lax.broadcasted_iota(jnp.int32, shape, 1)
    grads_MxP = jnp.zeros(shape, jnp.float32)
    for index, rows_Mx1 in columns.items():
        grads_MxP = jnp.where(column == index, rows_Mx1, grads_MxP)
    return jnp.sum(grads_MxP, axis=0)


def _dq_kernel(config: KernelConfig, *refs):
    """dQ of one query block, and its share of the per-head parameter gradients."""
    named = _named_refs(config, refs)
    dq_ref, d_params_ref = named["outputs"]
    math_ops = _gpu_math(config)
    bq, bk = config.block_q, config.block_k
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)  # longest rows first
    q_start = named["offset"][0] + q_block * bq
    head = load_head(lambda j: named["head"][j])
    all_rows = pl.ds(0, bq)
    rows = _load_rows(config, named, all_rows)
    q_MxD, do_MxD = named["q"][...], named["do"][...]
    coefficients = row_coefficients(config, head, rows.log_n)
    factor = _ssmax_factor(config, head, rows.log_n)
    k_seg_ref = named.get("k_seg")

    def body(k_block, carry, *, masked: bool):
        acc_MxD, sums, factor_sums = carry
        k_start = pl.multiple_of(k_block * bk, bk)
        keys = pl.ds(k_start, bk)
        k_NxD = named["k"][keys, :]
        tile = _tile_gradients(
            config,
            math_ops,
            head,
            coefficients,
            q_MxD,
            k_NxD,
            named["v"][keys, :],
            do_MxD,
            q_start,
            k_start,
            rows,
            None if k_seg_ref is None else k_seg_ref[:, keys],
            masked=masked,
        )
        acc_MxD = acc_MxD + lax.dot_general(
            tile.ds_MxN.astype(k_NxD.dtype), k_NxD, _NN, preferred_element_type=jnp.float32
        )
        sums = jax.tree.map(
            jnp.add, sums, _param_sums(config, math_ops, head, tile, factor, k_start - q_start)
        )
        if factor_sums is not None:
            x_MxN = _factor_input(config, head, q_MxD, k_NxD, tile, k_start - q_start)
            factor_sums = jax.tree.map(jnp.add, factor_sums, _factor_sums(tile, x_MxN))
        return acc_MxD, sums, factor_sums

    start, stop = config.mask.key_blocks(q_start, bq, bk)
    full_stop = config.mask.full_key_blocks_stop(q_start, bk, start, stop, config.segments)
    zeros_Mx1 = jnp.zeros((bq, 1), jnp.float32)
    factor_sums = _FactorSums(*[zeros_Mx1] * 4) if factor is not None else None
    carry = (jnp.zeros(q_MxD.shape, jnp.float32), _ParamSums(*[zeros_Mx1] * 3), factor_sums)
    carry = lax.fori_loop(start, full_stop, functools.partial(body, masked=False), carry)
    acc_MxD, sums, factor_sums = lax.fori_loop(
        full_stop, stop, functools.partial(body, masked=True), carry
    )
    d_factor = None
    if factor is not None:
        d_factor = _factor_gradient(factor_sums)
        acc_MxD = acc_MxD * factor
    dq_ref[...] = (acc_MxD * jnp.float32(1.0 / math.sqrt(config.head_dim))).astype(dq_ref.dtype)
    d_params_ref[...] = _param_gradients(config, head, sums, d_factor, rows.log_n)


def _dq_call(config: KernelConfig, inputs: _KernelInputs) -> tuple[jax.Array, jax.Array]:
    batch, q_pad, num_heads, d_pad = inputs.q.shape
    bq, groups = config.block_q, config.groups
    num_q_blocks = q_pad // bq
    kv_pad = inputs.k.shape[1]

    def q_block(i):
        return num_q_blocks - 1 - i

    query_block = pl.BlockSpec((None, bq, None, d_pad), lambda i, b, h: (b, q_block(i), h, 0))
    all_keys = pl.BlockSpec(
        (None, kv_pad, None, d_pad), lambda i, b, h: (b, 0, lax.div(h, jnp.int32(groups)), 0)
    )
    row_stats = pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, q_block(i), 0))
    query_rows = pl.BlockSpec((None, bq, 1), lambda i, b, h: (b, q_block(i), 0))
    specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, NUM_HEAD_PARAMS), lambda i, b, h: (h, 0)),
        query_block,
        all_keys,
        all_keys,
        query_block,
        row_stats,
        row_stats,
        query_rows,
        query_rows,
        query_rows,
        pl.BlockSpec((None, 1, kv_pad), lambda i, b, h: (b, 0, 0)),
    ]
    out_specs = [
        query_block,
        pl.BlockSpec((None, None, None, NUM_HEAD_PARAMS), lambda i, b, h: (i, b, h, 0)),
    ]
    out_shapes = [
        jax.ShapeDtypeStruct(inputs.q.shape, inputs.q.dtype),
        jax.ShapeDtypeStruct((num_q_blocks, batch, num_heads, NUM_HEAD_PARAMS), jnp.float32),
    ]
    return _call(
        config,
        _dq_kernel,
        "bam_attention_dq",
        (num_q_blocks, batch, num_heads),
        inputs,
        specs,
        out_specs,
        out_shapes,
    )


def _call(config: KernelConfig, kernel, name: str, grid, inputs, specs, out_specs, out_shapes):
    """pallas_call of `kernel` on the inputs present (SSMax and segment rows are optional)."""
    present = [(x, s) for x, s in zip(inputs, specs, strict=True) if x is not None]
    d_pad = inputs.q.shape[3]
    return pl.pallas_call(
        functools.partial(kernel, config),
        grid=grid,
        in_specs=[s for _, s in present],
        out_specs=out_specs,
        out_shape=varying_results(out_shapes, [x for x, _ in present]),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps or (4 if d_pad <= 64 else 8),
            num_stages=config.num_stages or 2,
        ),
        interpret=config.interpret,
        name=name,
    )(*[x for x, _ in present])
