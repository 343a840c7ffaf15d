"""What each attention layer receives besides its activations: the factors training draws
per layer (`LayerFactors`) and a layer's finished inputs (`LayerInputs`)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax

from bam_jax.priors import Prior
from bam_jax.pytrees import export_serializable


@export_serializable
@flax.struct.dataclass
class LayerFactors:
    """Per-layer factors that training draws to vary the attention it learns under (each
    [n_layers], or one layer's scalar inside the layer loop; None leaves that part as it is):
    `ssmax_scale_L` multiplies each layer's learned SSMax scale (`TrainConfig.ssmax_jitter`)
    and `prior_dilation_L` makes each layer see every distance that many times longer
    (`TrainConfig.prior_dilation`): the BAM prior evaluated at the longer distances, ALiBi's
    slopes multiplied, RoPE rotating as if every position were that many times larger. A
    sinusoidal model adds its position table once, before the first layer, so it takes the
    largest factor for every position and, with local layers, refuses factors. NoPE has no
    positions and refuses them. Evaluation uses none."""

    ssmax_scale_L: jax.Array | None = None
    prior_dilation_L: jax.Array | None = None


@export_serializable
@flax.struct.dataclass
class LayerInputs:
    """One attention layer's finished inputs, which the Transformer builds before its layer
    loop (`Attention.layer_inputs`; every leaf has a leading [n_layers] axis when the
    layers are scanned): the prior it adds (its own or the global one, dilated in
    training), its SSMax scale (jittered in training), the cap on SSMax's key count, and
    the factor RoPE multiplies the positions by (training's dilation)."""

    prior: Prior | None = None
    ssmax_scale_H: jax.Array | None = None
    ssmax_max_count: int | jax.Array | None = None
    position_scale: float | jax.Array | None = None


def layer_slice(factors: LayerFactors | None, layer: int) -> LayerFactors | None:
    """Layer `layer`'s scalars of per-layer factors."""
    return None if factors is None else jax.tree.map(lambda x_L: x_L[layer], factors)


def finished_inputs(
    block: Any,
    shared_prior: Prior | None,
    factors: LayerFactors | None,
    ssmax_max_count: int | jax.Array | None,
) -> LayerInputs:
    """A block's finished inputs (`Attention.layer_inputs`) from the shared prior and one
    layer's factors."""
    return block.attention.layer_inputs(
        shared_prior,
        ssmax_max_count=ssmax_max_count,
        ssmax_scale_factor=None if factors is None else factors.ssmax_scale_L,
        prior_dilation=None if factors is None else factors.prior_dilation_L,
    )
