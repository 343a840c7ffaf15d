"""Passkey retrieval sweeps (docs/spec.md section 10) over prompt lengths, with reusable results.

Samples of one length are built deterministically from (seed, length), scored in batches
through a `ChunkedForward`, and stored per length; lengths already in the results file
for the same settings are read back instead of recomputed.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
from tqdm.auto import tqdm

from bam_eval.memory import check_sample_memory
from bam_eval.results import ResultStore
from bam_jax.inference import ChunkedForward, capacity_bucket
from bam_jax.passkey import SAMPLINGS, PasskeySample, TextEncoder
from bam_jax.retrieval import (
    DEFAULT_NEEDLES,
    RetrievalTask,
    build_task_samples,
    check_target_length,
    task_token_budget,
)

logger = logging.getLogger("bam.eval")


@dataclasses.dataclass(frozen=True)
class PasskeySettings:
    """Everything besides the length that changes a passkey result."""

    sampling: str = "equidistant"
    n_samples: int = 10
    prefix_digits: int = 1
    seed: int = 0
    tokenizer: str = ""
    checkpoint: str = ""
    dtype: str = "float32"
    task: str = "passkey"
    needles: int = DEFAULT_NEEDLES

    def __post_init__(self) -> None:
        RetrievalTask(self.task, self.needles)
        if self.sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {SAMPLINGS}, got {self.sampling!r}")
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.prefix_digits < 0:
            raise ValueError(f"prefix_digits must be >= 0, got {self.prefix_digits}")

    @property
    def retrieval_task(self) -> RetrievalTask:
        return RetrievalTask(self.task, self.needles)

    def as_dict(self) -> dict[str, Any]:
        """The results key; a passkey sweep leaves out the task fields, so results stored
        before there were other tasks still match."""
        settings = dataclasses.asdict(self)
        if self.task == "passkey":
            del settings["task"], settings["needles"]
        return settings


def samples_for_length(
    tokenizer: TextEncoder, target_length: int, settings: PasskeySettings
) -> list[PasskeySample]:
    """The samples of one length: the same for every run with the same settings."""
    rng = np.random.default_rng([settings.seed, target_length])
    return build_task_samples(
        tokenizer,
        settings.retrieval_task,
        target_length,
        settings.n_samples,
        sampling=settings.sampling,
        rng=rng,
        prefix_digits=settings.prefix_digits,
    )


def stack_samples(samples: Sequence[PasskeySample]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens [B, T] and score positions [B, 5] of a batch of samples."""
    length = max(len(s.tokens) for s in samples)
    tokens_BxT = np.zeros((len(samples), length), np.int32)
    for row, s in enumerate(samples):
        tokens_BxT[row, : len(s.tokens)] = s.tokens
    positions_BxP = np.stack([s.score_positions for s in samples])
    return tokens_BxT, positions_BxP


class SampleScores(NamedTuple):
    """Per sample: whether every scored digit was predicted (never where the logits were
    not finite), the predicted tokens [B, P], and whether its scored logits were finite."""

    correct: list[bool]
    predicted_BxP: np.ndarray
    finite: list[bool]


def score_samples(
    scorer: ChunkedForward, samples: Sequence[PasskeySample], batch_size: int | None = None
) -> SampleScores:
    """Greedy teacher-forced predictions of each key's last digits; correct = all match
    and the logits are finite.

    With ``batch_size`` larger than the batch, rows are repeated up to that size.
    """
    tokens_BxT, positions_BxP = stack_samples(samples)
    if batch_size is not None and len(samples) < batch_size:
        # Repeat the last row so every batch of a sweep has one shape (one compile).
        fill = batch_size - len(samples)
        tokens_BxT = np.concatenate([tokens_BxT, np.repeat(tokens_BxT[-1:], fill, 0)])
        positions_BxP = np.concatenate([positions_BxP, np.repeat(positions_BxP[-1:], fill, 0)])
    logits_BxPxV = scorer.logits_at(tokens_BxT, positions_BxP)[: len(samples)]
    predicted_BxP = logits_BxPxV.argmax(-1)
    answers_BxP = np.stack([s.answer_tokens for s in samples])
    finite_B = np.isfinite(logits_BxPxV).all(axis=(1, 2))
    correct_B = (predicted_BxP == answers_BxP).all(-1) & finite_B
    return SampleScores([bool(c) for c in correct_B], predicted_BxP, [bool(f) for f in finite_B])


