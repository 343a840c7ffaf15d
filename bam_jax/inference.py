"""Inference with a key/value cache: chunked forward passes, prefill, decode, generation.

The cache holds every layer's rotated keys and values in fixed-capacity buffers, one
[B, S, K, D] array per layer (so a jitted step that donates the cache updates each in
place); `length` counts the filled slots (shared by the batch). A forward over a chunk
writes its keys at `length` and attends with query_offset = length, so slots not yet
written lie in the future of every query and are masked by causality. SSMax counts the
cached tokens in n_i.

A model with `scan_layers` works too, but its scan copies the cache on every call;
`reconfigure(model, scan_layers=False)` gives the same weights in the in-place layout.

Every cached forward runs through `ChunkedForward`: a sequence is padded at the end to a
whole number of chunks of a fixed size (padding never changes earlier positions), so one
compiled step serves every length and memory is bounded by chunk_size x capacity, never
length ** 2. Two jitted steps serve every (batch, chunk, capacity) shape:

- advance: runs a chunk and keeps only the cache; its logits are dead code that XLA drops,
  so chunks with nothing to score skip the output projection entirely;
- gather: runs a chunk and returns the logits at a few requested positions only ([B, P, V];
  a model with `hidden_states` / `logits` projects only those positions), never [T, vocab].

`prefill` and `decode_step` are such forwards scoring their last position; the scoring
helpers (`logits_at`, `next_token_loss`) size their own cache to a bucket of capacities
(1, 2, 3, 4, 6, 8, 12, 16, ... chunks), so one compiled step serves many lengths; with
blockwise attention unfilled slots are skipped, so a sweep may share one capacity
(`min_capacity`) across all its lengths and compile its steps once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.kv_cache import KVCache

CacheFactory = Callable[[int, int], Any]


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


def capacity_bucket(n_tokens: int, chunk_size: int) -> int:
    """Cache slots for ``n_tokens``: whole chunks, rounded up to 2**k or 1.5 * 2**k chunks."""
    if n_tokens < 1 or chunk_size < 1:
        raise ValueError(f"n_tokens and chunk_size must be >= 1, got {n_tokens}, {chunk_size}")
    chunks = math.ceil(n_tokens / chunk_size)
    power = 1 << (chunks - 1).bit_length()
    if chunks > 2 and chunks <= 3 * power // 4:
        power = 3 * power // 4
    return power * chunk_size


@functools.partial(jax.jit, donate_argnums=2)
def _advance(graphdef: nnx.GraphDef, state: nnx.State, cache: Any, tokens_BxC: jax.Array) -> Any:
    _, cache = nnx.merge(graphdef, state)(tokens_BxC, cache=cache)
    return cache


@functools.partial(jax.jit, donate_argnums=2)
def _gather(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: Any,
    tokens_BxC: jax.Array,
    positions_BxP: jax.Array,
) -> tuple[Any, jax.Array]:
    model = nnx.merge(graphdef, state)
    index_BxPx1 = jnp.clip(positions_BxP, 0, tokens_BxC.shape[1] - 1)[..., None]
    if hasattr(model, "hidden_states"):  # project only the scored positions
        hidden_BxCxE, cache = model.hidden_states(tokens_BxC, cache=cache)
        picked_BxPxE = jnp.take_along_axis(hidden_BxCxE, index_BxPx1, axis=1)
        return cache, model.logits(picked_BxPxE).astype(jnp.float32)
    logits_BxCxV, cache = model(tokens_BxC, cache=cache)
    picked_BxPxV = jnp.take_along_axis(logits_BxCxV, index_BxPx1, axis=1)
    return cache, picked_BxPxV.astype(jnp.float32)


@functools.partial(jax.jit, donate_argnums=2)
def _next_token_loss(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: Any,
    tokens_BxC: jax.Array,
    targets_BxC: jax.Array,
) -> tuple[Any, jax.Array]:
    logits_BxCxV, cache = nnx.merge(graphdef, state)(tokens_BxC, cache=cache)
    logits_BxCxV = logits_BxCxV.astype(jnp.float32)
    logp_BxCxV = jax.nn.log_softmax(logits_BxCxV, axis=-1)
    picked_BxC = jnp.take_along_axis(logp_BxCxV, targets_BxC[..., None], axis=-1)
    # A -inf logit can leave the target's loss finite: NaN marks every such position.
    finite_BxC = jnp.all(jnp.isfinite(logits_BxCxV), axis=-1)
    return cache, jnp.where(finite_BxC, -picked_BxC[..., 0], jnp.nan)


@dataclasses.dataclass
class ChunkStats:
    """What a chunked forward has run, for progress reports and reuse checks."""

    sequences: int = 0
    chunks: int = 0
    tokens: int = 0


class ChunkedForward:
    """Runs a cached model over sequences of any length, one fixed-size chunk per jitted call.

    ``model(tokens_BxC, cache=cache) -> (logits_BxCxV, cache)`` is the cached forward (an
    NNX module; a Linen one through `flax.nnx.bridge.ToNNX`); ``cache_factory(batch,
    capacity)`` makes an empty cache for it. Without one, a model with a `ModelConfig` as
    its `config` gets `init_cache`; any other model needs a factory for the helpers that
    make their own cache (`logits_at`, `next_token_loss`), while `run` takes a cache.
    """

    def __init__(
        self, model: nnx.Module, cache_factory: CacheFactory | None = None, *, chunk_size: int = 512
    ):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        _check_module(model)
        self.chunk_size = chunk_size
        # The model's own factory is looked up only when a cache is made without one given.
        self._cache_factory = cache_factory or functools.partial(model_cache_factory, model)
        self.min_capacity = 0
        self.stats = ChunkStats()
        self.graphdef, self.state = nnx.split(model)

    def cache_factory(self, batch: int, capacity: int) -> Any:
        """An empty cache of `capacity` slots for `batch` rows, each buffer its own."""
        return unaliased(self._cache_factory(batch, capacity))

    def capacity_for(self, n_tokens: int) -> int:
        """Cache slots the scoring helpers use for a sequence of ``n_tokens``."""
        return max(capacity_bucket(n_tokens, self.chunk_size), self.min_capacity)

    def _padded_chunks(self, tokens_BxT: np.ndarray) -> np.ndarray:
        """The tokens padded at the end to whole chunks, [n_chunks, B, C]."""
        tokens_BxT = np.asarray(tokens_BxT, np.int32)
        if tokens_BxT.ndim != 2 or tokens_BxT.shape[1] < 1:
            raise ValueError(f"tokens_BxT must be [batch, length >= 1], got {tokens_BxT.shape}")
        batch, length = tokens_BxT.shape
        n_chunks = math.ceil(length / self.chunk_size)
        padded_BxT = np.zeros((batch, n_chunks * self.chunk_size), np.int32)
        padded_BxT[:, :length] = tokens_BxT
        self.stats.sequences += batch
        self.stats.tokens += batch * length
        self.stats.chunks += n_chunks
        return padded_BxT.reshape(batch, n_chunks, self.chunk_size).transpose(1, 0, 2)

    def run(
        self, tokens_BxT: np.ndarray, cache: Any, positions_BxP: np.ndarray
    ) -> tuple[np.ndarray, Any]:
        """Runs the tokens through ``cache`` (which is donated); returns the float32 logits
        [B, P, V] at the given positions of each row and the new cache, whose length has
        grown by whole chunks. Chunks holding no requested position only fill the cache."""
        positions_BxP = np.asarray(positions_BxP, np.int32)
        if positions_BxP.ndim != 2 or positions_BxP.shape[0] != np.shape(tokens_BxT)[0]:
            raise ValueError(f"positions_BxP must be [batch, P], got {positions_BxP.shape}")
        if positions_BxP.min() < 0 or positions_BxP.max() >= np.shape(tokens_BxT)[1]:
            raise ValueError("positions_BxP must lie inside the sequences")
        chunks = self._padded_chunks(tokens_BxT)
        cache = unaliased(cache)
        wanted_chunks = set((positions_BxP // self.chunk_size).ravel().tolist())
        out_BxPxV = None
        for i, chunk_BxC in enumerate(chunks):
            if i not in wanted_chunks:
                cache = _advance(self.graphdef, self.state, cache, chunk_BxC)
                continue
            local_BxP = positions_BxP - i * self.chunk_size
            cache, picked_BxPxV = _gather(self.graphdef, self.state, cache, chunk_BxC, local_BxP)
            picked_BxPxV = np.asarray(picked_BxPxV)
            if out_BxPxV is None:
                out_BxPxV = np.zeros_like(picked_BxPxV)
            inside_BxP = (local_BxP >= 0) & (local_BxP < self.chunk_size)
            out_BxPxV[inside_BxP] = picked_BxPxV[inside_BxP]
        assert out_BxPxV is not None
        return out_BxPxV, cache

    def logits_at(self, tokens_BxT: np.ndarray, positions_BxP: np.ndarray) -> np.ndarray:
        """Logits float32 [B, P, V] at the given positions of each row (right-padded rows),
        through a fresh cache of ``capacity_for`` slots."""
        batch, length = np.shape(tokens_BxT)
        cache = self.cache_factory(batch, self.capacity_for(length))
        return self.run(tokens_BxT, cache, positions_BxP)[0]

    def next_token_loss(self, tokens_BxT: np.ndarray) -> np.ndarray:
        """Loss float32 [B, T - 1] of predicting token t + 1 from tokens 0..t; NaN where
        the logits are not all finite."""
        tokens_BxT = np.asarray(tokens_BxT, np.int32)
        batch, length = tokens_BxT.shape
        chunks = self._padded_chunks(tokens_BxT)
        cache = self.cache_factory(batch, self.capacity_for(length))
        targets_BxT = np.zeros((batch, chunks.shape[0] * self.chunk_size), np.int32)
        targets_BxT[:, : length - 1] = tokens_BxT[:, 1:]
        targets = targets_BxT.reshape(batch, -1, self.chunk_size).transpose(1, 0, 2)
        losses = []
        for chunk_BxC, target_BxC in zip(chunks, targets, strict=True):
            cache, loss_BxC = _next_token_loss(
                self.graphdef, self.state, cache, chunk_BxC, target_BxC
            )
            losses.append(loss_BxC)
        # One read-back at the end, so the chunks are dispatched without waiting on each.
        return np.concatenate(jax.device_get(losses), axis=1)[:, : length - 1]

    def compiled_temp_bytes(self, batch: int, n_tokens: int, n_positions: int = 1) -> int:
        """Scratch memory XLA plans for one step at this length's capacity: the larger of
        the step that only fills the cache and the one that also scores ``n_positions``
        positions of each row."""
        capacity = self.capacity_for(n_tokens)
        cache = jax.eval_shape(lambda: self.cache_factory(batch, capacity))
        tokens_BxC = jax.ShapeDtypeStruct((batch, self.chunk_size), jnp.int32)
        positions_BxP = jax.ShapeDtypeStruct((batch, n_positions), jnp.int32)
        steps = (
            _advance.lower(self.graphdef, self.state, cache, tokens_BxC),
            _gather.lower(self.graphdef, self.state, cache, tokens_BxC, positions_BxP),
        )
        return max(int(s.compile().memory_analysis().temp_size_in_bytes) for s in steps)


def model_cache_factory(model: Any, batch: int, capacity: int) -> KVCache:
    """`init_cache` with the model's config, for a model that has a `ModelConfig` as its
    `config`; a TypeError saying what to pass for any other."""
    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise TypeError(
            f"{type(model).__name__} has no bam_jax ModelConfig as its `config` to size a cache "
            "from: pass cache_factory=(batch, capacity) -> an empty cache of its own, or a cache"
        )
    return init_cache(config, batch, capacity)


def _check_module(model: Any) -> None:
    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"the model must be a flax.nnx.Module whose model(tokens_BxC, cache=cache) returns "
            f"(logits [B, C, V], the advanced cache), got {type(model).__name__}; wrap a Linen "
            "module in flax.nnx.bridge.ToNNX"
        )


def unaliased(cache: Any) -> Any:
    """`cache` with every array that shares its buffer with an earlier leaf replaced by a
    copy: a jitted step that donates the cache may donate each buffer only once (a cache
    built as `(jnp.zeros(shape),) * n_layers` holds one buffer n_layers times)."""
    seen: set[Any] = set()

    def own_buffer(x: Any) -> Any:
        if not isinstance(x, jax.Array):
            return x
        keys = _buffer_keys(x)
        shared = not keys.isdisjoint(seen)
        seen.update(keys)
        return jnp.copy(x) if shared else x

    return jax.tree.map(own_buffer, cache)


def _buffer_keys(x: jax.Array) -> set[Any]:
    """What identifies the buffers of an array: the array itself, and the address of each
    shard where jax can tell it."""
    keys: set[Any] = {id(x)}
    with contextlib.suppress(Exception):  # deleted, abstract or not addressable here
        keys.update(shard.data.unsafe_buffer_pointer() for shard in x.addressable_shards)
    return keys


def _check_eager(*values: Any) -> None:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(values)):
        raise TypeError(
            "prefill and generate run eagerly by design: they loop over chunks in Python and "
            "call their own compiled steps, so they cannot be traced by jax.jit or nnx.jit. "
            "Call them outside jit; the jit-able pieces are decode_step and the model's own "
            "cached forward"
        )


def _cache_length(cache: Any) -> int:
    if not hasattr(cache, "length") or not hasattr(cache, "capacity"):
        raise TypeError(
            f"the cache must have `length` (filled slots) and `capacity` (all slots), as "
            f"bam_jax.KVCache has; got {type(cache).__name__}"
        )
    return int(cache.length)


def _with_length(cache: Any, length: jax.Array) -> Any:
    """The cache with its `length` replaced (flax.struct and other dataclasses)."""
    if hasattr(cache, "replace"):
        return cache.replace(length=length)
    if dataclasses.is_dataclass(cache):
        return dataclasses.replace(cache, length=length)
    raise TypeError(
        f"prefill sets the cache's length after the padded last chunk: the cache must be a "
        f"dataclass or have replace(length=...), as bam_jax.KVCache has; got "
        f"{type(cache).__name__}"
    )


def _check_room(cache: Any, needed: int) -> None:
    length = _cache_length(cache)
    if length + needed > cache.capacity:
        raise ValueError(
            f"cache capacity {cache.capacity} is too small: {length} slots are filled and "
            f"{needed} more are needed"
        )


def _last_position_logits(
    model: nnx.Module, tokens_BxT: jax.Array, cache: Any, chunk_size: int
) -> tuple[jax.Array, Any]:
    """Logits [B, V] after the last token and the cache holding exactly the tokens."""
    tokens_BxT = np.asarray(tokens_BxT, np.int32)
    if tokens_BxT.ndim != 2 or tokens_BxT.shape[1] < 1:
        raise ValueError(f"tokens_BxT must be [batch, length >= 1], got {tokens_BxT.shape}")
    batch, length = tokens_BxT.shape
    cache_batch = getattr(cache, "batch_size", batch)
    if batch != cache_batch:
        raise ValueError(f"batch {batch} differs from the cache's {cache_batch}")
    _check_room(cache, math.ceil(length / chunk_size) * chunk_size)
    filled = cache.length + length
    last_Bx1 = np.full((batch, 1), length - 1, np.int32)
    logits_Bx1xV, cache = ChunkedForward(model, chunk_size=chunk_size).run(
        tokens_BxT, cache, last_Bx1
    )
    # The padded slots of the last chunk are not part of the sequence: later tokens
    # overwrite them.
    return jnp.asarray(logits_Bx1xV[:, 0]), _with_length(cache, filled)


def prefill(
    model: nnx.Module, tokens_BxT: jax.Array, cache: Any, *, chunk_size: int = 512
) -> tuple[jax.Array, Any]:
    """Runs the prompt through the model in chunks; returns the last position's logits.

    Any NNX module whose `model(tokens_BxC, cache=cache)` returns (logits [B, C, V], the
    cache advanced by C) can be passed, with a cache that has `length`, `capacity` and
    `replace(length=...)` (a flax.struct dataclass such as `KVCache`, or any dataclass).
    The final chunk is padded to `chunk_size`, so the cache needs room for the prompt
    rounded up to a multiple of `chunk_size` (the padded slots are overwritten later).
    The cache passed in is donated (its buffers are updated in place): use the returned one;
    a buffer that appears in it twice is copied first. Prefill runs eagerly by design (a
    Python loop over compiled chunk steps): call it outside jit.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    _check_eager(tokens_BxT, cache)
    return _last_position_logits(model, tokens_BxT, cache, chunk_size)


