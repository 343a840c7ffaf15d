"""Training configuration: frozen dataclasses checked on construction, plus the checks that
need the runtime (device count, files on disk, tokenizer) in `validate_for_runtime`.

Both run before anything is compiled, and every error names the field that is wrong.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from typing import Any

from bam_jax.config import ModelConfig
from train.data import DataConfig

MESH_AXES = ("data", "fsdp", "tensor")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """RAdam with decoupled weight decay; cosine schedule from `lr` to
    `final_lr_fraction * lr` after `warmup_steps` of linear warmup. Prior and SSMax
    parameters have their own peak learning rates and are never decayed."""

    lr: float = 1e-3
    prior_lr: float = 1e-3
    ssmax_lr: float = 1e-3
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 0
    final_lr_fraction: float = 0.1
    clip_norm: float = 1.0

    def __post_init__(self):
        for name in ("lr", "prior_lr", "ssmax_lr", "eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"optim.{name} must be > 0, got {getattr(self, name)}")
        for name in ("b1", "b2", "final_lr_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"optim.{name} must be in [0, 1], got {getattr(self, name)}")
        if self.weight_decay < 0 or self.clip_norm < 0 or self.warmup_steps < 0:
            raise ValueError(
                "optim.weight_decay, optim.clip_norm and optim.warmup_steps must be >= 0"
            )


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = self.sizes
        if any(s == 0 or s < -1 for s in sizes):
            raise ValueError(f"mesh: axis sizes must be positive or -1, got {sizes}")
        if sizes.count(-1) > 1:
            raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")

    @property
    def sizes(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    def resolve(self, n_devices: int) -> tuple[int, int, int]:
        """Axis sizes for `n_devices`, with -1 filled in."""
        known = math.prod(s for s in self.sizes if s != -1)
        if known > n_devices or n_devices % known:
            raise ValueError(
                f"mesh: {dict(zip(MESH_AXES, self.sizes, strict=True))} needs {known} devices "
                f"(or a divisor of the device count), but {n_devices} are available"
            )
        sizes = tuple(n_devices // known if s == -1 else s for s in self.sizes)
        if math.prod(sizes) != n_devices:
            raise ValueError(
                f"mesh: {dict(zip(MESH_AXES, sizes, strict=True))} uses {math.prod(sizes)} "
                f"devices, but {n_devices} are available; set one axis to -1"
            )
        return sizes  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. The sequence length is `model.max_seq_len`.

    `batch_size` sequences go through one forward/backward pass; gradients of
    `tokens_per_step / (batch_size * seq_len)` such passes are summed per optimizer step
    (0 = one pass per step).
    """

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig.preset("tiny"))
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    steps: int = 100
    batch_size: int = 16
    tokens_per_step: int = 0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    eval_batches: int = 1
    checkpoint_every: int = 100
    keep_last: int = 3
    keep_every: int = 0
    async_checkpoint: bool = True
    profile_start: int = -1
    profile_steps: int = 5
    progress_bar: bool = True

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "checkpoint_every", "keep_last"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int, got {getattr(self, name)!r}")
        for name in ("tokens_per_step", "eval_every", "keep_every", "profile_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_every and self.eval_batches < 1:
            raise ValueError(
                f"eval_batches must be >= 1 when eval_every > 0, got {self.eval_batches}"
            )
        if self.tokens_per_step % self.tokens_per_pass:
            raise ValueError(
                f"tokens_per_step ({self.tokens_per_step}) must be a multiple of batch_size * "
                f"model.max_seq_len ({self.batch_size} * {self.seq_len} = {self.tokens_per_pass})"
            )

    @property
    def seq_len(self) -> int:
        return self.model.max_seq_len

    @property
    def tokens_per_pass(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def accum_steps(self) -> int:
        return max(self.tokens_per_step // self.tokens_per_pass, 1)

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        d = dict(d)
        sections = {
            "model": ModelConfig,
            "data": DataConfig,
            "optim": OptimConfig,
            "mesh": MeshConfig,
        }
        for name, kind in sections.items():
            if name in d:
                d[name] = _dataclass_from_dict(kind, d[name], name)
        return _dataclass_from_dict(cls, d, "config")


def _dataclass_from_dict(kind: type, d: Any, where: str) -> Any:
    if isinstance(d, kind):
        return d
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a mapping, got {type(d).__name__}")
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown}; expected some of {sorted(known)}")
    return kind(**d)


def validate_for_runtime(cfg: TrainConfig, n_devices: int, n_processes: int = 1) -> None:
    """Checks that need the devices, the files and the tokenizer; raise ValueError."""
    from bam_jax.tokenizers import get_tokenizer

    data_size, fsdp_size, _ = cfg.mesh.resolve(n_devices)
    batch_shards = data_size * fsdp_size
    if cfg.batch_size % batch_shards:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by the data-parallel size "
            f"mesh.data * mesh.fsdp = {batch_shards}"
        )
    if cfg.batch_size % n_processes:
        raise ValueError(
            f"batch_size ({cfg.batch_size}) must be divisible by the process count {n_processes}"
        )
    if cfg.data.source != "passkey" and not cfg.data.path:
        raise ValueError(
            f"data.path is required for data.source={cfg.data.source!r} (text files, or shards "
            "written by `python -m train.shards`)"
        )
    if cfg.data.source != "passkey" and not _path_exists(cfg.data.path):
        raise ValueError(f"data.path: {cfg.data.path!r} does not exist")
    vocab = _data_vocab_size(cfg)
    if vocab > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of the "
            f"data's tokenizer ({vocab}); set model.vocab_size >= {vocab} or change "
            f"data.tokenizer"
        )
    if cfg.data.source != "shards":
        get_tokenizer(cfg.data.tokenizer)


def _path_exists(path: str) -> bool:
    return os.path.exists(path) or bool(glob.glob(path))


def _data_vocab_size(cfg: TrainConfig) -> int:
    from bam_jax.tokenizers import get_tokenizer

    if cfg.data.source == "shards":
        from train.shards import read_meta

        return int(read_meta(cfg.data.path)["vocab_size"])
    return get_tokenizer(cfg.data.tokenizer).vocab_size