def auto_batch_size(
    n_samples: int,
    cache_bytes_per_slot: int,
    capacity: int,
    memory_budget_bytes: int,
    activation_bytes: int = 0,
) -> int:
    """Samples per batch: as many as fit the budget (cache and activations), at least one,
    split evenly so the last batch is not much smaller (it is padded to the same shape)."""
    per_row = max(1, cache_bytes_per_slot * capacity + activation_bytes)
    largest = int(max(1, min(n_samples, memory_budget_bytes // per_row)))
    n_batches = -(-n_samples // largest)
    return -(-n_samples // n_batches)


def _length_entry(
    samples: Sequence[PasskeySample],
    scores: SampleScores,
    tokenizer: TextEncoder,
    seconds: float,
    batch_size: int,
    train_length: int | None,
) -> dict[str, Any]:
    n_filler = samples[0].n_filler
    return {
        "target_length": samples[0].target_length,
        "multiple": samples[0].target_length / train_length if train_length else None,
        "prompt_length": max(s.prompt_length for s in samples),
        "n_filler": n_filler,
        "filler_before": [s.filler_before for s in samples],
        "depths": [s.filler_before / n_filler if n_filler else 0.0 for s in samples],
        "keys": [s.key for s in samples],
        "predicted": [tokenizer.decode(row.tolist()) for row in scores.predicted_BxP],
        "correct": scores.correct,
        "non_finite": [not finite for finite in scores.finite],
        "accuracy": float(np.mean(scores.correct)),
        "seconds_per_sample": seconds / len(samples),
        "batch_size": batch_size,
    }


def evaluate_passkey(
    scorer: ChunkedForward,
    tokenizer: TextEncoder,
    lengths: Sequence[int],
    settings: PasskeySettings,
    store: ResultStore,
    *,
    patience: int | None = None,
    batch_size: int | None = None,
    cache_bytes_per_slot: int = 0,
    activation_bytes: int = 0,
    memory_budget_bytes: int = 4 << 30,
    shared_capacity_bytes: int = 512 << 20,
    train_length: int | None = None,
    progress: bool = True,
    label: str = "",
) -> list[dict[str, Any]]:
    """Accuracy per length (ascending), computing only lengths not yet in ``store``.

    Stops after ``patience`` consecutive lengths at 0% (stored ones count too).
    ``batch_size`` None picks the largest batch whose memory (KV cache plus
    ``activation_bytes`` per sample) fits ``memory_budget_bytes``; a length whose one sample
    does not fit is refused before any work.
    When one sample's cache for the longest length fits ``shared_capacity_bytes``, every
    length uses that capacity and one batch size, so the steps compile once per sweep.
    """

    def fitting_batch(n_samples: int, capacity: int) -> int:
        return auto_batch_size(
            n_samples, cache_bytes_per_slot, capacity, memory_budget_bytes, activation_bytes
        )

    task = settings.retrieval_task
    lengths = sorted(set(int(n) for n in lengths))
    for n in lengths:  # a length below the prompt's minimum fails before any work
        check_target_length(tokenizer, task, n, settings.prefix_digits)
    todo = [n for n in lengths if store.get(settings.as_dict(), str(n)) is None]
    if todo:
        longest = task_token_budget(tokenizer, task, todo[-1], settings.prefix_digits)
        capacity = capacity_bucket(longest, scorer.chunk_size)
        check_sample_memory(
            f"{task.name} length {todo[-1]} ({longest} tokens)",
            capacity,
            cache_bytes_per_slot,
            activation_bytes,
            memory_budget_bytes,
            "evaluate shorter lengths (--lengths / --multiples) or raise --memory-gb",
        )
        if cache_bytes_per_slot * capacity <= shared_capacity_bytes:
            scorer.min_capacity = capacity
            if batch_size is None:
                batch_size = fitting_batch(settings.n_samples, capacity)
    on_terminal = progress and sys.stderr.isatty()
    bar = tqdm(
        total=len(todo) * settings.n_samples,
        disable=not on_terminal or not todo,
        desc=f"{task.name} {label}".strip(),
        unit="sample",
    )
    log_label = label if progress and not on_terminal else None
    try:
        return _sweep(
            lengths,
            settings,
            store,
            patience,
            log_label,
            lambda n: _run_length(
                scorer,
                tokenizer,
                n,
                settings,
                batch_size,
                fitting_batch,
                train_length,
                bar,
            ),
        )
    finally:
        bar.close()
        scorer.min_capacity = 0


def _sweep(
    lengths: list[int],
    settings: PasskeySettings,
    store: ResultStore,
    patience: int | None,
    log_label: str | None,
    run_length: Callable[[int], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Stored entries where present, new ones otherwise (logged on "bam.eval" under
    `log_label` unless it is None); early stop on zero streaks."""
    results, zero_streak = [], 0
    for n in lengths:
        entry = store.get(settings.as_dict(), str(n))
        if entry is None:
            entry = run_length(n)
            store.put(settings.as_dict(), str(n), entry)
            if log_label is not None:
                logger.info(
                    "%s %s: length %d, accuracy %.0f%% (%d samples, %.2f s each)",
                    settings.task,
                    log_label,
                    n,
                    100 * entry["accuracy"],
                    len(entry["correct"]),
                    entry["seconds_per_sample"],
                )
        results.append(entry)
        zero_streak = zero_streak + 1 if entry["accuracy"] == 0.0 else 0
        if patience is not None and zero_streak >= patience:
            break
    return results


def _run_length(
    scorer: ChunkedForward,
    tokenizer: TextEncoder,
    target_length: int,
    settings: PasskeySettings,
    batch_size: int | None,
    fitting_batch: Callable[[int, int], int],
    train_length: int | None,
    bar: tqdm,
) -> dict[str, Any]:
    """``fitting_batch(n_samples, capacity)``: the batch size when ``batch_size`` is None."""
    samples = samples_for_length(tokenizer, target_length, settings)
    if batch_size is None:
        batch_size = fitting_batch(len(samples), scorer.capacity_for(len(samples[0].tokens)))
    correct: list[bool] = []
    predicted: list[np.ndarray] = []
    finite: list[bool] = []
    start = time.perf_counter()
    for i in range(0, len(samples), batch_size):
        batch = samples[i : i + batch_size]
        scores = score_samples(scorer, batch, batch_size)
        correct += scores.correct
        predicted.append(scores.predicted_BxP)
        finite += scores.finite
        bar.update(len(batch))
        bar.set_postfix(length=target_length, acc=f"{np.mean(correct):.0%}")
    seconds = time.perf_counter() - start
    scores = SampleScores(correct, np.concatenate(predicted), finite)
    return _length_entry(samples, scores, tokenizer, seconds, batch_size, train_length)
