"""Time and temporary memory of reference vs blockwise attention; prints a Markdown table.

    python bench/attention_bench.py                      # 1k, 4k, 16k, 32k
    python bench/attention_bench.py --lengths 4096 --block-q 512 --block-k 1024

Batch 1, 8 heads, head dim 64, float32, causal, on the default JAX backend. Times are
medians of jit-compiled runs; memory is the compiled executable's temporary buffer
size (deterministic; inputs and outputs excluded). The reference is skipped where its
temporaries would exceed --reference-limit-gb.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import dot_product_attention
from bam_jax.priors import init_ggd_prior

HEADS, HEAD_DIM = 8, 64
CONFIGS = ("none", "ggd", "ggd+ssmax")


def make_inputs(length: int) -> tuple:
    keys = jax.random.split(jax.random.key(0), 4)
    shape = (1, length, HEADS, HEAD_DIM)
    q, k, v = (jax.random.normal(key, shape, jnp.float32) for key in keys[:3])
    prior = init_ggd_prior(HEADS, alpha_init="slope", beta_init="linear", key=keys[3])
    prior = prior.replace(theta_mu_H=jnp.full((HEADS,), 0.1, jnp.float32))
    scale = jnp.ones((HEADS,), jnp.float32)
    return q, k, v, prior, scale


def attention_fn(config: str, implementation: str, block_q: int, block_k: int) -> Callable:
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


def compile_and_measure(fn: Callable, args: tuple, repeats: int) -> tuple[float, float]:
    """Median seconds per call and temporary memory in MiB."""
    compiled = jax.jit(fn).lower(*args).compile()
    temp_bytes = compiled.memory_analysis().temp_size_in_bytes
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times), temp_bytes / 2**20


def reference_fits(fn: Callable, args: tuple, limit_bytes: float) -> bool:
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes <= limit_bytes


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for length in args.lengths:
        inputs = make_inputs(length)
        for config in args.configs:
            for implementation in ("reference", "blockwise"):
                forward = attention_fn(config, implementation, args.block_q, args.block_k)
                both = forward_backward_fn(forward)
                row = {"length": length, "config": config, "impl": implementation}
                if implementation == "reference" and not reference_fits(
                    both, inputs, args.reference_limit_gb * 2**30
                ):
                    rows.append(row)
                    continue
                row["fwd_s"], row["fwd_mb"] = compile_and_measure(forward, inputs, args.repeats)
                row["bwd_s"], row["bwd_mb"] = compile_and_measure(both, inputs, args.repeats)
                rows.append(row)
                print(format_row(row), flush=True)
    return rows


def format_row(row: dict) -> str:
    if "fwd_s" not in row:
        cells = ["skipped (does not fit)"] + [""] * 3
    else:
        cells = [
            f"{row['fwd_s'] * 1e3:.0f}",
            f"{row['fwd_mb']:.1f}",
            f"{row['bwd_s'] * 1e3:.0f}",
            f"{row['bwd_mb']:.1f}",
        ]
    return "| " + " | ".join([str(row["length"]), row["config"], row["impl"], *cells]) + " |"


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print()
    print(
        f"Blockwise block_q={args.block_q} block_k={args.block_k}; "
        f"{jax.devices()[0].platform}, batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32"
    )
    print()
    print("| tokens | prior | impl | fwd ms | fwd temp MB | fwd+bwd ms | fwd+bwd temp MB |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        print(format_row(row))
    by_key = {(r["length"], r["config"], r["impl"]): r for r in rows if "fwd_s" in r}
    print()
    print("| tokens | prior overhead fwd | prior overhead fwd+bwd | q/k/v/out size MB |")
    print("|---|---|---|---|")
    for length in args.lengths:
        base = by_key.get((length, "none", "blockwise"))
        ggd = by_key.get((length, "ggd", "blockwise"))
        if base and ggd:
            qkv_mb = length * HEADS * HEAD_DIM * 4 / 2**20
            print(
                f"| {length} | {ggd['fwd_s'] / base['fwd_s']:.2f}x | "
                f"{ggd['bwd_s'] / base['bwd_s']:.2f}x | {qkv_mb:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--block-q", type=int, default=512)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--reference-limit-gb", type=float, default=4.0)
    args = parser.parse_args()
    np.set_printoptions(precision=3)
    print_table(run(args), args)


if __name__ == "__main__":
    main()
