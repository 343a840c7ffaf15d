"""The model's building blocks: its variable types, a bias-free linear layer with torch's
initialisation and logical sharding names, and RMSNorm.

Variable types: trainable prior parameters are `PriorParam`, SSMax scales `SSMaxParam`
(both `nnx.Param`), frozen ones `PriorConstant` (an `nnx.Variable`, so optimizers that
filter on `nnx.Param` skip them). Every variable carries logical axis names as
`out_sharding` metadata (not applied eagerly; a sharding table maps them to a mesh).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from bam_jax.config import ModelConfig

Axes = tuple[str | None, ...]


class PriorParam(nnx.Param):
    """A trainable parameter of a positional prior (never weight-decayed)."""


class SSMaxParam(nnx.Param):
    """A trainable Scalable-Softmax scale s_h (never weight-decayed)."""


class PriorConstant(nnx.Variable):
    """A frozen positional parameter (prior or SSMax scale): stored, not trained."""


# Collection names of these variables when the modules are used from Linen (nnx.bridge).
nnx.register_variable_name("prior_params", PriorParam, overwrite=True)
nnx.register_variable_name("ssmax_params", SSMaxParam, overwrite=True)
nnx.register_variable_name("prior_constants", PriorConstant, overwrite=True)


def torch_linear_init(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for an [in, out] kernel, torch.nn.Linear's default."""
    return jax.nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")(key, shape, dtype)


def annotated(init: Callable, axes: Axes) -> Callable:
    return nnx.with_metadata(init, out_sharding=axes, eager_sharding=False)


class Linear(nnx.Linear):
    """`nnx.Linear` applied to its input flattened to [rows, in].

    Same parameters and result; XLA's CPU backend runs a 2-D product and its gradient
    faster than the same product on a [B, T, in] input (docs/benchmarks.md measures it).
    """

    def __call__(self, inputs: jax.Array) -> jax.Array:
        rows = super().__call__(inputs.reshape(-1, inputs.shape[-1]))
        return rows.reshape(*inputs.shape[:-1], rows.shape[-1])


def linear_layer(
    in_dim: int,
    out_dim: int,
    axes: Axes,
    config: ModelConfig,
    rngs: nnx.Rngs,
    *,
    float32_result: bool = False,
) -> Linear:
    """A bias-free linear layer: float32 kernel, inputs and kernel cast to the compute dtype.

    float32_result: accumulate and return in float32 (layers that write to the residual
    stream, and the output layer); otherwise the result is in the compute dtype.
    """
    return Linear(
        in_dim,
        out_dim,
        use_bias=False,
        dtype=jnp.dtype(config.dtype),
        param_dtype=jnp.float32,
        preferred_element_type=jnp.float32 if float32_result else None,
        kernel_init=annotated(torch_linear_init, axes),
        rngs=rngs,
    )


def positional_variable(value: jax.Array, trainable: bool, param_type: type) -> nnx.Variable:
    variable_type = param_type if trainable else PriorConstant
    return variable_type(value, out_sharding=(None,), eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * weight, computed in float32, returned in `dtype` (the input of a matmul)."""

    def __init__(self, dim: int, eps: float, dtype: jnp.dtype):
        self.eps = eps
        self.dtype = dtype
        self.weight = nnx.Param(
            jnp.ones((dim,), jnp.float32), out_sharding=("norm",), eager_sharding=False
        )

    def __call__(self, x_BxTxE: jax.Array) -> jax.Array:
        x = x_BxTxE.astype(jnp.float32)
        normed = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return (normed * self.weight[...].astype(jnp.float32)).astype(self.dtype)
