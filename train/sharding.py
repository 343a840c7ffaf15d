"""Device mesh (data, fsdp, tensor) and the table mapping the model's logical axis names to
mesh axes.

Batches are split over data x fsdp; parameters are split over fsdp along their "embed" axis
and over tensor along heads, MLP and vocabulary axes. An axis that does not divide the
dimension it would split is left out, so every preset runs on any mesh.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from bam_configs.training import MESH_AXES, MeshConfig

LogicalAxes = Sequence[str | None] | None

LOGICAL_AXIS_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", ("tensor",)),
    ("embed", ("fsdp",)),
    ("q_heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("mlp", ("tensor",)),
    ("norm", ()),
    ("layers", ()),
)


def make_mesh(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    sizes = cfg.resolve(len(devices))
    auto = (AxisType.Auto,) * len(MESH_AXES)
    if devices == list(jax.devices()):
        return jax.make_mesh(sizes, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(devices).reshape(sizes), MESH_AXES, axis_types=auto)


def logical_to_spec(
    names: LogicalAxes, shape: Sequence[int], mesh: Mesh, rules=LOGICAL_AXIS_RULES
) -> PartitionSpec:
    """PartitionSpec for an array with these logical axis names."""
    if names is None:
        return PartitionSpec()
    if len(names) != len(shape):
        raise ValueError(f"logical axes {tuple(names)} do not match shape {tuple(shape)}")
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for name, dim in zip(names, shape, strict=True):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = []
        for axis in table.get(name, ()) if name is not None else ():
            size = mesh.shape[axis]
            if (
                size > 1
                and axis not in used
                and dim % (math.prod(mesh.shape[a] for a in axes) * size) == 0
            ):
                axes.append(axis)
        used.update(axes)
        spec.append(tuple(axes) if len(axes) > 1 else (axes[0] if axes else None))
    return PartitionSpec(*spec)


def named_sharding(mesh: Mesh, names: LogicalAxes, shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(names, shape, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are [accum_steps, batch, seq_len], split over the batch axis."""
    return NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def local_rows(sharding: NamedSharding, global_shape: Sequence[int]) -> tuple[int, int]:
    """(first row, row count) of the batch axis (axis 1) this process holds."""
    index_map = sharding.addressable_devices_indices_map(tuple(global_shape))
    starts = [idx[1].start or 0 for idx in index_map.values()]
    stops = [global_shape[1] if idx[1].stop is None else idx[1].stop for idx in index_map.values()]
    lo, hi = min(starts), max(stops)
    covered = sorted({(s, e) for s, e in zip(starts, stops, strict=True)})
    if sum(e - s for s, e in covered) != hi - lo:
        raise ValueError(
            "mesh: this process's devices hold a non-contiguous part of the batch; "
            "reorder the mesh so each process owns one block of the data axis"
        )
    return lo, hi - lo
