"""The TPU (Mosaic lowering) forward kernel.

Grid (batch, heads, query blocks, key blocks), the last axis sequential: the running max,
sum and accumulator live in VMEM scratch across key blocks. The key/value index map is
clamped to the band a query block can see, so blocks outside it are never fetched, and
their grid steps do nothing. Within a key block that is a multiple of TPU_KEY_CHUNK (256)
keys the kernel walks chunks of that many, so the live logits tile is [block_q, 256]
however large the key block fetched.
Mosaic tiles the last two dims of every block, so tensors are laid out [B, H, T, D] and
row vectors as [.., T, 1] / [.., 1, S].

With a prior table, a tile's block_q + block_k table entries arrive as whole blocks of
gcd(block_q, block_k) lanes, and the Toeplitz tile is one broadcast and one strided lane
rotation (`pltpu.roll`, row i rotated by i more than row 0).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bam_jax.kernels.backend import FusedBackend
from bam_jax.kernels.tile_math import (
    KernelConfig,
    SoftmaxState,
    exact_math,
    finalize,
    init_state,
    load_head,
    online_update,
    pad_to,
    round_up,
    row_coefficients,
    tile_logits_log2,
)
from bam_jax.pytrees import varying_results

TPU_KEY_CHUNK = 256
TPU_LANES = 128
TPU_DEFAULT_BLOCK_Q = 256
TPU_DEFAULT_BLOCK_K = 512


def key_chunk(block_k: int) -> int:
    return TPU_KEY_CHUNK if block_k % TPU_KEY_CHUNK == 0 else block_k


def table_granule(config: KernelConfig) -> int:
    """Lanes per block of the prior table: every tile's first entry is a multiple of it."""
    return math.gcd(config.block_q, config.block_k)


def _table_tile(table_1xL: jax.Array, first: int, rows: int, cols: int) -> jax.Array:
    """[rows, cols] tile with tile[i, c] = table[first + c - i + rows - 1]."""
    window = table_1xL[:, first : first + rows + cols]
    rotated = pltpu.roll(
        jnp.broadcast_to(window, (rows, rows + cols)), cols + 1, 1, stride=1, stride_axis=0
    )
    return rotated[:, :cols]


