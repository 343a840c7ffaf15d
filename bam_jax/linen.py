"""Using the NNX modules from Flax Linen, through `flax.nnx.bridge`.

`bridge.to_linen(Attention, config)` (or `Transformer`) is an ordinary Linen submodule.
Its variables land in Linen collections by type: weights in "params", trainable prior
parameters in "prior_params", SSMax scales in "ssmax_params", frozen prior parameters in
"prior_constants" (so an optimizer can treat each group on its own).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
from flax import nnx
from flax.nnx import bridge

from bam_jax.config import ModelConfig
from bam_jax.model import Attention, Transformer

COLLECTIONS = ("params", "prior_params", "ssmax_params", "prior_constants")


def linen_attention(config: ModelConfig, *, name: str | None = None) -> nn.Module:
    """The attention module as a Linen module: `__call__(x_BxTxD, segment_ids_BxT=None)`."""
    return bridge.to_linen(Attention, config, name=name)


def linen_transformer(config: ModelConfig, *, name: str | None = None) -> nn.Module:
    """The whole model as a Linen module: `__call__(tokens_BxT, segment_ids_BxT=None)`."""
    return bridge.to_linen(Transformer, config, name=name)


def load_linen_variables(module: nnx.Module, variables: Mapping[str, Any]) -> nnx.Module:
    """Copies the variables of a bridged module (one Linen scope, all collections) into the
    NNX module of the same structure, in place; returns it."""
    merged: dict[str, Any] = {}
    for collection in COLLECTIONS:
        if collection in variables:
            _merge_into(merged, nn.meta.unbox(dict(variables[collection])))
    state = nnx.state(module)
    nnx.replace_by_pure_dict(state, merged)
    nnx.update(module, state)
    return module


def _merge_into(target: dict[str, Any], source: Mapping[str, Any]) -> None:
    for key, value in source.items():
        if isinstance(value, Mapping):
            _merge_into(target.setdefault(key, {}), value)
        else:
            target[key] = value
