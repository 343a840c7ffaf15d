"""Which attention implementation runs: the one place that names the implementations,
checks a choice and decides what "auto" means on a device.

- "reference": the T x S oracle (`bam_jax.attention.reference_attention`).
- "blockwise": online softmax over key blocks (`bam_jax.blockwise`).
- "fused": the fused kernel (`bam_jax.pallas_attention`): Pallas on GPU and TPU, native
  code on CPU. "pallas", its earlier name, is accepted for one release.
"""

from __future__ import annotations

from typing import Literal, Protocol

import jax

from bam_jax.kernels.cpu import cpu_kernel_preferred

Implementation = Literal["reference", "blockwise", "fused"]
Purpose = Literal["training", "inference"]
IMPLEMENTATIONS: tuple[Implementation, ...] = ("reference", "blockwise", "fused")
IMPLEMENTATION_ALIASES: dict[str, Implementation] = {"pallas": "fused"}
IMPLEMENTATION_CHOICES = ("auto", *IMPLEMENTATIONS, *IMPLEMENTATION_ALIASES)
# Device kinds (`jax.Device.device_kind`) on which the compiled fused kernels passed
# bench/accelerator_check/; the evidence (device, date, table) is in docs/accelerators.md.
FUSED_VALIDATED_DEVICES: tuple[str, ...] = ()


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

    "auto" is the fused kernel on a GPU or TPU whose kind is in FUSED_VALIDATED_DEVICES
    and, for inference on CPU, where `cpu_kernel_preferred()` says the native kernel is
    faster than blockwise attention; blockwise attention everywhere else. Training on CPU
    keeps blockwise attention: the native kernel's backward is the blockwise one."""
    resolved = canonical_implementation("auto" if choice is None else choice, field=field)
    if resolved != "auto":
        return resolved  # type: ignore[return-value]
    device = jax.devices()[0] if device is None else device
    if device.platform in ("gpu", "tpu") and device.device_kind in FUSED_VALIDATED_DEVICES:
        return "fused"
    if purpose == "inference" and device.platform == "cpu" and cpu_kernel_preferred():
        return "fused"
    return "blockwise"
