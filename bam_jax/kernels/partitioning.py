"""The fused kernels' partitioning rule: under a mesh each device computes its own shard.

A kernel computes every (batch row, kv head) on its own, and query head h reads kv head
h // groups, so a slice of the batch together with a slice of the kv heads and their groups
of query heads is a whole problem. Without a rule XLA gathers a custom call's (or a Pallas
call's) operands and every device computes everything. With this one
(`jax.experimental.custom_partitioning`, with a Shardy sharding rule and the GSPMD
callbacks), given the role of each operand's and result's dimensions:

- the dimensions with the role "batch" are sharded over the mesh axes that q's batch is
  sharded over (q is the first operand, k the second);
- the kv heads ("kv_heads") and the query heads ("heads") over the axes of q's heads, when
  those divide the kv heads (shard i of the query heads is then the groups of shard i of
  the kv heads); with a single kv head the query heads alone are sharded and k and v are
  whole;
- every other dimension (sequence, head dim, a table's distances, the offset, heads that
  the kv heads cannot follow) is computed whole: an operand sharded there is gathered.

A result that sums over the batch (a parameter's gradient) must keep a batch dimension
for the caller to sum: the kernel then holds no collective. Under vmap the kernel runs
one call per vmapped index, without the rule. The rule is left out where there is nothing
to partition or no device to partition over: in a one-device process, and when lowering
ahead of time for devices the host lacks (an abstract mesh with an abstract device, as
`bam_jax.kernels.lowering` uses), where jax refuses custom partitioning.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import (
    ArrayMapping,
    CompoundFactor,
    SdyShardingRule,
    custom_partitioning,
)
from jax.sharding import Mesh, NamedSharding, PartitionSpec

Kernel = Callable[..., tuple[jax.Array, ...]]
Role = Literal["batch", "heads", "kv_heads"] | None
Roles = tuple[tuple[Role, ...], ...]

# A fused forward's operands, in the order every backend takes them (q, k, v, prior table
# [H, X], head params [H, P], log_n [B, T], q segments [B, T], k segments [B, S], offset
# [1]), and its results (the output [B, T, H, D], the log-sum-exp [B, H, T]).
FORWARD_OPERAND_ROLES: Roles = (
    ("batch", None, "heads", None),
    ("batch", None, "kv_heads", None),
    ("batch", None, "kv_heads", None),
    ("heads", None),
    ("heads", None),
    ("batch", None),
    ("batch", None),
    ("batch", None),
    (None,),
)
FORWARD_RESULT_ROLES: Roles = (("batch", None, "heads", None), ("batch", "heads", None))


def kernel_operand(x: jax.Array | None, dtype: jnp.dtype) -> jax.Array:
    """x in `dtype` as a kernel operand, or a [1, 1] placeholder where the call has no such
    input: a kernel's operand list is fixed (FORWARD_OPERAND_ROLES), and a placeholder's
    dimensions are computed whole."""
    return jnp.zeros((1, 1), dtype) if x is None else jnp.asarray(x, dtype)


def offset_operand(query_offset: int | jax.Array) -> jax.Array:
    """The query offset as the kernels take it: int32 [1]."""
    return jnp.reshape(jnp.asarray(query_offset, jnp.int32), (1,))


def partitioned_by_batch_and_heads(
    kernel: Kernel, operand_roles: Roles, result_roles: Roles
) -> Kernel:
    """`kernel(*operands, **attributes)` with the partitioning rule above; `kernel` builds
    its call for the shapes it is given (the per-device shard's). `operand_roles` and
    `result_roles` give each dimension's role (None: computed whole); an operand dimension
    whose size is not its role's (a [1, 1] placeholder for an absent input) is whole."""

    def call(*operands: jax.Array, **attributes: Any) -> tuple[jax.Array, ...]:
        sizes = _role_sizes(operands[0].shape, operands[1].shape)
        fitted = _fitted_roles(operand_roles, [x.shape for x in operands], sizes)
        local = functools.partial(kernel, **attributes)
        if not _devices_to_partition_over():
            return _sequential_under_vmap(local, local, len(result_roles))(*operands)
        partitioned = custom_partitioning(local)
        partitioned.def_partition(
            partition=functools.partial(_partition, local, fitted, result_roles, sizes),
            infer_sharding_from_operands=functools.partial(_result_shardings, result_roles, sizes),
            sharding_rule=_sharding_rule(fitted, result_roles, sizes),
        )
        return _sequential_under_vmap(partitioned, local, len(result_roles))(*operands)

    return call


def _devices_to_partition_over() -> bool:
    if jax.device_count() == 1:
        return False
    return getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None) is None


