"""Training configuration: frozen dataclasses checked on construction, plus the checks that
need the runtime (device count, files on disk, tokenizer) in `validate_for_runtime`.

Both run before anything is compiled, and every error names the field that is wrong.
`to_config_dict` and `TrainConfig.from_dict` carry a config to and from the ml_collections
ConfigDict that the command line overrides (and a config.json's nested mapping).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import reprlib
import types
import typing
from typing import Any

import numpy as np
from ml_collections import ConfigDict, config_dict

from bam_jax.config import FLOAT32_MAX, ModelConfig
from bam_jax.io.documents import HF_PREFIX, check_dataset_reader, is_stdlib_source, stdlib_files
from bam_jax.io.shards import local_shard_dir, read_meta
from bam_jax.tokenizers import get_tokenizer
from bam_train.data import DataConfig

MESH_AXES = ("data", "fsdp", "tensor")
MAX_SEED = 2**31 - 1
OPTIMIZER_NUMERICS = ("optax", "torch")


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """RAdam with decoupled weight decay; cosine schedule from `lr` to
    `final_lr_fraction * lr` after `warmup_steps` of linear warmup. Prior and SSMax
    parameters have their own peak learning rates and are never decayed. `numerics` is
    "optax" or "torch": where eps enters RAdam's step and the clipping factor
    (bam_train.optim); "torch" is the authors' code."""

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
    numerics: str = "optax"

    def __post_init__(self):
        if self.numerics not in OPTIMIZER_NUMERICS:
            raise ValueError(
                f"optim.numerics must be one of {OPTIMIZER_NUMERICS}, got {self.numerics!r}"
            )
        for name in ("lr", "prior_lr", "ssmax_lr", "eps"):
            _check_positive_float32(f"optim.{name}", getattr(self, name))
        for name in ("weight_decay", "clip_norm"):
            _check_float32(f"optim.{name}", getattr(self, name), minimum=0.0)
        for name in ("b1", "b2", "final_lr_fraction"):
            _check_float32(f"optim.{name}", getattr(self, name), minimum=0.0, maximum=1.0)
        _check_int("optim.warmup_steps", self.warmup_steps, minimum=0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis, size in zip(MESH_AXES, self.sizes, strict=True):
            if not _is_int(size) or size == 0 or size < -1:
                raise ValueError(
                    f"mesh.{axis} must be a positive int or -1 (the remaining devices), "
                    f"got {size!r}"
                )
        sizes = self.sizes
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
    (0 = one pass per step). Every `eval_every` steps (0 = never) the validation loss is
    taken over `eval_batches` micro-batches of `batch_size` rows.

    `ssmax_jitter` (SSMax encodings) multiplies the learned SSMax scale of the layers whose
    key count grows with the prompt (`model.ssmax_growing_layers`: neither capped by
    `model.ssmax_capped_layers` nor windowed by `model.local_layers`) by a factor drawn from
    U[1 - ssmax_jitter, 1] for each micro-batch of each step (evaluation uses 1): attention
    at the training length is then at times softer than the model's own, so retrieval must
    win by margins that still hold when SSMax sharpens the logits by log(n) at many times
    the training length.

    `prior_dilation` (1 = off) makes every global layer (not windowed by
    `model.local_layers`) see every distance u times longer, u drawn log-uniformly from
    [1, prior_dilation] for each micro-batch of each step (evaluation uses 1), as when the
    same tokens lie u times further apart, so the model cannot rely on a head that reaches
    the needle at the training length only because the prompt is short. Per encoding: BAM
    evaluates its prior at u times every distance (`bam_jax.GGDPrior.dilated`: local heads
    narrow, flat heads stay flat); ALiBi multiplies its slopes by u; RoPE rotates queries and
    keys as if every position were u times larger; sinusoidal multiplies the positions of
    its table by u, which reaches every layer, so it refuses local layers; NoPE has no
    positions and refuses the option; rope_local is windowed in every layer, so has no
    global layer to dilate.
    """

    model: ModelConfig = dataclasses.field(default_factory=lambda: ModelConfig.of_size("toy"))
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
    ssmax_jitter: float = 0.0
    prior_dilation: float = 1.0

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "checkpoint_every", "keep_last"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("tokens_per_step", "eval_every", "eval_batches", "keep_every"):
            _check_int(name, getattr(self, name), minimum=0)
        _check_int("profile_steps", self.profile_steps, minimum=0)
        _check_int("profile_start", self.profile_start, minimum=-1)
        _check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        for name in ("async_checkpoint", "progress_bar"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        _check_float32("ssmax_jitter", self.ssmax_jitter, minimum=0.0, maximum=0.99)
        if self.ssmax_jitter and not self.model.ssmax:
            raise ValueError(
                f"ssmax_jitter={self.ssmax_jitter} needs an SSMax encoding (*_ssmax), got "
                f"model.encoding={self.model.encoding!r}; set ssmax_jitter=0"
            )
        if self.ssmax_jitter and not any(self.model.ssmax_growing_layers()):
            raise ValueError(
                f"ssmax_jitter={self.ssmax_jitter} applies to the layers whose SSMax key count "
                "grows with the prompt, but all "
                f"{self.model.n_layers} are capped (model.ssmax_capped_layers) or windowed "
                "(model.local_layers, rope_local)"
            )
        self._check_prior_dilation()
        if self.eval_every and self.eval_batches < 1:
            raise ValueError(
                f"eval_batches must be >= 1 when eval_every > 0, got {self.eval_batches}"
            )
        if self.tokens_per_step % self.tokens_per_pass:
            raise ValueError(
                f"tokens_per_step ({self.tokens_per_step}) must be a multiple of batch_size * "
                f"model.max_seq_len ({self.batch_size} * {self.seq_len} = {self.tokens_per_pass})"
            )

    def _check_prior_dilation(self) -> None:
        _check_float32("prior_dilation", self.prior_dilation, minimum=1.0, maximum=1e6)
        if self.prior_dilation == 1.0:
            return
        problem = self.model.dilation_problem()
        if problem:
            raise ValueError(
                f"prior_dilation={self.prior_dilation}: the model {problem}; set prior_dilation=1"
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
    def from_dict(cls, d: Any) -> TrainConfig:
        """The config of a (nested) mapping such as a config.json or a ConfigDict's `to_dict()`;
        missing fields take their defaults; unknown keys, values of the wrong type and bad
        values raise a ValueError naming the key path."""
        return _dataclass_from_dict(cls, d, path="")


def to_config_dict(cfg: Any) -> ConfigDict:
    """A (nested) config dataclass as a ConfigDict whose fields take `--config.FIELD=VALUE`
    overrides of their declared types: a field that is None takes values of its type, and one
    of several types (str or float) any Python literal."""
    hints = typing.get_type_hints(type(cfg))
    return ConfigDict(
        {
            f.name: _config_value(getattr(cfg, f.name), hints[f.name])
            for f in dataclasses.fields(cfg)
        }
    )


def _config_value(value: Any, annotation: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return to_config_dict(value)
    types_besides_none = [a for a in typing.get_args(annotation) if a is not type(None)]
    if len(types_besides_none) > 1:
        return config_dict.FieldReference(value, field_type=object)
    if value is None:
        return config_dict.placeholder(types_besides_none[0] if types_besides_none else object)
    return value


def field_type(path: str) -> Any:
    """The declared type of TrainConfig field `path` ("model.dim"); a ValueError naming the
    first part of the path that is not a field, with the valid ones."""
    kind: Any = TrainConfig
    walked = ""
    for name in path.split("."):
        if not dataclasses.is_dataclass(kind):
            raise ValueError(
                f"config: unknown field {path!r}; {walked} is {describe_type(kind)}, not a "
                "section with fields"
            )
        hints = typing.get_type_hints(kind)
        section = f" of {walked}" if walked else ""
        walked = _join(walked, name)
        if name not in hints:
            raise ValueError(
                f"config: unknown field {walked!r}; valid fields{section}: "
                f"{', '.join(sorted(hints))}"
            )
        kind = hints[name]
    return kind


def _dataclass_from_dict(kind: type, d: Any, path: str) -> Any:
    if isinstance(d, kind):
        return d
    if not isinstance(d, dict):
        raise ValueError(
            f"config: {path or 'the config'} must be a mapping of field names to values, "
            f"got {type(d).__name__} {reprlib.repr(d)}"
        )
    hints = typing.get_type_hints(kind)
    unknown = sorted(set(d) - set(hints))
    if unknown:
        names = ", ".join(f"'{_join(path, name)}'" for name in unknown)
        raise ValueError(
            f"config: unknown field{'s' if len(unknown) > 1 else ''} {names}; valid fields"
            f"{f' of {path}' if path else ''}: {', '.join(sorted(hints))}"
        )
    values = {
        name: _field_from_dict(hints[name], value, _join(path, name)) for name, value in d.items()
    }
    try:
        return kind(**values)
    except ValueError as err:
        raise ValueError(_name_section(path, str(err), hints)) from None


def _field_from_dict(annotation: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(annotation):
        return _dataclass_from_dict(annotation, value, path)
    if not _has_type(value, annotation):
        raise ValueError(
            f"config: {path} must be {describe_type(annotation)}, got {reprlib.repr(value)}"
        )
    return value


def _has_type(value: Any, annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_has_type(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return _is_int(value)
    if annotation is float:
        return _is_number(value)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True


def describe_type(annotation: Any) -> str:
    """How an error message names the values a field accepts."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(describe_type(arg) for arg in typing.get_args(annotation))
    names = {bool: "true or false", int: "an int", float: "a number", str: "a string"}
    if annotation is type(None):
        return "None"
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _name_section(path: str, message: str, hints: dict[str, Any]) -> str:
    """A section's own error message with the section named: "dim must ..." becomes
    "model.dim must ..."."""
    if not path or message.startswith((f"{path}.", f"{path}:")):
        return message
    first_word = message.split(" ", 1)[0]
    return f"{path}.{message}" if first_word in hints else f"{path}: {message}"


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name} must be an int {bounds}, got {value!r}")


