"""The command line: the sections in order, the exit status."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from bam_jax.kernels.registry import FUSED_BACKENDS
from bam_jax.provenance import matmul_gflops
from bench.accelerator_check import __doc__ as DESCRIPTION
from bench.accelerator_check.autotune import run_autotune
from bench.accelerator_check.gate import run_gate
from bench.accelerator_check.report import Deadline, Report, UserError, stop_at_deadline
from bench.accelerator_check.settings import (
    DEFAULT_HEAD_DIM,
    Settings,
    default_out_path,
    device_kind,
    make_settings,
)
from bench.accelerator_check.throughput import (
    ALL_VARIANTS,
    DEFAULT_VARIANTS,
    ThroughputRun,
    run_throughput,
)
from bench.accelerator_check.training import run_training

DEFAULT_DEADLINE_S = 450.0
SECTIONS = ("gate", "throughput", "training", "autotune")
DEFAULT_SECTIONS = ("gate", "throughput", "training")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=DESCRIPTION.split("\n")[0])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes on CPU, kernels in interpret mode: proves the script, measures nothing",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="markdown table, rewritten after every row"
    )
    parser.add_argument("--deadline-s", type=float, default=DEFAULT_DEADLINE_S)
    parser.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS), choices=SECTIONS)
    parser.add_argument("--lengths", type=int, nargs="+", default=None)
    parser.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help=f"throughput and autotune rows (default {DEFAULT_HEAD_DIM})",
    )
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=ALL_VARIANTS
    )
    parser.add_argument("--iters", type=int, default=3, help="timed calls per throughput row")
    parser.add_argument("--train-batch", type=int, default=16, help="sequences per training step")
    args = parser.parse_args(argv)
    for name in ("deadline_s", "iters", "train_batch"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.head_dim is not None and args.head_dim <= 0:
        parser.error(f"--head-dim must be positive, got {args.head_dim}")
    if args.lengths and min(args.lengths) <= 0:
        parser.error(f"--lengths must be positive, got {args.lengths}")
    return args


def header(settings: Settings, args: argparse.Namespace, today: datetime.date) -> list[str]:
    kind = device_kind()
    mode = "compiled"
    if settings.interpret:
        mode = "smoke run, Pallas in interpret mode: timings mean nothing"
    backend = FUSED_BACKENDS.get(settings.platform)
    validated = "yes" if backend and kind in backend.validated_devices else "no"
    return [
        f"# Accelerator check: {kind}, {today.isoformat()}",
        "",
        f"jax {jax.__version__}, platform {settings.platform}, {jax.device_count()} device(s), "
        f"{mode}; deadline {args.deadline_s:.0f} s. "
        f"Listed in the {settings.platform} backend's validated_devices: {validated}.",
    ]


def run_check(args: argparse.Namespace) -> int:
    """0 when the gate passed (or was not run), 1 when it failed."""
    settings = make_settings(args)
    today = datetime.date.today()
    report = Report(args.out or default_out_path(today))
    deadline = Deadline(args.deadline_s)
    timer = stop_at_deadline(report, deadline)
    report.add(*header(settings, args, today))
    n = 256 if settings.interpret else 8192
    f32_tflops = matmul_gflops(n, repeats=5) / 1e3
    bf16_tflops = matmul_gflops(n, repeats=5, dtype=jnp.bfloat16) / 1e3
    report.add(
        "",
        f"Matmul {n}x{n}, precision highest: float32 {f32_tflops:.2f} TFLOP/s, "
        f"bfloat16 {bf16_tflops:.2f} TFLOP/s; 'vs f32 matmul' divides by the float32 rate.",
    )
    gate_passed = run_gate(report, settings) if "gate" in args.sections else True
    if "throughput" in args.sections:
        run = ThroughputRun(report, settings, deadline, f32_tflops, gate_passed)
        run_throughput(run, tuple(args.variants))
    if "training" in args.sections:
        run_training(report, settings, deadline, f32_tflops, gate_passed)
    if "autotune" in args.sections:
        run_autotune(report, settings, deadline, f32_tflops, gate_passed)
    timer.cancel()
    elapsed = args.deadline_s - deadline.remaining()
    report.add("", f"Finished in {elapsed:.0f} s; table: {report.path}")
    return 0 if gate_passed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return run_check(args)
    except UserError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
