"""Memory estimates of chunked evaluation, checked before anything compiles."""

from __future__ import annotations

import jax.numpy as jnp

from bam_jax.blockwise import DEFAULT_BLOCK
from bam_jax.config import ModelConfig

# The prompt's token ids on the host while its sample runs: the sample's, the batch's and
# the padded chunks' int32 arrays (4 bytes each), and room for the Python list the prompt
# is assembled in (8 bytes per id, freed before the batch is built).
HOST_BYTES_PER_TOKEN = 16


def format_bytes(n_bytes: float) -> str:
    for unit, scale in (("GB", 2**30), ("MB", 2**20)):
        if n_bytes >= scale / 10:
            return f"{n_bytes / scale:.2f} {unit}"
    return f"{n_bytes / 2**10:.2f} KB"


def check_sample_memory(
    what: str,
    capacity: int,
    cache_bytes_per_slot: int,
    activation_bytes: int,
    budget_bytes: int,
    advice: str,
) -> None:
    """Raises a ValueError, before any compile, when one sequence alone exceeds the budget."""
    cache_bytes = cache_bytes_per_slot * capacity
    needed = cache_bytes + activation_bytes
    if needed > budget_bytes:
        raise ValueError(
            f"{what}: one sample needs about {format_bytes(needed)} (KV cache of "
            f"{capacity} slots {format_bytes(cache_bytes)} + activations and token ids "
            f"{format_bytes(activation_bytes)}), more than the memory budget of "
            f"{format_bytes(budget_bytes)}; {advice}"
        )


def cache_bytes_per_slot(config: ModelConfig) -> int:
    """Bytes of KV cache per sequence position (keys and values of every layer)."""
    itemsize = jnp.dtype(config.dtype).itemsize
    return 2 * config.n_layers * config.kv_heads * config.head_dim * itemsize


def activation_bytes(config: ModelConfig, chunk_size: int, capacity: int) -> int:
    """A generous estimate of one sequence's memory besides its KV cache while a chunk
    runs: float32 hidden states, MLP and logits of the chunk, attention tiles and per-slot
    position terms, and the prompt's token ids on the host (`HOST_BYTES_PER_TOKEN`)."""
    per_token = (
        16 * config.dim
        + 4 * config.ffn_hidden_dim
        + config.vocab_size
        + 2 * config.n_heads * min(config.block_k or DEFAULT_BLOCK, capacity)
    )
    scratch = 4 * (chunk_size * per_token + config.n_heads * capacity)
    return scratch + HOST_BYTES_PER_TOKEN * capacity
