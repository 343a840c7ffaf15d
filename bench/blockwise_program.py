"""The compiled program of one value-and-gradient of blockwise attention, against an earlier
revision of bam_jax/blockwise.py; prints a Markdown table.

    python -m bench.blockwise_program                    # this tree against main
    python -m bench.blockwise_program --before HEAD~1 --repeats 7

The standard case: batch 2, 8 query heads on 2 key/value heads, 1000 tokens (not a
multiple of the block), head dim 64, float32, causal, tiles of 256, a GGD prior with a
negative shape, SSMax and two documents a row. For each version (the earlier one is
`git show REV:bam_jax/blockwise.py`, loaded beside the current package) it reports the
while loops and lines of the optimized HLO, the compile seconds (lowering and
compilation, median of fresh compiles) and the median time of a compiled forward +
backward (three calls a round; wall time and the CPU time of all the process's threads,
which a busy machine inflates less), with the float32 matmul rate measured around them.
Versions alternate in every round, so that a machine shared with other work slows both
alike; the persistent compilation cache is off.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

import jax
import jax.numpy as jnp

from bam_jax import blockwise
from bam_jax.attention_spec import AttentionSpec
from bam_jax.priors import init_ggd_prior
from bam_jax.provenance import matmul_gflops

BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 1000, 8, 2, 64
PRIOR_SHAPE = -0.6


def load_revision(revision: str) -> ModuleType:
    """bam_jax/blockwise.py as of `revision`, as a module beside the current package."""
    root = Path(__file__).resolve().parents[1]
    source = subprocess.run(
        ["git", "show", f"{revision}:bam_jax/blockwise.py"],
        cwd=root,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "blockwise_before.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("blockwise_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def make_inputs() -> tuple:
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (BATCH, LENGTH, HEADS, HEAD_DIM), jnp.float32)
    k, v = (
        jax.random.normal(key, (BATCH, LENGTH, KV_HEADS, HEAD_DIM), jnp.float32)
        for key in keys[1:3]
    )
    prior = init_ggd_prior(HEADS, alpha_init="slope", beta_init=PRIOR_SHAPE)
    scale = jnp.ones((HEADS,), jnp.float32)
    boundary_B = jnp.array([LENGTH // 3, LENGTH // 2])
    segments_BxT = (jnp.arange(LENGTH)[None, :] >= boundary_B[:, None]).astype(jnp.int32)
    cotangent = jax.random.normal(keys[3], q.shape, jnp.float32)
    return (q, k, v, prior, scale), segments_BxT, cotangent


def value_and_grad_fn(module: ModuleType, segments_BxT, cotangent):
    spec = AttentionSpec(causal=True, implementation="blockwise")

    def loss(q, k, v, prior, scale):
        out = module.blockwise_attention(
            q,
            k,
            v,
            spec,
            prior=prior,
            ssmax_scale_H=scale,
            ssmax_max_count=None,
            query_segment_ids_BxT=segments_BxT,
            key_segment_ids_BxS=segments_BxT,
            query_offset=0,
        )
        return jnp.sum(out * cotangent)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def compile_once(fn, args: tuple):
    """Compiled program and the seconds its lowering and compilation took."""
    jax.clear_caches()
    start = time.perf_counter()
    compiled = fn.lower(*args).compile()
    return compiled, time.perf_counter() - start


def call_seconds(compiled, args: tuple) -> tuple[float, float]:
    """Wall and CPU seconds (all threads of this process) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    jax.block_until_ready(compiled(*args))
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="main", help="git revision to compare with")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    versions = {f"before ({args.before})": load_revision(args.before), "after": blockwise}
    inputs, segments_BxT, cotangent = make_inputs()
    fns = {name: value_and_grad_fn(m, segments_BxT, cotangent) for name, m in versions.items()}
    programs = {name: compile_once(fn, inputs)[0] for name, fn in fns.items()}
    compile_s = {name: [] for name in fns}
    walls = {name: [] for name in fns}
    gflops = [matmul_gflops()]
    for compiled in programs.values():
        call_seconds(compiled, inputs)
    for _ in range(args.repeats):
        for name, fn in fns.items():
            compile_s[name].append(compile_once(fn, inputs)[1])
            walls[name].extend(call_seconds(programs[name], inputs) for _ in range(3))
    gflops.append(matmul_gflops())
    print(
        f"batch {BATCH}, {HEADS} heads on {KV_HEADS} kv heads, {LENGTH} tokens, head dim "
        f"{HEAD_DIM}, tiles {blockwise.DEFAULT_BLOCK}, GGD shape {PRIOR_SHAPE}, SSMax, "
        f"documents; {jax.devices()[0].platform}, jax {jax.__version__}; float32 matmul "
        f"{gflops[0]:.0f} / {gflops[1]:.0f} GFLOP/s before / after the rounds; medians of "
        f"{args.repeats}\n"
    )
    print("| version | while loops | HLO lines | compile s | fwd+bwd wall ms | fwd+bwd CPU ms |")
    print("|---|---|---|---|---|---|")
    medians = {}
    for name, compiled in programs.items():
        hlo = compiled.as_text()
        wall_ms, cpu_ms = (statistics.median(x) * 1e3 for x in zip(*walls[name], strict=True))
        medians[name] = (statistics.median(compile_s[name]), wall_ms, cpu_ms)
        loops, lines = len(re.findall(r"\bwhile\(", hlo)), hlo.count("\n")
        cells = [name, str(loops), str(lines), f"{medians[name][0]:.2f}", f"{wall_ms:.1f}"]
        print("| " + " | ".join([*cells, f"{cpu_ms:.1f}"]) + " |")
    before, after = medians.values()
    print(
        f"\nafter / before: compile {after[0] / before[0]:.2f}x, fwd+bwd wall "
        f"{after[1] / before[1]:.2f}x, CPU {after[2] / before[2]:.2f}x"
    )


if __name__ == "__main__":
    main()