def _check_float32(name: str, value: Any, minimum: float, maximum: float | None = None) -> None:
    """A number in [minimum, maximum] that float32 holds as a finite number."""
    _check_finite_float32(name, value)
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum:g}" if maximum is None else f"in [{minimum:g}, {maximum:g}]"
        raise ValueError(f"{name} must be {bounds}, got {value!r}")


def _check_positive_float32(name: str, value: Any) -> None:
    """A number > 0 that float32 holds as a finite number, without rounding it to 0."""
    _check_finite_float32(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    if np.float32(value) == 0:
        raise ValueError(f"{name} must be > 0 in float32, got {value!r}, which rounds to 0")


def _check_finite_float32(name: str, value: Any) -> None:
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if abs(value) > FLOAT32_MAX:
        raise ValueError(f"{name} must fit in float32 (at most {FLOAT32_MAX:.8g}), got {value!r}")


def validate_for_runtime(cfg: TrainConfig, n_devices: int, n_processes: int = 1) -> None:
    """Checks that need the devices, the files and the tokenizer; raise ValueError."""

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
            "written by `python -m bam_train.shards`)"
        )
    data_path = cfg.data.path
    if cfg.data.source == "shards":
        data_path = local_shard_dir(data_path)
    text = cfg.data.source == "text"
    streamed = text and data_path.startswith(HF_PREFIX)
    stdlib = text and is_stdlib_source(data_path)
    if stdlib:
        stdlib_files(data_path)  # a ValueError when the interpreter has no stdlib sources
    if cfg.data.source != "passkey" and not (streamed or stdlib) and not _path_exists(data_path):
        raise ValueError(f"data.path: {cfg.data.path!r} does not exist")
    if text:
        check_dataset_reader(data_path)
    _check_validation_rows(cfg)
    vocab, origin = _data_vocab(cfg)
    if vocab > cfg.model.vocab_size:
        raise ValueError(
            f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the vocabulary of "
            f"{origin} ({vocab}); set model.vocab_size >= {vocab} or change data.tokenizer"
        )
    if cfg.data.source != "shards":
        get_tokenizer(cfg.data.tokenizer)


