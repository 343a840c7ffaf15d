"""One window semantics everywhere: a window of w lets a query see the w keys before it and
itself (w + 1 keys, jax's `local_window_size=(w, 0)`), and also the w keys after it without
causality; a window of 0 is the query alone. Pinned on every implementation that runs on a
CPU (the reference, blockwise attention, the native CPU kernel, both Pallas kernels in
interpret mode), on a decoding chunk over a long cache (where blockwise attention and the
CPU kernel first cut the keys to the window's reach), in `ModelConfig`, and against
`jax.nn.dot_product_attention`'s `local_window_size`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import bam_jax
import bam_jax.blockwise
from bam_configs.presets import preset
from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from tests.support.cpu_compiler import needs_compiler

HEAD_DIM = 16


def _fused(backend: str, interpret: bool):
    return functools.partial(fused_attention, backend=backend, interpret=interpret)


REFERENCE = pytest.param(bam_jax.reference_attention, id="reference")
BLOCKWISE = pytest.param(bam_jax.blockwise.blockwise_attention, id="blockwise")
FUSED_CPU = pytest.param(_fused("cpu", False), id="fused_cpu", marks=needs_compiler)
PALLAS_INTERPRETED = [
    pytest.param(_fused("gpu", True), id="pallas_gpu_interpret"),
    pytest.param(_fused("tpu", True), id="pallas_tpu_interpret"),
]


def attended_positions(attention, spec: AttentionSpec, q_len: int, kv_len: int, offset: int):
    """Which key positions each query attends to, [T, S] boolean: with q = k = 0 every
    visible key has the same weight, and value s is the one-hot of position s (split over
    heads of HEAD_DIM columns), so the output is the visible set over its size."""
    heads = -(-kv_len // HEAD_DIM)
    q_1xTxHxD = jnp.zeros((1, q_len, heads, HEAD_DIM))
    k_1xSxHxD = jnp.zeros((1, kv_len, heads, HEAD_DIM))
    one_hot_SxP = np.eye(kv_len, heads * HEAD_DIM, dtype=np.float32)
    v_1xSxHxD = jnp.asarray(one_hot_SxP.reshape(1, kv_len, heads, HEAD_DIM))
    run = jax.jit(lambda q, k, v: attention(q, k, v, spec, query_offset=offset))
    weights_TxP = np.asarray(run(q_1xTxHxD, k_1xSxHxD, v_1xSxHxD)).reshape(q_len, -1)
    return weights_TxP[:, :kv_len] > 1e-4


def expected_positions(window: int, causal: bool, q_len: int, kv_len: int, offset: int):
    query_T1 = offset + np.arange(q_len)[:, None]
    key_1S = np.arange(kv_len)[None, :]
    behind = query_T1 - key_1S
    return (behind <= window) & ((behind >= 0) if causal else (behind >= -window))


@pytest.mark.parametrize("attention", [REFERENCE, BLOCKWISE, FUSED_CPU, *PALLAS_INTERPRETED])
@pytest.mark.parametrize(("window", "causal"), [(0, True), (1, True), (5, True), (3, False)])
def test_a_window_of_w_sees_w_keys_back_and_the_query(attention, window, causal):
    spec = AttentionSpec(causal=causal, window=window, block_q=16, block_k=16)
    # 70 queries: the CPU kernel runs on 64 queries or more (fewer run blockwise attention).
    seen_TxS = attended_positions(attention, spec, 70, 70, 0)
    np.testing.assert_array_equal(seen_TxS, expected_positions(window, causal, 70, 70, 0))
    if causal:
        counts = seen_TxS.sum(axis=1)
        assert counts[window:].tolist() == [window + 1] * (70 - window)


@pytest.mark.parametrize("attention", [REFERENCE, BLOCKWISE, FUSED_CPU])
@pytest.mark.parametrize("q_len", [1, 64])
def test_a_decoding_chunk_over_a_long_cache_sees_the_same_window(attention, q_len):
    kv_len, offset, window = 700, 600, 5  # keys cut to the window's reach before tiling
    spec = AttentionSpec(window=window)
    seen_TxS = attended_positions(attention, spec, q_len, kv_len, offset)
    expected = expected_positions(window, True, q_len, kv_len, offset)
    np.testing.assert_array_equal(seen_TxS, expected)


def test_a_model_takes_a_window_of_zero_as_every_attention_call_does():
    config = bam_jax.ModelConfig.of_size(
        "nano", encoding="bam_ssmax", global_prior=False, local_layers=1, local_window=0, n_layers=1
    )
    assert config.attention_spec(0).window == 0 == AttentionSpec(window=0).window
    model = bam_jax.Transformer(config, rngs=nnx.Rngs(0))
    tokens_1xT = jnp.arange(8)[None] % config.vocab_size

    def logit_at_3(embeddings_1xTxE):
        layer = model.layers[0]
        return jnp.sum(layer(embeddings_1xTxE)[0][0, 3])

    embeddings_1xTxE = model.tok_embeddings(tokens_1xT)
    grad_T = np.abs(np.asarray(jax.grad(logit_at_3)(embeddings_1xTxE))[0]).sum(-1)
    assert grad_T[3] > 0 and np.all(np.delete(grad_T, 3) == 0), "a window of 0: itself only"


def test_the_quickstart_local_layer_sees_the_query_and_the_16_tokens_before_it():
    config = preset("quickstart").model
    assert config.layer_windows() == (16, None)
    mask = config.attention_spec(0).mask(128)
    seen_S = np.asarray(mask.visible(jnp.int32(100), jnp.arange(128)))
    assert np.flatnonzero(seen_S).tolist() == list(range(84, 101))


@pytest.mark.parametrize(("window", "causal"), [(0, True), (5, True), (3, False)])
def test_a_window_is_jax_local_window_size(window, causal):
    rng = np.random.default_rng(window)
    q_BxTxHxD, k_BxTxHxD, v_BxTxHxD = (
        jnp.asarray(rng.normal(size=(2, 30, 2, HEAD_DIM)), jnp.float32) for _ in range(3)
    )
    ours = bam_jax.reference_attention(
        q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, AttentionSpec(causal=causal, window=window)
    )
    jax_window = (window, 0) if causal else (window, window)
    theirs = jax.nn.dot_product_attention(
        q_BxTxHxD, k_BxTxHxD, v_BxTxHxD, is_causal=causal, local_window_size=jax_window
    )
    np.testing.assert_allclose(ours, theirs, atol=1e-5)
