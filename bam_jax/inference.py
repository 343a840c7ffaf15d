"""Inference with a key/value cache: chunked prefill, single-token decode, generation.

The cache holds every layer's rotated keys and values in fixed-capacity buffers, one
[B, S, Hkv, D] array per layer (so a jitted step that donates the cache updates each in
place); `length` counts the filled slots (shared by the batch). A forward over a chunk
writes its keys at `length` and attends with query_offset = length, so slots not yet
written lie in the future of every query and are masked by causality. SSMax counts the
cached tokens in n_i.

A model with `scan_layers` works too, but its scan copies the cache on every call;
`reconfigure(model, scan_layers=False)` gives the same weights in the in-place layout.

`prefill` runs the prompt in chunks of a fixed size (the last one padded and masked), so
one compiled step serves every prompt length and memory is bounded by
chunk_size x capacity, never prompt_length ** 2.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import flax.struct
import jax
import jax.numpy as jnp
from flax import nnx

from bam_jax.config import ModelConfig

if TYPE_CHECKING:
    from bam_jax.model import Transformer


@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values (tuples of L arrays [B, S, Hkv, D]) and the filled length."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]


def init_cache(
    config: ModelConfig, batch: int, capacity: int, dtype: jnp.dtype | str | None = None
) -> KVCache:
    """An empty cache; `dtype` defaults to the model's compute dtype."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    dtype = jnp.dtype(config.dtype if dtype is None else dtype)
    shape = (batch, capacity, config.kv_heads, config.head_dim)
    return KVCache(
        keys=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
        values=tuple(jnp.zeros(shape, dtype) for _ in range(config.n_layers)),
        length=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, donate_argnums=(3,))
def _forward_chunk(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    tokens_BxC: jax.Array,
    cache: KVCache,
    num_valid: jax.Array,
) -> tuple[jax.Array, KVCache]:
    model = nnx.merge(graphdef, state)
    hidden_BxCxD, cache = model.hidden_states(tokens_BxC, cache=cache, num_valid=num_valid)
    last_BxD = jax.lax.dynamic_index_in_dim(hidden_BxCxD, num_valid - 1, axis=1, keepdims=False)
    return model.logits(last_BxD), cache


def _check_room(cache: KVCache, needed: int) -> None:
    length = int(cache.length)
    if length + needed > cache.capacity:
        raise ValueError(
            f"cache capacity {cache.capacity} is too small: {length} slots are filled and "
            f"{needed} more are needed"
        )


def prefill(
    model: Transformer, tokens_BxT: jax.Array, cache: KVCache, *, chunk_size: int = 512
) -> tuple[jax.Array, KVCache]:
    """Runs the prompt through the model in chunks; returns the last position's logits.

    The final chunk is padded to `chunk_size`, so the cache needs room for the prompt
    rounded up to a multiple of `chunk_size` (the padded slots are overwritten later).
    The cache passed in is donated (its buffers are updated in place): use the returned one.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tokens_BxT = jnp.asarray(tokens_BxT, jnp.int32)
    if tokens_BxT.ndim != 2 or tokens_BxT.shape[1] < 1:
        raise ValueError(f"tokens_BxT must be [batch, length >= 1], got {tokens_BxT.shape}")
    if tokens_BxT.shape[0] != cache.batch_size:
        raise ValueError(f"batch {tokens_BxT.shape[0]} differs from the cache's {cache.batch_size}")
    length = tokens_BxT.shape[1]
    n_chunks = math.ceil(length / chunk_size)
    _check_room(cache, n_chunks * chunk_size)
    padded = jnp.pad(tokens_BxT, ((0, 0), (0, n_chunks * chunk_size - length)))
    graphdef, state = nnx.split(model)
    logits_BxV = None
    for i in range(n_chunks):
        chunk = padded[:, i * chunk_size : (i + 1) * chunk_size]
        num_valid = jnp.int32(min(chunk_size, length - i * chunk_size))
        logits_BxV, cache = _forward_chunk(graphdef, state, chunk, cache, num_valid)
    return logits_BxV, cache


def decode_step(
    model: Transformer, tokens_Bx1: jax.Array, cache: KVCache
) -> tuple[jax.Array, KVCache]:
    """Appends one token per row; returns its next-token logits [B, V] and the new cache
    (the cache passed in is donated)."""
    tokens_Bx1 = jnp.asarray(tokens_Bx1, jnp.int32)
    if tokens_Bx1.ndim != 2 or tokens_Bx1.shape[1] != 1:
        raise ValueError(f"tokens_Bx1 must be [batch, 1], got {tokens_Bx1.shape}")
    _check_room(cache, 1)
    graphdef, state = nnx.split(model)
    return _forward_chunk(graphdef, state, tokens_Bx1, cache, jnp.int32(1))


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: float) -> jax.Array:
    """Greedy for temperature 0, else a draw from softmax(logits / temperature)."""
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV.astype(jnp.float32) / temperature).astype(
        jnp.int32
    )


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "temperature"))
def _decode_loop(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    logits_BxV: jax.Array,
    cache: KVCache,
    key: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float,
) -> jax.Array:
    model = nnx.merge(graphdef, state)
    batch = logits_BxV.shape[0]

    def body(i, carry):
        logits_BxV, cache, out_BxN = carry
        token_B = sample_token(logits_BxV, jax.random.fold_in(key, i), temperature)
        out_BxN = out_BxN.at[:, i].set(token_B)
        logits_Bx1xV, cache = model(token_B[:, None], cache=cache)
        return logits_Bx1xV[:, 0], cache, out_BxN

    out_BxN = jnp.zeros((batch, max_new_tokens), jnp.int32)
    _, _, out_BxN = jax.lax.fori_loop(0, max_new_tokens, body, (logits_BxV, cache, out_BxN))
    return out_BxN


def generate(
    model: Transformer,
    prompt_BxT: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    chunk_size: int = 512,
) -> jax.Array:
    """Continues every prompt by `max_new_tokens` tokens; returns only the new ones [B, N].

    temperature 0 is greedy decoding; otherwise tokens are sampled (a `key` is required).
    The prompt is prefilled in chunks, then a compiled loop decodes one token at a time.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("key is required when temperature > 0")
    key = jax.random.key(0) if key is None else key
    prompt_BxT = jnp.asarray(prompt_BxT, jnp.int32)
    batch, length = prompt_BxT.shape
    chunk_size = min(chunk_size, length)
    capacity = math.ceil(length / chunk_size) * chunk_size + max_new_tokens
    cache = init_cache(model.config, batch, capacity)
    logits_BxV, cache = prefill(model, prompt_BxT, cache, chunk_size=chunk_size)
    graphdef, state = nnx.split(model)
    return _decode_loop(
        graphdef,
        state,
        logits_BxV,
        cache,
        key,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
    )
