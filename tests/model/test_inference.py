"""KV-cache inference: chunked prefill and decode against one full forward, generation."""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_jax import inference
from bam_jax.config import ModelConfig
from bam_jax.inference import decode_step, generate, init_cache, prefill
from bam_jax.kv_cache import KVCache
from bam_jax.layers import PriorParam, SSMaxParam
from bam_jax.model import Transformer
from bam_jax.model_state import reconfigure
from tests.support.grids import slow_unless

PROMPT_LEN, TOTAL_LEN, CAPACITY = 13, 16, 24


@functools.cache
def built(encoding: str, **overrides) -> Transformer:
    """A micro model (blockwise attention over 4-token tiles) with non-trivial priors."""
    config = ModelConfig.of_size("nano", encoding=encoding, block_q=4, block_k=4, **overrides)
    model = Transformer(config, rngs=nnx.Rngs(2))
    state = nnx.state(model, nnx.Any(PriorParam, SSMaxParam))
    noisy = jax.tree.map(lambda x: x + 0.2 * jnp.arange(x.shape[-1]) / x.shape[-1], state)
    nnx.update(model, noisy)
    return model


@jax.jit
def _forward(graphdef, state, tokens):
    return nnx.merge(graphdef, state)(tokens)


def full_forward(model: Transformer, tokens: jax.Array) -> jax.Array:
    """One forward over all tokens with the plain-einsum attention (an independent path)."""
    return _forward(*nnx.split(reconfigure(model, attention_impl="reference")), tokens)


def tokens_for(model: Transformer, length: int = TOTAL_LEN, seed: int = 4) -> jax.Array:
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.integers(0, model.config.vocab_size, (2, length)), jnp.int32)


def cached_logits(model: Transformer, tokens: jax.Array, chunk_size: int) -> list[jax.Array]:
    """Next-token logits after the prompt, then after each decoded token, via the cache."""
    cache = init_cache(model.config, 2, CAPACITY)
    last, cache = prefill(model, tokens[:, :PROMPT_LEN], cache, chunk_size=chunk_size)
    assert int(cache.length) == PROMPT_LEN
    outputs = [last]
    for t in range(PROMPT_LEN, TOTAL_LEN):
        last, cache = decode_step(model, tokens[:, t : t + 1], cache)
        outputs.append(last)
    assert int(cache.length) == TOTAL_LEN
    return outputs


@pytest.mark.parametrize(
    ("encoding", "chunk_size"),
    slow_unless(
        [
            ("bam_ssmax", 5),
            ("rope", 3),
            ("alibi_ssmax", 5),
            ("sinusoidal", 3),
            ("rope_local", 5),
            ("bam_ssmax_local", 3),
        ],
        default=[("bam_ssmax", 5), ("rope", 3), ("bam_ssmax_local", 3)],
    ),
)
def test_chunked_prefill_and_decode_equal_full_forward(encoding, chunk_size):
    # Chunks of 3 and 5 do not divide the 13-token prompt: the last one is padded.
    overrides = {"local_window": 6} if encoding in ("rope_local", "bam_ssmax_local") else {}
    if encoding == "bam_ssmax_local":
        encoding, overrides["local_layers"] = "bam_ssmax", 1
    model = built(encoding, **overrides)
    tokens = tokens_for(model)
    full = full_forward(model, tokens)
    for step, logits in enumerate(cached_logits(model, tokens, chunk_size)):
        np.testing.assert_allclose(logits, full[:, PROMPT_LEN - 1 + step], atol=2e-5, rtol=1e-5)


def test_scanned_layers_with_cache():
    model = built("bam_ssmax", global_prior=False)
    scanned = reconfigure(model, scan_layers=True)
    tokens = tokens_for(model)
    full = full_forward(model, tokens)
    for step, logits in enumerate(cached_logits(scanned, tokens, 5)):
        np.testing.assert_allclose(logits, full[:, PROMPT_LEN - 1 + step], atol=2e-5, rtol=1e-5)


def test_prefill_compiles_once_per_chunk_shape():
    model = built("bam_ssmax")
    cache = init_cache(model.config, 2, CAPACITY)
    prefill(model, tokens_for(model, 7), cache, chunk_size=5)
    compiled = inference._advance._cache_size(), inference._gather._cache_size()
    for length in (4, 9, 11):  # other prompt lengths, same chunk and cache shapes
        cache = init_cache(model.config, 2, CAPACITY)
        logits, cache = prefill(model, tokens_for(model, length), cache, chunk_size=5)
        assert int(cache.length) == length
        chex.assert_shape(logits, (2, model.config.vocab_size))
    assert (inference._advance._cache_size(), inference._gather._cache_size()) == compiled


