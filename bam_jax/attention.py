"""Causal attention with a positional prior, documents, SSMax and grouped-query heads.

One entry point, `dot_product_attention`, dispatches to implementations that compute
the same function:

- "reference": plain einsum with the bias and mask materialised, float32 softmax.
- "blockwise": flash-style online softmax over key blocks; the prior is evaluated per
  tile from positions, so no T x S array is ever built.
- "pallas": fused Pallas kernel (GPU/Triton, TPU/Mosaic) with the prior computed in the
  tile loop; see bam_jax/pallas_attention.py. Opt-in: `default_implementation` picks it
  only on device kinds where bench/accelerator_check.py has passed (docs/accelerators.md).

Positions: key slot s sits at position s; query t sits at `query_offset + t`. With a KV
cache of capacity S, unfilled slots lie in the future of every query and are masked by
causality. Segment ids: a query sees only keys with the same id; negative ids mark
padding, which is never attended to and never counted by SSMax.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bam_jax.priors import Prior

Implementation = Literal["reference", "blockwise", "pallas"]
PADDING_SEGMENT = -1
# Device kinds (`jax.Device.device_kind`) on which the compiled Pallas kernels passed
# bench/accelerator_check.py; the evidence (device, date, table) is in docs/accelerators.md.
PALLAS_VALIDATED_DEVICES: tuple[str, ...] = ()


def default_implementation(device: jax.Device | None = None) -> Implementation:
    """The implementation to use when none is chosen: "pallas" on a GPU or TPU whose kind
    is in PALLAS_VALIDATED_DEVICES, "blockwise" everywhere else.

    `device` defaults to the first device of the default backend.
    """
    device = jax.devices()[0] if device is None else device
    if device.platform in ("gpu", "tpu") and device.device_kind in PALLAS_VALIDATED_DEVICES:
        return "pallas"
    return "blockwise"


def dot_product_attention(
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
    implementation: Implementation = "reference",
    block_q: int = 256,
    block_k: int = 256,
) -> jax.Array:
    """Attention output [B, T, H, D] in the query's dtype.

    logits = q.k / sqrt(D) + prior.bias(k_pos - q_pos); with SSMax (`ssmax_scale_H`
    given) the logits of query i are multiplied by s_h * log(n_i), n_i the number of
    keys it may see, either including the prior (`ssmax_prior_inside`, the default)
    or before the prior is added. Softmax is computed in float32. A query that can
    see no key (padding) gets a zero output.
    """
    query_BxTxHxD, key_BxSxKxD, value_BxSxKxD = (
        jnp.asarray(x) for x in (query_BxTxHxD, key_BxSxKxD, value_BxSxKxD)
    )
    ssmax_scale_H, query_segment_ids_BxT, key_segment_ids_BxS = (
        None if x is None else jnp.asarray(x)
        for x in (ssmax_scale_H, query_segment_ids_BxT, key_segment_ids_BxS)
    )
    if implementation not in ("reference", "blockwise", "pallas"):
        raise ValueError(
            f"implementation must be 'reference', 'blockwise' or 'pallas', got {implementation!r}"
        )
    kwargs = dict(
        prior=prior,
        ssmax_scale_H=ssmax_scale_H,
        ssmax_prior_inside=ssmax_prior_inside,
        query_segment_ids_BxT=query_segment_ids_BxT,
        key_segment_ids_BxS=key_segment_ids_BxS,
        query_offset=query_offset,
        causal=causal,
        window=window,
    )
    check_attention_inputs(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, **kwargs)
    if has_no_queries_or_keys(query_BxTxHxD, key_BxSxKxD):
        return jnp.zeros(query_BxTxHxD.shape, query_BxTxHxD.dtype)
    if implementation == "reference":
        return reference_attention(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, **kwargs)
    if implementation == "blockwise":
        from bam_jax.blockwise import blockwise_attention

        return blockwise_attention(
            query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, block_q=block_q, block_k=block_k, **kwargs
        )
    from bam_jax.pallas_attention import pallas_attention

    return pallas_attention(
        query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, block_q=block_q, block_k=block_k, **kwargs
    )


def check_attention_inputs(
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
) -> None:
    """Raises ValueError (shapes, values) or TypeError (dtypes) naming the bad argument.

    Only shapes, dtypes and Python values are read, so under jit this costs nothing at
    run time.
    """
    _check_qkv(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD)
    batch, q_len, num_heads, _ = query_BxTxHxD.shape
    kv_len = key_BxSxKxD.shape[1]
    if prior is not None:
        _check_prior(prior, num_heads)
    if ssmax_scale_H is not None and jnp.shape(ssmax_scale_H) != (num_heads,):
        raise ValueError(
            f"ssmax_scale_H must have shape ({num_heads},) (one per query head), "
            f"got {jnp.shape(ssmax_scale_H)}"
        )
    _check_segment_ids(query_segment_ids_BxT, key_segment_ids_BxS, batch, q_len, kv_len)
    _check_positions(query_offset, causal, window, ssmax_prior_inside)


def has_no_queries_or_keys(query_BxTxHxD: jax.Array, key_BxSxKxD: jax.Array) -> bool:
    """True when the output is empty or every query sees no key (its output is then zero)."""
    return 0 in (query_BxTxHxD.shape[0], query_BxTxHxD.shape[1], key_BxSxKxD.shape[1])


def _check_qkv(q, k, v) -> None:
    for name, x in (("query_BxTxHxD", q), ("key_BxSxKxD", k), ("value_BxSxKxD", v)):
        if x.ndim != 4:
            raise ValueError(
                f"{name} must have 4 axes [batch, length, heads, head_dim], got shape {x.shape}"
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    if k.shape != v.shape:
        raise ValueError(
            f"key_BxSxKxD {k.shape} and value_BxSxKxD {v.shape} must have the same shape"
        )
    if q.shape[0] != k.shape[0]:
        raise ValueError(
            f"query_BxTxHxD and key_BxSxKxD must have the same batch size, "
            f"got {q.shape[0]} and {k.shape[0]}"
        )
    if q.shape[3] != k.shape[3] or q.shape[3] < 1:
        raise ValueError(
            f"query_BxTxHxD and key_BxSxKxD must have the same head_dim >= 1, "
            f"got {q.shape[3]} and {k.shape[3]}"
        )
    num_heads, num_kv_heads = q.shape[2], k.shape[2]
    if num_kv_heads < 1 or num_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a positive multiple of kv heads "
            f"({num_kv_heads}): query_BxTxHxD {q.shape}, key_BxSxKxD {k.shape}"
        )


def _check_prior(prior: Prior, num_heads: int) -> None:
    """Every parameter of a dataclass prior (GGDPrior, AlibiPrior) holds one value per head."""
    if not callable(getattr(prior, "bias", None)):
        raise TypeError(f"prior must have a bias(distance) method, got {type(prior).__name__}")
    if not dataclasses.is_dataclass(prior):
        if getattr(prior, "num_heads", None) != num_heads:
            raise ValueError(
                f"prior.num_heads must be {num_heads} (the query heads), "
                f"got {getattr(prior, 'num_heads', None)!r}"
            )
        return
    for field in dataclasses.fields(prior):
        if not field.metadata.get("pytree_node", True):
            continue
        shape = jnp.shape(getattr(prior, field.name))
        if shape != (num_heads,):
            raise ValueError(
                f"prior.{field.name} must have shape ({num_heads},) (one per query head), "
                f"got {shape}"
            )


def _check_segment_ids(q_seg, k_seg, batch: int, q_len: int, kv_len: int) -> None:
    if (q_seg is None) != (k_seg is None):
        raise ValueError("query_segment_ids_BxT and key_segment_ids_BxS must be given together")
    if q_seg is None:
        return
    for name, ids, axes, expected in (
        ("query_segment_ids_BxT", q_seg, "[batch, queries]", (batch, q_len)),
        ("key_segment_ids_BxS", k_seg, "[batch, keys]", (batch, kv_len)),
    ):
        if jnp.shape(ids) != expected:
            raise ValueError(f"{name} must have shape {axes} = {expected}, got {jnp.shape(ids)}")
        if not jnp.issubdtype(jnp.result_type(ids), jnp.signedinteger):
            raise TypeError(
                f"{name} must have a signed integer dtype (document ids, negative for "
                f"padding), got {jnp.result_type(ids)}"
            )


def _check_positions(query_offset, causal, window, ssmax_prior_inside) -> None:
    if not jnp.issubdtype(jnp.result_type(query_offset), jnp.integer):
        raise TypeError(
            f"query_offset must be an integer (the position of the first query), "
            f"got {jnp.result_type(query_offset)}"
        )
    if jnp.ndim(query_offset) != 0:
        raise ValueError(f"query_offset must be a scalar, got shape {jnp.shape(query_offset)}")
    if isinstance(query_offset, (int, np.integer)) and query_offset < 0:
        raise ValueError(f"query_offset must be >= 0, got {query_offset}")
    for name, flag in (("causal", causal), ("ssmax_prior_inside", ssmax_prior_inside)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 0
    ):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")


def visibility_mask(
    query_positions_T: jax.Array,
    key_positions_S: jax.Array,
    query_segment_ids_BxT: jax.Array | None,
    key_segment_ids_BxS: jax.Array | None,
    *,
    causal: bool,
    window: int | None,
) -> jax.Array:
    """Boolean [B or 1, T, S]: may query t attend to key s."""
    distance_TxS = query_positions_T[:, None] - key_positions_S[None, :]
    mask_TxS = jnp.ones(distance_TxS.shape, bool)
    if causal:
        mask_TxS &= distance_TxS >= 0
    if window is not None:
        mask_TxS &= jnp.abs(distance_TxS) <= window
    mask = mask_TxS[None]
    if query_segment_ids_BxT is not None:
        same_segment_BxTxS = query_segment_ids_BxT[:, :, None] == key_segment_ids_BxS[:, None, :]
        not_padding_BxS = key_segment_ids_BxS >= 0
        mask = mask & same_segment_BxTxS & not_padding_BxS[:, None, :]
    return mask


def ssmax_factor(ssmax_scale_H: jax.Array, visible_count: jax.Array) -> jax.Array:
    """s_h * log(n_i) in float32; rows with n_i = 0 get 0 (they are fully masked)."""
    return ssmax_scale_H.astype(jnp.float32) * log_visible_count(visible_count)


def log_visible_count(visible_count: jax.Array) -> jax.Array:
    """log(max(n_i, 1)) in float32: SSMax's length term (0 for rows with no visible key)."""
    return jnp.log(jnp.maximum(visible_count, 1).astype(jnp.float32))


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


