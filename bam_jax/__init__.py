"""bam_jax: the Bayesian Attention Mechanism in JAX/Flax."""

from bam_jax.attention import PADDING_SEGMENT, dot_product_attention, reference_attention
from bam_jax.priors import (
    PRIOR_PRESETS,
    AlibiPrior,
    GGDPrior,
    alibi_slopes,
    ggd_bias,
    init_ggd_prior,
)

__all__ = [
    "PADDING_SEGMENT",
    "PRIOR_PRESETS",
    "AlibiPrior",
    "GGDPrior",
    "alibi_slopes",
    "dot_product_attention",
    "ggd_bias",
    "init_ggd_prior",
    "reference_attention",
]
