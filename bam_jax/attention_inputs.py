"""The per-call inputs of an attention call, and the checks every implementation shares.

`AttentionInputs` holds the arrays that change from call to call or are learned (the
prior, the SSMax scales and count cap, the segment ids, the query offset), beside the
static `AttentionSpec`. It is a pytree, so it passes through `jax.jit`, `jax.vmap` and a
custom VJP's residuals as one value. Every implementation is a function
`(query, key, value, spec, inputs)`; `checked_attention` gives it the public keyword form
(`prior=..., ssmax_scale_H=..., ...`), builds the `AttentionInputs` and checks it once.
Only shapes, dtypes and Python values are read, so under jit the checks cost nothing at
run time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention_spec import AttentionSpec
from bam_jax.masking import window_keys
from bam_jax.priors import Prior


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionInputs:
    """The per-call arrays of an attention call (every field a pytree leaf or subtree).

    prior: a positional prior (`GGDPrior`, `AlibiPrior`, anything with `bias(distance)`),
        or None.
    ssmax_scale_H: Scalable-Softmax scales s_h [H], or None for a plain softmax.
    ssmax_max_count: the cap on SSMax's key count n_i (an integer scalar), or None.
    query_segment_ids_BxT, key_segment_ids_BxS: document ids (negative: padding), both or
        neither.
    query_offset: the position of the first query (an integer scalar, may be traced).
    """

    prior: Prior | None = None
    ssmax_scale_H: jax.Array | None = None
    ssmax_max_count: int | jax.Array | None = None
    query_segment_ids_BxT: jax.Array | None = None
    key_segment_ids_BxS: jax.Array | None = None
    query_offset: int | jax.Array = 0

    @property
    def has_documents(self) -> bool:
        return self.query_segment_ids_BxT is not None

    @property
    def has_ssmax(self) -> bool:
        return self.ssmax_scale_H is not None

    def replace(self, **changes) -> AttentionInputs:
        return dataclasses.replace(self, **changes)

    def check(
        self, query_BxTxHxD: jax.Array, key_BxSxKxD: jax.Array, value_BxSxKxD: jax.Array
    ) -> None:
        """Raises ValueError (shapes, values) or TypeError (dtypes) naming the bad argument,
        for these inputs beside this query, key and value."""
        _check_qkv(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD)
        batch, q_len, num_heads, _ = query_BxTxHxD.shape
        kv_len = key_BxSxKxD.shape[1]
        if self.prior is not None:
            _check_prior(self.prior, num_heads)
        if self.ssmax_scale_H is not None and jnp.shape(self.ssmax_scale_H) != (num_heads,):
            raise ValueError(
                f"ssmax_scale_H must have shape ({num_heads},) (one per query head), "
                f"got {jnp.shape(self.ssmax_scale_H)}"
            )
        if self.ssmax_max_count is not None:
            _check_ssmax_max_count(self.ssmax_max_count, self.ssmax_scale_H)
        _check_segment_ids(
            self.query_segment_ids_BxT, self.key_segment_ids_BxS, batch, q_len, kv_len
        )
        _check_query_offset(self.query_offset)


class AttentionImplementation(Protocol):
    def __call__(
        self,
        query_BxTxHxD: jax.Array,
        key_BxSxKxD: jax.Array,
        value_BxSxKxD: jax.Array,
        spec: AttentionSpec,
        inputs: AttentionInputs,
        **options,
    ) -> jax.Array: ...


def checked_attention(
    implementation: AttentionImplementation, name: str
) -> Callable[..., jax.Array]:
    """`implementation` in the public keyword form, named `name`:
    `name(query, key, value, spec=None, *, prior=None, ssmax_scale_H=None,
    ssmax_max_count=None, query_segment_ids_BxT=None, key_segment_ids_BxS=None,
    query_offset=0, **options)` (a spec of None is `AttentionSpec()`; `options` are the
    implementation's own, e.g. the fused kernel's backend and launch parameters).
    """

    def run(
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
        **options,
    ) -> jax.Array:
        inputs = AttentionInputs(
            prior=prior,
            ssmax_scale_H=ssmax_scale_H,
            ssmax_max_count=ssmax_max_count,
            query_segment_ids_BxT=query_segment_ids_BxT,
            key_segment_ids_BxS=key_segment_ids_BxS,
            query_offset=query_offset,
        )
        return run_checked(
            implementation, query_BxTxHxD, key_BxSxKxD, value_BxSxKxD, spec, inputs, **options
        )

    run.__name__ = run.__qualname__ = name
    run.__module__ = implementation.__module__
    run.__doc__ = implementation.__doc__
    return run


def run_checked(
    implementation: AttentionImplementation,
    query_BxTxHxD: jax.Array,
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec | None,
    inputs: AttentionInputs,
    **options,
) -> jax.Array:
    """`implementation` with its arguments checked first, and zeros of the query's shape
    returned without running it when there are no queries or no keys.

    Query, key and value wider than float32 (float64 under x64) are rounded to float32
    before the implementation runs, and its output is returned in the query's dtype:
    every implementation computes in float32 at most (docs/precision.md).
    """
    spec = AttentionSpec() if spec is None else spec
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be a bam_jax.AttentionSpec (causal, window, ...), got {spec!r}")
    inputs.check(query_BxTxHxD, key_BxSxKxD, value_BxSxKxD)
    if has_no_queries_or_keys(query_BxTxHxD, key_BxSxKxD):
        return jnp.zeros(query_BxTxHxD.shape, query_BxTxHxD.dtype)
    qkv = (_at_most_float32(x) for x in (query_BxTxHxD, key_BxSxKxD, value_BxSxKxD))
    out = implementation(*qkv, spec, inputs, **options)
    return out.astype(query_BxTxHxD.dtype)


def keys_in_window(
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    spec: AttentionSpec,
    inputs: AttentionInputs,
    *,
    q_len: int,
    block_k: int,
) -> tuple[jax.Array, jax.Array, AttentionInputs]:
    """Keys, values and inputs cut to the key blocks the spec's causal window lets the
    queries see (`bam_jax.masking.window_keys`); unchanged without such a window."""
    key_BxSxKxD, value_BxSxKxD, key_segment_ids_BxS, query_offset = window_keys(
        key_BxSxKxD,
        value_BxSxKxD,
        inputs.key_segment_ids_BxS,
        inputs.query_offset,
        q_len=q_len,
        causal=spec.causal,
        window=spec.window,
        block_k=block_k,
    )
    inputs = inputs.replace(key_segment_ids_BxS=key_segment_ids_BxS, query_offset=query_offset)
    return key_BxSxKxD, value_BxSxKxD, inputs


def _at_most_float32(x: jax.Array) -> jax.Array:
    """x in float32 when its floating dtype is wider, else unchanged."""
    if jnp.finfo(x.dtype).bits > 32:
        return x.astype(jnp.float32)
    return x


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


def _check_ssmax_max_count(max_count: int | jax.Array, ssmax_scale_H: jax.Array | None) -> None:
    if ssmax_scale_H is None:
        raise ValueError("ssmax_max_count caps SSMax's key count: it needs ssmax_scale_H")
    if not jnp.issubdtype(jnp.result_type(max_count), jnp.integer) or jnp.ndim(max_count):
        raise TypeError(
            f"ssmax_max_count must be an integer scalar (the largest key count SSMax uses), "
            f"got {max_count!r}"
        )
    if isinstance(max_count, (int, np.integer)) and max_count < 1:
        raise ValueError(f"ssmax_max_count must be >= 1, got {max_count}")


def _check_query_offset(query_offset) -> None:
    if not jnp.issubdtype(jnp.result_type(query_offset), jnp.integer):
        raise TypeError(
            f"query_offset must be an integer (the position of the first query), "
            f"got {jnp.result_type(query_offset)}"
        )
    if jnp.ndim(query_offset) != 0:
        raise ValueError(f"query_offset must be a scalar, got shape {jnp.shape(query_offset)}")
    if isinstance(query_offset, (int, np.integer)) and query_offset < 0:
        raise ValueError(f"query_offset must be >= 0, got {query_offset}")