def decode_step(model: nnx.Module, tokens_Bx1: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    """Appends one token per row; returns its next-token logits [B, V] (float32) and the
    new cache. Jit-able (`nnx.jit(decode_step)`, or inside a user's own jitted loop); the
    cache's room is checked only where its length is known, outside a trace. Any model
    whose `model(tokens_BxC, cache=cache)` returns (logits [B, C, V], the advanced cache)
    can be passed."""
    if np.ndim(tokens_Bx1) != 2 or np.shape(tokens_Bx1)[1] != 1:
        raise ValueError(f"tokens_Bx1 must be [batch, 1], got {np.shape(tokens_Bx1)}")
    # Traced, the length is known only at run time.
    with contextlib.suppress(jax.errors.ConcretizationTypeError):
        _check_room(cache, 1)
    return _decode(model, jnp.asarray(tokens_Bx1, jnp.int32), cache)


@nnx.jit
def _decode(model: nnx.Module, tokens_Bx1: jax.Array, cache: Any) -> tuple[jax.Array, Any]:
    logits_Bx1xV, cache = model(tokens_Bx1, cache=cache)
    return logits_Bx1xV[:, 0].astype(jnp.float32), cache


def sample_token(logits_BxV: jax.Array, key: jax.Array, temperature: jax.Array | None) -> jax.Array:
    """Greedy for a temperature of None, else a draw from softmax(logits / temperature)."""
    if temperature is None:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logits_BxV.astype(jnp.float32) / temperature).astype(
        jnp.int32
    )


