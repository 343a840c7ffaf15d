"""Training throughput: steady-state step time and tokens/s, compile time reported apart.

  python bench/train_bench.py                       # tiny, anchor, l6 on the local devices
  python bench/train_bench.py --configs=tiny --steps=20

Rows:
  tiny    the tiny preset (bam_ssmax, dim 64, 2 layers, context 128, batch 16)
  anchor  the anchor configuration (docs/benchmarks.md): bam_ssmax, dim 256, 4 layers, 8 heads,
          vocabulary 32768, context 256, batch 16, float32 (the authors' code: 905 tokens/s
          on 2 cores)
  l6      the paper's l6 model (dim 512, 6 layers, 16 heads) at context 512, batch 4, float32

Each step is the full optimizer step (forward, backward, RAdam with weight decay, clipping);
the timed loop feeds one prepared batch so that data loading is not measured. On a shared
machine wall time depends on the load; the CPU seconds per step (all threads of this process)
divided by the core count estimate the step time of an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

import jax

from bam_configs.presets import preset
from bam_jax.model import count_params
from bam_train.config import TrainConfig
from bam_train.data import DataConfig, train_iterator
from bam_train.loop import build


def bench_configs() -> dict[str, TrainConfig]:
    l6 = preset("l6_512")
    l6 = l6.replace(
        model=l6.model.replace(dtype="float32", attention_impl="reference"),
        data=DataConfig(source="passkey", passkey_loss="all"),
        batch_size=4,
        tokens_per_step=0,
        eval_every=0,
    )
    return {"tiny": preset("tiny"), "anchor": preset("anchor"), "l6": l6}


def measure(cfg: TrainConfig, steps: int, warmup: int = 2) -> dict[str, float]:
    setup = build(cfg)
    start = time.perf_counter()
    compiled = setup.train_step.lower(
        setup.abstract_sharded_state(), setup.abstract_batch()
    ).compile()
    compile_s = time.perf_counter() - start
    state = setup.init()
    batch = setup.global_batch(next(train_iterator(cfg.data, cfg.seq_len, 0, setup.layout())))
    for _ in range(warmup):
        state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times, cpu_times = [], []
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        state, metrics = compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    step_s = statistics.median(times)
    tokens = cfg.accum_steps * cfg.batch_size * cfg.seq_len
    return {
        "params": count_params(setup.abstract_state.params),
        "tokens_per_step": tokens,
        "compile_s": compile_s,
        "step_s": step_s,
        "tokens_per_s": tokens / step_s,
        "cpu_s": statistics.median(cpu_times),
    }


def matmul_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Float32 matmul rate of this machine right now (the anchors quote ~186 GFLOP/s)."""
    a = jax.numpy.ones((n, n), jax.numpy.float32)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    start = time.perf_counter()
    for _ in range(repeats):
        jax.block_until_ready(matmul(a))
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="tiny,anchor,l6")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--attention_impl", default=None, help="override for every row")
    args = parser.parse_args()
    configs = bench_configs()
    print(f"devices: {jax.device_count()} x {jax.devices()[0].device_kind}")
    print(f"float32 matmul: {matmul_gflops():.0f} GFLOP/s (before the runs)")
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| config | params | tokens/step | compile s | step s | tokens/s | CPU s/step |")
    print("|---|---|---|---|---|---|---|")
    for name in args.configs.split(","):
        cfg = configs[name]
        if args.attention_impl:
            model = dataclasses.replace(cfg.model, attention_impl=args.attention_impl)
            cfg = cfg.replace(model=model)
        r = measure(cfg, args.steps)
        print(
            f"| {name} | {r['params'] / 1e6:.1f}M | {r['tokens_per_step']} | "
            f"{r['compile_s']:.1f} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['cpu_s']:.2f} |",
            flush=True,
        )
    print(f"float32 matmul: {matmul_gflops():.0f} GFLOP/s (after the runs)")


if __name__ == "__main__":
    main()
