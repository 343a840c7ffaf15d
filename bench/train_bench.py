"""Training throughput: wall time of a full optimizer step against the float32 matmul rate
measured in the same run.

  python -m bench.train_bench                       # tiny, quickstart, anchor, l6
  python -m bench.train_bench --configs=anchor --steps=10 --rounds=3

Rows:
  tiny        the tiny preset (bam_ssmax, dim 64, 2 layers, context 128, batch 16)
  quickstart  the `bam-quickstart` preset (toy model, vocabulary 128, batch 32, loss on 16
              positions and the answer digits)
  anchor      the anchor configuration (docs/benchmarks.md): bam_ssmax, dim 256, 4 layers,
              8 heads, vocabulary 32768, context 256, batch 16, float32, loss on every token
  l6          the paper's l6 model (dim 512, 6 layers, 16 heads) at context 512, batch 4

Each step is the full optimizer step (forward, backward, RAdam with weight decay, clipping)
of the jitted, state-donating train step; one prepared batch is fed, so data loading is not
timed. Wall time only: run it on an otherwise idle machine. The float32 matmul rate (2048^3
products) is measured right before and after each row, and the row's "model FLOPs /
matmul" is 6 x parameters x tokens per second over the mean of the two, the ratio the
anchor of the authors' code is quoted in (74% on 2 cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from collections.abc import Callable

import jax

from bam_configs.presets import preset
from bam_configs.training import DataConfig, TrainConfig
from bam_jax.model_state import count_params
from bam_jax.provenance import matmul_gflops
from bam_train.data import train_iterator
from bam_train.setup import build


def bench_configs() -> dict[str, TrainConfig]:
    l6 = preset("l6_512")
    l6 = l6.replace(
        model=l6.model.replace(dtype="float32"),
        data=DataConfig(source="passkey", passkey_loss="all"),
        batch_size=4,
        tokens_per_step=0,
        eval_every=0,
    )
    return {
        "tiny": preset("tiny"),
        "quickstart": preset("quickstart"),
        "anchor": preset("anchor"),
        "l6": l6,
    }


def measure(
    cfg: TrainConfig,
    steps: int,
    warmup: int = 2,
    seconds_left: Callable[[], float] | None = None,
) -> dict[str, float]:
    """Compile time, median step time and throughput of `cfg`'s train step over `steps`
    timed steps (fewer when `seconds_left()` falls under ten of the slowest step)."""
    setup = build(cfg)
    start = time.perf_counter()
    compiled = setup.train_step.lower(
        setup.abstract_sharded_state(), setup.abstract_batch(), setup.step_values
    ).compile()
    compile_s = time.perf_counter() - start
    state = setup.init()
    batch = setup.global_batch(next(train_iterator(cfg.data, cfg.seq_len, 0, setup.layout())))
    for _ in range(warmup):
        state, metrics = compiled(state, batch, setup.step_values)
    jax.block_until_ready(metrics)
    times: list[float] = []
    while len(times) < steps:
        if times and seconds_left is not None and seconds_left() < 10 * max(times):
            break
        start = time.perf_counter()
        state, metrics = compiled(state, batch, setup.step_values)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens = cfg.accum_steps * cfg.batch_size * cfg.seq_len
    params = count_params(setup.abstract_state.params)
    return {
        "params": params,
        "tokens_per_step": tokens,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "model_gflops": 6 * params * tokens / step_s / 1e9,
    }


HEADER = (
    "| round | config | params | tokens/step | compile s | step s | tokens/s | "
    "matmul GFLOP/s (before/after) | model FLOPs / matmul |\n"
    "|---|---|---|---|---|---|---|---|---|"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,quickstart,anchor,l6")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per row")
    parser.add_argument("--rounds", type=int, default=1, help="times to run every row")
    parser.add_argument("--attention_impl", default=None, help="override for every row")
    args = parser.parse_args()
    configs = bench_configs()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(HEADER)
    for round_ in range(1, args.rounds + 1):
        for name in args.configs.split(","):
            cfg = configs[name]
            if args.attention_impl:
                model = dataclasses.replace(cfg.model, attention_impl=args.attention_impl)
                cfg = cfg.replace(model=model)
            before = matmul_gflops()
            r = measure(cfg, args.steps)
            after = matmul_gflops()
            ratio = r["model_gflops"] / ((before + after) / 2)
            print(
                f"| {round_} | {name} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | "
                f"{r['compile_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{before:.0f} / {after:.0f} | {ratio:.0%} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
