"""What the Pallas attention kernels share: their static configuration and the tile math.

Both kernels (bam_jax/kernels/gpu.py, bam_jax/kernels/tpu.py) call these functions on one
(query block, key block) tile: logits in log2 units with the prior, SSMax and masks applied
(`tile_logits_log2`), the online-softmax update (`online_update`) and the final
normalisation with the log-sum-exp (`finalize`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from bam_jax.masking import AttentionMask
from bam_jax.priors import GGD_EPS, GGD_MAX_LOG2_MAGNITUDE

Backend = Literal["gpu", "tpu", "cpu"]
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Everything the kernels specialise on (hashable, so it can be a static argument)."""

    backend: Backend
    interpret: bool
    approx_math: bool
    block_q: int
    block_k: int
    q_len: int
    head_dim: int
    groups: int
    mask: AttentionMask
    prior_kind: Literal["none", "ggd", "alibi", "other"]
    ssmax: bool
    prior_inside: bool
    segments: bool
    num_warps: int | None
    num_stages: int | None
    q_splits: int = 1
    # The prior read from a per-head table of its magnitude over distances rather than
    # evaluated per element (any Prior; "other" kinds need it).
    prior_table: bool = False
    debug: bool = False

    @property
    def padded_q_len(self) -> int:
        return round_up(self.q_len, self.block_q)

    @property
    def padded_kv_len(self) -> int:
        return round_up(self.mask.kv_len, self.block_k)

    @property
    def num_k_blocks(self) -> int:
        return self.padded_kv_len // self.block_k


class DerivedInputs(NamedTuple):
    """What the fused kernels read that is computed from a call's `AttentionInputs`:
    SSMax's log(n_i) [B, T] (with KernelConfig.ssmax) and the prior's magnitude -bias at
    the distances of `prior_table_distances` [H, X] (with KernelConfig.prior_table)."""

    log_n_BxT: jax.Array | None
    prior_table_HxX: jax.Array | None = None


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_to(x: jax.Array, axis: int, size: int, value: Any = 0) -> jax.Array:
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


class MathOps(NamedTuple):
    exp2: Callable[[jax.Array], jax.Array]
    log2: Callable[[jax.Array], jax.Array]


def _log2_by_product(x: jax.Array) -> jax.Array:
    # jnp.log2 is log(x) / log(2): a full divide per element inside a kernel.
    return jnp.log(x) * jnp.float32(LOG2_E)


def exact_math() -> MathOps:
    return MathOps(exp2=jnp.exp2, log2=_log2_by_product)


class HeadScalars(NamedTuple):
    """One head's row of the per-head parameter table, in column order."""

    coef: jax.Array  # exp(theta_alpha) or the ALiBi slope
    beta: jax.Array
    mu: jax.Array
    ssmax_scale: jax.Array
    limit: jax.Array  # GGD_MAX_LOG2_MAGNITUDE - log2(coef): where the GGD saturates


# The per-head parameter table [H, NUM_HEAD_PARAMS] that every kernel reads: the columns of
# HeadScalars, padded to 8. bam_jax/kernels/cpu_attention.cc repeats NUM_HEAD_PARAMS and
# SSMAX_SCALE as kHeadParams and kSsmaxColumn (tests/kernels/test_cpu_kernel.py compares them).
HEAD_PARAM_COLUMNS = HeadScalars._fields
COEF, BETA, MU, SSMAX_SCALE, LIMIT = range(len(HEAD_PARAM_COLUMNS))
NUM_HEAD_PARAMS = 8


class RowCoefficients(NamedTuple):
    """Per-query multipliers of the content and prior terms, in log2 units ([M, 1])."""

    content: jax.Array
    prior: jax.Array


def row_coefficients(
    config: KernelConfig, head: HeadScalars, log_n_Mx1: jax.Array | None
) -> RowCoefficients:
    content = jnp.float32(LOG2_E / math.sqrt(config.head_dim))
    prior = jnp.float32(LOG2_E)
    if not config.prior_table:
        prior = head.coef * prior
    if config.ssmax:
        factor_Mx1 = head.ssmax_scale * log_n_Mx1
        content = content * factor_Mx1
        if config.prior_inside:
            prior = prior * factor_Mx1
    return RowCoefficients(content=content, prior=prior)


