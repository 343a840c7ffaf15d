"""bam-eval's per-sample memory estimate against the measured peak, per prompt length.

  taskset -c 0 python -m bench.eval_memory --lengths 65536 1048576 4194304 16777216
  python -m bench.eval_memory --device --lengths 65536 1048576 16777216   # on an accelerator

The model is the quickstart preset's (random weights: memory does not depend on them)
under bam-eval's inference settings (`InferenceSettings()`: chunks of 512, the default
attention and blocks). For each length a fresh process computes the estimate as `bam-eval
passkey` does for a sweep whose longest length it is (`bam_eval.memory`: the KV cache plus
activations and token ids) and XLA's plan for the two chunk steps at that capacity (the
cache plus the larger step's `memory_analysis().temp_size_in_bytes`: compiled, never run,
so it is shown at every length). Another fresh process then measures one passkey sample of
the length (built with the model's tokenizer).

On a CPU the measured peak is the rise of resident memory over the process before the
sample: both chunk steps are compiled at the cache capacity first (a warm-up prompt of two
chunks), the memory the warm-up freed goes back to the kernel (glibc's malloc_trim) and the
kernel's peak-RSS counter is reset (/proc/self/clear_refs); the peak is taken over the
lower of the resident memory before the sample and after it (the runtime may free some of
the warm-up's buffers only during the sample). Every chunk runs the same
compiled program, whose buffers XLA sizes statically whatever the number of filled slots,
so the sample's host arrays are built whole (its tokens, the batch and the padded chunks)
but only its first two chunks run (one that only fills the cache, one that is scored), in
a cache of the length's capacity made of ones rather than zeros, so that all of it is
resident (the kernel maps untouched zero pages lazily) as after a whole prompt: the memory
of the whole sample without its O(length^2) time. `--full` scores whole samples instead
(feasible up to ~64k tokens on a CPU), which checks that shortcut.

With `--device` the default jax device is used (an accelerator) and the measured peak is
its allocator's `peak_bytes_in_use` over the bytes in use before the sample (the weights);
the token arrays stay on the host there and are not counted, and whatever compiling the
steps allocates on the device is (they compile within the sample).

A length whose estimate exceeds half of the memory available now (MemAvailable on a CPU,
the device's `bytes_limit` with `--device`) is not measured; the table says whether bam-eval
refuses it up front with the default 4 GiB budget.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEASURE = """
import ctypes, gc, json, sys
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from bam_configs.presets import preset
from bam_eval.api import InferenceSettings
from bam_eval.memory import activation_bytes, cache_bytes_per_slot, check_sample_memory
from bam_eval.passkey import PasskeySettings, samples_for_length, score_samples, stack_samples
from bam_jax.inference import capacity_bucket
from bam_jax.kv_cache import KVCache
from bam_jax.model import Transformer
from bam_jax.retrieval import task_token_budget
from bam_jax.tokenizers import get_tokenizer

length, mode, on_device = int(sys.argv[1]), sys.argv[2], sys.argv[3] == "device"
DEFAULT_BUDGET = 4 << 30


def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field + ":"))


def device_stats():
    return jax.devices()[0].memory_stats()


def resident_cache(batch, slots):
    c = inference_config
    shape = (batch, slots, c.kv_heads, c.head_dim)
    ones = lambda: jnp.ones(shape, c.dtype)
    return KVCache(
        keys=tuple(ones() for _ in range(c.n_layers)),
        values=tuple(ones() for _ in range(c.n_layers)),
        length=jnp.zeros((), jnp.int32),
    )


def refused_by_default():
    try:
        check_sample_memory("passkey", capacity, per_slot, activations, DEFAULT_BUDGET, "")
    except ValueError:
        return True
    return False


def measure_on_cpu(samples_of_length):
    # Compiles both steps for this capacity and builds the prompt template.
    warm = samples_for_length(tokenizer, 2 * inference.chunk_size, passkey)
    score_samples(forward, warm, batch_size=1)
    del warm
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the warm-up's freed memory back to the kernel
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak RSS (VmHWM) starts again from the current RSS
    before = status("VmRSS")
    samples_of_length()
    peak = status("VmHWM")
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    # Some of the warm-up's memory may still be held at `before` and freed during the sample
    # (the runtime frees buffers asynchronously): the rest level is the lower of the two.
    return peak - min(before, status("VmRSS"))


def measure_on_device(samples_of_length):
    before = device_stats()["bytes_in_use"]
    samples_of_length()
    return device_stats()["peak_bytes_in_use"] - before


