"""The GPU (Triton lowering) forward kernel.

Grid (query blocks, batch, heads), longest query blocks first. Each program holds its query
block and loops over the key blocks it can see with `lax.fori_loop`; keys and values of
the whole sequence are addressed through one block (Triton only offsets pointers).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from bam_jax.kernels.backend import FusedBackend
from bam_jax.kernels.tile_math import (
    NUM_HEAD_PARAMS,
    KernelConfig,
    MathOps,
    RowCoefficients,
    exact_math,
    finalize,
    ggd_unit,
    init_state,
    load_head,
    online_update,
    row_coefficients,
    tile_logits_log2,
)
from bam_jax.pytrees import varying_results


def _ptx_unary(instruction: str) -> Callable[[jax.Array], jax.Array]:
    def apply(x: jax.Array) -> jax.Array:
        [y] = plgpu.elementwise_inline_asm(
            f"{instruction} $0, $1;",
            args=[x],
            constraints="=f,f",
            pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
        )
        return y

    return apply


def _gpu_math(config: KernelConfig) -> MathOps:
    if config.approx_math:
        return MathOps(exp2=_ptx_unary("ex2.approx.ftz.f32"), log2=_ptx_unary("lg2.approx.ftz.f32"))
    return exact_math()


class _SubBlock(NamedTuple):
    """Rows of the query block that share one online-softmax state."""

    rows: pl.Slice
    q_start: jax.Array
    q_MxD: jax.Array
    coefficients: RowCoefficients
    seg_Mx1: jax.Array | None


GPU_MAX_BLOCK_Q = 256
GPU_MAX_BLOCK_K = 128
GPU_MIN_BLOCK = 16  # tensor-core dots need both tile sides >= 16


class GpuDefaults(NamedTuple):
    block_q: int
    block_k: int
    num_warps: int
    num_stages: int


# By padded head dim. Not tuned on hardware yet: `bench/accelerator_check/ --autotune`
# sweeps the alternatives.
GPU_DEFAULTS = {
    16: GpuDefaults(128, 64, 4, 2),
    32: GpuDefaults(128, 64, 4, 2),
    64: GpuDefaults(128, 64, 4, 2),
    128: GpuDefaults(128, 64, 8, 2),
    256: GpuDefaults(64, 32, 8, 2),
}


def gpu_defaults(head_dim: int) -> GpuDefaults:
    """Blocks, warps and stages the GPU kernel uses for this head dim when none are given."""
    padded = max(16, pl.next_power_of_2(head_dim))
    if padded not in GPU_DEFAULTS:
        raise ValueError(f"the GPU kernel supports head dims up to 256, got {head_dim}")
    return GPU_DEFAULTS[padded]


def _table_tile(table_ref, base: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """table[base + col - row] over an [M, N] tile: the Toeplitz slice a tile reads from
    the per-head prior table (a gather of M + N - 1 distinct, cached values)."""
    rows, cols = shape
    index_MxN = (base + lax.broadcasted_iota(jnp.int32, (1, cols), 1)) - lax.broadcasted_iota(
        jnp.int32, (rows, 1), 0
    )
    return table_ref[index_MxN]


def _kernel(config: KernelConfig, offset_ref, head_ref, q_ref, k_ref, v_ref, *refs):
    """One query block against its visible key blocks.

    With q_splits = m > 1 the query block is m sub-blocks of block_k rows each. The GGD
    tile of sub-block s at key block j equals that of sub-block 0 at key block j - s, so
    each step evaluates the prior's exp2/log2 for one sub-block only and carries the last
    m - 1 tiles: the prior's transcendental cost drops by a factor m. With a prior table
    every tile is read from it instead.
    """
    refs = list(refs)
    table_ref = refs.pop(0) if config.prior_table else None
    log_n_ref = refs.pop(0) if config.ssmax else None
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if config.segments else (None, None)
    out_ref, lse_ref = refs
    math_ops = _gpu_math(config)
    bk, splits = config.block_k, config.q_splits
    sub_rows = config.block_q // splits
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)  # longest rows first
    q_start = offset_ref[0] + q_block * config.block_q
    head = load_head(lambda j: head_ref[j])
    subs = []
    for s in range(splits):
        rows = pl.ds(s * sub_rows, sub_rows)
        log_n = None if log_n_ref is None else log_n_ref[rows, :]
        subs.append(
            _SubBlock(
                rows=rows,
                q_start=q_start + s * sub_rows,
                q_MxD=q_ref[rows, :],
                coefficients=row_coefficients(config, head, log_n),
                seg_Mx1=None if q_seg_ref is None else q_seg_ref[rows, :],
            )
        )
    reuse = config.prior_kind == "ggd" and not config.prior_table
    # Table entry of distance 0 for the first query: see prior_table_distances.
    table_zero = offset_ref[0] + config.padded_q_len - 1

    def unit_at(k_start):
        return ggd_unit(math_ops, head, k_start - q_start, (sub_rows, bk))

    def prior_tiles(k_start):
        if reuse:
            return (unit_at(k_start),)
        if table_ref is None:
            return (None,) * splits
        return tuple(
            _table_tile(table_ref, table_zero + k_start - sub.q_start, (sub_rows, bk))
            for sub in subs
        )

    def body(k_block, state, *, masked: bool):
        carries, window = state
        k_start = pl.multiple_of(k_block * bk, bk)
        keys = pl.ds(k_start, bk)
        k_NxD, v_NxD = k_ref[keys, :], v_ref[keys, :]
        k_seg = None if k_seg_ref is None else k_seg_ref[:, keys]
        units = (*prior_tiles(k_start), *window)
        new_carries = []
        for sub, carry, unit in zip(subs, carries, units, strict=True):
            logits = tile_logits_log2(
                config,
                math_ops,
                sub.q_MxD,
                k_NxD,
                sub.q_start,
                k_start,
                head,
                sub.coefficients,
                sub.seg_Mx1,
                k_seg,
                unit,
                masked=masked,
            )
            new_carries.append(online_update(math_ops, carry, logits, v_NxD))
        return tuple(new_carries), units[:-1] if reuse else ()

    start, stop = config.mask.key_blocks(q_start, config.block_q, config.block_k)
    window = tuple(unit_at((start - s) * bk) for s in range(1, splits)) if reuse else ()
    carries = tuple(init_state(sub_rows, q_ref.shape[1]) for _ in range(splits))
    # Tiles below the diagonal need no mask; the rest (diagonal, padding, documents) do.
    full_stop = config.mask.full_key_blocks_stop(
        q_start, config.block_k, start, stop, config.segments
    )
    state = (carries, window)
    state = lax.fori_loop(start, full_stop, functools.partial(body, masked=False), state)
    carries, _ = lax.fori_loop(full_stop, stop, functools.partial(body, masked=True), state)
    for sub, carry in zip(subs, carries, strict=True):
        out, lse = finalize(carry)
        out_ref[sub.rows, :] = out.astype(out_ref.dtype)
        lse_ref[sub.rows, :] = lse


def gpu_forward(
    config: KernelConfig, q, k, v, head_params_Hx8, log_n, q_seg, k_seg, offset, table_HxX
):
    batch, q_pad, num_heads, d_pad = q.shape
    kv_pad = k.shape[1]
    bq, groups = config.block_q, config.groups
    num_q_blocks = q_pad // bq

    def q_block(i):
        return num_q_blocks - 1 - i

    def kv_head(h):
        return lax.div(h, jnp.int32(groups))

    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, NUM_HEAD_PARAMS), lambda i, b, h: (h, 0)),
        pl.BlockSpec((None, bq, None, d_pad), lambda i, b, h: (b, q_block(i), h, 0)),
        pl.BlockSpec((None, kv_pad, None, d_pad), lambda i, b, h: (b, 0, kv_head(h), 0)),
        pl.BlockSpec((None, kv_pad, None, d_pad), lambda i, b, h: (b, 0, kv_head(h), 0)),
    ]
    inputs = [offset, head_params_Hx8, q, k, v]
    if config.prior_table:
        in_specs.append(pl.BlockSpec((None, table_HxX.shape[1]), lambda i, b, h: (h, 0)))
        inputs.append(table_HxX)
    row_spec = pl.BlockSpec((None, bq, 1), lambda i, b, h: (b, q_block(i), 0))
    if config.ssmax:
        in_specs.append(row_spec)
        inputs.append(log_n)
    if config.segments:
        in_specs += [row_spec, pl.BlockSpec((None, 1, kv_pad), lambda i, b, h: (b, 0, 0))]
        inputs += [q_seg, k_seg]
    out_specs = [
        pl.BlockSpec((None, bq, None, d_pad), lambda i, b, h: (b, q_block(i), h, 0)),
        pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, q_block(i), 0)),
    ]
    defaults = gpu_defaults(d_pad)
    return pl.pallas_call(
        functools.partial(_kernel, config),
        grid=(num_q_blocks, batch, num_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=varying_results(_out_shapes(q), inputs),
        compiler_params=plgpu.CompilerParams(
            num_warps=config.num_warps or defaults.num_warps,
            num_stages=config.num_stages or defaults.num_stages,
        ),
        interpret=config.interpret,
        debug=config.debug,
        name="bam_attention_fwd",
    )(*inputs)


def _out_shapes(q_BxTxHxD: jax.Array) -> list[jax.ShapeDtypeStruct]:
    batch, q_pad, num_heads, d_pad = q_BxTxHxD.shape
    return [
        jax.ShapeDtypeStruct((batch, q_pad, num_heads, d_pad), q_BxTxHxD.dtype),
        jax.ShapeDtypeStruct((batch, num_heads, q_pad, 1), jnp.float32),
    ]


def choose_blocks(interpret, head_dim, q_len, kv_len, block_q, block_k) -> tuple[int, int]:
    defaults = gpu_defaults(head_dim)
    bq = _checked_block("block_q", block_q or defaults.block_q, GPU_MAX_BLOCK_Q)
    bk = _checked_block("block_k", block_k or defaults.block_k, GPU_MAX_BLOCK_K)
    return (
        min(bq, max(GPU_MIN_BLOCK, pl.next_power_of_2(q_len))),
        min(bk, max(GPU_MIN_BLOCK, pl.next_power_of_2(kv_len))),
    )


def _checked_block(name: str, value: int, largest: int) -> int:
    is_power_of_two = value > 0 and value & (value - 1) == 0
    if not is_power_of_two or not GPU_MIN_BLOCK <= value <= largest:
        raise ValueError(
            f"{name} must be a power of two from {GPU_MIN_BLOCK} to {largest} on GPU "
            f"(Triton tiles), got {value}"
        )
    return value


BACKEND = FusedBackend(
    "gpu",
    choose_blocks,
    pallas=True,
    fused_backward=True,
    approx_math=True,
    prior_reuse=True,
    pads_head_dim=True,
)
