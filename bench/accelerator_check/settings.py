"""What the check runs at: full size on an accelerator, tiny sizes with --smoke."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import re
from pathlib import Path

import jax

from bench.accelerator_check.report import UserError

DEFAULT_LENGTHS = (16384, 32768, 131072)
DEFAULT_HEAD_DIM = 128


@dataclasses.dataclass(frozen=True)
class Settings:
    backend: str  # "gpu" or "tpu": the kernel's lowering
    interpret: bool  # Pallas interpret mode (CPU smoke run)
    platform: str
    lengths: tuple[int, ...]
    heads: int
    head_dim: int
    iters: int
    max_seconds_per_row: float
    compile_allowance_s: float
    block_q: int | None
    block_k: int | None
    train_batch: int
    train_steps: int


def make_settings(args: argparse.Namespace) -> Settings:
    platform = jax.default_backend()
    if args.smoke:
        return Settings(
            backend="gpu",
            interpret=True,
            platform=platform,
            lengths=tuple(args.lengths or (64,)),
            heads=2,
            head_dim=args.head_dim or 32,
            iters=1,
            max_seconds_per_row=5.0,
            compile_allowance_s=2.0,
            block_q=32,
            block_k=16,
            train_batch=2,
            train_steps=2,
        )
    if platform not in ("gpu", "tpu"):
        raise UserError(
            f"no GPU or TPU found (JAX backend is {platform!r}); run on an accelerator, "
            "or pass --smoke for a tiny CPU run that proves the script works"
        )
    return Settings(
        backend=platform,
        interpret=False,
        platform=platform,
        lengths=tuple(args.lengths or DEFAULT_LENGTHS),
        heads=16,
        head_dim=args.head_dim or DEFAULT_HEAD_DIM,
        iters=args.iters,
        max_seconds_per_row=20.0,
        compile_allowance_s=15.0,
        block_q=None,
        block_k=None,
        train_batch=args.train_batch,
        train_steps=5,
    )


def device_kind() -> str:
    return jax.devices()[0].device_kind


def default_out_path(today: datetime.date) -> Path:
    name = re.sub(r"[^A-Za-z0-9_.-]+", "-", device_kind()).strip("-") or "device"
    return Path("results/accelerator_check") / f"{name}-{today.isoformat()}.md"
