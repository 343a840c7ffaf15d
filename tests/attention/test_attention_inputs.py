"""`dot_product_attention` rejects malformed inputs with an error naming the argument, and
every implementation agrees on empty inputs (length 0 queries or keys)."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_jax.attention import dot_product_attention, reference_attention
from bam_jax.attention_spec import AttentionSpec
from bam_jax.config import ModelConfig
from bam_jax.model import Attention
from bam_jax.priors import GGDPrior, init_ggd_prior

IMPLEMENTATIONS = ("reference", "blockwise", "fused")
BATCH, HEADS, HEAD_DIM = 2, 2, 4


def _qkv(q_len: int = 8, kv_len: int = 8, heads: int = HEADS, kv_heads: int = HEADS):
    rng = np.random.default_rng(0)
    q_BxTxHxD = jnp.asarray(rng.normal(size=(BATCH, q_len, heads, HEAD_DIM)), jnp.float32)
    k_BxSxKxD = jnp.asarray(rng.normal(size=(BATCH, kv_len, kv_heads, HEAD_DIM)), jnp.float32)
    v_BxSxKxD = jnp.asarray(rng.normal(size=(BATCH, kv_len, kv_heads, HEAD_DIM)), jnp.float32)
    return q_BxTxHxD, k_BxSxKxD, v_BxSxKxD


def _attend(implementation: str, *args, **kwargs) -> jax.Array:
    return dot_product_attention(
        *args, implementation=implementation, block_q=4, block_k=4, **kwargs
    )


def _documents(length: int) -> jax.Array:
    """Three documents and a padded tail, the same for every row: int32 [B, length]."""
    row = np.minimum(np.arange(length) // 3, 2)
    row[-1] = -1
    return jnp.asarray(np.tile(row, (BATCH, 1)), jnp.int32)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_key_segment_ids_shaped_like_the_queries_are_rejected(implementation: str) -> None:
    """4 queries at offset 4 over 8 cached keys: the key ids must be [B, 8], not [B, 4].

    Blockwise used to clamp its key-id tiles into the short array and return wrong
    numbers (off by up to 3 from the reference here); the reference raised a raw
    broadcasting TypeError.
    """
    q, k, v = _qkv(q_len=4, kv_len=8)
    segments_BxS = _documents(8)
    with pytest.raises(ValueError, match=r"key_segment_ids_BxS .*\(2, 8\), got \(2, 4\)"):
        _attend(
            implementation,
            q,
            k,
            v,
            query_segment_ids_BxT=segments_BxS[:, 4:],
            key_segment_ids_BxS=segments_BxS[:, 4:],
            query_offset=4,
        )


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "name, shape",
    [("query_segment_ids_BxT", (1, 8)), ("key_segment_ids_BxS", (BATCH, 9)), ("both", (BATCH,))],
)
def test_segment_ids_of_the_wrong_shape_are_rejected(
    implementation: str, name: str, shape: tuple[int, ...]
) -> None:
    q, k, v = _qkv()
    good = _documents(8)
    bad = jnp.zeros(shape, jnp.int32)
    q_seg = good if name == "key_segment_ids_BxS" else bad
    k_seg = good if name == "query_segment_ids_BxT" else bad
    expected = "query_segment_ids_BxT" if name == "both" else name
    with pytest.raises(ValueError, match=rf"{expected} must have shape .*got \({shape[0]},"):
        _attend(implementation, q, k, v, query_segment_ids_BxT=q_seg, key_segment_ids_BxS=k_seg)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.uint32, jnp.bool_])
def test_segment_ids_must_be_signed_integers(implementation: str, dtype) -> None:
    q, k, v = _qkv()
    segments = _documents(8).astype(dtype)
    with pytest.raises(TypeError, match="query_segment_ids_BxT must have a signed integer dtype"):
        _attend(
            implementation, q, k, v, query_segment_ids_BxT=segments, key_segment_ids_BxS=segments
        )


def test_segment_ids_given_as_lists_are_accepted() -> None:
    q, k, v = _qkv()
    segments = _documents(8)
    for implementation in ("reference", "blockwise"):
        expected = _attend(
            implementation, q, k, v, query_segment_ids_BxT=segments, key_segment_ids_BxS=segments
        )
        as_lists = segments.tolist()
        out = _attend(
            implementation, q, k, v, query_segment_ids_BxT=as_lists, key_segment_ids_BxS=as_lists
        )
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("q_len, kv_len", [(0, 8), (8, 0), (0, 0)])
def test_length_zero_gives_a_zero_output_of_the_query_shape(
    implementation: str, q_len: int, kv_len: int
) -> None:
    """No query: an empty [B, 0, H, D]; no key: every query sees nothing, so zeros."""
    q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(q_len, kv_len))
    documents = {
        "query_segment_ids_BxT": jnp.zeros((BATCH, q_len), jnp.int32),
        "key_segment_ids_BxS": jnp.zeros((BATCH, kv_len), jnp.int32),
    }
    attend = functools.partial(
        _attend,
        implementation,
        prior=init_ggd_prior(HEADS, alpha_init="slope", beta_init=1.0),
        ssmax_scale_H=jnp.ones((HEADS,), jnp.float32),
        query_offset=kv_len - q_len if kv_len >= q_len else 0,
        **documents,
    )
    out = jax.jit(attend)(q, k, v)
    chex.assert_shape(out, (BATCH, q_len, HEADS, HEAD_DIM))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), 0.0)
    grads = jax.grad(lambda *xs: jnp.sum(attend(*xs).astype(jnp.float32)), (0, 1, 2))(q, k, v)
    for grad, x in zip(grads, (q, k, v), strict=True):
        assert grad.shape == x.shape
        np.testing.assert_array_equal(np.asarray(grad, np.float32), 0.0)


def test_reference_attention_called_directly_handles_length_zero() -> None:
    q, k, v = _qkv(q_len=5, kv_len=0)
    out = reference_attention(q, k, v, AttentionSpec())
    np.testing.assert_array_equal(out, np.zeros((BATCH, 5, HEADS, HEAD_DIM), np.float32))


def _uneven_prior() -> GGDPrior:
    """theta_beta has one value for two heads (it used to broadcast silently)."""
    prior = init_ggd_prior(HEADS)
    return prior.replace(theta_beta_H=prior.theta_beta_H[:1])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize(
    "make_inputs, kwargs, error, message",
    [
        (lambda: _qkv(heads=3), {}, ValueError, r"query heads \(3\) .* kv heads \(2\)"),
        (lambda: _qkv(kv_heads=0), {}, ValueError, r"query heads \(2\) .* kv heads \(0\)"),
        (_qkv, {"prior": init_ggd_prior(3)}, ValueError, r"prior.theta_alpha_H .*\(2,\).*\(3,\)"),
        (_qkv, {"prior": _uneven_prior()}, ValueError, r"prior.theta_beta_H .*\(2,\).*\(1,\)"),
        (_qkv, {"query_offset": 1.5}, TypeError, "query_offset must be an integer"),
        (_qkv, {"query_offset": jnp.arange(2)}, ValueError, r"query_offset .* shape \(2,\)"),
        (_qkv, {"query_offset": -1}, ValueError, "query_offset must be >= 0"),
        (_qkv, {"causal": "no"}, TypeError, "causal must be a bool"),
        (_qkv, {"window": True}, ValueError, "window must be None or an int"),
        (
            lambda: tuple(x.astype(jnp.int32) for x in _qkv()),
            {},
            TypeError,
            "query_BxTxHxD must have a floating-point dtype",
        ),
    ],
)
def test_bad_arguments_name_what_to_fix(
    implementation: str, make_inputs, kwargs: dict, error: type, message: str
) -> None:
    with pytest.raises(error, match=message):
        _attend(implementation, *make_inputs(), **kwargs)


def test_the_nnx_attention_layer_gets_the_same_checks() -> None:
    config = ModelConfig.of_size("nano", encoding="bam", global_prior=False)
    attention = Attention(config.replace(attention_impl="blockwise"), rngs=nnx.Rngs(0))
    x_BxTxE = jnp.ones((BATCH, 6, config.dim), jnp.float32)
    with pytest.raises(TypeError, match="query_segment_ids_BxT must have a signed integer"):
        attention(x_BxTxE, jnp.zeros((BATCH, 6), jnp.float32))
    with pytest.raises(ValueError, match=r"query_segment_ids_BxT must have shape .*\(1, 6\)"):
        attention(x_BxTxE, jnp.zeros((1, 6), jnp.int32))
