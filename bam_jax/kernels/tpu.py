"""The TPU (Mosaic lowering) forward kernel.

Grid (batch, heads, query blocks, key blocks), the last axis sequential: the running max,
sum and accumulator live in VMEM scratch across key blocks. The key/value index map is
clamped to the band a query block can see, so blocks outside it are never fetched, and
their grid steps do nothing. Mosaic tiles the last two dims of every block, so tensors are
laid out [B, H, T, D] and row vectors as [.., T, 1] / [.., 1, S].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from bam_jax.kernels.tile_math import (
    KernelConfig,
    SoftmaxState,
    exact_math,
    finalize,
    init_state,
    load_head,
    online_update,
    row_coefficients,
    tile_logits_log2,
)


def _kernel(config: KernelConfig, offset_ref, head_ref, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
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
        k_start = k_block * config.block_k
        logits = tile_logits_log2(
            config,
            math_ops,
            q_ref[...],
            k_ref[...],
            q_start,
            k_start,
            head,
            rows,
            None if q_seg_ref is None else q_seg_ref[...],
            None if k_seg_ref is None else k_seg_ref[...],
            masked=masked,
        )
        carry = SoftmaxState(acc_ref[...], max_ref[...], sum_ref[...])
        acc_ref[...], max_ref[...], sum_ref[...] = online_update(
            math_ops, carry, logits, v_ref[...]
        )

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


def tpu_forward(config: KernelConfig, q, k, v, head_params_Hx8, log_n, q_seg, k_seg, offset):
    batch, q_pad, num_heads, d_pad = q.shape
    bq, bk, groups = config.block_q, config.block_k, config.groups
    # Mosaic tiles the last two dims of each block: put (length, head_dim) last.
    q_BxHxTxD = q.transpose(0, 2, 1, 3)
    k_BxKxSxD = k.transpose(0, 2, 1, 3)
    v_BxKxSxD = v.transpose(0, 2, 1, 3)

    def kv_block(b, h, i, j, offset_ref):
        start, stop = config.mask.key_blocks(offset_ref[0] + i * bq, bq, config.block_k)
        return (b, lax.div(h, groups), jnp.clip(j, start, jnp.maximum(stop - 1, start)), 0)

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
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if config.interpret else False,
        name="bam_attention_fwd",
    )(offset, *inputs)
    return out_BxHxTxD.transpose(0, 2, 1, 3), lse