def reference_attention(
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
) -> jax.Array:
    """The oracle: materialises the [B, H, T, S] logits."""
    check_attention_inputs(
        query_BxTxHxD,
        key_BxSxKxD,
        value_BxSxKxD,
        prior=prior,
        ssmax_scale_H=ssmax_scale_H,
        ssmax_prior_inside=ssmax_prior_inside,
        query_segment_ids_BxT=query_segment_ids_BxT,
        key_segment_ids_BxS=key_segment_ids_BxS,
        query_offset=query_offset,
        causal=causal,
        window=window,
    )
    if has_no_queries_or_keys(query_BxTxHxD, key_BxSxKxD):
        return jnp.zeros(query_BxTxHxD.shape, query_BxTxHxD.dtype)
    batch, q_len, num_heads, head_dim = query_BxTxHxD.shape
    kv_len, num_kv_heads = key_BxSxKxD.shape[1], key_BxSxKxD.shape[2]
    groups = num_heads // num_kv_heads
    q_BxTxKxGxD = query_BxTxHxD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    logits_BxKxGxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxD, key_BxSxKxD, preferred_element_type=jnp.float32
    )
    logits_BxHxTxS = logits_BxKxGxTxS.reshape(batch, num_heads, q_len, kv_len)
    logits_BxHxTxS = logits_BxHxTxS / jnp.float32(math.sqrt(head_dim))

    query_positions_T = jnp.arange(q_len) + query_offset
    key_positions_S = jnp.arange(kv_len)
    mask_BxTxS = visibility_mask(
        query_positions_T,
        key_positions_S,
        query_segment_ids_BxT,
        key_segment_ids_BxS,
        causal=causal,
        window=window,
    )
    bias_HxTxS = None
    if prior is not None:
        bias_HxTxS = prior.bias(key_positions_S[None, :] - query_positions_T[:, None])
    if ssmax_scale_H is not None:
        visible_BxT = mask_BxTxS.sum(-1)
        factor_BxHxT = ssmax_factor(ssmax_scale_H[None, :, None], visible_BxT[:, None, :])
        factor_BxHxTx1 = factor_BxHxT[..., None]
        if bias_HxTxS is not None and ssmax_prior_inside:
            logits_BxHxTxS = (logits_BxHxTxS + bias_HxTxS[None]) * factor_BxHxTx1
        else:
            logits_BxHxTxS = logits_BxHxTxS * factor_BxHxTx1
            if bias_HxTxS is not None:
                logits_BxHxTxS = logits_BxHxTxS + bias_HxTxS[None]
    elif bias_HxTxS is not None:
        logits_BxHxTxS = logits_BxHxTxS + bias_HxTxS[None]

    mask_Bx1xTxS = mask_BxTxS[:, None]
    logits_BxHxTxS = jnp.where(mask_Bx1xTxS, logits_BxHxTxS, -jnp.inf)
    row_max_BxHxTx1 = jnp.max(logits_BxHxTxS, axis=-1, keepdims=True)
    row_max_BxHxTx1 = jnp.where(jnp.isfinite(row_max_BxHxTx1), row_max_BxHxTx1, 0.0)
    unnormalised = jnp.where(mask_Bx1xTxS, jnp.exp(logits_BxHxTxS - row_max_BxHxTx1), 0.0)
    denominator = jnp.sum(unnormalised, axis=-1, keepdims=True)
    probs_BxHxTxS = unnormalised / jnp.where(denominator > 0, denominator, 1.0)

    probs_BxKxGxTxS = probs_BxHxTxS.reshape(batch, num_kv_heads, groups, q_len, kv_len)
    out_BxTxKxGxD = jnp.einsum(
        "bkgts,bskd->btkgd",
        probs_BxKxGxTxS,
        value_BxSxKxD.astype(jnp.float32),
        preferred_element_type=jnp.float32,
    )
    return out_BxTxKxGxD.reshape(batch, q_len, num_heads, head_dim).astype(query_BxTxHxD.dtype)
