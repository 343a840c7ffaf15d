"""A user's optimizer over bam_jax modules: the prior and SSMax scales train, at their own
learning rate, and are never weight-decayed, under nnx.Optimizer and under Linen."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import bam_jax
from bam_jax import ModelConfig, Transformer
from bam_jax.linen import linen_labels, linen_transformer, trainable

CONFIG = ModelConfig.of_size(
    "nano", encoding="bam_ssmax", prior_beta_init="sampled", attention_impl="reference"
)
TOKENS_BxT = jax.random.randint(jax.random.key(1), (2, 16), 0, CONFIG.vocab_size)


def groups(decay: float) -> dict[str, optax.GradientTransformation]:
    """Plain SGD so a step is easy to predict; heavy decay on the weights only."""
    return {
        "decay": optax.chain(optax.add_decayed_weights(decay), optax.sgd(0.1)),
        "no_decay": optax.sgd(0.1),
        "prior": optax.sgd(1.0),
        "ssmax": optax.sgd(1.0),
    }


def next_token_loss(logits_BxTxV: jax.Array) -> jax.Array:
    targets = jnp.roll(TOKENS_BxT, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, targets).mean()


def test_nnx_optimizer_trains_the_prior_without_decaying_it():
    model = Transformer(CONFIG, rngs=nnx.Rngs(0))
    tx = optax.multi_transform(groups(decay=0.5), bam_jax.optimizer_labels(model))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    alpha_before = model.prior.theta_alpha[...].copy()
    wq_before = model.layers[0].attention.wq.kernel[...].copy()

    update = nnx.jit(lambda optimizer, model, grads: optimizer.update(model, grads))
    zero_grads = jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param))
    update(optimizer, model, zero_grads)
    np.testing.assert_array_equal(model.prior.theta_alpha[...], alpha_before)  # not decayed
    np.testing.assert_allclose(
        model.layers[0].attention.wq.kernel[...], wq_before * 0.95, rtol=1e-6
    )

    grads = nnx.jit(nnx.grad(lambda m: next_token_loss(m(TOKENS_BxT))))(model)
    update(optimizer, model, grads)
    moved = model.prior.theta_alpha[...] - alpha_before
    np.testing.assert_allclose(moved, -grads.prior.theta_alpha[...], rtol=1e-6)
    assert np.all(np.abs(moved) > 0)


def test_linen_training_of_the_trainable_collections_moves_the_prior_and_never_decays_it():
    module = linen_transformer(CONFIG)
    variables = jax.jit(module.init)(jax.random.key(0), TOKENS_BxT)
    params = trainable(variables)
    assert set(params) == {"params", "prior_params", "ssmax_params"}
    tx = optax.multi_transform(groups(decay=0.5), linen_labels)
    opt_state = tx.init(params)
    update = jax.jit(tx.update)

    def loss(params):
        return next_token_loss(module.apply({**variables, **params}, TOKENS_BxT))

    zero = jax.tree.map(jnp.zeros_like, params)
    updates, opt_state = update(zero, opt_state, params)
    decayed = optax.apply_updates(params, updates)
    assert jax.tree.all(
        jax.tree.map(np.array_equal, decayed["prior_params"], params["prior_params"])
    )
    assert jax.tree.all(
        jax.tree.map(np.array_equal, decayed["ssmax_params"], params["ssmax_params"])
    )

    grads = jax.jit(jax.grad(loss))(params)
    updates, opt_state = update(grads, opt_state, params)
    trained = optax.apply_updates(params, updates)
    before = jax.tree.leaves(params["prior_params"])
    after = jax.tree.leaves(trained["prior_params"])
    assert before and all(np.any(a != b) for a, b in zip(after, before, strict=True))
