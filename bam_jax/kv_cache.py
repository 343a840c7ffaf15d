"""The key/value cache of cached inference (written by `Transformer`, driven by
`bam_jax.inference`)."""

from __future__ import annotations

import flax.struct
import jax

from bam_jax.pytrees import export_serializable


@export_serializable
@flax.struct.dataclass
class KVCache:
    """Per-layer keys and values (tuples of L arrays [B, S, K, D]) and the filled length."""

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    length: jax.Array

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]
