"""The NNX attention module and model used inside Flax Linen models via nnx.bridge."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.linen import (
    linen_attention,
    linen_transformer,
    linen_variables,
    load_linen_variables,
)
from bam_jax.model import Attention, Transformer

CONFIG = ModelConfig.of_size("nano", encoding="bam_ssmax", global_prior=False)


class LinenBlock(nn.Module):
    """A Linen residual block whose attention is the bridged NNX module."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x_BxTxE, segment_ids_BxT=None):
        h = nn.RMSNorm(name="norm")(x_BxTxE)
        return x_BxTxE + linen_attention(self.config, name="attention")(h, segment_ids_BxT)


def test_attention_inside_linen_equals_nnx_module():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 10, CONFIG.dim), np.float32))
    segments = jnp.array([[0] * 4 + [1] * 6, [3] * 10])
    block = LinenBlock(CONFIG)
    variables = jax.jit(block.init)(jax.random.key(1), x, segments)
    assert set(variables) == {"params", "prior_params", "ssmax_params", "prior_constants"}
    assert set(variables["prior_params"]["attention"]["prior"]) == {"theta_alpha", "theta_beta"}

    out = jax.jit(block.apply)(variables, x, segments)
    attention = load_linen_variables(
        nnx.eval_shape(lambda: Attention(CONFIG, rngs=nnx.Rngs(0))),
        {name: collection["attention"] for name, collection in variables.items()},
    )
    norm_scale = variables["params"]["norm"]["scale"]
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * norm_scale
    expected = nnx.jit(lambda attention, h: attention(h, segments))(attention, h)
    np.testing.assert_allclose(out, x + expected, atol=1e-6)

    def loss(prior_params):
        return jnp.sum(block.apply({**variables, "prior_params": prior_params}, x, segments))

    grads = jax.jit(jax.grad(loss))(variables["prior_params"])
    assert np.abs(nn.meta.unbox(grads)["attention"]["prior"]["theta_beta"]).max() > 0


def test_whole_model_inside_linen_equals_nnx_model():
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, CONFIG.vocab_size, (1, 9)))
    module = linen_transformer(CONFIG)
    variables = jax.jit(module.init)(jax.random.key(3), tokens)
    logits = jax.jit(module.apply)(variables, tokens)
    abstract = nnx.eval_shape(lambda: Transformer(CONFIG, rngs=nnx.Rngs(0)))
    model = load_linen_variables(abstract, variables)
    np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(model, tokens), atol=1e-6)


def test_nnx_model_weights_run_in_the_linen_model():
    tokens = jnp.asarray(np.random.default_rng(4).integers(0, CONFIG.vocab_size, (1, 9)))
    model = Transformer(CONFIG, rngs=nnx.Rngs(5))
    variables = linen_variables(model)
    assert set(variables) == {"params", "prior_params", "ssmax_params", "prior_constants"}
    logits = jax.jit(linen_transformer(CONFIG).apply)(variables, tokens)
    np.testing.assert_allclose(logits, nnx.jit(lambda m, t: m(t))(model, tokens), atol=1e-6)


def test_linen_attention_with_a_global_prior_says_what_to_change():
    with pytest.raises(ValueError, match=r"global_prior=False.*linen_transformer"):
        linen_attention(CONFIG.replace(global_prior=True))
