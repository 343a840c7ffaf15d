"""Passkey evaluation with stub cached models: scoring, chunking, batching, results reuse."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bam_eval.passkey import (
    PasskeySettings,
    evaluate_passkey,
    samples_for_length,
    score_samples,
    stack_samples,
)
from bam_eval.results import ResultStore
from bam_jax import inference
from bam_jax.inference import ChunkedForward, capacity_bucket
from bam_jax.passkey import passkey_template
from bam_jax.tokenizers import ByteTokenizer

VOCAB = 259


@flax.struct.dataclass
class StubCache:
    length: jax.Array
    seen_BxS: jax.Array


def stub_cache(batch: int, capacity: int) -> StubCache:
    return StubCache(jnp.zeros((), jnp.int32), jnp.zeros((batch, capacity), jnp.int32))


def _append(cache: StubCache, tokens_BxC: jax.Array) -> StubCache:
    seen = jax.lax.dynamic_update_slice_in_dim(cache.seen_BxS, tokens_BxC, cache.length, axis=1)
    return StubCache(cache.length + tokens_BxC.shape[1], seen)


class OracleModel(nnx.Module):
    """Is given the answers: predicts token t + 1 of its known sequences at position t."""

    def __init__(self, sequences_BxT: np.ndarray):
        self.sequences = nnx.Variable(jnp.asarray(sequences_BxT, jnp.int32))

    def __call__(self, tokens_BxC, *, cache):
        seq_BxT = self.sequences[...]
        pos_C = cache.length + jnp.arange(tokens_BxC.shape[1]) + 1
        next_BxC = jnp.take(seq_BxT, jnp.clip(pos_C, 0, seq_BxT.shape[1] - 1), axis=1)
        return 10.0 * jax.nn.one_hot(next_BxC, VOCAB), _append(cache, tokens_BxC)


class ConstantModel(nnx.Module):
    """Always predicts the same token."""

    def __call__(self, tokens_BxC, *, cache):
        logits = jnp.zeros((*tokens_BxC.shape, VOCAB)).at[..., ord("x") + 3].set(1.0)
        return logits, _append(cache, tokens_BxC)


class EchoModel(nnx.Module):
    """Logits that encode (absolute position, input token), to check chunk bookkeeping."""

    def __call__(self, tokens_BxC, *, cache):
        pos_C = cache.length + jnp.arange(tokens_BxC.shape[1])
        logits = tokens_BxC[..., None] * 1000.0 + pos_C[None, :, None] + jnp.zeros(VOCAB)
        return logits, _append(cache, tokens_BxC)


TOKENIZER = ByteTokenizer()


def test_capacity_buckets() -> None:
    assert capacity_bucket(1, 64) == 64
    assert capacity_bucket(65, 64) == 128
    assert capacity_bucket(129, 64) == 192
    assert capacity_bucket(257, 64) == 384
    assert capacity_bucket(385, 64) == 512
    buckets = {capacity_bucket(n, 512) for n in range(1000, 100_000, 997)}
    assert len(buckets) <= 2 * 8  # two buckets per doubling
    for n in (1000, 5000, 33_000, 99_999):
        assert n <= capacity_bucket(n, 512) <= max(1.5 * n, 1024)


def test_logits_at_positions_across_chunks() -> None:
    scorer = ChunkedForward(EchoModel(), stub_cache, chunk_size=16)
    tokens = np.arange(2 * 50).reshape(2, 50) % 7
    positions = np.array([[0, 15, 16, 49], [3, 31, 32, 40]])
    logits = scorer.logits_at(tokens, positions)
    assert logits.shape == (2, 4, VOCAB)
    expected = np.take_along_axis(tokens, positions, 1) * 1000.0 + positions
    np.testing.assert_array_equal(logits[..., 0], expected)


def test_oracle_scores_all_and_constant_none() -> None:
    settings = PasskeySettings(n_samples=4, seed=3)
    samples = samples_for_length(TOKENIZER, 900, settings)
    tokens_BxT, _ = stack_samples(samples)
    oracle = ChunkedForward(OracleModel(tokens_BxT), stub_cache, chunk_size=64)
    scores = score_samples(oracle, samples)
    assert scores.correct == [True] * 4 and scores.finite == [True] * 4
    decoded = [TOKENIZER.decode(p.tolist()) for p in scores.predicted_BxP]
    assert decoded == [str(s.key)[-5:] for s in samples]
    constant = ChunkedForward(ConstantModel(), stub_cache, chunk_size=64)
    assert score_samples(constant, samples).correct == [False] * 4


def test_one_wrong_digit_is_wrong() -> None:
    samples = samples_for_length(TOKENIZER, 700, PasskeySettings(n_samples=2))
    tokens_BxT, _ = stack_samples(samples)
    tokens_BxT[0, samples[0].answer_positions[2]] = ord("x") + 3  # the oracle learns a typo
    scorer = ChunkedForward(OracleModel(tokens_BxT), stub_cache, chunk_size=32)
    assert score_samples(scorer, samples).correct == [False, True]


def test_sweep_reuses_stored_lengths(tmp_path) -> None:
    settings = PasskeySettings(n_samples=3, tokenizer="byte")
    store = ResultStore(str(tmp_path / "passkey.json"), {"name": "const"})
    scorer = ChunkedForward(ConstantModel(), stub_cache, chunk_size=128)
    compiled_before = inference._advance._cache_size(), inference._gather._cache_size()
    first = evaluate_passkey(scorer, TOKENIZER, [600, 1200], settings, store, progress=False)
    assert [r["accuracy"] for r in first] == [0.0, 0.0]
    assert scorer.stats.sequences == 6
    # A second run (fresh store object on the same file) computes nothing it already has.
    store2 = ResultStore(str(tmp_path / "passkey.json"))
    again = evaluate_passkey(scorer, TOKENIZER, [600, 1200, 1800], settings, store2, progress=False)
    assert scorer.stats.sequences == 9
    assert [r["target_length"] for r in again] == [600, 1200, 1800]
    assert again[:2] == first
    # One shared cache capacity and batch shape per sweep: each step compiled once per run.
    advance_compiles = inference._advance._cache_size() - compiled_before[0]
    gather_compiles = inference._gather._cache_size() - compiled_before[1]
    assert advance_compiles <= 2 and gather_compiles <= 2
    entry = again[2]
    assert len(entry["correct"]) == 3 and len(entry["depths"]) == 3
    n_filler = entry["n_filler"]
    assert entry["filler_before"] == [0, n_filler // 2, n_filler]
    assert entry["depths"] == [0.0, (n_filler // 2) / n_filler, 1.0]
    assert entry["prompt_length"] <= 1800


def test_patience_stops_after_zero_lengths(tmp_path) -> None:
    store = ResultStore(str(tmp_path / "p.json"))
    scorer = ChunkedForward(ConstantModel(), stub_cache, chunk_size=128)
    out = evaluate_passkey(
        scorer,
        TOKENIZER,
        [500, 600, 700, 800],
        PasskeySettings(n_samples=1),
        store,
        patience=2,
        progress=False,
    )
    assert [r["target_length"] for r in out] == [500, 600]


def test_length_below_minimum_is_a_clear_error(tmp_path) -> None:
    minimum = passkey_template(TOKENIZER).min_length
    store = ResultStore(str(tmp_path / "p.json"))
    scorer = ChunkedForward(ConstantModel(), stub_cache, chunk_size=128)
    with pytest.raises(ValueError, match="minimum"):
        evaluate_passkey(scorer, TOKENIZER, [minimum - 1], PasskeySettings(), store, progress=False)
    assert scorer.stats.sequences == 0
