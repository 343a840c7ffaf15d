"""What an attention call computes, fixed before it runs: the one description every
attention implementation receives.

An `AttentionSpec` holds the static choices (the mask's causality and window, where
SSMax scales the prior, the implementation and its tiles). It is frozen and hashable, so
it is a jit static argument, and it checks its fields when built, before anything
traces. The values that change from call to call or are learned (the prior, the SSMax
scale and count cap, segment ids, the query offset) travel beside it as
`AttentionInputs` (bam_jax/attention_inputs.py).
`ModelConfig.attention_spec(layer)` builds a model layer's spec.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bam_jax.implementation import canonical_implementation
from bam_jax.masking import AttentionMask, check_window


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static part of an attention call.

    causal: mask keys after the query.
    window: w keys back: with `causal`, each query sees the w keys before it and itself
        (w + 1 positions, at most; 0: itself only), as jax.nn.dot_product_attention's
        `local_window_size=(w, 0)`; without `causal`, also the w keys after it (its
        `(w, w)`). None: no window.
    ssmax_prior_inside: with SSMax, whether the prior is scaled with the content logits
        (True) or added after the scaling (False).
    implementation: "auto", "reference", "blockwise" or "fused" ("pallas", its earlier
        name, is stored as "fused"); `bam_jax.implementation.resolve_implementation`
        decides what "auto" runs.
    block_q, block_k: tile sizes of the blockwise and fused implementations (None: the
        implementation's default).
    """

    causal: bool = True
    window: int | None = None
    ssmax_prior_inside: bool = True
    implementation: str = "auto"
    block_q: int | None = None
    block_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("causal", "ssmax_prior_inside"):
            flag = getattr(self, name)
            if not isinstance(flag, (bool, np.bool_)):
                raise TypeError(f"{name} must be a bool, got {flag!r}")
        check_window(self.window)
        check_block_sizes(self.block_q, self.block_k)
        implementation = canonical_implementation(self.implementation)
        object.__setattr__(self, "implementation", implementation)

    def mask(self, kv_len: int) -> AttentionMask:
        """The mask over `kv_len` key slots."""
        return AttentionMask(bool(self.causal), self.window, kv_len)

    def replace(self, **changes) -> AttentionSpec:
        """A copy with `changes` applied (and checked)."""
        return dataclasses.replace(self, **changes)


def check_block_sizes(block_q: int | None, block_k: int | None) -> None:
    """Raises ValueError unless each tile size is None (the implementation's default) or a
    positive int."""
    for name, value in (("block_q", block_q), ("block_k", block_k)):
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise ValueError(f"{name} must be a positive int, got {value!r}")