def test_generate_greedy_follows_the_full_forward_argmax():
    model = built("rope_ssmax")
    prompt = tokens_for(model, 6)
    new = generate(model, prompt, max_new_tokens=8, chunk_size=4)
    chex.assert_shape(new, (2, 8))
    logits = full_forward(model, jnp.concatenate([prompt, new], axis=1))
    np.testing.assert_array_equal(new, jnp.argmax(logits[:, 5:13], axis=-1))


def test_generate_with_temperature_is_reproducible_by_key():
    model = built("rope_ssmax")
    prompt = tokens_for(model, 6)
    sample = functools.partial(generate, model, prompt, max_new_tokens=8, chunk_size=4)
    first = sample(temperature=1.0, key=jax.random.key(1))
    again = sample(temperature=1.0, key=jax.random.key(1))
    other = sample(temperature=1.0, key=jax.random.key(2))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    assert first.dtype == jnp.int32 and np.all((first >= 0) & (first < model.config.vocab_size))
    compiled = inference._decode_loop._cache_size()
    hotter = sample(temperature=3.0, key=jax.random.key(1))
    near_greedy = sample(temperature=1e-4, key=jax.random.key(1))
    assert inference._decode_loop._cache_size() == compiled, "a temperature compiled anew"
    assert not np.array_equal(hotter, first)
    np.testing.assert_array_equal(near_greedy, sample())


def test_cache_shapes_dtypes_and_errors():
    model = built("bam_ssmax")
    config = model.config
    cache = init_cache(config.replace(dtype="bfloat16"), 3, 10)
    assert isinstance(cache, KVCache) and cache.keys[0].dtype == jnp.bfloat16
    assert len(cache.values) == config.n_layers
    chex.assert_shape(cache.values[1], (3, 10, config.kv_heads, config.head_dim))
    assert cache.capacity == 10 and int(cache.length) == 0
    tokens = tokens_for(model, 9)
    with pytest.raises(ValueError, match="capacity"):
        prefill(model, tokens, init_cache(config, 2, 9), chunk_size=4)  # 3 padded chunks: 12
    with pytest.raises(ValueError, match="segment_ids"):
        model(tokens, jnp.zeros_like(tokens), cache=init_cache(config, 2, 16))
    with pytest.raises(ValueError, match="key"):
        generate(model, tokens, max_new_tokens=2, temperature=0.5)
    with pytest.raises(ValueError, match="batch"):
        prefill(model, tokens, init_cache(config, 1, 16), chunk_size=4)


def test_decode_step_runs_under_nnx_jit_as_outside_it():
    model = Transformer(ModelConfig.of_size("nano", encoding="bam_ssmax"), rngs=nnx.Rngs(0))
    tokens = tokens_for(model)
    cache = init_cache(model.config, 2, CAPACITY)
    _, cache = prefill(model, tokens[:, :PROMPT_LEN], cache, chunk_size=4)
    eager_logits, eager_cache = decode_step(model, tokens[:, PROMPT_LEN : PROMPT_LEN + 1], cache)
    jitted = nnx.jit(decode_step)
    logits, jit_cache = jitted(model, tokens[:, PROMPT_LEN : PROMPT_LEN + 1], cache)
    np.testing.assert_array_equal(logits, eager_logits)
    assert int(jit_cache.length) == int(eager_cache.length) == PROMPT_LEN + 1


def test_a_cache_holding_one_buffer_for_every_layer_prefills_as_a_fresh_one():
    model = built("bam_ssmax")
    config, tokens = model.config, tokens_for(model, 9)
    shape = (2, CAPACITY, config.kv_heads, config.head_dim)
    zeros = jnp.zeros(shape)  # what `(jnp.zeros(shape),) * n_layers` gives every layer
    aliased = KVCache(keys=(zeros,) * config.n_layers, values=(zeros,) * config.n_layers, length=0)
    logits, cache = prefill(model, tokens, aliased, chunk_size=4)
    expected_logits, expected = prefill(
        model, tokens, init_cache(config, 2, CAPACITY), chunk_size=4
    )
    np.testing.assert_array_equal(logits, expected_logits)
    chex.assert_trees_all_equal(cache, expected)
    assert not np.array_equal(cache.keys[0], cache.keys[1])
