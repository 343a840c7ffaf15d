"""Evaluation as functions: passkey retrieval, perplexity by position and learned priors of
loaded models (`load_models`), each returning its results and, given an output folder,
extending the results files there and drawing the figures. `bam-eval` is a command line
over these functions.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

from bam_eval import plots
from bam_eval.copy_probe import CopySettings, evaluate_copy
from bam_eval.memory import activation_bytes, cache_bytes_per_slot, check_sample_memory
from bam_eval.models import EvalModel, for_inference, load_eval_model, model_tokenizers
from bam_eval.passkey import PasskeySettings, auto_batch_size, evaluate_passkey
from bam_eval.perplexity import evaluate_perplexity, load_rows
from bam_eval.prior_inspect import figure_table, head_classes, prior_curves, prior_table
from bam_eval.results import ResultStore
from bam_eval.tables import task_label
from bam_jax.config import ModelConfig
from bam_jax.inference import ChunkedForward, capacity_bucket
from bam_jax.model import Transformer
from bam_jax.retrieval import DEFAULT_NEEDLES

logger = logging.getLogger("bam.eval")

# What the tables and figures read from each stored entry.
PASSKEY_FIELDS = ("target_length", "prompt_length", "accuracy", "depths", "correct")
PERPLEXITY_FIELDS = ("positions", "loss", "perplexity")
COPY_FIELDS = ("target_length", "accuracy", "letter_accuracy", "distances")


@dataclasses.dataclass(frozen=True)
class InferenceSettings:
    """How the models run: prefill chunk, attention implementation (None: the evaluation's
    default, `bam_jax.implementation.resolve_implementation`) and blocks, compute dtype
    (parameters stay float32), batch size (None: the largest within the memory budget) and
    that budget."""

    chunk_size: int = 512
    attention: str | None = None
    block_q: int | None = None
    block_k: int | None = None
    dtype: str = "float32"
    batch_size: int | None = None
    memory_gb: float = 4.0

    @property
    def memory_budget_bytes(self) -> int:
        return int(self.memory_gb * 2**30)

    def prepare(self, model: Transformer) -> tuple[ChunkedForward, ModelConfig]:
        """The chunked forward of `model` under these settings, and its config."""
        inference_model = for_inference(
            model,
            attention_impl=self.attention,
            block_q=self.block_q,
            block_k=self.block_k,
            dtype=self.dtype,
        )
        forward = ChunkedForward(inference_model, chunk_size=self.chunk_size)
        return forward, inference_model.config


@dataclasses.dataclass
class Evaluation:
    """Results per model name (what each task returns) and the figures drawn."""

    results: dict[str, Any]
    figures: list[str] = dataclasses.field(default_factory=list)


def load_models(specs: Sequence[str], *, step: int | None = None) -> list[EvalModel]:
    """Models from [NAME=]PATH[@STEP] arguments; their names must differ."""
    models = [load_eval_model(spec, step=step) for spec in specs]
    names = [m.name for m in models]
    if len(set(names)) != len(names):
        raise ValueError(f"model names must differ, got {names}; name them NAME=PATH")
    return models


def check_out_folder(out: str | None) -> None:
    if out is not None and os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} is a file, expected a folder for the results")


def result_store(
    out: str | None, model: EvalModel, task: str, fields: Sequence[str] = (), fresh: bool = False
) -> ResultStore:
    path = None if out is None else os.path.join(out, model.name, f"{task}.json")
    return ResultStore(path, model.info(), fields, fresh=fresh)


def passkey_lengths(
    model: EvalModel, lengths: Sequence[int], multiples: Sequence[float]
) -> list[int]:
    """The given lengths and multiples of the model's training length, ascending."""
    chosen = {*lengths, *(round(x * model.train_length) for x in multiples)}
    if not chosen:
        raise ValueError("give --lengths and/or --multiples")
    return sorted(chosen)


