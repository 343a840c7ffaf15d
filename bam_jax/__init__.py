"""bam_jax: the Bayesian Attention Mechanism in JAX/Flax.

Shape suffixes. Array names end in their shape, letters joined by "x"
(`query_BxTxHxD`); these letters mean the same thing in every module of the project:

    B  batch rows                      E  model (embedding) width
    T  query positions                 F  feed-forward hidden width
    S  key positions (cache capacity)  V  vocabulary size
    H  query heads                     L  layers
    K  key/value heads                 C  chunk length (chunked inference)
    G  query heads per key/value head  M  query block (tile rows)
    D  head dimension                  N  key block (tile columns)
    R  rotary frequencies (D / 2)      P  positions scored per row
    X  distances of a prior table      W  windows of a row
    A  micro-batches of a train step   I  tile batch, K (blockwise, per batch row)
    J  grouped tile rows, G * M (blockwise)

Digits are literal sizes (`log_n_Bx1xT`, `head_params_Hx8`).
"""

import importlib.metadata

from bam_jax.attention import dot_product_attention, reference_attention
from bam_jax.attention_inputs import AttentionInputs
from bam_jax.attention_spec import AttentionSpec
from bam_jax.config import ENCODINGS, Encoding, ModelConfig
from bam_jax.inference import decode_step, generate, init_cache, prefill
from bam_jax.kv_cache import KVCache
from bam_jax.layer_inputs import LayerFactors
from bam_jax.layers import PriorConstant, PriorParam, SSMaxParam
from bam_jax.masking import PADDING_SEGMENT
from bam_jax.model import Attention, Transformer, TransformerBlock, stacked_blocks
from bam_jax.model_state import count_params, reconfigure
from bam_jax.param_groups import optimizer_labels
from bam_jax.positional import alibi_prior, apply_rope, sinusoidal_embedding
from bam_jax.priors import (
    PRIOR_PRESETS,
    AlibiPrior,
    GGDPrior,
    alibi_slopes,
    ggd_bias,
    init_ggd_prior,
)
from bam_jax.reference_checkpoint import (
    export_reference_checkpoint,
    load_reference_checkpoint,
)

try:
    __version__ = importlib.metadata.version("bam-jax")
except importlib.metadata.PackageNotFoundError:  # a checkout that was never pip-installed
    __version__ = "0+unknown"

__all__ = [
    "ENCODINGS",
    "PADDING_SEGMENT",
    "PRIOR_PRESETS",
    "AlibiPrior",
    "Attention",
    "AttentionInputs",
    "AttentionSpec",
    "Encoding",
    "GGDPrior",
    "KVCache",
    "LayerFactors",
    "ModelConfig",
    "PriorConstant",
    "PriorParam",
    "SSMaxParam",
    "Transformer",
    "TransformerBlock",
    "alibi_prior",
    "alibi_slopes",
    "apply_rope",
    "count_params",
    "decode_step",
    "dot_product_attention",
    "export_reference_checkpoint",
    "generate",
    "ggd_bias",
    "init_cache",
    "init_ggd_prior",
    "load_reference_checkpoint",
    "optimizer_labels",
    "prefill",
    "reconfigure",
    "reference_attention",
    "sinusoidal_embedding",
    "stacked_blocks",
]