def tile_distance(relative_start: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """k_pos - q_pos as float32 [M, N] over a tile whose first key sits relative_start
    after its first query: one int-to-float conversion per row and per column, one add per
    element (exact below 2 ** 24)."""
    rows, cols = shape
    col_1xN = lax.broadcasted_iota(jnp.int32, (1, cols), 1).astype(jnp.float32)
    row_Mx1 = lax.broadcasted_iota(jnp.int32, (rows, 1), 0).astype(jnp.float32)
    return (jnp.asarray(relative_start, jnp.int32).astype(jnp.float32) + col_1xN) - row_Mx1


def ggd_limit(theta_alpha_H: jax.Array) -> jax.Array:
    """Per head, the log2 of the GGD's unit-coefficient power at which the prior saturates:
    GGD_MAX_LOG2_MAGNITUDE - log2(exp(theta_alpha)), as `bam_jax.priors.ggd_bias` tests it."""
    return jnp.float32(GGD_MAX_LOG2_MAGNITUDE) - theta_alpha_H.astype(jnp.float32) * LOG2_E


def ggd_unit(
    math_ops: MathOps, head: HeadScalars, relative_start: jax.Array, shape: tuple[int, int]
) -> jax.Array:
    """(|d - mu| + eps) ** beta for d = relative_start + col - row, float32 [M, N], saturating
    where coef times it reaches 2 ** GGD_MAX_LOG2_MAGNITUDE, as `bam_jax.priors.ggd_bias`."""
    gap = jnp.abs(tile_distance(relative_start, shape) - head.mu) + jnp.float32(GGD_EPS)
    return math_ops.exp2(jnp.minimum(head.beta * math_ops.log2(gap), head.limit))


def tile_logits_log2(
    config: KernelConfig,
    math_ops: MathOps,
    q_MxD: jax.Array,
    k_NxD: jax.Array,
    q_start: jax.Array,
    k_start: jax.Array,
    head: HeadScalars,
    rows: RowCoefficients,
    q_seg_Mx1: jax.Array | None,
    k_seg_1xN: jax.Array | None,
    prior_tile_MxN: jax.Array | None = None,
    *,
    masked: bool = True,
) -> jax.Array:
    """Logits of one tile in log2 units, float32 [M, N]; -inf where not visible.

    prior_tile_MxN: what the per-row prior coefficient multiplies, when the caller already
    has it: the GGD tile without its coefficient (the GPU kernel reuses it across query
    sub-blocks), or the prior's magnitude read from a table (required with
    config.prior_table). Computed here otherwise.
    masked: False for tiles the caller knows to be fully visible
        (`AttentionMask.full_key_blocks_stop`).
    """
    shape = (q_MxD.shape[0], k_NxD.shape[0])
    scores = lax.dot_general(
        q_MxD, k_NxD, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
    )
    logits = scores * rows.content
    if prior_tile_MxN is None and not config.prior_table:
        if config.prior_kind == "ggd":
            prior_tile_MxN = ggd_unit(math_ops, head, k_start - q_start, shape)
        elif config.prior_kind == "alibi":
            prior_tile_MxN = jnp.abs(tile_distance(k_start - q_start, shape))
    if prior_tile_MxN is not None:
        logits = logits - prior_tile_MxN * rows.prior
    if not masked:
        return logits
    visible = config.mask.visible(
        q_start + lax.broadcasted_iota(jnp.int32, shape, 0),
        k_start + lax.broadcasted_iota(jnp.int32, shape, 1),
        q_seg_Mx1,
        k_seg_1xN,
    )
    return jnp.where(visible, logits, -jnp.inf)


class SoftmaxState(NamedTuple):
    acc_MxD: jax.Array
    max_Mx1: jax.Array
    sum_Mx1: jax.Array


def init_state(block_q: int, head_dim: int) -> SoftmaxState:
    return SoftmaxState(
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q, 1), -jnp.inf, jnp.float32),
        jnp.zeros((block_q, 1), jnp.float32),
    )


def online_update(
    math_ops: MathOps, carry: SoftmaxState, logits_MxN: jax.Array, v_NxD
) -> SoftmaxState:
    new_max = jnp.maximum(carry.max_Mx1, jnp.max(logits_MxN, axis=1, keepdims=True))
    safe_max = jnp.where(new_max == -jnp.inf, 0.0, new_max)
    correction = math_ops.exp2(carry.max_Mx1 - safe_max)
    probs = math_ops.exp2(logits_MxN - safe_max)
    new_sum = carry.sum_Mx1 * correction + jnp.sum(probs, axis=1, keepdims=True)
    update = lax.dot_general(
        probs.astype(v_NxD.dtype),
        v_NxD,
        (((1,), (0,)), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return SoftmaxState(carry.acc_MxD * correction + update, new_max, new_sum)


def finalize(carry: SoftmaxState) -> tuple[jax.Array, jax.Array]:
    """Normalised output and natural-log log-sum-exp (+inf for rows that see no key, so that
    every probability the backward recomputes from it is 0)."""
    seen = carry.sum_Mx1 > 0
    out = carry.acc_MxD / jnp.where(seen, carry.sum_Mx1, 1.0)
    lse = (carry.max_Mx1 + jnp.log2(jnp.where(seen, carry.sum_Mx1, 1.0))) * jnp.float32(LN_2)
    return out, jnp.where(seen, lse, jnp.inf)


def load_head(load: Callable[[int], jax.Array]) -> HeadScalars:
    return HeadScalars(*(load(column) for column in range(len(HEAD_PARAM_COLUMNS))))