def run_passkey(
    models: Sequence[EvalModel],
    *,
    lengths: Sequence[int] = (),
    multiples: Sequence[float] = (),
    samples: int = 10,
    sampling: str = "equidistant",
    prefix_digits: int = 1,
    patience: int | None = None,
    seed: int = 0,
    tokenizer: str | None = None,
    inference: InferenceSettings = InferenceSettings(),
    out: str | None = None,
    figures: bool = True,
    progress: bool = True,
    task: str = "passkey",
    needles: int = DEFAULT_NEEDLES,
    fresh: bool = False,
) -> Evaluation:
    """Retrieval accuracy per length of each model: `results[name]` lists one entry per
    length. `task` is "passkey" or one of bam_jax.retrieval's other TASKS with `needles`
    keys, values or assignments. With `out`, results are kept in OUT/NAME/passkey.json
    (lengths found there for the same settings are not run again; with `fresh` the file's
    earlier results are dropped, replaced when the first new one is written) and, with
    `figures`, accuracy and depth figures are drawn under OUT, named after the task."""
    if not lengths and not multiples:
        raise ValueError("give --lengths and/or --multiples")
    check_out_folder(out)
    figure_name = task_label(task, needles)
    title = "passkey" if task == "passkey" else f"{task} ({needles} needles)"
    tokenizers = model_tokenizers(list(models), tokenizer)
    evaluation = Evaluation({})
    for m in models:
        text_encoder = tokenizers[m.name]
        settings = PasskeySettings(
            sampling=sampling,
            n_samples=samples,
            prefix_digits=prefix_digits,
            seed=seed,
            tokenizer=text_encoder.name,
            checkpoint=m.checkpoint,
            dtype=inference.dtype,
            task=task,
            needles=needles,
        )
        forward, config = inference.prepare(m.model)
        model_lengths = passkey_lengths(m, lengths, multiples)
        longest = capacity_bucket(max(*model_lengths, 1), inference.chunk_size)
        evaluation.results[m.name] = evaluate_passkey(
            forward,
            text_encoder,
            model_lengths,
            settings,
            result_store(out, m, "passkey", PASSKEY_FIELDS, fresh),
            patience=patience,
            batch_size=inference.batch_size,
            cache_bytes_per_slot=cache_bytes_per_slot(config),
            activation_bytes=activation_bytes(config, inference.chunk_size, longest),
            memory_budget_bytes=inference.memory_budget_bytes,
            train_length=m.train_length,
            progress=progress,
            label=m.name,
        )
        for entry in evaluation.results[m.name]:
            _warn_of_non_finite_samples(m.name, entry)
        if out is not None and figures:
            evaluation.figures.append(
                plots.depth_heatmap(
                    evaluation.results[m.name],
                    os.path.join(out, m.name, f"{figure_name}_depth_{sampling}.png"),
                    title=f"{m.name}: {title} accuracy by needle depth ({sampling})",
                )
            )
    if out is not None and figures:
        evaluation.figures.append(
            plots.accuracy_vs_length(
                evaluation.results,
                {m.name: m.train_length for m in models},
                os.path.join(out, f"{figure_name}_accuracy_{sampling}.png"),
                title=f"{title[0].upper()}{title[1:]} retrieval ({sampling} needle depths)",
            )
        )
    return evaluation


def run_copy(
    models: Sequence[EvalModel],
    *,
    lengths: Sequence[int] = (),
    multiples: Sequence[float] = (),
    samples: int = 20,
    sampling: str = "equidistant",
    data: str = CopySettings.data,
    form: str = CopySettings.form,
    seed: int = 0,
    tokenizer: str | None = None,
    inference: InferenceSettings = InferenceSettings(),
    out: str | None = None,
    fresh: bool = False,
) -> Evaluation:
    """The copy probe (bam_eval.copy_probe) in `form` per length of each model:
    `results[name]` lists one entry per length. With `out`, results are kept in
    OUT/NAME/copy.json."""
    check_out_folder(out)
    tokenizers = model_tokenizers(list(models), tokenizer)
    evaluation = Evaluation({})
    for m in models:
        settings = CopySettings(
            data=data,
            form=form,
            sampling=sampling,
            n_samples=samples,
            seed=seed,
            tokenizer=tokenizers[m.name].name,
            checkpoint=m.checkpoint,
            dtype=inference.dtype,
        )
        forward, config = inference.prepare(m.model)
        model_lengths = passkey_lengths(m, lengths, multiples)
        capacity = capacity_bucket(model_lengths[-1], inference.chunk_size)
        cache_bytes = cache_bytes_per_slot(config)
        scratch_bytes = activation_bytes(config, inference.chunk_size, capacity)
        check_sample_memory(
            f"model {m.name!r}: copy probe at length {model_lengths[-1]}",
            capacity,
            cache_bytes,
            scratch_bytes,
            inference.memory_budget_bytes,
            "evaluate shorter lengths (--lengths / --multiples) or raise --memory-gb",
        )
        batch_size = inference.batch_size or auto_batch_size(
            samples, cache_bytes, capacity, inference.memory_budget_bytes, scratch_bytes
        )
        evaluation.results[m.name] = evaluate_copy(
            forward,
            tokenizers[m.name],
            model_lengths,
            settings,
            result_store(out, m, "copy", COPY_FIELDS, fresh),
            batch_size=batch_size,
            train_length=m.train_length,
            label=m.name,
        )
    return evaluation


def _warn_of_non_finite_samples(name: str, entry: dict[str, Any]) -> None:
    bad = sum(entry.get("non_finite", ()))
    if bad:
        logger.warning(
            "warning: model %r: logits not finite for %d of %d samples at length %d; they "
            "count as failures",
            name,
            bad,
            len(entry["correct"]),
            entry["target_length"],
        )


