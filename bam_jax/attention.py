"""Causal attention with a positional prior, documents, SSMax and grouped-query heads.

One entry point, `dot_product_attention`, dispatches to implementations that compute
the same function:

- "reference": plain einsum with the bias and mask materialised, float32 softmax.
- "blockwise": flash-style online softmax over key blocks; the prior is evaluated per
  tile from positions, so no T x S array is ever built.
- "fused" ("pallas" until the next release): the fused kernel with the prior computed in
  the tile loop, Pallas on GPU (Triton) and TPU (Mosaic), native code on CPU; see
  bam_jax/fused_attention.py. `bam_jax.implementation.resolve_implementation` decides
  what "auto" runs: the fused kernel only on device kinds where
  bench/accelerator_check/ has passed (docs/accelerators.md).

Positions: key slot s sits at position s; query t sits at `query_offset + t`. With a KV
cache of capacity S, unfilled slots lie in the future of every query and are masked by
causality. Segment ids: a query sees only keys with the same id; negative ids mark
padding, which is never attended to and never counted by SSMax.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from bam_jax.attention_inputs import AttentionInputs, checked_attention, run_checked
from bam_jax.attention_spec import AttentionSpec
from bam_jax.blockwise import attend_blockwise
from bam_jax.fused_attention import attend_fused, has_symbolic_shape
from bam_jax.implementation import resolve_implementation
from bam_jax.masking import log_visible_count, visibility_mask
from bam_jax.priors import Prior


def dot_product_attention(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec | None = None,
    *,
    prior: Prior | None = None,
    ssmax_scale_H: jax.Array | None = None,
    ssmax_max_count: int | jax.Array | None = None,
    query_segment_ids_BxT: jax.Array | None = None,
    key_segment_ids_BxS: jax.Array | None = None,
    query_offset: int | jax.Array = 0,
    **spec_fields,
) -> jax.Array:
    """Attention output [B, T, H, D] in the query's dtype.

    logits = q.k / sqrt(D) + prior.bias(k_pos - q_pos); with SSMax (`ssmax_scale_H`
    given) the logits of query i are multiplied by s_h * log(n_i), n_i the number of
    keys it may see, either including the prior (`spec.ssmax_prior_inside`, the default)
    or before the prior is added. Softmax is computed in float32. A query that can
    see no key (padding) gets a zero output.

    Args:
      query_BxTxHxD: queries; H must be a multiple of K (grouped-query attention).
      key_BxSxKxD, value_BxSxKxD: keys and values of the S key slots.
      spec: the static choices (`AttentionSpec`: causal, window, ssmax_prior_inside,
        implementation, block_q, block_k). Instead of a spec its fields may be given by
        keyword (`causal=False, window=16`), which builds one; not both.
      prior: a positional prior (`GGDPrior`, `AlibiPrior`) whose `bias(distance)` is
        added to the logits, distance = key position - query position (<= 0 when causal);
        None for no prior.
      ssmax_scale_H: Scalable-Softmax scales s_h, or None for a plain softmax.
      ssmax_max_count: with SSMax, n_i is capped at this count, so the scaling stops
        growing past it (e.g. the training context: the layer then attends as sharply at
        any length as it did in training). None: no cap.
      query_segment_ids_BxT, key_segment_ids_BxS: integer document ids; a query sees only
        keys with its id, and negative ids mark padding. Both or neither.
      query_offset: position of the first query (a KV cache's fill level when decoding).

    The implementation "auto" (the default) is `resolve_implementation`'s choice:
    blockwise unless the fused kernel has been validated on this device kind, and
    blockwise for symbolic shapes (`jax.export`), which the fused kernel refuses.
    """
    spec = _spec_of(spec, spec_fields)
    query_BxTxHxD, key_BxSxKxD, value_BxSxKxD = (
        jnp.asarray(x) for x in (query_BxTxHxD, key_BxSxKxD, value_BxSxKxD)
    )
    ssmax_scale_H, query_segment_ids_BxT, key_segment_ids_BxS = (
        None if x is None else jnp.asarray(x)
        for x in (ssmax_scale_H, query_segment_ids_BxT, key_segment_ids_BxS)
    )
    inputs = AttentionInputs(
        prior=prior,
        ssmax_scale_H=ssmax_scale_H,
        ssmax_max_count=ssmax_max_count,
        query_segment_ids_BxT=query_segment_ids_BxT,
        key_segment_ids_BxS=key_segment_ids_BxS,
        query_offset=query_offset,
    )
    choice = spec.implementation
    if choice == "auto" and has_symbolic_shape(query_BxTxHxD, key_BxSxKxD):
        choice = "blockwise"  # the fused kernel needs concrete shapes
    implementation = {
        "reference": attend_reference,
        "blockwise": attend_blockwise,
        "fused": attend_fused,
    }[resolve_implementation(choice)]
    return run_checked(implementation, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, spec, inputs)


def _spec_of(spec: AttentionSpec | None, fields: dict) -> AttentionSpec:
    """`spec`, or the spec that `fields` (AttentionSpec's fields by keyword) describe."""
    unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(AttentionSpec)})
    if unknown:
        raise TypeError(
            f"dot_product_attention got unexpected keyword arguments {unknown}; "
            f"the spec's fields are {[f.name for f in dataclasses.fields(AttentionSpec)]}"
        )
    if spec is None:
        return AttentionSpec(**fields)
    if fields:
        raise TypeError(
            f"dot_product_attention takes a spec or its fields by keyword, not both: "
            f"got spec and {sorted(fields)}"
        )
    return spec


def attend_reference(
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec,
    inputs: AttentionInputs,
) -> jax.Array:
    """The oracle: materialises the [B, H, T, S] logits."""
    batch, q_len, num_heads, head_dim = query_BxTxHxD.shape
    kv_len, num_kv_heads = key_BxSxKxD.shape[1], key_BxSxKxD.shape[2]
    groups = num_heads // num_kv_heads
    q_BxTxKxGxD = query_BxTxHxD.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    logits_BxKxGxTxS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BxTxKxGxD, key_BxSxKxD, preferred_element_type=jnp.float32
    )
    logits_BxHxTxS = logits_BxKxGxTxS.reshape(batch, num_heads, q_len, kv_len)
    logits_BxHxTxS = logits_BxHxTxS / jnp.float32(math.sqrt(head_dim))

    query_positions_T = jnp.arange(q_len) + inputs.query_offset
    key_positions_S = jnp.arange(kv_len)
    mask_BxTxS = visibility_mask(
        spec.mask(kv_len),
        query_positions_T,
        key_positions_S,
        inputs.query_segment_ids_BxT,
        inputs.key_segment_ids_BxS,
    )
    prior, ssmax_scale_H = inputs.prior, inputs.ssmax_scale_H
    bias_HxTxS = None
    if prior is not None:
        bias_HxTxS = prior.bias(key_positions_S[None, :] - query_positions_T[:, None])
    if ssmax_scale_H is not None:
        visible_BxT = mask_BxTxS.sum(-1)
        log_n_Bx1xT = log_visible_count(visible_BxT, inputs.ssmax_max_count)[:, None, :]
        factor_BxHxT = ssmax_scale_H.astype(jnp.float32)[None, :, None] * log_n_Bx1xT
        factor_BxHxTx1 = factor_BxHxT[..., None]
        if bias_HxTxS is not None and spec.ssmax_prior_inside:
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


reference_attention = checked_attention(attend_reference, "reference_attention")
