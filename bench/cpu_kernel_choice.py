"""Where the CPU kernel beats blockwise attention: its native build, other builds (by default
one without AVX-512) and blockwise, timed in one run on one machine; prints a table.

    python -m bench.cpu_kernel_choice                 # the native build and -mno-avx512f
    python -m bench.cpu_kernel_choice --extra-build=-mno-avx512f --extra-build=-march=znver3

Batch 1, 8 heads, head dim 64, float32, the GGD prior and SSMax, a causal chunk at the end
of 8192 cached keys: a 512-query prefill chunk and a single-query decode step. Each build
of bam_jax/kernels/cpu_attention.cc (the usual flags plus the given ones) is registered as
its own custom call; the kernel runs at one query too (fused_attention hands fewer than
CPU_MIN_QUERIES to blockwise attention, whose tiles for them are timed as "blockwise").
Blockwise attention runs in the tiles evaluation gives it (512 x 1024) for the chunk. All
variants compile once, then run in turn --rounds times so a slow spell of a shared machine
hits them alike. Reported: median and fastest wall time, and the attention's FLOPs (4 x head
dim x heads per visible query-key pair) per second as a share of the float32 matmul rate
measured before and after the rounds. The machine (CPU model, AVX-512, CPUs the kernel may
use) and the load average before and after are printed with the table.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import os
import shlex
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import dot_product_attention
from bam_jax.kernels import cpu
from bam_jax.kernels.registry import FUSED_BACKENDS
from bam_jax.priors import GGDPrior
from bam_jax.provenance import matmul_gflops

HEADS, HEAD_DIM, KEYS = 8, 64, 8192
SHAPES = {"prefill 512 x 8192": 512, "decode 1 x 8192": 1}
PREFILL_TILES = (512, 1024)


def build_target(extra_flags: str, number: int) -> str:
    """Builds the kernel with the usual flags plus `extra_flags`; its custom call's name."""
    flags = tuple(shlex.split(extra_flags))
    if not flags:
        cpu._register()
        return cpu.TARGET_NAME
    library = ctypes.CDLL(str(cpu._build(extra_flags=flags)))
    name = f"{cpu.TARGET_NAME}_build{number}"
    jax.ffi.register_ffi_target(
        name, jax.ffi.pycapsule(library.BamCpuAttentionForward), platform="cpu"
    )
    return name


@contextlib.contextmanager
def kernel_traced_as(target: str) -> Iterator[None]:
    """While tracing: the kernel's custom call is `target`, whatever the query count."""
    saved = cpu.TARGET_NAME, FUSED_BACKENDS["cpu"]
    cpu.TARGET_NAME = target
    FUSED_BACKENDS["cpu"] = dataclasses.replace(saved[1], min_queries=0)
    try:
        yield
    finally:
        cpu.TARGET_NAME, FUSED_BACKENDS["cpu"] = saved


def attention_call(queries: int, target: str | None) -> Callable[[], None]:
    """A compiled, ready-to-time call: the kernel as `target`, or blockwise for None."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((1, queries, HEADS, HEAD_DIM)), jnp.float32)
    k, v = (
        jnp.asarray(rng.standard_normal((1, KEYS, HEADS, HEAD_DIM)), jnp.float32) for _ in range(2)
    )
    prior = GGDPrior(jnp.full((HEADS,), -2.0), jnp.linspace(-0.5, 1.0, HEADS), jnp.zeros(HEADS))
    short = queries < cpu.CPU_MIN_QUERIES
    tiles = (cpu.CPU_MIN_QUERIES, cpu.CPU_SHORT_BLOCK_K) if short else PREFILL_TILES
    attend = jax.jit(
        lambda q, k, v, offset: dot_product_attention(
            q,
            k,
            v,
            prior=prior,
            ssmax_scale_H=jnp.full((HEADS,), 0.3),
            query_offset=offset,
            implementation="blockwise" if target is None else "fused",
            block_q=tiles[0],
            block_k=tiles[1],
        )
    )
    offset = jnp.int32(KEYS - queries)
    with contextlib.nullcontext() if target is None else kernel_traced_as(target):
        compiled = attend.lower(q, k, v, offset).compile()
    jax.block_until_ready(compiled(q, k, v, offset))
    return lambda: jax.block_until_ready(compiled(q, k, v, offset))


def machine() -> str:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    models = [
        line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line
    ]
    model = models[0] if models else "unknown CPU"
    avx512 = "with" if " avx512f" in cpuinfo else "without"
    return (
        f"{model}, {avx512} AVX-512, {len(os.sched_getaffinity(0))} CPUs "
        f"(the kernel uses up to {cpu.kernel_threads()} threads)"
    )


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--extra-build",
        action="append",
        metavar="FLAGS",
        help="another kernel build, with these flags after the usual ones (repeatable; "
        "write --extra-build=-mno-avx512f); default: -mno-avx512f",
    )
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    builds = ["", *(args.extra_build or ["-mno-avx512f"])]
    load_before = load()
    targets = {flags: build_target(flags, n) for n, flags in enumerate(builds)}
    names = {None: "blockwise"} | {flags: f"kernel, {flags or 'native build'}" for flags in builds}
    calls = {
        (shape, variant): attention_call(queries, targets.get(variant))
        for shape, queries in SHAPES.items()
        for variant in names
    }
    seconds: dict[tuple[str, str | None], list[float]] = {key: [] for key in calls}
    rate_before = matmul_gflops()
    for _ in range(args.rounds):
        for key, call in calls.items():
            start = time.perf_counter()
            call()
            seconds[key].append(time.perf_counter() - start)
    rate_after = matmul_gflops()
    rate = (rate_before + rate_after) / 2
    print(f"{machine()}; load average (1 / 5 / 15 min) {load_before} before, {load()} after")
    print(
        f"batch 1, {HEADS} heads, head dim {HEAD_DIM}, float32, GGD + SSMax, {KEYS} keys; "
        f"matmul {rate_before:.0f} / {rate_after:.0f} GFLOP/s (before / after), "
        f"{args.rounds} rounds\n"
    )
    print("| shape | attention | median ms | fastest ms | / blockwise | attention / matmul |")
    print("|---|---|---|---|---|---|")
    for (shape, variant), times in seconds.items():
        queries = SHAPES[shape]
        pairs = sum(KEYS - queries + i + 1 for i in range(queries))
        median = statistics.median(times)
        baseline = statistics.median(seconds[(shape, None)])
        share = 4 * HEAD_DIM * HEADS * pairs / median / 1e9 / rate
        print(
            f"| {shape} | {names[variant]} | {median * 1e3:.1f} | {min(times) * 1e3:.1f} "
            f"| {median / baseline:.2f}x | {share:.1%} |"
        )


if __name__ == "__main__":
    main()
