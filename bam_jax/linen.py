"""Using the NNX modules from Flax Linen, through `flax.nnx.bridge`.

`bridge.to_linen(Attention, config)` (or `Transformer`) is an ordinary Linen submodule.
Its variables land in Linen collections by type: weights in "params", trainable prior
parameters in "prior_params", SSMax scales in "ssmax_params", frozen prior parameters in
"prior_constants". Optimise `trainable(variables)`, not `variables["params"]` alone, or the
prior and the SSMax scales never move; `linen_labels` gives each leaf its optimizer group
(`bam_jax.param_groups`), so the prior can learn at its own rate without weight decay.

Weights move both ways: `load_linen_variables` copies a Linen variables dict into an NNX
module, `linen_variables` gives an NNX module's variables as the Linen module expects them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from flax.nnx import bridge, variablelib

from bam_jax.attention_spec import AttentionSpec
from bam_jax.config import ModelConfig
from bam_jax.layers import PriorParam, SSMaxParam
from bam_jax.model import Attention, Transformer
from bam_jax.param_groups import parameter_group

COLLECTIONS = ("params", "prior_params", "ssmax_params", "prior_constants")
# The collections an optimizer trains, with the variable type each holds.
TRAINABLE_COLLECTIONS = {
    "params": nnx.Param,
    "prior_params": PriorParam,
    "ssmax_params": SSMaxParam,
}


def linen_attention(
    config: ModelConfig,
    *,
    spec: AttentionSpec | None = None,
    layer: int = 0,
    name: str | None = None,
) -> nn.Module:
    """The attention module as a Linen module: `__call__(x_BxTxE, segment_ids_BxT=None)`,
    and `(x_BxTxE, kv=(keys, values), cache_length=n)` for cached decoding, as `Attention`.

    `spec` is the layer's `AttentionSpec` (None: `config.attention_spec(layer)`), so a
    layer can be local, bidirectional or use another implementation. One attention layer
    owns its prior, so a BAM config must have `global_prior=False` (a global prior belongs
    to the Transformer, which passes it to every layer).
    """
    if config.shared_prior:
        raise ValueError(
            "linen_attention: a single attention layer needs its own prior; build it from "
            "config.replace(global_prior=False), or use linen_transformer for a model whose "
            "layers share one prior"
        )
    return bridge.to_linen(Attention, config, layer=layer, spec=spec, name=name)


def linen_transformer(config: ModelConfig, *, name: str | None = None) -> nn.Module:
    """The whole model as a Linen module: `__call__(tokens_BxT, segment_ids_BxT=None)`."""
    return bridge.to_linen(Transformer, config, name=name)


def load_linen_variables(module: nnx.Module, variables: Mapping[str, Any]) -> nnx.Module:
    """Copies the variables of a bridged module (one Linen scope, all collections) into the
    NNX module of the same structure, in place; returns it."""
    flat: dict[tuple, Any] = {}
    for collection in COLLECTIONS:
        if collection in variables:
            flat.update(traverse_util.flatten_dict(nn.meta.unbox(dict(variables[collection]))))
    merged = traverse_util.unflatten_dict(flat)
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, merged)
    nnx.update(module, state)
    return module


def linen_variables(module: nnx.Module) -> dict[str, dict[str, Any]]:
    """The variables of an NNX module as the bridged Linen module of the same config takes
    them in `apply`: one dict per collection (see COLLECTIONS)."""
    flat = {
        (variablelib.variable_name_from_type(variable.type), *path): variable.get_value()
        for path, variable in nnx.to_flat_state(nnx.state(module))
    }
    return traverse_util.unflatten_dict(flat)


def trainable(variables: Mapping[str, Any]) -> dict[str, Any]:
    """The collections an optimizer trains: weights, prior parameters and SSMax scales (the
    frozen "prior_constants" and any collection of the user's own stay out)."""
    return {name: variables[name] for name in TRAINABLE_COLLECTIONS if name in variables}


def linen_labels(params: Mapping[str, Any]) -> dict[str, Any]:
    """`param_labels` for `optax.multi_transform` over `trainable(variables)`: "prior" and
    "ssmax" by collection, and "decay" or "no_decay" for the weights by their dims."""
    return {
        name: jax.tree.map(
            lambda leaf, kind=TRAINABLE_COLLECTIONS[name]: parameter_group(kind, jnp.ndim(leaf)),
            tree,
        )
        for name, tree in params.items()
    }
