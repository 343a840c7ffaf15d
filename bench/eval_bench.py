"""Passkey evaluation speed and memory: seconds per sample and peak memory by prompt length.

    python -m bench.eval_bench                       # tiny, l6 at 1k..64k; anchor at 4k..16k
    python -m bench.eval_bench --models anchor --lengths 4k,8k,16k

Each (model, length) runs in a fresh process, so its peak resident memory (ru_maxrss:
JAX runtime, weights, KV cache, scratch) is its own. Random weights (speed does not depend
on them), the Mistral tokenizer and the paper's prompt; one untimed sample compiles the
steps, then `--repeats` samples are timed. A length whose time, extrapolated
quadratically from the previous one, exceeds `--max-seconds` is not run (its planned
memory is still compiled and shown) and marked so.
Columns: wall seconds per sample, CPU seconds per sample (all threads), the first call
(compile + one sample), peak RSS, the KV cache and the compiled scratch of one prefill
step, the float32 matmul rate measured in the same child before and after the timed
samples, and the attention's share of it: causal attention FLOPs (4 x head dim per visible
logit, every layer and head) per second over the mean matmul rate. The attention and its
blocks are the evaluation's defaults (bam_eval.models.for_inference: the fused kernel on
CPU) unless --attention/--block-q/--block-k.

"anchor" is the long-context inference configuration of docs/benchmarks.md (bam_ssmax, dim 256,
4 layers, 8 heads, vocabulary 32768, chunk 512), where the reference PyTorch code takes
4.8 s at 4k, 17.7 s at 8k and 61 s at 16k with 4.4 GB peak.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
MODELS = {
    "tiny": {"preset": "toy"},
    "l6": {"preset": "l6"},
    "anchor": {"preset": "toy", "dim": 256, "n_layers": 4, "n_heads": 8},
}
DEFAULT_LENGTHS = {
    "tiny": "1024,8192,32768,65536",
    "l6": "1024,8192,32768,65536",
    "anchor": "4096,8192,16384",
}
REFERENCE_SECONDS = {4096: 4.8, 8192: 17.7, 16384: 61.0}


def measure(
    model_name: str,
    length: int,
    chunk: int,
    attention: str | None,
    blocks: tuple[int | None, int | None],
    repeats: int,
    compile_only: bool,
) -> dict:
    """Runs in the child process: compile once, then time `repeats` samples (or only report
    the planned memory with `compile_only`)."""
    import numpy as np
    from flax import nnx

    from bam_eval.memory import cache_bytes_per_slot
    from bam_eval.models import for_inference
    from bam_eval.passkey import PasskeySettings, samples_for_length, score_samples
    from bam_jax.config import ModelConfig
    from bam_jax.inference import ChunkedForward
    from bam_jax.model import Transformer
    from bam_jax.provenance import matmul_gflops
    from bam_jax.tokenizers import get_tokenizer
    from bench.accelerator_check.throughput import causal_forward_flops

    spec = dict(MODELS[model_name])
    config = ModelConfig.of_size(spec.pop("preset"), encoding="bam_ssmax", **spec)
    model = for_inference(
        Transformer(config, rngs=nnx.Rngs(0)),
        attention_impl=attention,
        block_q=blocks[0],
        block_k=blocks[1],
    )
    scorer = ChunkedForward(model, chunk_size=chunk)
    tokenizer = get_tokenizer("mistral")
    samples = samples_for_length(
        tokenizer, length, PasskeySettings(n_samples=repeats + 1, sampling="random")
    )
    prompt_tokens = len(samples[0].tokens)
    planned = {
        "model": model_name,
        "length": length,
        "tokens": prompt_tokens,
        "cache_bytes": cache_bytes_per_slot(config) * prompt_tokens,
        "scratch_bytes": scorer.compiled_temp_bytes(1, prompt_tokens),
    }
    if compile_only:
        return planned
    start = time.perf_counter()
    score_samples(scorer, samples[:1])
    first = time.perf_counter() - start
    rate_before = matmul_gflops()
    start, cpu_start = time.perf_counter(), time.process_time()
    for s in samples[1:]:
        score_samples(scorer, [s])
    seconds = (time.perf_counter() - start) / repeats
    cpu_seconds = (time.process_time() - cpu_start) / repeats
    rate_after = matmul_gflops()
    cfg = model.config
    attention_flops = cfg.n_layers * causal_forward_flops(
        1, cfg.n_heads, prompt_tokens, cfg.head_dim
    )
    return {
        **planned,
        "attention": model.config.attention_impl,
        "block_q": model.config.block_q,
        "block_k": model.config.block_k,
        "seconds": seconds,
        "matmul_gflops": [rate_before, rate_after],
        "attention_of_matmul": attention_flops / seconds / 1e9 / ((rate_before + rate_after) / 2),
        "cpu_seconds": cpu_seconds,
        "load_average": os.getloadavg()[0],
        "first_call_seconds": first,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "params": int(sum(np.prod(x.shape) for x in _leaves(model))),
    }


def _leaves(model):
    import jax
    from flax import nnx

    return jax.tree.leaves(nnx.state(model))


def _parse_lengths(text: str) -> list[int]:
    from bam_eval.cli import parse_count

    return [parse_count(t) for t in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,l6,anchor")
    parser.add_argument("--lengths", default=None, help="default: per model, see DEFAULT_LENGTHS")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--attention", default=None, help="default: the evaluation's")
    parser.add_argument("--block-q", type=int, default=None, help="default: the evaluation's")
    parser.add_argument("--block-k", type=int, default=None, help="default: the evaluation's")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--compile-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model_name, length = args.child.split(":")
        blocks = (args.block_q, args.block_k)
        row = measure(
            model_name,
            int(length),
            args.chunk,
            args.attention,
            blocks,
            args.repeats,
            args.compile_only,
        )
        print("RESULT " + json.dumps(row))
        return

    rows = []
    print(
        f"{'model':>7} {'length':>7} {'tokens':>7} {'tiles':>9} {'s/sample':>9} {'cpu s':>7} "
        f"{'1st call':>8} {'peak RSS':>9} {'KV cache':>9} {'scratch':>9} {'load':>5} "
        f"{'matmul GFLOP/s':>14} {'attn/matmul':>11}  reference s (speed-up)"
    )
    for model_name in args.models.split(","):
        previous = None
        for length in _parse_lengths(args.lengths or DEFAULT_LENGTHS[model_name]):
            estimate = previous and previous["seconds"] * (length / previous["length"]) ** 2
            if estimate and estimate > args.max_seconds:
                row = _run_child(model_name, length, args, compile_only=True)
                guess = f"~{estimate:.0f}"
                print(
                    f"{model_name:>7} {length:>7} {row['tokens']:>7} {'-':>9} {guess:>9} "
                    f"{'-':>7} {'-':>8} {'-':>9} {_mib(row['cache_bytes']):>9} "
                    f"{_mib(row['scratch_bytes']):>9}  not run: quadratic extrapolation "
                    f"over --max-seconds {args.max_seconds:.0f}",
                    flush=True,
                )
                continue
            row = _run_child(model_name, length, args)
            rows.append(row)
            previous = row
            ref = REFERENCE_SECONDS.get(length) if model_name == "anchor" else None
            blocks = (
                f"{row['block_q']}x{row['block_k']}"
                if row["attention"] == "blockwise"
                else "kernel"
            )
            rates = "/".join(f"{r:.0f}" for r in row["matmul_gflops"])
            print(
                f"{model_name:>7} {length:>7} {row['tokens']:>7} {blocks:>9} "
                f"{row['seconds']:>9.2f} {row['cpu_seconds']:>7.2f} "
                f"{row['first_call_seconds']:>8.1f} {_mib(row['peak_rss_bytes']):>9} "
                f"{_mib(row['cache_bytes']):>9} {_mib(row['scratch_bytes']):>9} "
                f"{row['load_average']:>5.1f} {rates:>14} {row['attention_of_matmul']:>11.0%}  "
                + (f"{ref} ({ref / row['seconds']:.1f}x)" if ref else ""),
                flush=True,
            )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


def _run_child(
    model_name: str, length: int, args: argparse.Namespace, compile_only: bool = False
) -> dict:
    command = [
        sys.executable,
        "-m",
        "bench.eval_bench",
        "--child",
        f"{model_name}:{length}",
        "--chunk",
        str(args.chunk),
        "--repeats",
        str(args.repeats),
    ]
    options = (("--attention", args.attention), ("--block-q", args.block_q))
    for flag, value in (*options, ("--block-k", args.block_k)):
        if value is not None:
            command += [flag, str(value)]
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"benchmark child failed:\n{done.stderr[-3000:]}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB"


if __name__ == "__main__":
    main()
