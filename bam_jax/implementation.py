"""Which attention implementation runs: the one place that names the implementations,
checks a choice and decides what "auto" means on a device.

- "reference": the T x S oracle (`bam_jax.attention.reference_attention`).
- "blockwise": online softmax over key blocks (`bam_jax.blockwise`).
- "fused": the fused kernel (`bam_jax.fused_attention`): Pallas on GPU and TPU, native
  code on CPU. "pallas", its earlier name, is accepted for one release. Whether "auto"
  picks it is each platform's entry in `bam_jax.kernels.registry.FUSED_BACKENDS`.
"""

from __future__ import annotations

from typing import Literal, Protocol

import jax

from bam_jax.kernels.registry import FUSED_BACKENDS

Implementation = Literal["reference", "blockwise", "fused"]
Purpose = Literal["training", "inference"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("reference", "blockwise", "fused")
IMPLEMENTATION_ALIASES: dict[str, Implementation] = {"pallas": "fused"}
IMPLEMENTATION_CHOICES = ("auto", *IMPLEMENTATIONS, *IMPLEMENTATION_ALIASES)


class DeviceLike(Protocol):
    platform: str
    device_kind: str


def canonical_implementation(
    choice: str, *, field: str = "implementation", allow_auto: bool = True
) -> str:
    """`choice` under its current name ("pallas" -> "fused"), or a ValueError naming
    `field` and the choices."""
    choices = IMPLEMENTATION_CHOICES if allow_auto else IMPLEMENTATION_CHOICES[1:]
    if choice not in choices:
        raise ValueError(f"{field} must be one of {choices}, got {choice!r}")
    return IMPLEMENTATION_ALIASES.get(choice, choice)


def resolve_implementation(
    choice: str | None = "auto",
    *,
    device: DeviceLike | None = None,
    purpose: Purpose = "training",
    field: str = "implementation",
) -> Implementation:
    """The implementation that runs for `choice` (None means "auto") on `device` (default:
    the first device of the default backend).

    "auto" is the fused kernel where the platform's backend says so
    (`FusedBackend.chosen_by_auto`): on a device kind in its `validated_devices` (none
    yet) and, for inference on CPU, where `cpu_kernel_preferred()` says the native kernel
    is faster than blockwise attention; blockwise attention everywhere else."""
    resolved = canonical_implementation("auto" if choice is None else choice, field=field)
    if resolved != "auto":
        return resolved  # type: ignore[return-value]
    device = jax.devices()[0] if device is None else device
    backend = FUSED_BACKENDS.get(device.platform)
    if backend is not None and backend.chosen_by_auto(device.device_kind, purpose):
        return "fused"
    return "blockwise"
