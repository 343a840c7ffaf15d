"""Elementwise work per logit in the Pallas kernels' lowered modules, on any host.

Lowers the forward kernel (head dim 128, 2048 tokens, bf16, causal, GGD prior unless
stated) for a GPU (Triton IR) and a TPU (Mosaic) and counts, in the loop body, the ops on
the logits tile per QK^T product: special functions (exp2, log2, ...), int-to-float
conversions, divides, gathers and other ALU ops (bam_jax.kernels.lowering.tile_op_counts).

    python -m bench.kernel_ops
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from bam_jax.fused_attention import fused_attention
from bam_jax.kernels.lowering import kernel_modules, tile_op_counts
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes

HEADS, HEAD_DIM, LENGTH = 4, 128, 2048
CATEGORIES = ("special", "int-to-float", "divide", "gather", "alu")
# (name, platform, options, prior, logits tile rows x cols)
VARIANTS = (
    ("GGD (tile reuse)", "cuda", {}, "ggd", (64, 64)),
    ("GGD, no reuse", "cuda", {"prior_reuse": False}, "ggd", (128, 64)),
    ("GGD, exact exp2/log2", "cuda", {"approx_math": False}, "ggd", (64, 64)),
    ("GGD, prior table", "cuda", {"prior_table": True}, "ggd", (128, 64)),
    ("ALiBi", "cuda", {}, "alibi", (128, 64)),
    ("no prior", "cuda", {}, None, (128, 64)),
    ("GGD", "tpu", {}, "ggd", (256, 256)),
    ("GGD, prior table", "tpu", {"prior_table": True}, "ggd", (256, 256)),
    ("no prior", "tpu", {}, None, (256, 256)),
)


def make_prior(kind: str | None) -> GGDPrior | AlibiPrior | None:
    if kind == "ggd":
        return GGDPrior(jnp.zeros(HEADS), jnp.ones(HEADS), jnp.zeros(HEADS))
    if kind == "alibi":
        return AlibiPrior(jnp.asarray(alibi_slopes(HEADS)))
    return None


def counts(platform: str, options: dict, prior_kind: str | None, tile: tuple[int, int]):
    prior = make_prior(prior_kind)
    backend = "gpu" if platform == "cuda" else "tpu"

    def forward(q, k, v):
        return fused_attention(q, k, v, prior=prior, backend=backend, debug=True, **options)

    shape = jax.ShapeDtypeStruct((1, LENGTH, HEADS, HEAD_DIM), jnp.bfloat16)
    [module] = kernel_modules(forward, (shape, shape, shape), platform)
    return tile_op_counts(module, *tile)


def main() -> None:
    print(f"jax {jax.__version__}; ops per logit in the forward kernel's loop body")
    print("| kernel | variant | tile | " + " | ".join(CATEGORIES) + " |")
    print("|---" * (3 + len(CATEGORIES)) + "|")
    for name, platform, options, prior_kind, tile in VARIANTS:
        per_logit = counts(platform, options, prior_kind, tile)
        cells = [f"{per_logit.get(c, 0.0):g}" for c in CATEGORIES]
        kernel = "GPU (Triton)" if platform == "cuda" else "TPU (Mosaic)"
        print(f"| {kernel} | {name} | {tile[0]} x {tile[1]} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
