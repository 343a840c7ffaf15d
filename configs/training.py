"""Training configuration: frozen dataclasses (the optimizer, the mesh, the data and the run,
around the library's `ModelConfig`) checked on construction, plus the checks that need the
runtime (device count, files on disk, tokenizer) in `validate_for_runtime`. Building a config
imports no data pipeline; the presets that build them are beside it (`bam_configs.presets`).

Both run before anything is compiled, and every error names the field that is wrong.
`to_config_dict` and `TrainConfig.from_dict` carry a config to and from the ml_collections
ConfigDict that the command line overrides (and a config.json's nested mapping).
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import typing
from typing import Any

from ml_collections import ConfigDict, config_dict

from bam_jax.config import ModelConfig
from bam_jax.io.documents import HF_PREFIX, check_dataset_reader, is_stdlib_source, stdlib_files
from bam_jax.io.shards import local_shard_dir, read_meta
from bam_jax.tokenizers import get_tokenizer
from bam_jax.validation import (
    check_float32,
    check_int,
    check_positive_float32,
    dataclass_from_dict,
    describe_type,
    is_int,
    join_path,
)

MESH_AXES = ("data", "fsdp", "tensor")
MAX_SEED = 2**31 - 1
OPTIMIZER_NUMERICS = ("optax", "torch")
SOURCES = ("passkey", "text", "shards")
PASSKEY_LOSSES = ("answer", "all")


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
            check_positive_float32(f"optim.{name}", getattr(self, name))
        for name in ("weight_decay", "clip_norm"):
            check_float32(f"optim.{name}", getattr(self, name), minimum=0.0)
        for name in ("b1", "b2", "final_lr_fraction"):
            check_float32(f"optim.{name}", getattr(self, name), minimum=0.0, maximum=1.0)
        check_int("optim.warmup_steps", self.warmup_steps, minimum=0)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Mesh axis sizes; -1 takes the remaining devices (at most one axis)."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for axis, size in zip(MESH_AXES, self.sizes, strict=True):
            if not is_int(size) or size == 0 or size < -1:
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
class DataConfig:
    """Where rows come from.

    source: "passkey" | "text" | "shards"; path: .txt/.jsonl file, directory or glob, a
    directory saved by `datasets.Dataset.save_to_disk`, "hf:NAME[:SUBSET][@SPLIT]" for a
    Hugging Face dataset streamed from the hub, or "python-stdlib" for the interpreter's
    standard library sources less its held-out files (text), or a shard directory (shards);
    tokenizer: "mistral", "byte", "passkey:BASE" (BASE cut down to the passkey strings'
    tokens), a tokenizer.json file or a directory holding one, or a SentencePiece .model
    (passkey, text); text_key: the .jsonl or dataset field; add_bos/add_eos: around each
    text document; shuffle: row order (text, shards; False reads the stream in order);
    val_rows: held-out rows at the start of the data (text, shards); val_gap_tokens: tokens
    skipped after them, so training starts that many tokens after the held-out rows (text,
    shards); boundary_targets: also train the target that crosses into the next document
    (EOS -> BOS) instead of masking it (text, shards); copy_seeding: the share of the text
    stream's characters in generic copy documents, in which random strings recur
    (bam_train.copy_seeding; text only, 0 for a pure language model).
    Passkey: prompts are at least passkey_min_length tokens (0 = the template minimum) and at
    most the context; passkey_prefix_digits key digits are given before the five predicted;
    passkey_paper_filler_fraction of the prompts use the paper's filler, the rest random
    filler sentences; passkey_task_fraction of them open with the task sentence, the rest
    start directly with filler or the needle (so needles also sit at a document's first
    positions); passkey_loss "answer" trains the answer digits, "all" every token;
    passkey_lm_positions (with "answer") adds that many random prompt positions per row,
    trained on predicting their next token; passkey_multikey_fraction of the rows are
    multi-key prompts instead (bam_jax.retrieval: passkey_multikey_needles needles with
    different nouns and keys, one asked for).
    num_threads/prefetch: grain read threads and prefetch buffer (0 threads = in the loop);
    rows are read in order whatever the thread count, so runs stay deterministic.
    """

    source: str = "passkey"
    path: str = ""
    tokenizer: str = "mistral"
    text_key: str = "text"
    add_bos: bool = True
    add_eos: bool = True
    shuffle: bool = True
    val_rows: int = 64
    val_gap_tokens: int = 0
    boundary_targets: bool = False
    copy_seeding: float = 0.0
    passkey_min_length: int = 0
    passkey_prefix_digits: int = 1
    passkey_paper_filler_fraction: float = 0.25
    passkey_task_fraction: float = 1.0
    passkey_lm_positions: int = 0
    passkey_loss: str = "answer"
    passkey_multikey_fraction: float = 0.0
    passkey_multikey_needles: int = 2
    num_threads: int = 2
    prefetch: int = 2

    def __post_init__(self):
        if self.source not in SOURCES:
            raise ValueError(f"data.source must be one of {SOURCES}, got {self.source!r}")
        if self.passkey_loss not in PASSKEY_LOSSES:
            raise ValueError(
                f"data.passkey_loss must be one of {PASSKEY_LOSSES}, got {self.passkey_loss!r}"
            )
        fractions = (
            "passkey_paper_filler_fraction",
            "passkey_task_fraction",
            "passkey_multikey_fraction",
        )
        for name in fractions:
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"data.{name} must be in [0, 1], got {getattr(self, name)}")
        if not 0.0 <= self.copy_seeding < 1.0:
            raise ValueError(f"data.copy_seeding must be in [0, 1), got {self.copy_seeding}")
        if self.copy_seeding and self.source != "text":
            raise ValueError(
                f"data.copy_seeding mixes copy documents into text; data.source is "
                f"{self.source!r}, expected 'text' (or copy_seeding 0)"
            )
        for name in ("val_rows", "val_gap_tokens", "num_threads", "prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"data.{name} must be >= 0, got {getattr(self, name)}")
        if self.passkey_prefix_digits < 0:
            raise ValueError("data.passkey_prefix_digits must be >= 0")
        if self.passkey_lm_positions < 0:
            raise ValueError(
                f"data.passkey_lm_positions must be >= 0, got {self.passkey_lm_positions}"
            )
        if self.passkey_multikey_fraction > 0 and self.passkey_multikey_needles < 2:
            raise ValueError(
                f"data.passkey_multikey_needles must be >= 2, got {self.passkey_multikey_needles}"
            )


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
            check_int(name, getattr(self, name), minimum=1)
        for name in ("tokens_per_step", "eval_every", "eval_batches", "keep_every"):
            check_int(name, getattr(self, name), minimum=0)
        check_int("profile_steps", self.profile_steps, minimum=0)
        check_int("profile_start", self.profile_start, minimum=-1)
        check_int("seed", self.seed, minimum=0, maximum=MAX_SEED)
        for name in ("async_checkpoint", "progress_bar"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        check_float32("ssmax_jitter", self.ssmax_jitter, minimum=0.0, maximum=0.99)
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
        check_float32("prior_dilation", self.prior_dilation, minimum=1.0, maximum=1e6)
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
        return dataclass_from_dict(cls, d, path="")


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
        walked = join_path(walked, name)
        if name not in hints:
            raise ValueError(
                f"config: unknown field {walked!r}; valid fields{section}: "
                f"{', '.join(sorted(hints))}"
            )
        kind = hints[name]
    return kind


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
