"""Forward throughput of the Pallas attention kernel, with and without the GGD prior.

On a GPU (or TPU) this times, for every sequence length and head dim:
  pallas              the kernel without any prior (the baseline of the ratio column)
  pallas+ggd          the kernel with the generalized Gaussian prior computed in-kernel
  pallas+ggd-noreuse  the same, each GGD tile evaluated per query sub-block (no reuse)
  cudnn               jax.nn.dot_product_attention(implementation="cudnn", is_causal=True)
Optional variants: pallas+ggd+ssmax, pallas+alibi, pallas+ggd-exact (exact exp2/log2
instead of the hardware approximations). Causal forward FLOPs = 2 * 2 * B * H * T * T / 2 * D.
Before timing it checks the compiled kernel against the reference oracle (values and
gradients) at a small size. Every configuration is caught separately; failures appear in
the table. Rows are printed as they finish, so a run cut short by a timeout keeps them.

    PYTHONPATH=. python bench/pallas_bench.py --out pallas_bench.md   # GPU/TPU
    PYTHONPATH=. python bench/pallas_bench.py --interpret             # CPU sanity run
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bam_jax.attention import reference_attention
from bam_jax.pallas_attention import pallas_attention
from bam_jax.priors import AlibiPrior, GGDPrior, alibi_slopes

DEFAULT_LENGTHS = (4096, 8192, 16384, 32768, 65536, 131072)
DEFAULT_VARIANTS = ("pallas+ggd", "pallas", "cudnn", "pallas+ggd-noreuse")
ALL_VARIANTS = (
    "pallas+ggd",
    "pallas",
    "cudnn",
    "pallas+ggd+ssmax",
    "pallas+alibi",
    "pallas+ggd-exact",
    "pallas+ggd-noreuse",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument(
        "--tokens-per-batch",
        type=int,
        default=16384,
        help="batch = max(1, tokens_per_batch // length), so short lengths fill the device",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS
    )
    parser.add_argument("--block-q", type=int, default=None)
    parser.add_argument("--block-k", type=int, default=None)
    parser.add_argument("--num-warps", type=int, default=None)
    parser.add_argument("--num-stages", type=int, default=None)
    parser.add_argument("--iters", type=int, default=3, help="timed calls per configuration")
    parser.add_argument(
        "--max-seconds-per-config",
        type=float,
        default=20.0,
        help="stop timing a configuration after this many seconds",
    )
    parser.add_argument("--no-check", action="store_true", help="skip the correctness check")
    parser.add_argument(
        "--interpret",
        action="store_true",
        help="CPU: tiny interpret-mode sanity run (timings meaningless)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    return parser.parse_args(argv)


def make_prior(kind: str, heads: int):
    if kind == "ggd":
        rng = np.random.default_rng(0)
        return GGDPrior(
            jnp.asarray(np.log(rng.uniform(0.01, 0.5, heads)), jnp.float32),
            jnp.asarray(np.linspace(-0.5, 1.7, heads), jnp.float32),
            jnp.zeros((heads,), jnp.float32),
        )
    if kind == "alibi":
        return AlibiPrior(jnp.asarray(alibi_slopes(heads)))
    return None


def build_variant(variant: str, args: argparse.Namespace, backend: str, heads: int) -> Callable:
    """A jitted f(q, k, v) -> out for one variant."""
    if variant == "cudnn":
        if backend != "gpu":
            raise RuntimeError("cuDNN attention needs a GPU")
        return jax.jit(
            lambda q, k, v: jax.nn.dot_product_attention(
                q, k, v, is_causal=True, implementation="cudnn"
            )
        )
    prior_kind = "ggd" if "ggd" in variant else "alibi" if "alibi" in variant else None
    prior = make_prior(prior_kind, heads) if prior_kind else None
    ssmax = jnp.ones((heads,), jnp.float32) if "ssmax" in variant else None
    options = dict(
        prior=prior,
        ssmax_scale_H=ssmax,
        backend=backend,
        interpret=args.interpret,
        approx_math="exact" not in variant,
        prior_reuse="noreuse" not in variant,
        block_q=args.block_q,
        block_k=args.block_k,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
    )
    return jax.jit(lambda q, k, v: pallas_attention(q, k, v, **options))


def time_call(fn: Callable, inputs: tuple, iters: int, max_seconds: float) -> tuple[float, float]:
    """(compile + first call seconds, median seconds of the timed calls)."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*inputs))
    first = time.perf_counter() - start
    times = []
    budget_start = time.perf_counter()
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
        if time.perf_counter() - budget_start > max_seconds:
            break
    return first, statistics.median(times)


def causal_flops(batch: int, heads: int, length: int, head_dim: int) -> float:
    return 2 * 2 * batch * heads * length * length / 2 * head_dim


def correctness_check(backend: str, interpret: bool) -> list[str]:
    """Compiled kernel vs the reference oracle: values (f32 and bf16) and gradients."""
    rng = np.random.default_rng(1)
    lines = []
    for head_dim in (64, 128, 48):
        lines += check_head_dim(backend, interpret, head_dim, rng)
    return lines


