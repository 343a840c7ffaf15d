"""Models to evaluate: training workdirs and reference run directories, named and checked.

A model argument is ``PATH``, ``NAME=PATH``, ``PATH@STEP`` or ``NAME=PATH@STEP``. A
directory with ``args.json`` and ``model.pt`` / ``model.npz`` is a reference run (read
by the importer); any other directory is a training workdir (its latest checkpoint, or
STEP). Results are keyed by ``EvalModel.checkpoint``: the path, the step and a fingerprint
of the parameter values, so a model retrained into the same folder is evaluated afresh.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from bam_jax.config import ModelConfig
from bam_jax.implementation import resolve_implementation
from bam_jax.io.checkpoints import checkpoint_dir, checkpoint_steps, error_summary, load_params
from bam_jax.io.files import run_path
from bam_jax.model import Transformer
from bam_jax.model_state import reconfigure
from bam_jax.reference_checkpoint import load_reference_checkpoint
from bam_jax.tokenizers import Tokenizer, get_tokenizer

logger = logging.getLogger("bam.eval")
# A workdir whose training writes and deletes checkpoints while it is read is read again,
# from its newest checkpoint, up to this many times in all.
LIVE_RUN_ATTEMPTS = 5

REFERENCE_WEIGHTS = ("model.pt", "model.npz")
# Blockwise attention's tiles for inference when none are given: a query block spanning a
# whole default chunk and 1024-key blocks, faster than 256 x 256 tiles over a long cache on
# CPUs (docs/benchmarks.md has the measurements). Pallas keeps its backend's own tiles.
BLOCKWISE_INFERENCE_BLOCKS = (512, 1024)


@dataclasses.dataclass
class EvalModel:
    name: str
    path: str
    kind: str  # "workdir" or "reference"
    step: int | None
    config: ModelConfig
    model: Transformer
    tokenizer: str | None  # the tokenizer the checkpoint records, if any
    training: dict[str, Any] = dataclasses.field(default_factory=dict)  # the run's config
    fingerprint: str = dataclasses.field(init=False)

    def __post_init__(self):
        self.fingerprint = parameter_fingerprint(self.model)

    @property
    def train_length(self) -> int:
        return self.config.max_seq_len

    @property
    def checkpoint(self) -> str:
        """PATH[@STEP]#FINGERPRINT: what the results of this model are keyed by."""
        where = self.path if self.step is None else f"{self.path}@{self.step}"
        return f"{where}#{self.fingerprint}"

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "kind": self.kind,
            "step": self.step,
            "encoding": self.config.encoding,
            "train_length": self.train_length,
            "fingerprint": self.fingerprint,
            "config": self.config.to_dict(),
            "training": self.training,
        }


def parameter_fingerprint(model: nnx.Module) -> str:
    """First 12 hex digits of a SHA-256 over every variable's name, shape, dtype and bytes."""
    digest = hashlib.sha256()
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.state(model)):
        array = np.asarray(leaf)
        digest.update(f"{jax.tree_util.keystr(path)}:{array.shape}:{array.dtype};".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:12]


def parse_model_arg(arg: str) -> tuple[str, str, int | None]:
    """(name, path, step) from NAME=PATH@STEP, NAME and STEP optional."""
    name, sep, rest = arg.partition("=")
    if not sep:
        name, rest = "", arg
    path, at, step_text = rest.rpartition("@")
    if not at or not step_text.isdigit():
        path, step_text = rest, ""
    path = path.rstrip("/")
    if not path:
        raise ValueError(f"model {arg!r}: expected PATH, NAME=PATH or PATH@STEP")
    return name or os.path.basename(path) or path, path, int(step_text) if step_text else None


def is_reference_run(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "args.json")) and any(
        os.path.isfile(os.path.join(path, w)) for w in REFERENCE_WEIGHTS
    )


def load_eval_model(arg: str, *, step: int | None = None) -> EvalModel:
    """Loads a workdir checkpoint or a reference run; clear errors for anything else."""
    name, path, arg_step = parse_model_arg(arg)
    step = arg_step if arg_step is not None else step
    if not run_path(path).is_dir():
        raise ValueError(f"model {arg!r}: {path!r} is not a directory")
    if is_reference_run(path):
        evaluated = _load_reference(arg, name, path, step)
    else:
        evaluated = _load_workdir(arg, name, path, step)
    bad = non_finite_parameters(evaluated.model)
    if bad:
        raise ValueError(
            f"model {arg!r}: parameters with NaN or inf values: {', '.join(bad)}; the "
            "results would be meaningless (evaluate an earlier checkpoint with PATH@STEP)"
        )
    return evaluated


def _load_reference(arg: str, name: str, path: str, step: int | None) -> EvalModel:
    if step is not None:
        raise ValueError(f"model {arg!r}: a reference run has one checkpoint, no steps")
    try:
        config, model = load_reference_checkpoint(path)
    except (ValueError, ImportError) as error:
        raise ValueError(f"model {arg!r}: {error}") from error
    with open(os.path.join(path, "args.json"), encoding="utf-8") as f:
        arguments = json.load(f)
    return EvalModel(name, path, "reference", None, config, model, None, arguments)


