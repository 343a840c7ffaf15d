"""Using the NNX modules from Flax Linen, through `flax.nnx.bridge`.

`bridge.to_linen(Attention, config)` (or `Transformer`) is an ordinary Linen submodule.
Its variables land in Linen collections by type: weights in "params", trainable prior
parameters in "prior_params", SSMax scales in "ssmax_params", frozen prior parameters in
"prior_constants" (so an optimizer can treat each group on its own).

Weights move both ways: `load_linen_variables` copies a Linen variables dict into an NNX
module, `linen_variables` gives an NNX module's variables as the Linen module expects them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax import nnx, traverse_util
from flax.nnx import bridge, variablelib

from bam_jax.config import ModelConfig
from bam_jax.model import Attention, Transformer

COLLECTIONS = ("params", "prior_params", "ssmax_params", "prior_constants")


def linen_attention(config: ModelConfig, *, name: str | None = None) -> nn.Module:
    """The attention module as a Linen module: `__call__(x_BxTxE, segment_ids_BxT=None)`.

    One attention layer owns its prior, so a BAM config must have `global_prior=False`
    (a global prior belongs to the Transformer, which passes it to every layer).
    """
    if config.shared_prior:
        raise ValueError(
            "linen_attention: a single attention layer needs its own prior; build it from "
            "config.replace(global_prior=False), or use linen_transformer for a model whose "
            "layers share one prior"
        )
    return bridge.to_linen(Attention, config, name=name)


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