@functools.partial(jax.jit, static_argnames=("max_new_tokens",))
def _decode_loop(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    logits_BxV: jax.Array,
    cache: Any,
    key: jax.Array,
    temperature: jax.Array | None,
    *,
    max_new_tokens: int,
) -> jax.Array:
    """Decodes `max_new_tokens` tokens; `temperature` is None for greedy decoding, else a
    float32 scalar, so every temperature shares one program."""
    batch = logits_BxV.shape[0]

    def body(i, carry):
        # The model is merged inside the loop and its state carried: a model that updates
        # a variable when called (the RNG counts of a Linen model under nnx.bridge.ToNNX)
        # may only do so at the loop's own trace level.
        logits_BxV, cache, out_BxT, state = carry
        model = nnx.merge(graphdef, state)
        token_B = sample_token(logits_BxV, jax.random.fold_in(key, i), temperature)
        out_BxT = out_BxT.at[:, i].set(token_B)
        logits_Bx1xV, cache = model(token_B[:, None], cache=cache)
        return logits_Bx1xV[:, 0], cache, out_BxT, nnx.state(model)

    out_BxT = jnp.zeros((batch, max_new_tokens), jnp.int32)
    carry = (logits_BxV, cache, out_BxT, state)
    return jax.lax.fori_loop(0, max_new_tokens, body, carry)[2]