def _load_workdir(arg: str, name: str, path: str, step: int | None) -> EvalModel:
    directory = checkpoint_dir(path)
    if not run_path(directory).is_dir():
        raise ValueError(
            f"model {arg!r}: {path!r} is neither a training workdir (no "
            f"{os.path.basename(directory)}/ folder) nor a reference run directory "
            f"(args.json with {' or '.join(REFERENCE_WEIGHTS)})"
        )
    steps = checkpoint_steps(path)
    chosen = _checkpoint_step(arg, path, step, steps)
    for attempt in range(LIVE_RUN_ATTEMPTS):
        try:
            saved = load_params(path, chosen)
            model = saved.model()
            break
        except Exception as error:  # Orbax and TensorStore raise many types, by damaged file
            now = _steps_left(path)
            last = attempt == LIVE_RUN_ATTEMPTS - 1
            if step is not None or last or not now or (now == steps and chosen in now):
                raise _unreadable(arg, path, chosen, error, now) from error
            if now[-1] != chosen:
                logger.warning(
                    "model %r: checkpoint %s was removed while it was read (the run is still "
                    "training); evaluating step %d instead",
                    arg,
                    os.path.join(directory, str(chosen)),
                    now[-1],
                )
            chosen, steps = now[-1], now
    tokenizer = saved.run_config.get("data", {}).get("tokenizer")
    return EvalModel(
        name, path, "workdir", chosen, saved.config, model, tokenizer, saved.run_config
    )


def _steps_left(workdir: str) -> list[int]:
    """The run's complete checkpoints now; a training that deletes one while they are listed
    makes the listing fail, and it is taken again."""
    for _ in range(LIVE_RUN_ATTEMPTS):
        try:
            return checkpoint_steps(workdir)
        except OSError:
            continue
    return []


def _unreadable(arg: str, path: str, step: int, error: Exception, steps: list[int]) -> ValueError:
    """The error for checkpoint `step` of `path`, which failed with `error`; `steps` are the
    run's checkpoints now."""
    others = [s for s in steps if s != step]
    fallback = (
        f"evaluate another step with {path}@STEP (steps: {others})"
        if others
        else "the run has no other checkpoint"
    )
    where = os.path.join(checkpoint_dir(path), str(step))
    if step not in steps:
        return ValueError(
            f"model {arg!r}: checkpoint {where} was removed while it was read (a training "
            f"still running deletes its older checkpoints); {fallback}"
        )
    return ValueError(
        f"model {arg!r}: checkpoint {where} cannot be read ({error_summary(error)}); it is "
        f"damaged or incomplete: {fallback}"
    )


def _checkpoint_step(arg: str, workdir: str, step: int | None, steps: list[int]) -> int:
    """The requested step, or the latest, of the run's complete checkpoints `steps`."""
    if not steps:
        raise ValueError(
            f"model {arg!r}: {checkpoint_dir(workdir)} holds no complete checkpoint; train the "
            "run first"
        )
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ValueError(f"model {arg!r}: no checkpoint at step {step} (steps: {steps})")
    return step


def non_finite_parameters(model: nnx.Module, limit: int = 5) -> list[str]:
    """Names of the first ``limit`` floating-point variables holding NaN or inf, with counts."""
    found = []
    for path, variable in nnx.to_flat_state(nnx.state(model)):
        array = np.asarray(variable.get_value())
        if not np.issubdtype(array.dtype, np.floating):
            continue
        bad = int(array.size - np.count_nonzero(np.isfinite(array)))
        if bad:
            found.append(f"{'.'.join(map(str, path))} ({bad} of {array.size} values)")
    if len(found) > limit:
        found = [*found[:limit], f"and {len(found) - limit} more"]
    return found


def model_tokenizers(models: list[EvalModel], requested: str | None) -> dict[str, Tokenizer]:
    """Each model's tokenizer: `requested` for all, or else the one each model was trained
    with ("mistral" where none is recorded); an error when one does not fit its model."""
    loaded: dict[str, Tokenizer] = {}
    chosen = {}
    for m in models:
        spec = requested or m.tokenizer or "mistral"
        if m.tokenizer and m.tokenizer != spec:
            raise ValueError(
                f"model {m.name!r} was trained with tokenizer {m.tokenizer!r}, not {spec!r}; "
                "leave out --tokenizer to use each model's own"
            )
        if spec not in loaded:
            loaded[spec] = get_tokenizer(spec)
        tokenizer = loaded[spec]
        if tokenizer.vocab_size > m.config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but model "
                f"{m.name!r} has a vocabulary of {m.config.vocab_size}: checkpoint and "
                "tokenizer do not match (pass --tokenizer)"
            )
        chosen[m.name] = tokenizer
    return chosen


def for_inference(
    model: Transformer,
    *,
    attention_impl: str | None = None,
    block_q: int | None = None,
    block_k: int | None = None,
    dtype: str | None = None,
) -> Transformer:
    """The same weights under an inference configuration: the attention
    `resolve_implementation(attention_impl, purpose="inference")` chooses, unrolled layers (the
    cache is then updated in place), no remat, optional dtype, and attention blocks
    `block_q` x `block_k`, by default BLOCKWISE_INFERENCE_BLOCKS for blockwise attention
    and the kernel's own for the fused kernel (never the blocks the model was trained with,
    which may be sized for short training rows)."""
    implementation = resolve_implementation(attention_impl, purpose="inference", field="attention")
    default_q, default_k = (
        BLOCKWISE_INFERENCE_BLOCKS if implementation == "blockwise" else (None, None)
    )
    changes: dict[str, Any] = {
        "attention_impl": implementation,
        "remat": False,
        "scan_layers": False,
        "block_q": block_q or default_q,
        "block_k": block_k or default_k,
    }
    if dtype is not None:
        changes["dtype"] = dtype
    if model.config.replace(**changes) == model.config:
        return model
    return reconfigure(model, **changes)
