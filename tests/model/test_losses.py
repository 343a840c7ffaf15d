"""The chunked output-projection cross-entropy against optax on the materialised logits."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.losses import output_cross_entropy
from bam_jax.model import Transformer


def _inputs(batch=3, length=37, width=16, vocab=50, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    hidden = jax.random.normal(keys[0], (batch, length, width))
    kernel = jax.random.normal(keys[1], (width, vocab)) / np.sqrt(width)
    targets = jax.random.randint(keys[2], (batch, length), 0, vocab)
    weights = (jax.random.uniform(keys[3], (batch, length)) > 0.3).astype(jnp.float32)
    return hidden, kernel, targets, weights


def _reference(hidden, kernel, targets, weights):
    logits = jnp.einsum("bte,ev->btv", hidden, kernel, precision="highest")
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(ce * weights)


# 1 token per chunk, chunks that leave a remainder of T (37 = 2 * 16 + 5 at 3 rows), one
# chunk of all positions, and a chunk larger than the batch.
@pytest.mark.parametrize("chunk_tokens", [1, 7, 48, 111, 4096])
@pytest.mark.parametrize("jit", [True, False])
def test_values_and_gradients_match_the_materialised_logits(chunk_tokens, jit):
    hidden, kernel, targets, weights = _inputs()

    def chunked(h, k, w):
        return output_cross_entropy(h, k, targets, w, chunk_tokens=chunk_tokens)

    value_and_grad = jax.value_and_grad(chunked, argnums=(0, 1, 2))
    value, grads = (jax.jit(value_and_grad) if jit else value_and_grad)(hidden, kernel, weights)
    with jax.default_matmul_precision("highest"):
        expected, expected_grads = jax.value_and_grad(
            lambda h, k, w: _reference(h, k, targets, w), argnums=(0, 1, 2)
        )(hidden, kernel, weights)
    np.testing.assert_allclose(value, expected, rtol=1e-6)
    for got, want in zip(grads, expected_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_zero_weights_give_zero_loss_and_gradients_but_the_weight_gradient_is_the_loss():
    hidden, kernel, targets, _ = _inputs(batch=2, length=9)
    weights = jnp.zeros(targets.shape)
    value, (d_hidden, d_kernel, d_weights) = jax.value_and_grad(
        lambda h, k, w: output_cross_entropy(h, k, targets, w, chunk_tokens=4), argnums=(0, 1, 2)
    )(hidden, kernel, weights)
    assert float(value) == 0.0
    assert not np.any(np.asarray(d_hidden)) and not np.any(np.asarray(d_kernel))
    logits = jnp.einsum("bte,ev->btv", hidden, kernel, precision="highest")
    per_position = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    np.testing.assert_allclose(d_weights, per_position, rtol=1e-5)


def test_bfloat16_compute_matches_the_bfloat16_output_layer():
    hidden, kernel, targets, weights = _inputs(length=20)
    hidden = hidden.astype(jnp.bfloat16)

    def materialised(h, k):
        logits = jax.lax.dot_general(
            h, k.astype(jnp.bfloat16), (((2,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )
        return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits, targets) * weights)

    def chunked(h, k):
        return output_cross_entropy(
            h, k, targets, weights, compute_dtype="bfloat16", chunk_tokens=8
        )

    value, (d_hidden, d_kernel) = jax.jit(jax.value_and_grad(chunked, argnums=(0, 1)))(
        hidden, kernel
    )
    expected, (e_hidden, e_kernel) = jax.jit(jax.value_and_grad(materialised, argnums=(0, 1)))(
        hidden, kernel
    )
    assert d_hidden.dtype == jnp.bfloat16 and d_kernel.dtype == jnp.float32
    np.testing.assert_allclose(value, expected, rtol=1e-5)
    scale = float(jnp.max(jnp.abs(e_kernel)))
    np.testing.assert_allclose(d_kernel, e_kernel, atol=2e-2 * scale)
    scale = float(jnp.max(jnp.abs(e_hidden.astype(jnp.float32))))
    np.testing.assert_allclose(
        d_hidden.astype(jnp.float32), e_hidden.astype(jnp.float32), atol=2e-2 * scale
    )


def test_model_cross_entropy_sum_equals_cross_entropy_of_its_logits():
    config = ModelConfig(vocab_size=40, dim=16, n_layers=1, n_heads=2, max_seq_len=12)
    model = Transformer(config)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 40)
    weights = jnp.ones(tokens.shape)

    @nnx.jit
    def both_losses(model, tokens, weights):
        hidden = model.hidden_states(tokens)
        expected = jnp.sum(
            optax.softmax_cross_entropy_with_integer_labels(model.logits(hidden), tokens)
        )
        return model.cross_entropy_sum(hidden, tokens, weights), expected

    got, expected = both_losses(model, tokens, weights)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(kernel=jnp.zeros((8, 50))), "kernel_ExV"),
        (dict(targets=jnp.zeros((3, 5), jnp.int32)), "targets_BxT"),
        (dict(weights=jnp.zeros((37,))), "weights_BxT"),
        (dict(chunk_tokens=0), "chunk_tokens"),
    ],
)
def test_bad_shapes_are_named(change, message):
    hidden, kernel, targets, weights = _inputs()
    args = dict(kernel=kernel, targets=targets, weights=weights, chunk_tokens=16) | change
    with pytest.raises(ValueError, match=message):
        output_cross_entropy(
            hidden,
            args["kernel"],
            args["targets"],
            args["weights"],
            chunk_tokens=args["chunk_tokens"],
        )
