"""Steps/s of the training loop itself (data, dispatch, metrics) on the tiny preset, for two
checkouts of the project side by side.

  git worktree add /tmp/wt-before COMMIT
  python -m bench.loop_overlap --before=/tmp/wt-before --after=. --repeats=3

Each run is a fresh process that calls `bam_train.loop.train` on the tiny preset with
validation off and one checkpoint at the end; steps/s is read from metrics.jsonl over the
windows after the first (which may hold compilation), so both checkouts are timed the same
way. Runs of the two checkouts are interleaved, and the float32 matmul rate is measured
before each, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap

RUN = """
import json, sys, time
from bam_configs.presets import preset
from bam_train.loop import train
from bam_train.metrics import read_metrics

steps, log_every, workdir = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = preset("tiny").replace(
    steps=steps, log_every=log_every, eval_every=0, checkpoint_every=steps, progress_bar=False
)
start = time.perf_counter()
train(cfg, workdir)
wall = time.perf_counter() - start
times = [r["step_time_s"] for r in read_metrics(workdir) if "step_time_s" in r][1:]
print("RESULT" + json.dumps({"steps_per_s": len(times) / sum(times), "wall_s": wall}))
"""

MATMUL = """
import time, jax, jax.numpy as jnp
a = jnp.ones((2048, 2048), jnp.float32)
f = jax.jit(lambda x: x @ x)
jax.block_until_ready(f(a))
start = time.perf_counter()
for _ in range(5):
    jax.block_until_ready(f(a))
print("RESULT", 2 * 2048**3 * 5 / (time.perf_counter() - start) / 1e9)
"""


def run_python(code: str, tree: str, *args: str) -> str:
    env = {**os.environ, "PYTHONPATH": tree, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.split("RESULT", 1)[1].strip()


def measure(tree: str, steps: int, log_every: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as workdir:
        return json.loads(run_python(RUN, tree, str(steps), str(log_every), workdir))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="checkout of the earlier loop")
    parser.add_argument("--after", default=".", help="checkout of the later loop")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--log_every", type=int, default=10)
    args = parser.parse_args()
    trees = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("| run | checkout | float32 matmul GFLOP/s | steps/s | wall s (with compile) |")
    print("|---|---|---|---|---|")
    for repeat in range(1, args.repeats + 1):
        for name, tree in trees.items():
            gflops = float(run_python(MATMUL, tree))
            r = measure(tree, args.steps, args.log_every)
            print(
                f"| {repeat} | {name} | {gflops:.0f} | {r['steps_per_s']:.1f} | "
                f"{r['wall_s']:.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
