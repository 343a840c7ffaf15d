"""Long-sequence forward passes through the KV cache, in fixed-size chunks.

Every sequence is padded at the end to a whole number of chunks; the cache capacity is
rounded up to a bucket (1, 2, 3, 4, 6, 8, 12, 16, ... chunks), so one compiled step serves
many sequence lengths. Padding at the end never changes earlier positions (causal mask).
Two jitted steps exist per (batch, chunk, capacity) shape:

- advance: runs a chunk and keeps only the cache; its logits are dead code that XLA drops,
  so chunks with nothing to score skip the output projection entirely;
- score: runs a chunk and returns the logits at a few requested positions only ([B, K, V];
  a model with `hidden_states` / `logits` projects only those positions), or the
  per-position next-token loss ([B, C]), never [T, vocab].

Memory is the cache (linear in length) plus one chunk's activations; with blockwise
attention no array grows with length squared. Blockwise attention also skips unfilled cache
slots, so a sweep may share one capacity (`min_capacity`) across all its lengths and
compile its steps once.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

CacheFactory = Callable[[int, int], Any]


def capacity_bucket(n_tokens: int, chunk_size: int) -> int:
    """Cache slots for ``n_tokens``: whole chunks, rounded up to 2**k or 1.5 * 2**k chunks."""
    if n_tokens < 1 or chunk_size < 1:
        raise ValueError(f"n_tokens and chunk_size must be >= 1, got {n_tokens}, {chunk_size}")
    chunks = math.ceil(n_tokens / chunk_size)
    power = 1 << (chunks - 1).bit_length()
    if chunks > 2 and chunks <= 3 * power // 4:
        power = 3 * power // 4
    return power * chunk_size


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
            f"{capacity} slots {format_bytes(cache_bytes)} + activations "
            f"{format_bytes(activation_bytes)}), more than the memory budget of "
            f"{format_bytes(budget_bytes)}; {advice}"
        )


@dataclasses.dataclass
class ChunkStats:
    """What a scorer has run, for progress reports and the reuse checks in tests."""

    sequences: int = 0
    chunks: int = 0
    tokens: int = 0


class ChunkedScorer:
    """Scores long sequences with a cached model, one chunk per jitted call.

    ``model(tokens_BxC, cache=cache) -> (logits_BxCxV, cache)`` is the cached forward;
    ``init_cache(batch, capacity)`` makes an empty cache for it.
    """

    def __init__(self, model: nnx.Module, init_cache: CacheFactory, *, chunk_size: int = 512):
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.chunk_size = chunk_size
        self.init_cache = init_cache
        self.min_capacity = 0
        self.stats = ChunkStats()
        graphdef, self.state = nnx.split(model)

        def advance(state, cache, tokens_BxC):
            _, cache = nnx.merge(graphdef, state)(tokens_BxC, cache=cache)
            return cache

        def gather(state, cache, tokens_BxC, positions_BxK):
            model = nnx.merge(graphdef, state)
            index_BxKx1 = jnp.clip(positions_BxK, 0, tokens_BxC.shape[1] - 1)[..., None]
            if hasattr(model, "hidden_states"):  # project only the scored positions
                hidden_BxCxD, cache = model.hidden_states(tokens_BxC, cache=cache)
                picked_BxKxD = jnp.take_along_axis(hidden_BxCxD, index_BxKx1, axis=1)
                return cache, model.logits(picked_BxKxD).astype(jnp.float32)
            logits_BxCxV, cache = model(tokens_BxC, cache=cache)
            picked_BxKxV = jnp.take_along_axis(logits_BxCxV, index_BxKx1, axis=1)
            return cache, picked_BxKxV.astype(jnp.float32)

        def next_token_loss(state, cache, tokens_BxC, targets_BxC):
            logits_BxCxV, cache = nnx.merge(graphdef, state)(tokens_BxC, cache=cache)
            logp_BxCxV = jax.nn.log_softmax(logits_BxCxV.astype(jnp.float32), axis=-1)
            picked_BxC = jnp.take_along_axis(logp_BxCxV, targets_BxC[..., None], axis=-1)
            return cache, -picked_BxC[..., 0]

        self._advance = jax.jit(advance, donate_argnums=1)
        self._gather = jax.jit(gather, donate_argnums=1)
        self._loss = jax.jit(next_token_loss, donate_argnums=1)

    def capacity_for(self, n_tokens: int) -> int:
        """Cache slots used for a sequence of ``n_tokens``."""
        return max(capacity_bucket(n_tokens, self.chunk_size), self.min_capacity)

    def _chunks(self, tokens_BxT: np.ndarray) -> tuple[np.ndarray, Any]:
        tokens_BxT = np.asarray(tokens_BxT, np.int32)
        if tokens_BxT.ndim != 2 or tokens_BxT.shape[1] < 1:
            raise ValueError(f"tokens_BxT must be [batch, length >= 1], got {tokens_BxT.shape}")
        batch, length = tokens_BxT.shape
        capacity = self.capacity_for(length)
        n_chunks = math.ceil(length / self.chunk_size)
        padded = np.zeros((batch, n_chunks * self.chunk_size), np.int32)
        padded[:, :length] = tokens_BxT
        self.stats.sequences += batch
        self.stats.tokens += batch * length
        self.stats.chunks += n_chunks
        chunks = padded.reshape(batch, n_chunks, self.chunk_size).transpose(1, 0, 2)
        return chunks, self.init_cache(batch, capacity)

    def logits_at(self, tokens_BxT: np.ndarray, positions_BxK: np.ndarray) -> np.ndarray:
        """Logits float32 [B, K, V] at the given positions of each row (right-padded rows)."""
        positions_BxK = np.asarray(positions_BxK, np.int32)
        if positions_BxK.ndim != 2 or positions_BxK.shape[0] != np.shape(tokens_BxT)[0]:
            raise ValueError(f"positions_BxK must be [batch, K], got {positions_BxK.shape}")
        if positions_BxK.min() < 0 or positions_BxK.max() >= np.shape(tokens_BxT)[1]:
            raise ValueError("positions_BxK must lie inside the sequences")
        chunks, cache = self._chunks(tokens_BxT)
        wanted_chunks = set((positions_BxK // self.chunk_size).ravel().tolist())
        out_BxKxV = None
        for i, chunk_BxC in enumerate(chunks):
            if i not in wanted_chunks:
                cache = self._advance(self.state, cache, chunk_BxC)
                continue
            local_BxK = positions_BxK - i * self.chunk_size
            cache, picked_BxKxV = self._gather(self.state, cache, chunk_BxC, local_BxK)
            picked_BxKxV = np.asarray(picked_BxKxV)
            if out_BxKxV is None:
                out_BxKxV = np.zeros_like(picked_BxKxV)
            inside_BxK = (local_BxK >= 0) & (local_BxK < self.chunk_size)
            out_BxKxV[inside_BxK] = picked_BxKxV[inside_BxK]
        assert out_BxKxV is not None
        return out_BxKxV

    def next_token_loss(self, tokens_BxT: np.ndarray) -> np.ndarray:
        """Loss float32 [B, T - 1] of predicting token t + 1 from tokens 0..t."""
        tokens_BxT = np.asarray(tokens_BxT, np.int32)
        chunks, cache = self._chunks(tokens_BxT)
        targets = np.zeros((tokens_BxT.shape[0], chunks.shape[0] * self.chunk_size), np.int32)
        targets[:, : tokens_BxT.shape[1] - 1] = tokens_BxT[:, 1:]
        targets = targets.reshape(tokens_BxT.shape[0], -1, self.chunk_size).transpose(1, 0, 2)
        losses = []
        for chunk_BxC, target_BxC in zip(chunks, targets, strict=True):
            cache, loss_BxC = self._loss(self.state, cache, chunk_BxC, target_BxC)
            losses.append(np.asarray(loss_BxC))
        return np.concatenate(losses, axis=1)[:, : tokens_BxT.shape[1] - 1]

    def compiled_temp_bytes(self, batch: int, n_tokens: int) -> int:
        """Scratch memory XLA plans for one advance step at this length's capacity."""
        capacity = self.capacity_for(n_tokens)
        cache = jax.eval_shape(lambda: self.init_cache(batch, capacity))
        tokens = jax.ShapeDtypeStruct((batch, self.chunk_size), jnp.int32)
        compiled = self._advance.lower(self.state, cache, tokens).compile()
        return int(compiled.memory_analysis().temp_size_in_bytes)
