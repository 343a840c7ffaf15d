"""The fused kernel's backends by platform (`jax.default_backend()` / `Device.platform`)."""

from __future__ import annotations

from bam_jax.kernels import cpu, gpu, tpu
from bam_jax.kernels.backend import FusedBackend

FUSED_BACKENDS: dict[str, FusedBackend] = {
    backend.name: backend for backend in (gpu.BACKEND, tpu.BACKEND, cpu.BACKEND)
}