def run_sample():
    samples = samples_for_length(tokenizer, length, passkey)
    if mode == "full":
        score_samples(forward, samples, batch_size=1)
        return
    # The host arrays of the whole prompt, then its first two chunks in a cache of the
    # length's capacity whose every page is resident, as after the whole prompt.
    tokens_1xT, positions_1xP = stack_samples(samples)
    forward._padded_chunks(tokens_1xT)
    if not on_device:
        forward.cache_factory = resident_cache
    head = 2 * inference.chunk_size
    in_head_1xP = head - 1 - np.arange(positions_1xP.shape[1])[None]
    forward.logits_at(tokens_1xT[:, :head], in_head_1xP)


train_config = preset("quickstart")
inference = InferenceSettings()
model = Transformer(train_config.model, rngs=nnx.Rngs(0))
forward, inference_config = inference.prepare(model)
tokenizer = get_tokenizer(train_config.data.tokenizer)
passkey = PasskeySettings(n_samples=1, tokenizer=tokenizer.name)
# What bam-eval passkey computes for a sweep whose longest length is `length`
# (bam_eval.api.run_passkey, bam_eval.passkey.evaluate_passkey).
longest = task_token_budget(tokenizer, passkey.retrieval_task, length, passkey.prefix_digits)
capacity = capacity_bucket(longest, inference.chunk_size)
per_slot = cache_bytes_per_slot(inference_config)
activations = activation_bytes(
    inference_config, inference.chunk_size, capacity_bucket(length, inference.chunk_size)
)
forward.min_capacity = capacity
result = {"capacity": capacity, "cache": per_slot * capacity, "activations": activations}
if mode == "estimate":
    result["refused_by_default"] = refused_by_default()
    short = samples_for_length(tokenizer, 2 * inference.chunk_size, passkey)
    scored = len(short[0].score_positions)
    result["compiled_temp"] = forward.compiled_temp_bytes(1, longest, scored)
    result["limit"] = device_stats()["bytes_limit"] if on_device else None
else:
    measure = measure_on_device if on_device else measure_on_cpu
    result["measured"] = measure(run_sample)
print("RESULT" + json.dumps(result))
"""


def in_fresh_process(length: int, mode: str, on_device: bool) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO}
    if not on_device:
        env["JAX_PLATFORMS"] = "cpu"
    where = "device" if on_device else "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(MEASURE), str(length), mode, where],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    raise RuntimeError(f"length {length}, {mode}: exit {proc.returncode}:\n{proc.stderr[-3000:]}")


def available_memory() -> int:
    """What the kernel says can be allocated now without swapping (MemAvailable)."""
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def gib(n_bytes: float) -> str:
    return f"{n_bytes / 2**30:.3f}"


def table_row(length: int, estimated: dict, measured: int | None, room: int) -> str:
    estimate = estimated["cache"] + estimated["activations"]
    compiled = estimated["cache"] + estimated["compiled_temp"]
    up_front = "refused at 4 GiB" if estimated["refused_by_default"] else "accepted at 4 GiB"
    if measured is None:
        measured_cell = f"not run: over half of the {gib(2 * room)} GiB available"
        ratio = "-"
    else:
        measured_cell, ratio = gib(measured), f"{estimate / measured:.3f}"
    return (
        f"| {length:,} | {estimated['capacity']:,} | {gib(estimate)} "
        f"({gib(estimated['cache'])} + {gib(estimated['activations'])}) | {gib(compiled)} "
        f"| {measured_cell} | {ratio} | {up_front} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[65536, 1 << 20, 1 << 24])
    parser.add_argument("--full", action="store_true", help="whole prompts, not two chunks")
    parser.add_argument("--device", action="store_true", help="measure on the jax device")
    args = parser.parse_args()
    if min(args.lengths) < 1:
        parser.error(f"--lengths must be >= 1, got {min(args.lengths)}")
    print(
        "| tokens | cache slots | estimate GiB (cache + activations and token ids) "
        "| XLA's plan GiB (cache + scratch) | measured peak GiB | estimate / measured "
        "| bam-eval up front |"
    )
    print("|---|---|---|---|---|---|---|")
    upper_bound = True
    for length in args.lengths:
        estimated = in_fresh_process(length, "estimate", args.device)
        room = (estimated["limit"] or available_memory()) // 2
        estimate = estimated["cache"] + estimated["activations"]
        measured = None
        if estimate <= room:
            mode = "full" if args.full else "chunks"
            measured = in_fresh_process(length, mode, args.device)["measured"]
            upper_bound &= estimate >= measured
        print(table_row(length, estimated, measured, room), flush=True)
    print(f"\nthe estimate is {'an' if upper_bound else 'NOT an'} upper bound at every length run")
    sys.exit(0 if upper_bound else 1)


if __name__ == "__main__":
    main()
