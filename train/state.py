"""The training state as plain pytrees, and the bridge to and from the NNX model.

Parameters live in the state as nested dicts of arrays (what the checkpoints hold); the
model is rebuilt from them inside the compiled step with `nnx.merge`, which costs nothing
after tracing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding

from bam_jax.config import ModelConfig
from bam_jax.io.checkpoints import key_path_names
from bam_jax.model import Transformer
from bam_jax.param_groups import variable_group
from bam_train.sharding import named_sharding, replicated

PyTree = Any


@struct.dataclass
class TrainState:
    step: jax.Array
    params: PyTree
    consts: PyTree
    opt_state: PyTree


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class ModelParts:
    """What is needed to turn parameter dicts back into a Transformer."""

    graphdef: Any
    params_treedef: Any
    consts_treedef: Any
    labels: PyTree
    logical_params: PyTree
    logical_consts: PyTree

    @classmethod
    def from_config(cls, config: ModelConfig) -> tuple[ModelParts, PyTree, PyTree]:
        """Parts plus abstract (shape-only) parameter and constant dicts."""
        abstract = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
        graphdef, params, consts = nnx.split(abstract, nnx.Param, ...)

        def per_variable(state, fn):
            variables = jax.tree.leaves(state, is_leaf=_is_variable)
            return jax.tree.unflatten(
                jax.tree.structure(nnx.to_pure_dict(state)), [fn(v) for v in variables]
            )

        def logical(v: nnx.Variable) -> tuple | None:
            names = v.get_metadata().get("out_sharding")
            return tuple(names) if names is not None else None

        _check_leaf_order(params)
        _check_leaf_order(consts)
        parts = cls(
            graphdef=graphdef,
            params_treedef=jax.tree.structure(params),
            consts_treedef=jax.tree.structure(consts),
            labels=per_variable(params, variable_group),
            logical_params=per_variable(params, logical),
            logical_consts=per_variable(consts, logical),
        )
        return parts, nnx.to_pure_dict(params), nnx.to_pure_dict(consts)

    def merge(self, params: PyTree, consts: PyTree) -> Transformer:
        p = jax.tree.unflatten(self.params_treedef, jax.tree.leaves(params))
        c = jax.tree.unflatten(self.consts_treedef, jax.tree.leaves(consts))
        return nnx.merge(self.graphdef, p, c)

    def split(self, model: Transformer) -> tuple[PyTree, PyTree]:
        _, params, consts = nnx.split(model, nnx.Param, ...)
        return nnx.to_pure_dict(params), nnx.to_pure_dict(consts)


def _check_leaf_order(state: nnx.State) -> None:
    """`merge` pairs dict leaves with State leaves by position: both orders must agree."""
    pure_paths = [
        key_path_names(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]
    ]
    state_paths = [key_path_names(p) for p, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    if len(pure_paths) != len(state_paths) or any(
        s[: len(p)] != p for p, s in zip(pure_paths, state_paths, strict=False)
    ):
        raise RuntimeError("parameter dict and nnx.State flatten in different orders")


def _shardings(mesh: Mesh, logical: PyTree, abstract: PyTree) -> PyTree:
    return jax.tree.map(
        lambda names, x: named_sharding(mesh, names, x.shape),
        logical,
        abstract,
        is_leaf=lambda n: n is None or isinstance(n, tuple),
    )


def state_shardings(
    parts: ModelParts, abstract_state: TrainState, tx: optax.GradientTransformation, mesh: Mesh
) -> TrainState:
    """Sharding of every leaf: optimizer moments follow their parameter."""
    params = _shardings(mesh, parts.logical_params, abstract_state.params)
    consts = _shardings(mesh, parts.logical_consts, abstract_state.consts)
    by_path = {
        key_path_names(path): (sharding, x.shape)
        for (path, sharding), x in zip(
            jax.tree_util.tree_flatten_with_path(params)[0],
            jax.tree.leaves(abstract_state.params),
            strict=True,
        )
    }

    def follow_param(path, x) -> NamedSharding:
        names = key_path_names(path)
        for i in range(len(names)):
            sharding, shape = by_path.get(names[i:], (None, None))
            if sharding is not None and shape == x.shape:
                return sharding
        return replicated(mesh)

    opt_state = jax.tree_util.tree_map_with_path(follow_param, abstract_state.opt_state)
    return TrainState(step=replicated(mesh), params=params, consts=consts, opt_state=opt_state)


def init_state(
    config: ModelConfig, parts: ModelParts, tx: optax.GradientTransformation, seed: int | jax.Array
) -> TrainState:
    """A fresh state (call under jit with out_shardings to create it sharded); `seed` may be
    traced, so one compiled init serves every seed."""
    params, consts = parts.split(Transformer(config, rngs=nnx.Rngs(jax.random.key(seed))))
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, consts=consts, opt_state=tx.init(params)
    )
