"""Whole-model utilities: counting a model's parameters and carrying its weights to a
changed config."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bam_jax.model import Transformer


def count_params(model_or_params: nnx.Module | Any) -> int:
    """Number of scalars in all variables of a model (trainable or not), or in a pytree of
    arrays such as a training state's parameter dicts (abstract shapes count too)."""
    if isinstance(model_or_params, nnx.Module):
        model_or_params = nnx.state(model_or_params)
    return int(sum(x.size for x in jax.tree.leaves(model_or_params)))


def reconfigure(model: Transformer, **changes: Any) -> Transformer:
    """The same weights under a changed config, e.g. `scan_layers`, `remat`, `dtype`,
    `attention_impl`, `local_window`: anything that keeps the set of parameters.

    Switching `scan_layers` stacks the blocks' weights along a leading layer axis (or
    splits them back into a list of blocks).
    """
    config = model.config.replace(**changes)
    converted = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    weights = nnx.to_pure_dict(nnx.state(model))
    layers = weights.pop("layers")
    if model.config.scan_layers and not config.scan_layers:
        layers = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(config.n_layers)}
    elif config.scan_layers and not model.config.scan_layers:
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *(layers[i] for i in range(len(layers))))
    weights["layers"] = layers
    state = nnx.state(converted)
    try:
        nnx.replace_by_pure_dict(state, weights)
    except (KeyError, ValueError) as error:
        raise ValueError(f"config changes {sorted(changes)} change the parameter set") from error
    if not all(isinstance(x, jax.Array) for x in jax.tree.leaves(state)):
        raise ValueError(f"config changes {sorted(changes)} add parameters")
    nnx.update(converted, state)
    return converted
