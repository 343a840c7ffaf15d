"""Time and temporary memory of reference vs blockwise attention; prints Markdown tables.

    python -m bench.attention_bench                      # 1k, 4k, 16k, 32k tokens
    python -m bench.attention_bench --lengths 4096 --block-q 512 --block-k 512

Batch 1, 8 heads, head dim 64, float32, causal, on the default JAX backend, for three
configurations: no prior, the GGD prior, GGD + SSMax. Times are the median wall time of
jit-compiled runs (compilation excluded): run it on an otherwise idle machine. The float32
matmul rate is measured before and after every length, and each time is also given as
the rate of the attention's causal matmul FLOPs (forward 2 x 2 x T^2/2 x D x H; forward +
backward 3.5x that: the backward recomputes QK^T) in % of the mean matmul rate. Memory is
the compiled executable's temporary buffer size (deterministic; arguments and results
excluded). The reference is skipped where its temporaries would exceed
--reference-limit-gb.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from bam_jax.attention import dot_product_attention
from bam_jax.priors import init_ggd_prior
from bam_jax.provenance import matmul_gflops

HEADS, HEAD_DIM = 8, 64
CONFIGS = ("none", "ggd", "ggd+ssmax")
IMPLEMENTATIONS = ("reference", "blockwise")


def make_inputs(length: int) -> tuple:
    keys = jax.random.split(jax.random.key(0), 3)
    shape = (1, length, HEADS, HEAD_DIM)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys)
    prior = init_ggd_prior(HEADS, alpha_init="slope", beta_init="linear")
    prior = prior.replace(theta_mu_H=jnp.full((HEADS,), 0.1, jnp.float32))
    scale = jnp.ones((HEADS,), jnp.float32)
    return q, k, v, prior, scale


def forward_fn(config: str, implementation: str, block_q: int, block_k: int) -> Callable:
    def attend(q, k, v, prior, scale):
        return dot_product_attention(
            q,
            k,
            v,
            prior=None if config == "none" else prior,
            ssmax_scale_H=scale if config == "ggd+ssmax" else None,
            implementation=implementation,
            block_q=block_q,
            block_k=block_k,
        )

    return attend


def forward_backward_fn(attend: Callable) -> Callable:
    def loss(q, k, v, prior, scale):
        return jnp.sum(attend(q, k, v, prior, scale) ** 2)

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))


def measure(compiled, args: tuple, repeats: int, warmup: bool) -> float:
    """Median wall seconds per call."""
    if warmup:
        jax.block_until_ready(compiled(*args))
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        walls.append(time.perf_counter() - start)
    return statistics.median(walls)


def forward_flops(length: int) -> float:
    """Causal QK^T and PV: 2 products x 2 FLOPs x T^2 / 2 pairs x D x H."""
    return 2.0 * length * length * HEAD_DIM * HEADS


def bench_one(length: int, config: str, implementation: str, args, gflops: float) -> dict:
    inputs = make_inputs(length)
    forward = forward_fn(config, implementation, args.block_q, args.block_k)
    row = {"length": length, "config": config, "impl": implementation, "matmul": gflops}
    long_run = length >= (4096 if implementation == "reference" else 16384)
    repeats = args.long_repeats if long_run else args.repeats
    for name, fn in (("fwd", forward), ("both", forward_backward_fn(forward))):
        compiled = jax.jit(fn).lower(*inputs).compile()
        temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
        if implementation == "reference" and temp_mb > args.reference_limit_gb * 1024:
            return row
        row[f"{name}_mb"] = temp_mb
        row[f"{name}_wall"] = measure(compiled, inputs, repeats, not long_run)
    return row


def format_row(row: dict) -> str:
    head = [str(row["length"]), row["config"], row["impl"]]
    if "both_mb" not in row:
        return "| " + " | ".join([*head, "does not fit", "", "", "", "", "", ""]) + " |"
    flops = forward_flops(row["length"])
    fwd_share = flops / row["fwd_wall"] / 1e9 / row["matmul"]
    both_share = 3.5 * flops / row["both_wall"] / 1e9 / row["matmul"]
    cells = [
        f"{row['fwd_wall'] * 1e3:.0f}",
        f"{fwd_share:.0%}",
        f"{row['fwd_mb']:.1f}",
        f"{row['both_wall'] * 1e3:.0f}",
        f"{both_share:.0%}",
        f"{row['both_mb']:.1f}",
        f"{row['matmul']:.0f}",
    ]
    return "| " + " | ".join([*head, *cells]) + " |"


HEADER = (
    "| tokens | prior | impl | fwd ms | fwd % of matmul | fwd temp MB | fwd+bwd ms "
    "| fwd+bwd % of matmul | fwd+bwd temp MB | matmul GFLOP/s |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def print_tables(rows: list[dict], args: argparse.Namespace) -> None:
    print(
        f"\nblock_q={args.block_q} block_k={args.block_k}; {jax.devices()[0].platform}, "
        f"batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32, causal; wall times\n"
    )
    print(HEADER)
    for row in rows:
        print(format_row(row))
    found = {(r["length"], r["config"], r["impl"]): r for r in rows if "both_mb" in r}
    print("\nBlockwise prior overhead (wall time, relative to the same call without a prior)\n")
    print("| tokens | GGD fwd | GGD fwd+bwd | GGD+SSMax fwd | GGD+SSMax fwd+bwd |")
    print("|---|---|---|---|---|")
    for length in args.lengths:
        base = found.get((length, "none", "blockwise"))
        if base is None:
            continue
        cells = []
        for config in ("ggd", "ggd+ssmax"):
            row = found.get((length, config, "blockwise"))
            for name in ("fwd", "both"):
                cells.append(f"{row[f'{name}_wall'] / base[f'{name}_wall']:.2f}x" if row else "")
        print(f"| {length} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--implementations", nargs="+", default=list(IMPLEMENTATIONS))
    parser.add_argument("--block-q", type=int, default=256)
    parser.add_argument("--block-k", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--long-repeats",
        type=int,
        default=1,
        help="runs (no warm-up) for blockwise >= 16k tokens and reference >= 4k tokens",
    )
    parser.add_argument("--reference-limit-gb", type=float, default=4.0)
    args = parser.parse_args()
    rows = []
    print(HEADER)
    for length in args.lengths:
        before = matmul_gflops()
        first = len(rows)
        for config in args.configs:
            for implementation in args.implementations:
                rows.append(bench_one(length, config, implementation, args, before))
        gflops = (before + matmul_gflops()) / 2
        for row in rows[first:]:
            row["matmul"] = gflops
            print(format_row(row), flush=True)
    print_tables(rows, args)


if __name__ == "__main__":
    main()
