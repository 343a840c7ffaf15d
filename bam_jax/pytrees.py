"""Registers bam_jax's pytree classes for `jax.export` serialisation, so a function that
takes or returns a prior, a KV cache or layer factors exports, serialises and reloads in a
process that has imported bam_jax. (`jax.export` serialisation itself needs the
`flatbuffers` package.) Also: `vary_together` and `varying_results`, for code that runs
inside `jax.shard_map`."""

from __future__ import annotations

import inspect
import json
from typing import Any, TypeVar

import jax
from jax import export, lax

T = TypeVar("T", bound=type)
PyTree = Any


def export_serializable(cls: T) -> T:
    """Class decorator, under `flax.struct.dataclass`: the class's static fields (its pytree
    auxiliary data) are written as JSON under the name bam_jax.CLASS."""
    export.register_pytree_node_serialization(
        cls,
        serialized_name=f"bam_jax.{cls.__name__}",
        serialize_auxdata=_to_json,
        deserialize_auxdata=_from_json,
    )
    return cls


def _to_json(auxdata: tuple) -> bytes:
    return json.dumps(list(auxdata)).encode()


def _from_json(data: bytes) -> tuple:
    return tuple(json.loads(data.decode()))


def vary_together(tree: PyTree, *references: PyTree) -> PyTree:
    """`tree` with every array leaf varying over each mesh axis that a leaf of `tree` or of
    `references` varies over.

    Inside `jax.shard_map` (with its default `check_vma=True`) a loop's carry must vary
    over the same mesh axes on entry as after the body has mixed in the sharded inputs,
    and a custom VJP's cotangents over the same axes as its inputs; casting the inputs and
    initial carries to their union settles both (transposed, the cast sums a gradient over
    the axes its input did not vary over). Outside `shard_map` nothing varies and `tree`
    is returned as it is."""
    arrays = [x for x in jax.tree.leaves((tree, references)) if isinstance(x, jax.Array)]
    axes = frozenset().union(*(_varying_axes(x) for x in arrays))
    if not axes:
        return tree

    def cast(x):
        if not isinstance(x, jax.Array):
            return x
        missing = tuple(sorted(axes - _varying_axes(x), key=str))
        return _cast_to_varying(x, missing) if missing else x

    return jax.tree.map(cast, tree)


def _varying_axes(x: jax.Array) -> frozenset:
    aval = jax.typeof(x)
    manual = getattr(aval, "mat", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def _cast_to_varying(x: jax.Array, axes: tuple) -> jax.Array:
    if hasattr(lax, "pcast"):
        return lax.pcast(x, axes, to="varying")
    return lax.pvary(x, axes)


# A result shape's field that says how it varies over mesh axes, and the aval attribute it
# is read from: its name in recent jax, then in earlier jax.
_VARYING_FIELDS = {"manual_axis_type": "mat", "vma": "vma"}


def varying_results(
    shapes: list[jax.ShapeDtypeStruct], inputs: PyTree
) -> list[jax.ShapeDtypeStruct]:
    """A Pallas kernel's result shapes, typed to vary over every mesh axis that an input
    varies over. Inside `jax.shard_map` (with its default `check_vma=True`) `pallas_call`
    refuses results that do not say how they vary, and each device computes its own;
    outside it nothing varies."""
    arrays = [x for x in jax.tree.leaves(inputs) if isinstance(x, jax.Array)]
    if not arrays:
        return shapes
    union = jax.typeof(vary_together(arrays[0], arrays))
    accepted = inspect.signature(jax.ShapeDtypeStruct).parameters
    for field, attribute in _VARYING_FIELDS.items():
        if field in accepted and hasattr(union, attribute):
            varying = {field: getattr(union, attribute)}
            return [jax.ShapeDtypeStruct(s.shape, s.dtype, **varying) for s in shapes]
    return shapes
