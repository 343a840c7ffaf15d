"""Decoders that bam_jax does not know, written as a user writes them around its attention
layer: an NNX one (`bam_jax.Attention`) and a Linen one (`bam_jax.linen.linen_attention`),
each with its own embedding, feed-forward layers and output layer, no `config` attribute,
and a KV cache when decoding. The first layer is local (`FIRST_WINDOW`), so a token's logits
depend on the FIRST_WINDOW tokens before it and itself in a one-layer decoder."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

import bam_jax
from bam_jax.linen import linen_attention

VOCAB, WIDTH, HEADS = 48, 32, 4
FIRST_WINDOW = 3
CONFIG = bam_jax.ModelConfig(
    dim=WIDTH,
    n_heads=HEADS,
    n_layers=1,
    vocab_size=VOCAB,
    encoding="bam_ssmax",
    global_prior=False,
    prior_alpha_init="slope",
    prior_beta_init="linear",
)


def layer_spec(layer: int, implementation: str) -> bam_jax.AttentionSpec:
    window = FIRST_WINDOW if layer == 0 else None
    return bam_jax.AttentionSpec(window=window, implementation=implementation)


def empty_cache(batch: int, capacity: int, n_layers: int = 2) -> bam_jax.KVCache:
    """A cache with its own buffer for every layer."""
    shape = (batch, capacity, HEADS, WIDTH // HEADS)
    return bam_jax.KVCache(
        keys=tuple(jnp.zeros(shape) for _ in range(n_layers)),
        values=tuple(jnp.zeros(shape) for _ in range(n_layers)),
        length=jnp.int32(0),
    )


def attend(
    attention: Callable,
    x_BxTxE: jax.Array,
    cache: bam_jax.KVCache | None,
    layer: int,
    keys: list,
    values: list,
) -> tuple[jax.Array, list, list]:
    """x plus layer `layer`'s attention, without a cache or reading and extending one:
    (x [B, T, E], the keys and values written so far)."""
    if cache is None:
        return x_BxTxE + attention(x_BxTxE), keys, values
    kv = (cache.keys[layer], cache.values[layer])
    y_BxTxE, (k, v) = attention(x_BxTxE, kv=kv, cache_length=cache.length)
    return x_BxTxE + y_BxTxE, [*keys, k], [*values, v]


class NNXDecoder(nnx.Module):
    """Embedding, n_layers of (residual attention, residual feed-forward), output layer."""

    def __init__(
        self,
        rngs: nnx.Rngs,
        *,
        n_layers: int = 2,
        dtype: Any = "float32",
        implementation: str = "blockwise",
    ):
        config = CONFIG.replace(dtype=dtype)
        dtype = jnp.dtype(dtype)
        self.embed = nnx.Embed(VOCAB, WIDTH, dtype=dtype, rngs=rngs)
        self.attention = nnx.List(
            [
                bam_jax.Attention(config, rngs=rngs, spec=layer_spec(i, implementation))
                for i in range(n_layers)
            ]
        )
        self.mlp = nnx.List(
            [nnx.Linear(WIDTH, WIDTH, dtype=dtype, rngs=rngs) for _ in range(n_layers)]
        )
        self.out = nnx.Linear(WIDTH, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens_BxT: jax.Array, cache: bam_jax.KVCache | None = None):
        x_BxTxE = self.embed(tokens_BxT)
        keys, values = [], []
        for i, (attention, mlp) in enumerate(zip(self.attention, self.mlp, strict=True)):
            x_BxTxE, keys, values = attend(attention, x_BxTxE, cache, i, keys, values)
            x_BxTxE = x_BxTxE + jax.nn.gelu(mlp(x_BxTxE))
        logits_BxTxV = self.out(x_BxTxE)
        if cache is None:
            return logits_BxTxV
        length = cache.length + tokens_BxT.shape[1]
        return logits_BxTxV, bam_jax.KVCache(tuple(keys), tuple(values), length)


class LinenDecoder(nn.Module):
    """The same decoder in Linen; `cache=` as the NNX one (through `nnx.bridge.ToNNX` for
    `bam_jax.prefill` and `generate`)."""

    n_layers: int = 2
    dtype: Any = "float32"
    implementation: str = "blockwise"

    @nn.compact
    def __call__(self, tokens_BxT: jax.Array, cache: bam_jax.KVCache | None = None):
        config = CONFIG.replace(dtype=self.dtype)
        dtype = jnp.dtype(self.dtype)
        x_BxTxE = nn.Embed(VOCAB, WIDTH, dtype=dtype)(tokens_BxT)
        keys, values = [], []
        for i in range(self.n_layers):
            spec = layer_spec(i, self.implementation)
            attention = linen_attention(config, spec=spec, name=f"attention{i}")
            x_BxTxE, keys, values = attend(attention, x_BxTxE, cache, i, keys, values)
            x_BxTxE = x_BxTxE + jax.nn.gelu(nn.Dense(WIDTH, dtype=dtype)(x_BxTxE))
        logits_BxTxV = nn.Dense(VOCAB, dtype=dtype)(x_BxTxE)
        if cache is None:
            return logits_BxTxV
        length = cache.length + tokens_BxT.shape[1]
        return logits_BxTxV, bam_jax.KVCache(tuple(keys), tuple(values), length)


def linen_as_nnx(decoder: LinenDecoder, tokens_BxT: jax.Array) -> nnx.Module:
    """The Linen decoder with its variables as an NNX module (what `prefill` takes)."""
    model = nnx.bridge.ToNNX(decoder, rngs=nnx.Rngs(0))
    with nnx.use_eager_sharding(False):
        nnx.bridge.lazy_init(model, tokens_BxT)
    return model