def generate(
    model: nnx.Module,
    prompt_BxT: jax.Array,
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    key: jax.Array | None = None,
    chunk_size: int = 512,
    cache: Any | None = None,
    cache_factory: CacheFactory | None = None,
) -> jax.Array:
    """Continues every prompt by `max_new_tokens` tokens; returns only the new ones, [B, T]
    with T = max_new_tokens.

    temperature 0 is greedy decoding; otherwise tokens are sampled (a `key` is required).
    The prompt is prefilled in chunks, then a compiled loop decodes one token at a time; the
    loop is compiled once for greedy decoding and once for sampling at any temperature.

    The model is any that `prefill` takes. Its cache is `cache` (empty, with room for the
    prompt rounded up to whole chunks plus `max_new_tokens`; it is donated), else
    `cache_factory(batch, capacity)`, else `init_cache` of a model with a `ModelConfig`.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature > 0 and key is None:
        raise ValueError("key is required when temperature > 0")
    if cache is not None and cache_factory is not None:
        raise ValueError("generate takes a cache or a cache_factory, not both")
    _check_eager(prompt_BxT, cache)
    _check_module(model)
    key = jax.random.key(0) if key is None else key
    prompt_BxT = jnp.asarray(prompt_BxT, jnp.int32)
    batch, length = prompt_BxT.shape
    chunk_size = min(chunk_size, length)
    capacity = math.ceil(length / chunk_size) * chunk_size + max_new_tokens
    if cache is None:
        cache = (cache_factory or functools.partial(model_cache_factory, model))(batch, capacity)
    _check_room(cache, capacity)
    logits_BxV, cache = prefill(model, prompt_BxT, cache, chunk_size=chunk_size)
    graphdef, state = nnx.split(model)
    return _decode_loop(
        graphdef,
        state,
        logits_BxV,
        cache,
        key,
        None if temperature == 0 else jnp.float32(temperature),
        max_new_tokens=max_new_tokens,
    )