def _sequential_under_vmap(partitioned: Kernel, local: Kernel, num_results: int) -> Kernel:
    """custom_partitioning has no batching rule: vmap runs the kernel's own (sequential)."""
    wrapped = jax.custom_batching.custom_vmap(partitioned)

    @wrapped.def_vmap
    def _vmapped(axis_size: int, in_batched: Sequence[bool], *operands: jax.Array):
        del axis_size
        in_axes = [0 if batched else None for batched in in_batched]
        return jax.vmap(local, in_axes=in_axes)(*operands), (True,) * num_results

    return wrapped


def _role_sizes(q_shape: tuple[int, ...], k_shape: tuple[int, ...]) -> dict[str, int]:
    return {"batch": q_shape[0], "heads": q_shape[2], "kv_heads": k_shape[2]}


def _fitted_roles(roles: Roles, shapes: Sequence[tuple[int, ...]], sizes: dict[str, int]) -> Roles:
    return tuple(
        tuple(
            role if role and size == sizes[role] else None for role, size in zip(r, s, strict=True)
        )
        for r, s in zip(roles, shapes, strict=True)
    )


def _sharding_rule(operand_roles: Roles, result_roles: Roles, sizes: dict[str, int]):
    """Factors b (batch), k (kv heads) and g (query heads per kv head: a query head is the
    compound (k g), or k or g alone where the other is 1); every other dimension has its
    own factor. Those and a compound's g must be whole (listed in order of first use, as
    Shardy needs)."""
    groups, kv_heads = sizes["heads"] // sizes["kv_heads"], sizes["kv_heads"]
    heads: str | CompoundFactor = CompoundFactor("k", "g")
    if groups == 1 or kv_heads == 1:
        heads = "k" if groups == 1 else "g"
    whole: list[str] = []

    def factor(role: Role, name: str) -> str | CompoundFactor:
        if role == "batch":
            return "b"
        if role == "kv_heads":
            return "k"
        if role == "heads":
            whole.extend(("g",) if isinstance(heads, CompoundFactor) and "g" not in whole else ())
            return heads
        whole.append(name)
        return name

    def mapping(roles: tuple[Role, ...], name: str) -> ArrayMapping:
        return ArrayMapping(*(factor(role, f"{name}_{dim}") for dim, role in enumerate(roles)))

    operands = tuple(mapping(r, f"operand{i}") for i, r in enumerate(operand_roles))
    results = tuple(mapping(r, f"result{i}") for i, r in enumerate(result_roles))
    group_size = {"g": groups} if isinstance(heads, CompoundFactor) else {}
    return SdyShardingRule(operands, results, need_replication_factors=tuple(whole), **group_size)


def _partition(
    local: Kernel,
    operand_roles: Roles,
    result_roles: Roles,
    sizes: dict[str, int],
    mesh: Mesh,
    arg_shapes: Sequence[jax.ShapeDtypeStruct],
    result_shape: Any,
):
    del result_shape
    mesh, axes = _plan(mesh, arg_shapes[0].sharding, sizes)
    arg_shardings = tuple(_sharding(mesh, roles, axes) for roles in operand_roles)
    result_shardings = tuple(_sharding(mesh, roles, axes) for roles in result_roles)
    return mesh, local, result_shardings, arg_shardings


def _result_shardings(
    result_roles: Roles,
    sizes: dict[str, int],
    mesh: Mesh,
    arg_shapes: Sequence[jax.ShapeDtypeStruct],
    shape: Any,
) -> tuple[NamedSharding, ...]:
    del shape
    mesh, axes = _plan(mesh, arg_shapes[0].sharding, sizes)
    return tuple(_sharding(mesh, roles, axes) for roles in result_roles)


def _plan(
    mesh: Mesh, q_sharding: Any, sizes: dict[str, int]
) -> tuple[Mesh, dict[str, tuple[str, ...]]]:
    """The mesh and the axes each role is sharded over: q's batch axes, and q's head axes
    when they divide the kv heads (or the query heads, for a single kv head, which every
    device then holds whole). Without a named mesh everything is computed whole."""
    if not isinstance(q_sharding, NamedSharding):
        devices = sorted(q_sharding.device_set, key=lambda device: device.id)
        return Mesh(np.array(devices), ("devices",)), {}
    mesh = q_sharding.mesh
    spec = (*q_sharding.spec, None, None, None, None)
    batch_axes, head_axes = _axes(spec[0]), _axes(spec[2])
    axes = {}
    if batch_axes and sizes["batch"] % _size(mesh, batch_axes) == 0:
        axes["batch"] = batch_axes
    if head_axes and sizes["kv_heads"] % _size(mesh, head_axes) == 0:
        axes["heads"] = axes["kv_heads"] = head_axes
    elif head_axes and sizes["kv_heads"] == 1 and sizes["heads"] % _size(mesh, head_axes) == 0:
        axes["heads"] = head_axes
    return mesh, axes


def _axes(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[axis] for axis in axes)


def _sharding(
    mesh: Mesh, roles: tuple[Role, ...], axes: dict[str, tuple[str, ...]]
) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(*(axes.get(role) if role else None for role in roles)))
