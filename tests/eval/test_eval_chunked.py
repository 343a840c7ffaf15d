"""Chunked cached scoring against one full forward of the real model, and its memory bound."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from bam_eval.memory import cache_bytes_per_slot
from bam_eval.models import BLOCKWISE_INFERENCE_BLOCKS, for_inference
from bam_jax.config import ModelConfig
from bam_jax.inference import ChunkedForward
from bam_jax.model import Transformer


def _model(encoding: str, scan_layers: bool = False):
    config = ModelConfig.of_size(
        "nano",
        encoding=encoding,
        max_seq_len=32,
        prior_beta_init="linear",
        scan_layers=scan_layers,
    )
    return Transformer(config, rngs=nnx.Rngs(1))


@nnx.jit
def _full_forward(model, tokens_BxT):
    return model(tokens_BxT)


@pytest.mark.parametrize(
    ("encoding", "scan_layers"), [("bam_ssmax", False), ("rope", False), ("sinusoidal_ssmax", True)]
)
def test_chunked_logits_match_full_forward(encoding: str, scan_layers: bool) -> None:
    # A scanned (training layout) model is evaluated in the unrolled, in-place cache layout.
    model = _model(encoding, scan_layers)
    tokens = np.random.default_rng(0).integers(3, 64, size=(2, 75)).astype(np.int32)
    full = np.asarray(_full_forward(model, tokens))
    positions = np.array([[0, 15, 16, 40, 74], [5, 31, 32, 33, 70]])
    scorer = ChunkedForward(for_inference(model, block_q=8, block_k=8), chunk_size=16)
    chunked = scorer.logits_at(tokens, positions)
    expected = np.take_along_axis(full, positions[..., None], axis=1)
    np.testing.assert_allclose(chunked, expected, atol=2e-4, rtol=2e-4)


def test_chunked_loss_matches_full_forward() -> None:
    model = _model("bam_ssmax")
    tokens = np.random.default_rng(1).integers(3, 64, size=(1, 49)).astype(np.int32)
    logits = np.asarray(_full_forward(model, tokens), np.float64)[0, :-1]
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
    scorer = ChunkedForward(for_inference(model), chunk_size=16)
    np.testing.assert_allclose(scorer.next_token_loss(tokens)[0], expected, atol=2e-4)


def test_inference_tiles_are_the_implementation_s_not_the_training_ones() -> None:
    config = ModelConfig.of_size("toy", encoding="bam_ssmax", block_q=64, block_k=64)
    model = Transformer(config, rngs=nnx.Rngs(0))
    blockwise = for_inference(model, attention_impl="blockwise").config
    assert (blockwise.block_q, blockwise.block_k) == BLOCKWISE_INFERENCE_BLOCKS
    # The fused kernel keeps its backend's tiles: blockwise's 1024-key blocks exceed Triton's.
    fused = for_inference(model, attention_impl="fused").config
    assert (fused.attention_impl, fused.block_q, fused.block_k) == ("fused", None, None)
    # "pallas", the earlier name, is the same choice.
    chosen = for_inference(model, attention_impl="pallas", block_q=32, block_k=16).config
    assert chosen.attention_impl == "fused"
    assert (chosen.block_q, chosen.block_k) == (32, 16)


def test_memory_at_16k_is_linear_not_quadratic() -> None:
    config = ModelConfig.of_size("toy", encoding="bam_ssmax")
    scorer = ChunkedForward(for_inference(Transformer(config, rngs=nnx.Rngs(0))), chunk_size=512)
    one_chunk = scorer.compiled_temp_bytes(1, 512)
    at_16k = scorer.compiled_temp_bytes(1, 16_384)
    cache_16k = cache_bytes_per_slot(config) * 16_384
    # Scratch is one chunk's work plus at most a copy of the cache; a [T, S] float32 score
    # matrix alone would be 1 GiB per head.
    assert at_16k <= one_chunk + 2 * cache_16k
    assert at_16k < 64 * 2**20
