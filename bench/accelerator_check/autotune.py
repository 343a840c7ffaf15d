"""d. The GGD forward over GPU block sizes, warps and stages, fastest first."""

from __future__ import annotations

import functools
from itertools import product

import jax
import jax.numpy as jnp

from bam_jax.attention_spec import AttentionSpec
from bam_jax.fused_attention import fused_attention
from bench.accelerator_check.gate import make_prior
from bench.accelerator_check.report import Deadline, Report, one_line
from bench.accelerator_check.settings import Settings
from bench.accelerator_check.throughput import causal_forward_flops, time_call

AUTOTUNE_GRID = {
    "block_q": (64, 128, 256),
    "block_k": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}


def autotune_configs(settings: Settings) -> list[dict[str, int]]:
    """Every AUTOTUNE_GRID combination the GPU kernel accepts (smoke: the small blocks)."""
    names = tuple(AUTOTUNE_GRID)
    configs = [dict(zip(names, values, strict=True)) for values in product(*AUTOTUNE_GRID.values())]
    if settings.interpret:
        configs = [c for c in configs if c["block_q"] == 64 and c["block_k"] == 32][:2]
    return configs


def run_autotune(
    report: Report, settings: Settings, deadline: Deadline, f32_tflops: float, gate_passed: bool
) -> None:
    length, s = settings.lengths[0], settings
    report.table(
        f"d. Autotune: pallas+ggd forward, T {length}, D {s.head_dim}, {s.heads} heads, bf16",
        ("block_q", "block_k", "warps", "stages", "ms", "TFLOP/s", "vs f32 matmul", "note"),
    )
    if not gate_passed:
        report.row("", "", "", "", "", "", "", "skipped: the gate failed")
        return
    keys = jax.random.split(jax.random.key(length), 3)
    shape = (1, length, s.heads, s.head_dim)
    qkv = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    prior = make_prior("ggd", s.heads)
    flops = causal_forward_flops(1, s.heads, length, s.head_dim)
    results = []
    for config in autotune_configs(settings):
        cells = tuple(config.values())
        if deadline.remaining() < s.compile_allowance_s:
            report.row(*cells, "", "", "", "skipped: would pass the deadline")
            continue
        spec = AttentionSpec(block_q=config["block_q"], block_k=config["block_k"])
        fn = jax.jit(
            functools.partial(
                fused_attention,
                spec=spec,
                backend=s.backend,
                interpret=s.interpret,
                prior=prior,
                num_warps=config["num_warps"],
                num_stages=config["num_stages"],
            )
        )
        try:
            _, median = time_call(fn, qkv, s.iters, s.max_seconds_per_row)
        except Exception as error:
            report.row(*cells, "", "", "", f"failed: {one_line(error)}")
            continue
        tflops = flops / median / 1e12
        results.append((median, config))
        report.row(
            *cells, f"{median * 1e3:.3g}", f"{tflops:.3g}", f"{tflops / f32_tflops:.2f}x", ""
        )
    if results:
        best = min(results, key=lambda item: item[0])[1]
        padded = max(16, 1 << (s.head_dim - 1).bit_length())
        values = ", ".join(str(v) for v in best.values())
        report.add("", f"Fastest: `GPU_DEFAULTS[{padded}] = GpuDefaults({values})`")
