"""What the fused kernel is on one platform. Each platform's module (cpu.py, gpu.py,
tpu.py) defines its entry, `bam_jax.kernels.registry.FUSED_BACKENDS` gathers them, and both
the implementation resolver and the dispatcher (`bam_jax.fused_attention`) read the fields
instead of comparing platform names."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from bam_jax.kernels.tile_math import Backend

# (interpret, head_dim, q_len, kv_len, block_q or None, block_k or None) -> (block_q, block_k)
BlockChooser = Callable[[bool, int, int, int, int | None, int | None], tuple[int, int]]
# Query and key block of the blockwise backward that kernels without a backward of their own use.
BLOCKWISE_BACKWARD_BLOCK = 512


@dataclasses.dataclass(frozen=True)
class FusedBackend:
    name: Backend
    choose_blocks: BlockChooser
    pallas: bool = False  # a Pallas kernel, which has an interpret mode; else native code
    fused_backward: bool = False  # backward kernels of its own; else the blockwise backward
    table_prior_only: bool = False  # reads every prior from its distance table
    approx_math: bool = False  # may use the hardware's approximate exp2/log2
    prior_reuse: bool = False  # GGD tiles reusable across query sub-blocks
    pads_head_dim: bool = False  # the head dim is padded to a power of two
    # Calls of fewer queries run blockwise attention (the same function) in these key blocks.
    min_queries: int = 0
    short_call_block_k: int | None = None
    reads_window_only: bool = False  # a local layer over a long cache reads its window only
    # Its interpret mode runs callbacks, which a partitioning rule cannot hold: interpreted,
    # it runs unpartitioned (gathered under a mesh).
    interpret_has_callbacks: bool = False
    # Device kinds (`jax.Device.device_kind`) on which the compiled kernel passed
    # bench/accelerator_check/, so that implementation "auto" picks it for training and
    # inference; the evidence (device, date, table) is in docs/accelerators.md.
    validated_devices: tuple[str, ...] = ()
    # For "auto" at inference on a device kind not validated: whether the kernel is faster
    # than blockwise attention here (None: never chosen so).
    preferred_for_inference: Callable[[], bool] | None = None

    def chosen_by_auto(self, device_kind: str, purpose: str) -> bool:
        """Whether implementation "auto" runs this kernel on a device of this kind."""
        if device_kind in self.validated_devices:
            return True
        return purpose == "inference" and bool(
            self.preferred_for_inference and self.preferred_for_inference()
        )
