"""Fused causal attention with the positional prior computed inside the kernel (Pallas).

Two variants share the tile math (`_row_coefficients`, `_tile_logits2`, `_online_update`,
`_finalize`) and differ only in how tiles reach it:

- "gpu" (Triton lowering): grid (query blocks, batch, heads); each program keeps its
  query tile and loops over key blocks up to the causal diagonal with `lax.fori_loop`.
  The prior depends only on k_pos - q_pos, so with block_q = m * block_k each GGD tile is
  evaluated once and reused by the m query sub-blocks (m times fewer exp2/log2).
- "tpu" (Mosaic lowering): grid (batch, heads, query blocks, key blocks); the running
  max, sum and accumulator live in VMEM scratch across the key-block axis, and the key
  index map is clamped to the visible band so skipped blocks are never fetched.

Logits are formed in log2 units (softmax via exp2) and in float32. The GGD prior
-exp(theta_alpha) * (|d - mu| + eps) ** theta_beta and ALiBi -slope * |d| are evaluated
per tile from positions; nothing of size T x S is built. SSMax uses n_i, the number of
keys query i can see, computed outside the kernel in O((T + S) log S).

The backward pass is a custom VJP: a pure-JAX flash-style recomputation over
(key block, query block) tiles using the saved log-sum-exp, differentiating the tile
logits with respect to queries, keys, prior parameters and SSMax scales.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from bam_jax.attention import visibility_mask
from bam_jax.priors import GGD_EPS, AlibiPrior, GGDPrior, Prior

Backend = Literal["gpu", "tpu"]
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
_GPU_MAX_BLOCK_Q = 128
_GPU_MAX_BLOCK_K = 64
_TPU_LANES = 128
_BACKWARD_BLOCK = 512
_NUM_HEAD_PARAMS = 8  # coef, beta, mu, ssmax scale, padding


def default_implementation() -> str:
    """ "pallas" on GPU and TPU backends, "blockwise" elsewhere."""
    return "pallas" if jax.default_backend() in ("gpu", "tpu") else "blockwise"


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels specialise on (hashable, so it can be a static argument)."""

    backend: Backend
    interpret: bool
    approx_math: bool
    block_q: int
    block_k: int
    q_len: int
    kv_len: int
    head_dim: int
    groups: int
    causal: bool
    window: int | None
    prior_kind: Literal["none", "ggd", "alibi"]
    ssmax: bool
    prior_inside: bool
    segments: bool
    num_warps: int | None
    num_stages: int | None
    q_splits: int = 1

    @property
    def padded_q_len(self) -> int:
        return _round_up(self.q_len, self.block_q)

    @property
    def padded_kv_len(self) -> int:
        return _round_up(self.kv_len, self.block_k)

    @property
    def num_k_blocks(self) -> int:
        return self.padded_kv_len // self.block_k


