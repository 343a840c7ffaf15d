"""bam-eval's per-sample memory estimate, which refuses lengths that do not fit, is an upper
bound: it covers the KV cache, the scratch XLA plans for the chunk steps and the prompt's
token arrays on the host (bench/eval_memory.py measures the peak against it)."""

import pytest
from flax import nnx

from bam_configs.presets import preset
from bam_eval.api import InferenceSettings
from bam_eval.memory import activation_bytes, cache_bytes_per_slot
from bam_eval.passkey import PasskeySettings, samples_for_length, stack_samples
from bam_jax.model import Transformer
from bam_jax.tokenizers import get_tokenizer
from tests.support.cpu_compiler import needs_compiler

# Long enough that the per-token terms outweigh the estimate's fixed slack per chunk.
LENGTH = 1 << 20


@pytest.mark.parametrize("attention", ["blockwise", pytest.param("fused", marks=needs_compiler)])
def test_the_estimate_covers_the_cache_the_compiled_steps_and_the_token_arrays(attention):
    train_config = preset("quickstart")
    inference = InferenceSettings(attention=attention)
    forward, config = inference.prepare(Transformer(train_config.model, rngs=nnx.Rngs(0)))
    tokenizer = get_tokenizer(train_config.data.tokenizer)
    settings = PasskeySettings(n_samples=1, tokenizer=tokenizer.name)
    samples = samples_for_length(tokenizer, LENGTH, settings)
    tokens_BxT, positions_BxP = stack_samples(samples)
    padded = forward._padded_chunks(tokens_BxT)
    token_arrays = samples[0].tokens.nbytes + tokens_BxT.nbytes + padded.nbytes
    length = tokens_BxT.shape[1]
    capacity = forward.capacity_for(length)
    scratch = forward.compiled_temp_bytes(1, length, positions_BxP.shape[1])
    cache = cache_bytes_per_slot(config) * capacity
    estimate = cache + activation_bytes(config, inference.chunk_size, capacity)
    assert estimate >= cache + scratch + token_arrays