def _warn_of_non_finite_windows(name: str, entry: dict[str, Any]) -> None:
    per_window = entry.get("non_finite_sequences", ())
    bad = sum(1 for count in per_window if count)
    if bad:
        logger.warning(
            "warning: model %r: logits not finite in %d of %d windows at --seq-len %d (in up "
            "to %d of %d sequences); their perplexity is NaN",
            name,
            bad,
            len(per_window),
            entry["seq_len"],
            max(per_window),
            entry["n_sequences"],
        )


def run_perplexity(
    models: Sequence[EvalModel],
    data: str,
    *,
    seq_len: int = 32_768,
    window: int = 1_024,
    sequences: int = 16,
    packing: str = "concat",
    text_key: str = "text",
    tokenizer: str | None = None,
    inference: InferenceSettings = InferenceSettings(),
    out: str | None = None,
    figures: bool = True,
    progress: bool = True,
    fresh: bool = False,
) -> Evaluation:
    """Perplexity per window of positions of each model over the same rows of `data`:
    `results[name]` holds positions, loss and perplexity per window. With `out`, results
    are kept in OUT/NAME/perplexity.json (with `fresh`, without its earlier results) and,
    with `figures`, OUT/perplexity.png is drawn."""
    check_perplexity_window(seq_len, window)
    check_out_folder(out)
    tokenizers = model_tokenizers(list(models), tokenizer)
    forwards = {m.name: inference.prepare(m.model) for m in models}
    capacity = capacity_bucket(seq_len + 1, inference.chunk_size)
    for name, (_, config) in forwards.items():
        check_sample_memory(
            f"model {name!r}: perplexity at --seq-len {seq_len}",
            capacity,
            cache_bytes_per_slot(config),
            activation_bytes(config, inference.chunk_size, capacity),
            inference.memory_budget_bytes,
            "use a smaller --seq-len or raise --memory-gb",
        )
    rows_by_tokenizer = {
        name: load_rows(data, encoder, seq_len, sequences, packing=packing, text_key=text_key)
        for name, encoder in {t.name: t for t in tokenizers.values()}.items()
    }
    evaluation = Evaluation({})
    for m in models:
        text_encoder = tokenizers[m.name]
        rows = rows_by_tokenizer[text_encoder.name]
        settings = {
            "seq_len": seq_len,
            "window": window,
            "sequences": len(rows),
            "packing": packing,
            "tokenizer": text_encoder.name,
            "checkpoint": m.checkpoint,
            "dtype": inference.dtype,
        }
        store = result_store(out, m, "perplexity", PERPLEXITY_FIELDS, fresh)
        entry = store.get(settings, data)
        if entry is None:
            entry = evaluate_perplexity(
                forwards[m.name][0],
                rows,
                window=window,
                batch_size=inference.batch_size or 1,
                progress=progress,
                label=m.name,
            )
            store.put(settings, data, entry)
        _warn_of_non_finite_windows(m.name, entry)
        evaluation.results[m.name] = entry
    if out is not None and figures:
        evaluation.figures.append(
            plots.perplexity_vs_position(
                evaluation.results,
                {m.name: m.train_length for m in models},
                os.path.join(out, "perplexity.png"),
                title=f"Perplexity by position: {_data_label(data)}",
            )
        )
    return evaluation


def _data_label(data: str) -> str:
    """A dataset's name for a title: the hf: spec, or the last part of the path."""
    return data if data.startswith("hf:") else os.path.basename(os.path.normpath(data))


def check_perplexity_window(seq_len: int, window: int) -> None:
    if seq_len % window:
        raise ValueError(f"--window {window} must divide --seq-len {seq_len}")


def run_prior(
    models: Sequence[EvalModel],
    *,
    max_distance: int | None = None,
    out: str | None = None,
    figures: bool = True,
    fresh: bool = False,
) -> Evaluation:
    """The positional parameters of each model per layer and head: `results[name]` holds
    the full table, the rows shown in figures (`shown`), the prior curves up to
    `max_distance` (default 500x the training length) and the head classes. With `out`,
    the table is kept in OUT/NAME/prior.json (with `fresh`, without the tables of other
    checkpoints) and, with `figures`, OUT/NAME/prior.png."""
    check_out_folder(out)
    evaluation = Evaluation({})
    for m in models:
        table = prior_table(m.model, m.config)
        curves = prior_curves(m.config, table, max_distance or 500 * m.train_length)
        store = result_store(out, m, "prior", fresh=fresh)
        store.put({"checkpoint": m.checkpoint}, "heads", {"table": table})
        shown = figure_table(m.config, table)
        evaluation.results[m.name] = {
            "table": table,
            "shown": shown,
            "curves": curves,
            "classes": head_classes(m.config, table),
        }
        if out is not None and figures:
            evaluation.figures.append(
                plots.prior_figure(
                    curves,
                    shown,
                    os.path.join(out, m.name, "prior.png"),
                    title=f"{m.name}: learned priors ({m.config.encoding})",
                    train_length=m.train_length,
                )
            )
    return evaluation