def _check_validation_rows(cfg: TrainConfig) -> None:
    """Validation reads `eval_batches` micro-batches of `batch_size` rows from the
    `data.val_rows` held-out rows (text and shards; passkey rows have their own seed)."""
    needed = cfg.eval_batches * cfg.batch_size
    if cfg.eval_every and cfg.data.source != "passkey" and cfg.data.val_rows < needed:
        raise ValueError(
            f"eval_batches: {cfg.eval_batches} validation batches of batch_size="
            f"{cfg.batch_size} rows need data.val_rows >= {needed}, got {cfg.data.val_rows}; "
            f"raise data.val_rows or lower eval_batches"
        )


def _path_exists(path: str) -> bool:
    return os.path.exists(path) or bool(glob.glob(path))


def _data_vocab(cfg: TrainConfig) -> tuple[int, str]:
    """The data's vocabulary size and where it comes from, for errors."""

    if cfg.data.source == "shards":
        meta = read_meta(cfg.data.path)
        tokenizer = meta.get("tokenizer")
        return int(meta["vocab_size"]), f"the shards in {cfg.data.path!r} (tokenizer {tokenizer!r})"
    tokenizer = get_tokenizer(cfg.data.tokenizer)
    return tokenizer.vocab_size, f"data.tokenizer {cfg.data.tokenizer!r}"
