"""Which keys each query may attend to: the one mask description every attention path uses.

Key slot s sits at position s; query t sits at `query_offset + t`. A query at position q
may see the key at position s when

- s < kv_len (tiles padded past the last key see nothing there);
- causal: s <= q;
- window w: q - w <= s, and without causality also s <= q + w (a causal window of w sees
  the w keys before the query and the query itself, w + 1 keys: jax's
  `local_window_size=(w, 0)`; a window of 0 sees the query's own key only);
- segment ids are given: the key has the query's id, and that id is not negative
  (negative ids mark padding, never attended to and never counted by SSMax).

The same description serves whole arrays (reference attention), tiles with traced block
offsets (blockwise attention and the Pallas kernels), the SSMax key counts and the block
ranges (which key blocks a query block visits, which query blocks see a key block).
Block arithmetic uses `lax.div` on non-negative positions so that it lowers inside the
Triton and Mosaic kernels too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

PADDING_SEGMENT = -1


def check_window(window: object) -> None:
    """Raises ValueError unless window is None or an int >= 0."""
    if window is not None and (
        not isinstance(window, int) or isinstance(window, bool) or window < 0
    ):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")


@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Causality, sliding window and number of real keys (hashable: a static argument)."""

    causal: bool
    window: int | None
    kv_len: int

    def visible(
        self,
        query_positions: jax.Array,
        key_positions: jax.Array,
        query_segment_ids: jax.Array | None = None,
        key_segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Boolean, the broadcast shape of the operands: may the query see the key.

        Pass the operands shaped to broadcast against each other (queries along one
        axis, keys along another); segment ids go with their positions' axes.
        """
        behind = query_positions - key_positions  # how far the key lies behind the query
        mask = key_positions < self.kv_len
        if self.causal:
            mask = mask & (behind >= 0)
        if self.window is not None:
            mask = mask & (behind <= self.window)
            if not self.causal:
                mask = mask & (behind >= -self.window)
        if query_segment_ids is not None:
            same_segment = query_segment_ids == key_segment_ids
            mask = mask & same_segment & (key_segment_ids >= 0)
        shape = jnp.broadcast_shapes(jnp.shape(query_positions), jnp.shape(key_positions))
        return jnp.broadcast_to(mask, jnp.broadcast_shapes(shape, mask.shape))

    def key_span(self, first_query: jax.Array, last_query: jax.Array):
        """[first, last] key positions that queries at first_query .. last_query may see
        (empty when last < first)."""
        first = jnp.zeros_like(first_query)
        if self.window is not None:
            first = jnp.maximum(first, first_query - self.window)
        if self.causal:
            last = last_query
        elif self.window is not None:
            last = last_query + self.window
        else:
            last = jnp.full_like(last_query, self.kv_len - 1)
        return first, jnp.minimum(last, self.kv_len - 1)

    def key_blocks(self, first_query: jax.Array, block_q: int, block_k: int):
        """[start, stop) key blocks a query block whose first query sits at first_query
        must visit; start <= stop <= the number of key blocks."""
        first, last = self.key_span(first_query, first_query + (block_q - 1))
        stop = lax.div(last, jnp.int32(block_k)) + 1
        start = jnp.minimum(lax.div(first, jnp.int32(block_k)), stop)
        return start, stop

    def full_key_blocks_stop(
        self, first_query: jax.Array, block_k: int, start, stop, has_segments: bool
    ) -> jax.Array:
        """End of the leading key blocks in [start, stop) that every query of the block
        sees: all their keys are real and in the past. Documents and windows mask every
        block."""
        if has_segments or self.window is not None:
            return start
        full = jnp.int32(self.kv_len // block_k)
        if self.causal:
            full = jnp.minimum(full, lax.div(first_query + 1, jnp.int32(block_k)))
        return jnp.clip(full, start, stop)

    def query_blocks(
        self, first_key: jax.Array, block_k: int, query_offset, block_q: int, num_q_blocks: int
    ):
        """[start, stop) query blocks with a query that may see a key of the key block
        starting at first_key."""
        start = jnp.int32(0)
        if self.causal:
            start = (first_key - query_offset) // block_q
        elif self.window is not None:
            start = (first_key - self.window - query_offset) // block_q
        start = jnp.clip(start, 0, num_q_blocks)
        stop = jnp.int32(num_q_blocks)
        if self.window is not None:
            last_query = first_key + block_k - 1 + self.window
            stop = jnp.clip((last_query - query_offset) // block_q + 1, start, stop)
        return start, stop

    def visible_counts(
        self,
        q_len: int,
        query_offset: int | jax.Array,
        query_segment_ids_BxT: jax.Array | None,
        key_segment_ids_BxS: jax.Array | None,
    ) -> jax.Array:
        """int32 [B or 1, T]: how many keys each query may see (SSMax's n_i), without a
        T x S mask.

        Keys of the query's document are located by a stable sort of the key segment ids
        and a binary search, so arbitrary (even non-contiguous) segment ids are counted
        exactly.
        """
        positions_T = jnp.arange(q_len, dtype=jnp.int32) + jnp.asarray(query_offset, jnp.int32)
        first_T, last_T = self.key_span(positions_T, positions_T)
        if query_segment_ids_BxT is None:
            return jnp.maximum(last_T - first_T + 1, 0)[None]
        count_le = jax.vmap(_segment_count_le)
        last_BxT = jnp.broadcast_to(last_T, query_segment_ids_BxT.shape)
        first_BxT = jnp.broadcast_to(first_T, query_segment_ids_BxT.shape)
        counts_BxT = count_le(key_segment_ids_BxS, query_segment_ids_BxT, last_BxT) - count_le(
            key_segment_ids_BxS, query_segment_ids_BxT, first_BxT - 1
        )
        counts_BxT = jnp.where(last_BxT >= first_BxT, counts_BxT, 0)
        return jnp.where(query_segment_ids_BxT >= 0, counts_BxT, 0).astype(jnp.int32)


def _segment_count_le(k_seg_S: jax.Array, q_seg_T: jax.Array, limit_T: jax.Array) -> jax.Array:
    """Number of keys at positions <= limit_T whose segment id equals q_seg_T."""
    kv_len = k_seg_S.shape[0]
    order_S = jnp.argsort(k_seg_S, stable=True).astype(jnp.int32)
    sorted_seg_S = k_seg_S[order_S]
    # jnp.searchsorted needs a known length; a symbolic one (`jax.export`) is searched here.
    known = isinstance(kv_len, int)
    search = jnp.searchsorted if known else _search_sorted
    start_T = search(sorted_seg_S, q_seg_T, side="left").astype(jnp.int32)
    end_T = search(sorted_seg_S, q_seg_T, side="right").astype(jnp.int32)

    def step(_, bounds):
        low, high = bounds
        active = low < high
        mid = (low + high) // 2
        go_right = order_S[jnp.clip(mid, 0, kv_len - 1)] <= limit_T
        low = jnp.where(active & go_right, mid + 1, low)
        high = jnp.where(active & ~go_right, mid, high)
        return low, high

    steps = _search_steps(kv_len)
    low, _ = lax.fori_loop(0, steps, step, (start_T, end_T))
    return low - start_T


def _search_steps(length) -> int:
    """Halvings a binary search over `length` entries needs; for a symbolic length
    (`jax.export`), those of the longest int32-indexed array."""
    return max(1, math.ceil(math.log2(length + 1))) if isinstance(length, int) else 32


def _search_sorted(sorted_S: jax.Array, values_T: jax.Array, side: str) -> jax.Array:
    """`jnp.searchsorted(sorted_S, values_T, side=side)` for an array of any length, a
    symbolic one included, by a binary search of fixed steps."""
    size = sorted_S.shape[0]
    low_T = jnp.zeros(values_T.shape, jnp.int32)
    high_T = jnp.full(values_T.shape, size, jnp.int32)

    def step(_, bounds):
        low, high = bounds
        mid = (low + high) // 2
        entry = sorted_S[jnp.clip(mid, 0, size - 1)]
        go_right = (entry < values_T) if side == "left" else (entry <= values_T)
        active = low < high
        return jnp.where(active & go_right, mid + 1, low), jnp.where(active & ~go_right, mid, high)

    return lax.fori_loop(0, _search_steps(size), step, (low_T, high_T))[0]


def log_visible_count(
    visible_count: jax.Array, max_count: int | jax.Array | None = None
) -> jax.Array:
    """log(max(n_i, 1)) in float32: SSMax's length term (0 for rows with no visible key),
    with n_i capped at `max_count` when one is given."""
    count = jnp.maximum(visible_count, 1)
    if max_count is not None:
        count = jnp.minimum(count, max_count)
    return jnp.log(count.astype(jnp.float32))


def visibility_mask(
    mask: AttentionMask,
    query_positions_T: jax.Array,
    key_positions_S: jax.Array,
    query_segment_ids_BxT: jax.Array | None,
    key_segment_ids_BxS: jax.Array | None,
) -> jax.Array:
    """Boolean [B or 1, T, S]: may query t attend to key s."""
    if query_segment_ids_BxT is None:
        return mask.visible(query_positions_T[None, :, None], key_positions_S[None, None, :])
    return mask.visible(
        query_positions_T[None, :, None],
        key_positions_S[None, None, :],
        query_segment_ids_BxT[:, :, None],
        key_segment_ids_BxS[:, None, :],
    )


def window_keys(
    key_BxSxKxD: jax.Array,
    value_BxSxKxD: jax.Array,
    key_segment_ids_BxS: jax.Array | None,
    query_offset: int | jax.Array,
    *,
    q_len: int,
    causal: bool,
    window: int | None,
    block_k: int,
) -> tuple[jax.Array, jax.Array, jax.Array | None, int | jax.Array]:
    """The keys, values, key segment ids and query offset of attention restricted to the
    key slots a causal `window` lets T = `q_len` queries from `query_offset` see.

    The cut starts at a multiple of `block_k` (at or before the first visible slot) and
    holds a whole number of blocks, so key blocks of `block_k` slots cover the same slots
    as in the full arrays: the attention is the same function, its tiles the same. Without
    a causal window, or when the cut would not be shorter than S, the inputs come back
    as they are. The cut lies inside [0, S), so every slot it holds is a real key.
    """
    kv_len = key_BxSxKxD.shape[1]
    unchanged = key_BxSxKxD, value_BxSxKxD, key_segment_ids_BxS, query_offset
    if window is None or not causal or not all_known(kv_len, q_len):
        return unchanged
    length = round_up_to(window + q_len + block_k - 1, block_k)
    if length >= kv_len:
        return unchanged
    offset = jnp.asarray(query_offset, jnp.int32)
    first = jnp.maximum(offset - window, 0) // block_k * block_k
    start = jnp.minimum(first, kv_len - length)
    cut = functools.partial(lax.dynamic_slice_in_dim, start_index=start, slice_size=length, axis=1)
    segments = None if key_segment_ids_BxS is None else cut(key_segment_ids_BxS)
    return cut(key_BxSxKxD), cut(value_BxSxKxD), segments, offset - start


def round_up_to(n: int, multiple: int) -> int:
    """n rounded up to a multiple; written so that for a symbolic n >= 1 (`jax.export`)
    jax can tell the result holds at least one multiple."""
    return (n + multiple - 1) // multiple * multiple


def all_known(*sizes) -> bool:
    """Whether every size is a number (not a symbolic dimension of `jax.export`)."""
    return all(isinstance(size, int) for size in sizes)
