"""Optimizer groups of a model's parameters: "decay" (weights of two or more dims),
"no_decay" (norm scales and other vectors), "prior" (the GGD prior's trainable parameters)
and "ssmax" (the SSMax scales), so different learning rates and no decay on priors take one
`optax.multi_transform`.

NNX (`nnx.Optimizer`)::

    labels = bam_jax.optimizer_labels(model)
    tx = optax.multi_transform(
        {"decay": optax.adamw(3e-3, weight_decay=0.1), "no_decay": optax.adam(3e-3),
         "prior": optax.adam(3e-2), "ssmax": optax.adam(1e-2)},
        labels,
    )
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

Linen: optimise `bam_jax.linen.trainable(variables)` (the weights, prior and SSMax
collections) with `param_labels=bam_jax.linen.linen_labels`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bam_jax.layers import PriorParam, SSMaxParam

GROUPS = ("decay", "no_decay", "prior", "ssmax")


def parameter_group(kind: type, ndim: int) -> str:
    """The optimizer group of a parameter of variable type `kind` with `ndim` dims."""
    if issubclass(kind, PriorParam):
        return "prior"
    if issubclass(kind, SSMaxParam):
        return "ssmax"
    return "decay" if ndim >= 2 else "no_decay"


def variable_group(variable: nnx.Variable) -> str:
    """The optimizer group of one parameter."""
    return parameter_group(type(variable), jnp.ndim(variable.get_value()))


def optimizer_labels(model: nnx.Module, wrt: Any = nnx.Param) -> Callable[[Any], Any]:
    """`param_labels` for `optax.multi_transform` over `nnx.state(model, wrt)`: a function
    of the parameter tree, whose leaves may be variables (as `nnx.Optimizer` initialises
    the optimizer) or plain arrays (as it updates), giving each leaf's group."""
    groups = {
        _parameter_path(path): variable_group(variable)
        for path, variable in jax.tree_util.tree_leaves_with_path(
            nnx.state(model, wrt), is_leaf=_is_variable
        )
    }

    def labels(params: Any) -> Any:
        return jax.tree_util.tree_map_with_path(
            lambda path, _: groups[_parameter_path(path)], params, is_leaf=_is_variable
        )

    return labels


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _parameter_path(path: tuple) -> str:
    """A leaf's path without the trailing `.value` of a variable leaf."""
    last = path[-1] if path else None
    if isinstance(last, jax.tree_util.GetAttrKey) and last.name == "value":
        path = path[:-1]
    return jax.tree_util.keystr(tuple(path))