def check_head_dim(backend: str, interpret: bool, head_dim: int, rng) -> list[str]:
    batch, length, heads, kv_heads = 2, 300, 4, 2
    q = jnp.asarray(rng.normal(size=(batch, length, heads, head_dim)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, head_dim)), jnp.float32)
    seg = np.sort(rng.integers(0, 3, size=(batch, length)), axis=1)
    seg[:, -5:] = -1
    seg = jnp.asarray(seg, jnp.int32)
    kwargs = dict(query_segment_ids_BxT=seg, key_segment_ids_BxS=seg)
    prior = make_prior("ggd", heads)
    scale = jnp.asarray(rng.uniform(0.5, 1.5, heads), jnp.float32)

    def pallas_fn(q, k, v, prior, scale):
        return pallas_attention(
            q,
            k,
            v,
            prior=prior,
            ssmax_scale_H=scale,
            backend=backend,
            interpret=interpret,
            **kwargs,
        )

    def reference_fn(q, k, v, prior, scale):
        return reference_attention(
            q,
            k,
            v,
            prior=prior,
            ssmax_scale_H=scale,
            ssmax_prior_inside=True,
            query_offset=0,
            causal=True,
            window=None,
            **kwargs,
        )

    lines = []
    for dtype in (jnp.float32, jnp.bfloat16):
        cast = tuple(x.astype(dtype) for x in (q, k, v))
        got = jax.jit(pallas_fn)(*cast, prior, scale).astype(jnp.float32)
        want = reference_fn(*cast, prior, scale).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(got - want)))
        lines.append(f"values    D={head_dim:<3} {jnp.dtype(dtype).name:<8} max|err| = {err:.2e}")

    def loss(fn, *args):
        return jnp.sum(jnp.sin(fn(*args)))

    argnums = (0, 1, 2, 3, 4)
    got = jax.jit(jax.grad(functools.partial(loss, pallas_fn), argnums))(q, k, v, prior, scale)
    want = jax.grad(functools.partial(loss, reference_fn), argnums)(q, k, v, prior, scale)
    rel = max(
        float(jnp.max(jnp.abs(g - w)) / jnp.maximum(jnp.max(jnp.abs(w)), 1e-6))
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    )
    lines.append(f"gradients D={head_dim:<3} float32  max relative err = {rel:.2e}")
    return lines


def failure_row(head_dim: int, length: int, batch: int, variant: str, error: Exception) -> str:
    message = f"{type(error).__name__}: {error}".replace("\n", " ").replace("|", "/")
    return f"| {head_dim} | {length} | {batch} | {variant} | failed: {message:.160} | | | |"


def run_table(args: argparse.Namespace, backend: str) -> list[str]:
    """Time every (head dim, length, variant); print each row as soon as it is measured."""
    table = [
        "| D | T | batch | variant | TFLOP/s | ms | vs pallas (no prior) | compile s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    print("\n".join(table), flush=True)
    for head_dim in args.head_dims:
        for length in args.lengths:
            for row in time_length(args, backend, head_dim, length):
                print(row, flush=True)
                table.append(row)
    return table


def time_length(args: argparse.Namespace, backend: str, head_dim: int, length: int):
    """Rows for one (head dim, length); the no-prior kernel is timed first, as the baseline."""
    batch = max(1, args.tokens_per_batch // length)
    shape = (batch, length, args.heads, head_dim)
    try:
        keys = jax.random.split(jax.random.key(length + head_dim), 3)
        inputs = tuple(jax.random.normal(key, shape, jnp.bfloat16) for key in keys)
    except Exception as error:
        yield failure_row(head_dim, length, batch, "inputs", error)
        return
    flops = causal_flops(batch, args.heads, length, head_dim)
    baseline = None
    for variant in sorted(args.variants, key=lambda name: name != "pallas"):
        try:
            fn = build_variant(variant, args, backend, args.heads)
            first, median = time_call(fn, inputs, args.iters, args.max_seconds_per_config)
        except Exception as error:
            yield failure_row(head_dim, length, batch, variant, error)
            continue
        if variant == "pallas":
            baseline = median
        ratio = f"{median / baseline:.2f}x" if baseline and variant != "pallas" else ""
        yield (
            f"| {head_dim} | {length} | {batch} | {variant} | {flops / median / 1e12:.1f} | "
            f"{median * 1e3:.2f} | {ratio} | {first:.1f} |"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    platform = jax.default_backend()
    if platform not in ("gpu", "tpu") and not args.interpret:
        print(
            f"pallas_bench: no GPU or TPU found (JAX backend is {platform!r}). The benchmark "
            "needs an accelerator; run with --interpret for a tiny CPU sanity check.",
            file=sys.stderr,
        )
        return 2
    backend = platform if platform in ("gpu", "tpu") else "gpu"
    if args.interpret:
        args.lengths, args.head_dims, args.heads, args.iters = [64, 128], [64], 2, 1
        args.tokens_per_batch = 128
        args.block_q = args.block_q or 32
        args.block_k = args.block_k or 32
    device = jax.devices()[0]
    header = [
        f"# Pallas attention forward, {getattr(device, 'device_kind', platform)}",
        f"jax {jax.__version__}, backend {backend}{' (interpret)' if args.interpret else ''}, "
        f"bf16 inputs, causal, {args.heads} heads, batch = max(1, {args.tokens_per_batch} // T)",
        "",
    ]
    print("\n".join(header), flush=True)
    report = list(header)
    if not args.no_check:
        try:
            check_lines = correctness_check(backend, args.interpret)
        except Exception as error:  # a broken kernel must not hide the rest of the report
            check_lines = [f"correctness check FAILED: {type(error).__name__}: {error}"[:400]]
            traceback.print_exc()
        check_block = [
            "## Correctness vs reference (T=300, GQA 4/2, GGD+SSMax+documents)",
            "",
            "```",
            *check_lines,
            "```",
            "",
        ]
        print("\n".join(check_block), flush=True)
        report += check_block

    table = run_table(args, backend)
    report += table
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(report) + "\n")
        print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
