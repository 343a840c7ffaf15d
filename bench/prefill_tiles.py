"""Attention of one prefill chunk against a long KV cache: blockwise by tiling, and the fused
CPU kernel; prints a table.

    python -m bench.prefill_tiles                                   # anchor shape, 16k keys
    python -m bench.prefill_tiles --shape 20,4,16,8192 --tiles 256x256,512x1024 --rounds 5

One 512-query chunk sits at the end of S cached keys (batch, heads, head dim and S from
--shape), with the GGD prior and SSMax, as every chunk of a long passkey prompt does late in
its prefill. Each blockwise tiling and the fused CPU kernel (`implementation="fused"` on
CPU; --no-kernel leaves it out) compile once; then they run in turn, --rounds times, so a
slow spell of a shared machine hits them alike. Reported: the median and fastest wall time
per chunk, and the attention's FLOPs (4 x head dim per logit of the chunk's S keys) per
second as a share of the float32 matmul rate, measured before and after the rounds.
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
from bam_jax.priors import GGDPrior
from bam_jax.provenance import matmul_gflops

CHUNK = 512


KERNEL = "fused CPU kernel"


def chunk_attention(shape: tuple[int, int, int, int], tiles: tuple[int, int] | None) -> Callable:
    """A compiled, ready-to-time call of one chunk's attention: blockwise with the given
    tiles, or the fused kernel for None."""
    batch, heads, head_dim, keys = shape
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((batch, CHUNK, heads, head_dim)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((batch, keys, heads, head_dim)), jnp.float32)
        for _ in range(2)
    )
    prior = GGDPrior(jnp.full((heads,), -2.0), jnp.linspace(-0.5, 1.0, heads), jnp.zeros(heads))
    attend = jax.jit(
        lambda q, k, v, offset: dot_product_attention(
            q,
            k,
            v,
            prior=prior,
            ssmax_scale_H=jnp.full((heads,), 0.3),
            query_offset=offset,
            implementation="blockwise" if tiles else "fused",
            block_q=tiles[0] if tiles else None,
            block_k=tiles[1] if tiles else None,
        )
    )
    offset = jnp.int32(keys - CHUNK)
    jax.block_until_ready(attend(q, k, v, offset))
    return lambda: jax.block_until_ready(attend(q, k, v, offset))


def _tiles(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(q), int(k)) for q, k in (t.split("x") for t in text.split(","))]
    except ValueError:
        message = f"expected tiles like 256x256,512x1024, got {text!r}"
        raise argparse.ArgumentTypeError(message) from None


def _shape(text: str) -> tuple[int, int, int, int]:
    parts = text.split(",")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"expected BATCH,HEADS,HEAD_DIM,KEYS, got {text!r}")
    return tuple(int(p) for p in parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=_shape, default=(1, 8, 32, 16384))
    parser.add_argument("--tiles", type=_tiles, default=_tiles("256x256,512x256,512x1024"))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--no-kernel", dest="kernel", action="store_false")
    args = parser.parse_args()
    batch, heads, head_dim, keys = args.shape
    variants = [*args.tiles, *([None] if args.kernel else [])]
    calls = {tiles: chunk_attention(args.shape, tiles) for tiles in variants}
    seconds: dict[tuple[int, int] | None, list[float]] = {tiles: [] for tiles in variants}
    rate_before = matmul_gflops()
    for _ in range(args.rounds):
        for tiles, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[tiles].append(time.perf_counter() - start)
    rate_after = matmul_gflops()
    rate = (rate_before + rate_after) / 2
    flops = 4 * batch * heads * CHUNK * keys * head_dim
    print(
        f"batch {batch}, {heads} heads, head dim {head_dim}, a {CHUNK}-query chunk against "
        f"{keys} keys; matmul {rate_before:.0f} / {rate_after:.0f} GFLOP/s (before / after)\n"
    )
    print("| attention | median ms | fastest ms | attention / matmul |")
    print("|---|---|---|---|")
    for tiles, times in seconds.items():
        median, fastest = statistics.median(times), min(times)
        share = flops / median / 1e9 / rate
        name = f"blockwise {tiles[0]} x {tiles[1]}" if tiles else KERNEL
        print(f"| {name} | {median * 1e3:.1f} | {fastest * 1e3:.1f} | {share:.0%} |")


if __name__ == "__main__":
    main()
