"""Registers bam_jax's pytree classes for `jax.export` serialisation, so a function that
takes or returns a prior, a KV cache or layer factors exports, serialises and reloads in a
process that has imported bam_jax. (`jax.export` serialisation itself needs the
`flatbuffers` package.)"""

from __future__ import annotations

import json
from typing import TypeVar

from jax import export

T = TypeVar("T", bound=type)


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