def _kernel(config: KernelConfig, offset_ref, head_ref, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    table_refs = []
    if config.prior_table:
        count = (config.block_q + config.block_k) // table_granule(config)
        table_refs, refs = refs[:count], refs[count:]
    log_n_ref = refs.pop(0) if config.ssmax else None
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if config.segments else (None, None)
    out_ref, lse_ref, acc_ref, max_ref, sum_ref = refs
    h, q_block, k_block = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    q_start = offset_ref[0] + q_block * config.block_q
    start, stop = config.mask.key_blocks(q_start, config.block_q, config.block_k)

    @pl.when(k_block == 0)
    def _():
        init = init_state(config.block_q, acc_ref.shape[1])
        acc_ref[...], max_ref[...], sum_ref[...] = init

    def update(masked: bool) -> None:
        math_ops = exact_math()
        head = load_head(lambda j: head_ref[h, j])
        rows = row_coefficients(config, head, None if log_n_ref is None else log_n_ref[...])
        chunk = key_chunk(config.block_k)
        table = None
        if table_refs:
            table = jnp.concatenate([ref[...] for ref in table_refs], axis=1)
        carry = SoftmaxState(acc_ref[...], max_ref[...], sum_ref[...])
        for c in range(config.block_k // chunk):
            keys = pl.ds(c * chunk, chunk)
            prior_tile = None
            if table is not None:
                prior_tile = _table_tile(table, c * chunk, config.block_q, chunk)
            logits = tile_logits_log2(
                config,
                math_ops,
                q_ref[...],
                k_ref[keys, :],
                q_start,
                k_block * config.block_k + c * chunk,
                head,
                rows,
                None if q_seg_ref is None else q_seg_ref[...],
                None if k_seg_ref is None else k_seg_ref[:, keys],
                prior_tile,
                masked=masked,
            )
            carry = online_update(math_ops, carry, logits, v_ref[keys, :])
        acc_ref[...], max_ref[...], sum_ref[...] = carry

    # Tiles below the diagonal need no mask; the rest (diagonal, padding, documents) do.
    full_stop = config.mask.full_key_blocks_stop(
        q_start, config.block_k, start, stop, config.segments
    )
    pl.when((k_block >= start) & (k_block < full_stop))(lambda: update(masked=False))
    pl.when((k_block >= full_stop) & (k_block < stop))(lambda: update(masked=True))

    @pl.when(k_block == config.num_k_blocks - 1)
    def _():
        out, lse = finalize(SoftmaxState(acc_ref[...], max_ref[...], sum_ref[...]))
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse


def tpu_forward(
    config: KernelConfig, q, k, v, head_params_Hx8, log_n, q_seg, k_seg, offset, table_HxX
):
    batch, q_pad, num_heads, d_pad = q.shape
    bq, bk, groups = config.block_q, config.block_k, config.groups
    # Mosaic tiles the last two dims of each block: put (length, head_dim) last.
    q_BxHxTxD = q.transpose(0, 2, 1, 3)
    k_BxKxSxD = k.transpose(0, 2, 1, 3)
    v_BxKxSxD = v.transpose(0, 2, 1, 3)

    def kv_block(b, h, i, j, offset_ref):
        start, stop = config.mask.key_blocks(offset_ref[0] + i * bq, bq, config.block_k)
        kv_head = lax.div(h, jnp.int32(groups))
        return (b, kv_head, jnp.clip(j, start, jnp.maximum(stop - 1, start)), 0)

    def k_seg_block(b, h, i, j, offset_ref):
        return (b, 0, kv_block(b, h, i, j, offset_ref)[2])

    def q_rows(b, h, i, j, offset_ref):
        return (b, i, 0)

    in_specs = [
        pl.BlockSpec(memory_space=pltpu.SMEM),
        pl.BlockSpec((None, None, bq, d_pad), lambda b, h, i, j, o: (b, h, i, 0)),
        pl.BlockSpec((None, None, bk, d_pad), kv_block),
        pl.BlockSpec((None, None, bk, d_pad), kv_block),
    ]
    inputs = [head_params_Hx8, q_BxHxTxD, k_BxKxSxD, v_BxKxSxD]
    if config.prior_table:
        table_specs, table = _table_inputs(config, table_HxX, kv_block)
        in_specs += table_specs
        inputs += [table] * len(table_specs)
    if config.ssmax:
        in_specs.append(pl.BlockSpec((None, bq, 1), q_rows))
        inputs.append(log_n)
    if config.segments:
        in_specs += [pl.BlockSpec((None, bq, 1), q_rows), pl.BlockSpec((None, 1, bk), k_seg_block)]
        inputs += [q_seg, k_seg]
    out_specs = [
        pl.BlockSpec((None, None, bq, d_pad), lambda b, h, i, j, o: (b, h, i, 0)),
        pl.BlockSpec((None, None, bq, 1), lambda b, h, i, j, o: (b, h, i, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((batch, num_heads, q_pad, d_pad), q.dtype),
        jax.ShapeDtypeStruct((batch, num_heads, q_pad, 1), jnp.float32),
    ]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1,
        grid=(batch, num_heads, q_pad // bq, config.num_k_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((bq, d_pad), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
        ],
    )
    out_BxHxTxD, lse = pl.pallas_call(
        functools.partial(_kernel, config),
        grid_spec=grid_spec,
        out_shape=varying_results(out_shape, [offset, *inputs]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if config.interpret else False,
        debug=config.debug,
        name="bam_attention_fwd",
    )(offset, *inputs)
    return out_BxHxTxD.transpose(0, 2, 1, 3), lse


def _table_inputs(config: KernelConfig, table_HxX: jax.Array, kv_block):
    """Block specs reading the (block_q + block_k) table entries of each tile as whole
    granules, and the table padded to whole granules ([H, 1, X'])."""
    bq, bk = config.block_q, config.block_k
    granule = table_granule(config)
    size = config.padded_q_len + config.padded_kv_len
    table = pad_to(table_HxX, 1, size)[:, None, :]

    def spec(part: int) -> pl.BlockSpec:
        def index(b, h, i, j, offset_ref):
            j = kv_block(b, h, i, j, offset_ref)[2]
            first = config.padded_q_len - (i + 1) * bq + j * bk
            return (h, 0, lax.div(first, jnp.int32(granule)) + part)

        return pl.BlockSpec((None, 1, granule), index)

    return [spec(part) for part in range((bq + bk) // granule)], table


def choose_blocks(interpret, head_dim, q_len, kv_len, block_q, block_k) -> tuple[int, int]:
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (value <= 0 or value % 8):
            raise ValueError(f"{name} must be a positive multiple of 8 on TPU, got {value}")
    bq = min(block_q or TPU_DEFAULT_BLOCK_Q, round_up(q_len, 8))
    # Compiled Mosaic needs key blocks of whole 128-lane tiles; the keys are padded to them.
    lanes = 8 if interpret else TPU_LANES
    bk = round_up(min(block_k or TPU_DEFAULT_BLOCK_K, round_up(kv_len, 8)), lanes)
    return bq, bk


BACKEND = FusedBackend("tpu", choose_blocks, pallas=True, interpret_has_callbacks=True)