def pallas_attention(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    *,
    prior: Prior | None = None,
    ssmax_scale_H: jax.Array | None = None,
    ssmax_prior_inside: bool = True,
    query_segment_ids_BxT: jax.Array | None = None,
    key_segment_ids_BxS: jax.Array | None = None,
    query_offset: int | jax.Array = 0,
    causal: bool = True,
    window: int | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    backend: Backend | None = None,
    interpret: bool = False,
    approx_math: bool = True,
    prior_reuse: bool = True,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> jax.Array:
    """Attention output [B, T, H, D], the same function as `reference_attention`.

    backend: "gpu" or "tpu"; None picks the running platform. An explicit backend is
        trusted, so the kernel can be lowered for another platform (`jax.jit(f).trace(...)
        .lower(lowering_platforms=("tpu",))`). On CPU pass a backend and `interpret=True`
        (Pallas interpret mode; "tpu" then uses TPU interpret semantics).
    block_q, block_k: tile sizes (None = backend default). On GPU they are capped at 128
        and 64 (register file; the defaults); on TPU a key block smaller than the keys is
        rounded to a multiple of 128 lanes.
    approx_math: on a compiled GPU kernel, use the hardware approximate exp2/log2 for the
        prior and softmax (about 2 ulp). Ignored in interpret mode and on TPU.
    prior_reuse: on GPU with block_q a multiple of block_k, evaluate each GGD tile once
        and reuse it for the next query sub-block (see `_gpu_kernel`).
    num_warps, num_stages: Triton launch parameters (None = defaults by head dim).
    """
    if query_BxTxHxD.ndim != 4 or key_BxSxKxD.ndim != 4 or value_BxSxKxD.ndim != 4:
        raise ValueError(
            "query, key and value must be [batch, length, heads, head_dim]; got "
            f"{query_BxTxHxD.shape}, {key_BxSxKxD.shape}, {value_BxSxKxD.shape}"
        )
    if key_BxSxKxD.shape != value_BxSxKxD.shape:
        raise ValueError(f"key {key_BxSxKxD.shape} and value {value_BxSxKxD.shape} differ")
    if (query_segment_ids_BxT is None) != (key_segment_ids_BxS is None):
        raise ValueError("query_segment_ids_BxT and key_segment_ids_BxS must be given together")
    if window is not None and window < 0:
        raise ValueError(f"window must be None or >= 0, got {window}")
    if isinstance(query_offset, int) and query_offset < 0:
        raise ValueError(f"query_offset must be >= 0, got {query_offset}")
    batch, q_len, num_heads, head_dim = query_BxTxHxD.shape
    kv_len, num_kv_heads = key_BxSxKxD.shape[1], key_BxSxKxD.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of kv heads")
    backend = _resolve_backend(backend)
    block_q, block_k = _choose_blocks(backend, interpret, q_len, kv_len, block_q, block_k)
    static = _Static(
        backend=backend,
        interpret=interpret,
        approx_math=approx_math and not interpret and backend == "gpu",
        block_q=block_q,
        block_k=block_k,
        q_len=q_len,
        kv_len=kv_len,
        head_dim=head_dim,
        groups=num_heads // num_kv_heads,
        causal=causal,
        window=window,
        prior_kind=_prior_kind(prior, num_heads),
        ssmax=ssmax_scale_H is not None,
        prior_inside=ssmax_prior_inside,
        segments=query_segment_ids_BxT is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if prior_reuse and backend == "gpu" and static.prior_kind == "ggd":
        static = dataclasses.replace(static, q_splits=_reuse_splits(block_q, block_k))
    if ssmax_scale_H is not None and ssmax_scale_H.shape != (num_heads,):
        raise ValueError(f"ssmax_scale_H must have shape ({num_heads},), got {ssmax_scale_H.shape}")
    offset = jnp.asarray(query_offset, jnp.int32).reshape(1)
    log_n_BxT = None
    if static.ssmax:
        counts = visible_key_counts(
            q_len,
            kv_len,
            offset[0],
            query_segment_ids_BxT,
            key_segment_ids_BxS,
            causal=causal,
            window=window,
        )
        log_n_BxT = jnp.broadcast_to(
            jnp.log(jnp.maximum(counts, 1).astype(jnp.float32)), (batch, q_len)
        )
    aux = _Aux(log_n_BxT, query_segment_ids_BxT, key_segment_ids_BxS, offset)
    return _attention(static, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, prior, ssmax_scale_H, aux)


class _Aux(NamedTuple):
    """Non-differentiable inputs."""

    log_n_BxT: jax.Array | None
    q_seg_BxT: jax.Array | None
    k_seg_BxS: jax.Array | None
    offset_1: jax.Array


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def _resolve_backend(backend: Backend | None) -> Backend:
    platform = jax.default_backend()
    if backend is None:
        if platform not in ("gpu", "tpu"):
            raise ValueError(
                f"the pallas implementation needs a GPU or TPU (running on {platform!r}); "
                "pass backend='gpu' or 'tpu' with interpret=True to run it on CPU"
            )
        return platform
    if backend not in ("gpu", "tpu"):
        raise ValueError(f"backend must be 'gpu', 'tpu' or None, got {backend!r}")
    return backend


def _choose_blocks(
    backend: Backend,
    interpret: bool,
    q_len: int,
    kv_len: int,
    block_q: int | None,
    block_k: int | None,
) -> tuple[int, int]:
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if backend == "gpu":
        # Triton tiles: powers of two, >= 16 for tensor-core dots.
        bq = min(block_q or 128, _GPU_MAX_BLOCK_Q, pl.next_power_of_2(max(q_len, 16)))
        bk = min(block_k or 64, _GPU_MAX_BLOCK_K, pl.next_power_of_2(max(kv_len, 16)))
        return max(16, pl.next_power_of_2(bq)), max(16, pl.next_power_of_2(bk))
    bq = min(block_q or 512, _round_up(q_len, 8))
    bq = _round_up(bq, 8)
    # Compiled Mosaic needs key blocks of whole 128-lane tiles (or all keys at once).
    lanes = 8 if interpret else _TPU_LANES
    bk = _round_up(block_k or 512, lanes)
    return bq, _round_up(kv_len, 8) if bk >= kv_len else bk


def _reuse_splits(block_q: int, block_k: int) -> int:
    """Query sub-blocks of block_k rows sharing GGD tiles (1: no reuse)."""
    if block_q <= block_k or block_q % block_k:
        return 1
    return block_q // block_k


def _prior_kind(prior: Prior | None, num_heads: int) -> Literal["none", "ggd", "alibi"]:
    if prior is None:
        return "none"
    if prior.num_heads != num_heads:
        raise ValueError(f"prior has {prior.num_heads} heads, query has {num_heads}")
    if isinstance(prior, GGDPrior):
        return "ggd"
    if isinstance(prior, AlibiPrior):
        return "alibi"
    raise NotImplementedError(
        f"the pallas kernel computes GGDPrior and AlibiPrior in-kernel; got {type(prior).__name__}"
    )


# ----------------------------------------------------------------------------------------
# SSMax visible-key counts


def visible_key_counts(
    q_len: int,
    kv_len: int,
    query_offset: int | jax.Array,
    query_segment_ids_BxT: jax.Array | None,
    key_segment_ids_BxS: jax.Array | None,
    *,
    causal: bool = True,
    window: int | None = None,
) -> jax.Array:
    """int32 [B or 1, T]: how many keys each query may see (its n_i), without a T x S mask.

    Keys of the query's document are located by a stable sort of the key segment ids and
    a binary search, so arbitrary (even non-contiguous) segment ids are counted exactly.
    """
    q_pos_T = jnp.arange(q_len, dtype=jnp.int32) + jnp.asarray(query_offset, jnp.int32)
    first_T = jnp.zeros_like(q_pos_T)
    last_T = jnp.full_like(q_pos_T, kv_len - 1)
    if causal:
        last_T = jnp.minimum(last_T, q_pos_T)
    if window is not None:
        first_T = jnp.maximum(first_T, q_pos_T - window)
        if not causal:
            last_T = jnp.minimum(last_T, q_pos_T + window)
    if query_segment_ids_BxT is None:
        return jnp.maximum(last_T - first_T + 1, 0)[None]
    count_le = jax.vmap(_segment_count_le)
    last_BxT = jnp.broadcast_to(last_T, query_segment_ids_BxT.shape)
    first_BxT = jnp.broadcast_to(first_T, query_segment_ids_BxT.shape)
    counts = count_le(key_segment_ids_BxS, query_segment_ids_BxT, last_BxT) - count_le(
        key_segment_ids_BxS, query_segment_ids_BxT, first_BxT - 1
    )
    counts = jnp.where(last_BxT >= first_BxT, counts, 0)
    return jnp.where(query_segment_ids_BxT >= 0, counts, 0).astype(jnp.int32)


def _segment_count_le(k_seg_S: jax.Array, q_seg_T: jax.Array, limit_T: jax.Array) -> jax.Array:
    """Number of keys at positions <= limit_T whose segment id equals q_seg_T."""
    kv_len = k_seg_S.shape[0]
    order_S = jnp.argsort(k_seg_S, stable=True).astype(jnp.int32)
    sorted_seg_S = k_seg_S[order_S]
    start_T = jnp.searchsorted(sorted_seg_S, q_seg_T, side="left").astype(jnp.int32)
    end_T = jnp.searchsorted(sorted_seg_S, q_seg_T, side="right").astype(jnp.int32)

    def step(_, bounds):
        low, high = bounds
        active = low < high
        mid = (low + high) // 2
        go_right = order_S[jnp.clip(mid, 0, kv_len - 1)] <= limit_T
        low = jnp.where(active & go_right, mid + 1, low)
        high = jnp.where(active & ~go_right, mid, high)
        return low, high

    steps = max(1, math.ceil(math.log2(kv_len + 1)))
    low, _ = lax.fori_loop(0, steps, step, (start_T, end_T))
    return low - start_T


# ----------------------------------------------------------------------------------------
# Shared tile math (runs inside both kernels)


class _Math(NamedTuple):
    exp2: Callable[[jax.Array], jax.Array]
    log2: Callable[[jax.Array], jax.Array]


def _exact_math() -> _Math:
    return _Math(exp2=jnp.exp2, log2=jnp.log2)


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


def _math_for(static: _Static) -> _Math:
    if static.approx_math:
        return _Math(exp2=_ptx_unary("ex2.approx.ftz.f32"), log2=_ptx_unary("lg2.approx.ftz.f32"))
    return _exact_math()


class _HeadScalars(NamedTuple):
    coef: jax.Array  # exp(theta_alpha) or the ALiBi slope
    beta: jax.Array
    mu: jax.Array
    ssmax_scale: jax.Array


class _Rows(NamedTuple):
    """Per-query multipliers of the content and prior terms, in log2 units ([Q, 1])."""

    content: jax.Array
    prior: jax.Array


def _row_coefficients(static: _Static, head: _HeadScalars, log_n_Qx1: jax.Array | None) -> _Rows:
    content = jnp.float32(LOG2_E / math.sqrt(static.head_dim))
    prior = head.coef * jnp.float32(LOG2_E)
    if static.ssmax:
        factor_Qx1 = head.ssmax_scale * log_n_Qx1
        content = content * factor_Qx1
        if static.prior_inside:
            prior = prior * factor_Qx1
    return _Rows(content=content, prior=prior)


def _ggd_unit(
    math_ops: _Math, head: _HeadScalars, relative_start: jax.Array, shape: tuple[int, int]
) -> jax.Array:
    """(|d - mu| + eps) ** beta for d = relative_start + col - row, float32 [Q, K]."""
    distance = (
        relative_start
        + lax.broadcasted_iota(jnp.int32, shape, 1)
        - lax.broadcasted_iota(jnp.int32, shape, 0)
    )
    gap = jnp.abs(distance.astype(jnp.float32) - head.mu) + jnp.float32(GGD_EPS)
    return math_ops.exp2(head.beta * math_ops.log2(gap))


def _tile_logits2(
    static: _Static,
    math_ops: _Math,
    q_QxD: jax.Array,
    k_KxD: jax.Array,
    q_start: jax.Array,
    k_start: jax.Array,
    head: _HeadScalars,
    rows: _Rows,
    q_seg_Qx1: jax.Array | None,
    k_seg_1xK: jax.Array | None,
    ggd_unit_QxK: jax.Array | None = None,
) -> jax.Array:
    """Masked logits of one tile in log2 units (-inf where not visible), float32 [Q, K].

    ggd_unit_QxK: the GGD tile without its per-row coefficient when the caller already has
    it (the GPU kernel reuses it across query sub-blocks); computed here otherwise.
    """
    shape = (q_QxD.shape[0], k_KxD.shape[0])
    scores = lax.dot_general(
        q_QxD, k_KxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    logits = scores * rows.content
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, 0)
    k_pos = k_start + lax.broadcasted_iota(jnp.int32, shape, 1)
    distance = k_pos - q_pos
    if static.prior_kind == "ggd":
        if ggd_unit_QxK is None:
            ggd_unit_QxK = _ggd_unit(math_ops, head, k_start - q_start, shape)
        logits = logits - ggd_unit_QxK * rows.prior
    elif static.prior_kind == "alibi":
        logits = logits - jnp.abs(distance).astype(jnp.float32) * rows.prior
    visible = k_pos < static.kv_len
    if static.causal:
        visible = visible & (distance <= 0)
    if static.window is not None:
        visible = visible & (distance >= -static.window)
        if not static.causal:
            visible = visible & (distance <= static.window)
    if static.segments:
        visible = visible & (q_seg_Qx1 == k_seg_1xK) & (k_seg_1xK >= 0)
    return jnp.where(visible, logits, -jnp.inf)


class _Carry(NamedTuple):
    acc_QxD: jax.Array
    max_Qx1: jax.Array
    sum_Qx1: jax.Array


def _init_carry(block_q: int, head_dim: int) -> _Carry:
    return _Carry(
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q, 1), -jnp.inf, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
    )


def _online_update(math_ops: _Math, carry: _Carry, logits_QxK: jax.Array, v_KxD) -> _Carry:
    new_max = jnp.maximum(carry.max_Qx1, jnp.max(logits_QxK, axis=1, keepdims=True))
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = math_ops.exp2(carry.max_Qx1 - safe_max)
    probs = math_ops.exp2(logits_QxK - safe_max)
    new_sum = carry.sum_Qx1 * correction + jnp.sum(probs, axis=1, keepdims=True)
    update = lax.dot_general(
        probs.astype(v_KxD.dtype),
        v_KxD,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return _Carry(carry.acc_QxD * correction + update, new_max, new_sum)


def _finalize(carry: _Carry) -> tuple[jax.Array, jax.Array]:
    """Normalised output and natural-log log-sum-exp (+inf for rows that see no key)."""
    seen = carry.sum_Qx1 > 0
    out = carry.acc_QxD / jnp.where(seen, carry.sum_Qx1, 1.0)
    lse = (carry.max_Qx1 + jnp.log2(jnp.where(seen, carry.sum_Qx1, 1.0))) * jnp.float32(LN_2)
    return out, jnp.where(seen, lse, jnp.inf)


def _key_block_range(static: _Static, q_start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[first, last) key blocks a query block starting at position q_start can see."""
    q_last = q_start + (static.block_q - 1)
    num_k = static.num_k_blocks
    if static.causal:
        stop = jnp.minimum(lax.div(q_last, static.block_k) + 1, num_k)
    elif static.window is not None:
        stop = jnp.minimum(lax.div(q_last + static.window, static.block_k) + 1, num_k)
    else:
        stop = jnp.int32(num_k)
    start = jnp.int32(0)
    if static.window is not None:
        start = jnp.minimum(lax.div(jnp.maximum(q_start - static.window, 0), static.block_k), stop)
    return start, stop


def _load_head(load: Callable[[int], jax.Array]) -> _HeadScalars:
    return _HeadScalars(coef=load(0), beta=load(1), mu=load(2), ssmax_scale=load(3))


# ----------------------------------------------------------------------------------------
# GPU (Triton) variant


class _SubBlock(NamedTuple):
    """Rows of the query block that share one online-softmax state."""

    rows: pl.Slice
    q_start: jax.Array
    q_RxD: jax.Array
    coefficients: _Rows
    seg_Rx1: jax.Array | None


def _gpu_kernel(static: _Static, offset_ref, head_ref, q_ref, k_ref, v_ref, *refs):
    """One query block against its visible key blocks.

    With q_splits = m > 1 the query block is m sub-blocks of block_k rows each. The GGD
    tile of sub-block s at key block j equals that of sub-block 0 at key block j - s, so
    each step evaluates the prior's exp2/log2 for one sub-block only and carries the last
    m - 1 tiles: the prior's transcendental cost drops by a factor m.
    """
    refs = list(refs)
    log_n_ref = refs.pop(0) if static.ssmax else None
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if static.segments else (None, None)
    out_ref, lse_ref = refs
    math_ops = _math_for(static)
    bk, splits = static.block_k, static.q_splits
    sub_rows = static.block_q // splits
    q_block = pl.num_programs(0) - 1 - pl.program_id(0)  # longest rows first
    q_start = offset_ref[0] + q_block * static.block_q
    head = _load_head(lambda j: head_ref[j])
    subs = []
    for s in range(splits):
        rows = pl.ds(s * sub_rows, sub_rows)
        log_n = None if log_n_ref is None else log_n_ref[rows, :]
        subs.append(
            _SubBlock(
                rows=rows,
                q_start=q_start + s * sub_rows,
                q_RxD=q_ref[rows, :],
                coefficients=_row_coefficients(static, head, log_n),
                seg_Rx1=None if q_seg_ref is None else q_seg_ref[rows, :],
            )
        )
    reuse = static.prior_kind == "ggd"

    def unit_at(k_start):
        return _ggd_unit(math_ops, head, k_start - q_start, (sub_rows, bk))

    def body(k_block, state):
        carries, window = state
        k_start = pl.multiple_of(k_block * bk, bk)
        keys = pl.ds(k_start, bk)
        k_KxD, v_KxD = k_ref[keys, :], v_ref[keys, :]
        k_seg = None if k_seg_ref is None else k_seg_ref[:, keys]
        units = (unit_at(k_start), *window) if reuse else (None,) * splits
        new_carries = []
        for sub, carry, unit in zip(subs, carries, units, strict=True):
            logits = _tile_logits2(
                static,
                math_ops,
                sub.q_RxD,
                k_KxD,
                sub.q_start,
                k_start,
                head,
                sub.coefficients,
                sub.seg_Rx1,
                k_seg,
                unit,
            )
            new_carries.append(_online_update(math_ops, carry, logits, v_KxD))
        return tuple(new_carries), units[:-1] if reuse else ()

    start, stop = _key_block_range(static, q_start)
    window = tuple(unit_at((start - s) * bk) for s in range(1, splits)) if reuse else ()
    carries = tuple(_init_carry(sub_rows, q_ref.shape[1]) for _ in range(splits))
    carries, _ = lax.fori_loop(start, stop, body, (carries, window))
    for sub, carry in zip(subs, carries, strict=True):
        out, lse = _finalize(carry)
        out_ref[sub.rows, :] = out.astype(out_ref.dtype)
        lse_ref[sub.rows, :] = lse


def _gpu_forward(static: _Static, q, k, v, head_params_HxP, log_n, q_seg, k_seg, offset):
    batch, q_pad, num_heads, d_pad = q.shape
    kv_pad = k.shape[1]
    bq, groups = static.block_q, static.groups
    num_q_blocks = q_pad // bq

    def q_block(i):
        return num_q_blocks - 1 - i

    in_specs = [
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
        pl.BlockSpec((None, _NUM_HEAD_PARAMS), lambda i, b, h: (h, 0)),
        pl.BlockSpec((None, bq, None, d_pad), lambda i, b, h: (b, q_block(i), h, 0)),
        pl.BlockSpec((None, kv_pad, None, d_pad), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
        pl.BlockSpec((None, kv_pad, None, d_pad), lambda i, b, h: (b, 0, lax.div(h, groups), 0)),
    ]
    inputs = [offset, head_params_HxP, q, k, v]
    row_spec = pl.BlockSpec((None, bq, 1), lambda i, b, h: (b, q_block(i), 0))
    if static.ssmax:
        in_specs.append(row_spec)
        inputs.append(log_n)
    if static.segments:
        in_specs += [row_spec, pl.BlockSpec((None, 1, kv_pad), lambda i, b, h: (b, 0, 0))]
        inputs += [q_seg, k_seg]
    out_specs = [
        pl.BlockSpec((None, bq, None, d_pad), lambda i, b, h: (b, q_block(i), h, 0)),
        pl.BlockSpec((None, None, bq, 1), lambda i, b, h: (b, h, q_block(i), 0)),
    ]
    num_warps = static.num_warps or (4 if d_pad <= 64 else 8)
    return pl.pallas_call(
        functools.partial(_gpu_kernel, static),
        grid=(num_q_blocks, batch, num_heads),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=_out_shapes(q),
        compiler_params=plgpu.CompilerParams(
            num_warps=num_warps, num_stages=static.num_stages or 2
        ),
        interpret=static.interpret,
        name="bam_attention_fwd",
    )(*inputs)


def _out_shapes(q_BxTxHxD: jax.Array) -> list[jax.ShapeDtypeStruct]:
    batch, q_pad, num_heads, d_pad = q_BxTxHxD.shape
    return [
        jax.ShapeDtypeStruct((batch, q_pad, num_heads, d_pad), q_BxTxHxD.dtype),
        jax.ShapeDtypeStruct((batch, num_heads, q_pad, 1), jnp.float32),
    ]


# ----------------------------------------------------------------------------------------
# TPU (Mosaic) variant


def _tpu_kernel(static: _Static, offset_ref, head_ref, q_ref, k_ref, v_ref, *refs):
    refs = list(refs)
    log_n_ref = refs.pop(0) if static.ssmax else None
    q_seg_ref, k_seg_ref = (refs.pop(0), refs.pop(0)) if static.segments else (None, None)
    out_ref, lse_ref, acc_ref, max_ref, sum_ref = refs
    h, q_block, k_block = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    q_start = offset_ref[0] + q_block * static.block_q
    start, stop = _key_block_range(static, q_start)

    @pl.when(k_block == 0)
    def _():
        init = _init_carry(static.block_q, acc_ref.shape[1])
        acc_ref[...], max_ref[...], sum_ref[...] = init

    @pl.when((k_block >= start) & (k_block < stop))
    def _():
        math_ops = _exact_math()
        head = _load_head(lambda j: head_ref[h, j])
        rows = _row_coefficients(static, head, None if log_n_ref is None else log_n_ref[...])
        k_start = k_block * static.block_k
        logits = _tile_logits2(
            static,
            math_ops,
            q_ref[...],
            k_ref[...],
            q_start,
            k_start,
            head,
            rows,
            None if q_seg_ref is None else q_seg_ref[...],
            None if k_seg_ref is None else k_seg_ref[...],
        )
        carry = _Carry(acc_ref[...], max_ref[...], sum_ref[...])
        acc_ref[...], max_ref[...], sum_ref[...] = _online_update(
            math_ops, carry, logits, v_ref[...]
        )

    @pl.when(k_block == static.num_k_blocks - 1)
    def _():
        out, lse = _finalize(_Carry(acc_ref[...], max_ref[...], sum_ref[...]))
        out_ref[...] = out.astype(out_ref.dtype)
        lse_ref[...] = lse


def _tpu_forward(static: _Static, q, k, v, head_params_HxP, log_n, q_seg, k_seg, offset):
    batch, q_pad, num_heads, d_pad = q.shape
    bq, bk, groups = static.block_q, static.block_k, static.groups
    # Mosaic tiles the last two dims of each block: put (length, head_dim) last.
    q_BxHxTxD = q.transpose(0, 2, 1, 3)
    k_BxKxSxD = k.transpose(0, 2, 1, 3)
    v_BxKxSxD = v.transpose(0, 2, 1, 3)

    def kv_block(b, h, i, j, offset_ref):
        start, stop = _key_block_range(static, offset_ref[0] + i * bq)
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
    inputs = [head_params_HxP, q_BxHxTxD, k_BxKxSxD, v_BxKxSxD]
    if static.ssmax:
        in_specs.append(pl.BlockSpec((None, bq, 1), q_rows))
        inputs.append(log_n)
    if static.segments:
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
        grid=(batch, num_heads, q_pad // bq, static.num_k_blocks),
        in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[
            pltpu.VMEM((bq, d_pad), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
            pltpu.VMEM((bq, 1), jnp.float32),
        ],
    )
    out_BxHxTxD, lse = pl.pallas_call(
        functools.partial(_tpu_kernel, static),
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=pltpu.InterpretParams() if static.interpret else False,
        name="bam_attention_fwd",
    )(offset, *inputs)
    return out_BxHxTxD.transpose(0, 2, 1, 3), lse


# ----------------------------------------------------------------------------------------
# Forward wrapper: padding, per-head scalars


def _head_params(static: _Static, prior: Prior | None, ssmax_scale_H, num_heads: int):
    columns = [jnp.zeros((num_heads,), jnp.float32)] * _NUM_HEAD_PARAMS
    if static.prior_kind == "ggd":
        theta_mu = prior.theta_mu_H.astype(jnp.float32)
        columns[0] = jnp.exp(prior.theta_alpha_H.astype(jnp.float32))
        columns[1] = prior.theta_beta_H.astype(jnp.float32)
        columns[2] = jnp.exp(theta_mu) - jnp.exp(-theta_mu)
    elif static.prior_kind == "alibi":
        columns[0] = prior.slopes_H.astype(jnp.float32)
    if ssmax_scale_H is not None:
        columns[3] = ssmax_scale_H.astype(jnp.float32)
    return jax.lax.stop_gradient(jnp.stack(columns, axis=1))


def _pad_to(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _forward(static: _Static, q, k, v, prior, ssmax_scale_H, aux: _Aux):
    """Output [B, T, H, D] and log-sum-exp [B, H, T] (natural log, +inf for empty rows)."""
    _, q_len, num_heads, head_dim = q.shape
    q_pad, kv_pad = static.padded_q_len, static.padded_kv_len
    d_pad = pl.next_power_of_2(head_dim) if static.backend == "gpu" else head_dim
    q_p = _pad_to(_pad_to(q, 1, q_pad), 3, d_pad)
    k_p = _pad_to(_pad_to(k, 1, kv_pad), 3, d_pad)
    v_p = _pad_to(_pad_to(v, 1, kv_pad), 3, d_pad)
    log_n = q_seg = k_seg = None
    if static.ssmax:
        log_n = _pad_to(aux.log_n_BxT, 1, q_pad)[..., None]
    if static.segments:
        q_seg = _pad_to(aux.q_seg_BxT.astype(jnp.int32), 1, q_pad, -1)[..., None]
        k_seg = _pad_to(aux.k_seg_BxS.astype(jnp.int32), 1, kv_pad, -1)[:, None, :]
    head_params = _head_params(static, prior, ssmax_scale_H, num_heads)
    run = _gpu_forward if static.backend == "gpu" else _tpu_forward
    out, lse = run(static, q_p, k_p, v_p, head_params, log_n, q_seg, k_seg, aux.offset_1)
    return out[:, :q_len, :, :head_dim], lse[:, :, :q_len, 0]


# ----------------------------------------------------------------------------------------
# Backward: pure-JAX recomputation from the saved log-sum-exp


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static: _Static, q, k, v, prior, ssmax_scale_H, aux: _Aux):
    return _forward(static, q, k, v, prior, ssmax_scale_H, aux)[0]


def _attention_fwd(static: _Static, q, k, v, prior, ssmax_scale_H, aux: _Aux):
    out, lse = _forward(static, q, k, v, prior, ssmax_scale_H, aux)
    return out, (q, k, v, prior, ssmax_scale_H, aux, out, lse)


def _attention_bwd(static: _Static, residuals, d_out):
    q, k, v, prior, ssmax_scale_H, aux, out, lse = residuals
    grads = attention_backward(static, q, k, v, prior, ssmax_scale_H, aux, out, lse, d_out)
    aux_cotangent = jax.tree.map(lambda _: None, aux)
    return (*grads, aux_cotangent)


_attention.defvjp(_attention_fwd, _attention_bwd)


def _tile_logits(
    static: _Static, q_BxQxHxD, k_BxKxGxD, prior, ssmax_scale_H, q_pos_Q, k_pos_K, log_n_BxQ
) -> jax.Array:
    """Unmasked natural-unit logits [B, H, Q, K] as a differentiable function of the inputs."""
    batch, rows, num_heads, head_dim = q_BxQxHxD.shape
    cols, num_kv = k_BxKxGxD.shape[1], k_BxKxGxD.shape[2]
    q_grouped = q_BxQxHxD.reshape(batch, rows, num_kv, static.groups, head_dim)
    scores = jnp.einsum(
        "bqkgd,bskd->bkgqs", q_grouped, k_BxKxGxD, preferred_element_type=jnp.float32
    ).reshape(batch, num_heads, rows, cols) / jnp.float32(math.sqrt(head_dim))
    bias = None if prior is None else prior.bias(k_pos_K[None, :] - q_pos_Q[:, None])[None]
    if ssmax_scale_H is None:
        return scores if bias is None else scores + bias
    factor = (ssmax_scale_H.astype(jnp.float32)[None, :, None] * log_n_BxQ[:, None, :])[..., None]
    if bias is None:
        return scores * factor
    if static.prior_inside:
        return (scores + bias) * factor
    return scores * factor + bias


def attention_backward(static: _Static, q, k, v, prior, ssmax_scale_H, aux: _Aux, out, lse, d_out):
    """Cotangents (dq, dk, dv, dprior, dssmax) by flash-style recomputation over tiles."""
    batch, q_len, num_heads, head_dim = q.shape
    kv_len, num_kv = k.shape[1], k.shape[2]
    bq = min(_BACKWARD_BLOCK, _round_up(q_len, 8))
    bk = min(_BACKWARD_BLOCK, _round_up(kv_len, 8))
    q_pad, kv_pad = _round_up(q_len, bq), _round_up(kv_len, bk)
    offset = aux.offset_1[0]
    delta_BxHxT = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32))
    q_p, do_p = _pad_to(q, 1, q_pad), _pad_to(d_out, 1, q_pad)
    k_p, v_p = _pad_to(k, 1, kv_pad), _pad_to(v, 1, kv_pad)
    lse_p = _pad_to(lse, 2, q_pad, jnp.inf)
    delta_p = _pad_to(delta_BxHxT, 2, q_pad)
    log_n_p = None if aux.log_n_BxT is None else _pad_to(aux.log_n_BxT, 1, q_pad)
    q_seg_p = k_seg_p = None
    if static.segments:
        q_seg_p = _pad_to(aux.q_seg_BxT, 1, q_pad, -1)
        k_seg_p = _pad_to(aux.k_seg_BxS, 1, kv_pad, -1)

    def tile(q_block, k_block, grads):
        dq, dk_blk, dv_blk, dprior, dscale = grads
        q0, k0 = q_block * bq, k_block * bk
        q_pos = offset + q0 + jnp.arange(bq, dtype=jnp.int32)
        k_pos = k0 + jnp.arange(bk, dtype=jnp.int32)
        q_t = lax.dynamic_slice_in_dim(q_p, q0, bq, 1)
        k_t = lax.dynamic_slice_in_dim(k_p, k0, bk, 1)
        v_t = lax.dynamic_slice_in_dim(v_p, k0, bk, 1)
        do_t = lax.dynamic_slice_in_dim(do_p, q0, bq, 1)
        log_n_t = None if log_n_p is None else lax.dynamic_slice_in_dim(log_n_p, q0, bq, 1)

        def logits_fn(q_, k_, prior_, scale_):
            return _tile_logits(static, q_, k_, prior_, scale_, q_pos, k_pos, log_n_t)

        logits, vjp_fn = jax.vjp(logits_fn, q_t, k_t, prior, ssmax_scale_H)
        mask = (
            visibility_mask(
                q_pos,
                k_pos,
                None if q_seg_p is None else lax.dynamic_slice_in_dim(q_seg_p, q0, bq, 1),
                None if k_seg_p is None else lax.dynamic_slice_in_dim(k_seg_p, k0, bk, 1),
                causal=static.causal,
                window=static.window,
            )
            & (k_pos < kv_len)[None, None, :]
        )
        lse_t = lax.dynamic_slice_in_dim(lse_p, q0, bq, 2)[..., None]
        probs = jnp.where(mask[:, None], jnp.exp(logits - lse_t), 0.0)
        probs_g = probs.reshape(batch, num_kv, static.groups, bq, bk)
        do_g = do_t.reshape(batch, bq, num_kv, static.groups, head_dim).astype(jnp.float32)
        dv_blk = dv_blk + jnp.einsum("bkgqs,bqkgd->bskd", probs_g, do_g)
        dprobs = jnp.einsum("bqkgd,bskd->bkgqs", do_g, v_t.astype(jnp.float32))
        delta_t = lax.dynamic_slice_in_dim(delta_p, q0, bq, 2)[..., None]
        dlogits = probs * (dprobs.reshape(probs.shape) - delta_t)
        dq_t, dk_t, dprior_t, dscale_t = vjp_fn(dlogits)
        dq = lax.dynamic_update_slice_in_dim(
            dq, lax.dynamic_slice_in_dim(dq, q0, bq, 1) + dq_t.astype(jnp.float32), q0, 1
        )
        dprior = jax.tree.map(jnp.add, dprior, dprior_t)
        dscale = jax.tree.map(jnp.add, dscale, dscale_t)
        return dq, dk_blk + dk_t.astype(jnp.float32), dv_blk, dprior, dscale

    def key_block(k_block, grads):
        dq, dk, dv, dprior, dscale = grads
        first, stop = _backward_query_range(static, k_block * bk, offset, bq, bk, q_pad // bq)
        zeros = jnp.zeros((batch, bk, num_kv, head_dim), jnp.float32)
        dq, dk_blk, dv_blk, dprior, dscale = lax.fori_loop(
            first, stop, lambda i, g: tile(i, k_block, g), (dq, zeros, zeros, dprior, dscale)
        )
        k0 = k_block * bk
        dk = lax.dynamic_update_slice_in_dim(dk, dk_blk, k0, 1)
        dv = lax.dynamic_update_slice_in_dim(dv, dv_blk, k0, 1)
        return dq, dk, dv, dprior, dscale

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


def _backward_query_range(static: _Static, k_start, offset, bq: int, bk: int, num_q: int):
    """[first, stop) query blocks that can see any key in [k_start, k_start + bk)."""
    first = jnp.int32(0)
    stop = jnp.int32(num_q)
    if static.causal:
        first = jnp.clip((k_start - offset) // bq, 0, num_q)
    if static.window is not None:
        stop = jnp.clip((k_start + bk - 1 + static.window - offset) // bq + 1, first, num_q)
        if not static.causal:
            first = jnp.clip((k_start - static.window - offset) // bq, 0, stop)
    return first, stop
