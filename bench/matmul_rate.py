"""The float32 matmul rate of this machine right now, the yardstick every benchmark here
divides by (a shared or throttled machine shows it as a lower rate)."""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp


def matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    """Median rate of jitted float32 n x n products, GFLOP/s."""
    a = jnp.ones((n, n), jnp.float32)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(matmul(a))
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9
