"""The long-range copy probe: a random name defined once in held-out text and asked for again.

A language model that retrieves a passkey must first be able to copy; this probe asks for
copying alone, with nothing of the passkey prompt. A sample of `target_length` tokens is
held-out text (by default the standard library files held out of training) with the name
written once at a depth given by the sampling rule, and ending in the name's first
`GIVEN_LETTERS` letters. Two forms (`FORMS`):

- program: a line `NAME = None`, and the sample ends in `print(` and the first letters;
- piece: the name alone on a line, and the sample ends in a new line and the first letters:
  the layout of the copy documents that training mixes in (`data.copy_seeding`). A model
  trained on them is in distribution here at its training length, so this form says
  whether it copies at all before the other asks whether it copies far.
 NAME is `NAME_LETTERS` random lowercase letters. The model's
greedy teacher-forced predictions of the remaining letters are scored: a sample is correct
when every one is right, and `letter_accuracy` is the share of letters right (chance is
about 1 in 26). The distance from the definition to the question runs from about the whole
length (needle at depth 0) down to a few tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bam_eval.results import ResultStore
from bam_jax.inference import ChunkedForward
from bam_jax.io.documents import STDLIB_HELD_OUT, source_documents
from bam_jax.passkey import depth_schedule
from bam_jax.tokenizers import Tokenizer

logger = logging.getLogger("bam.eval")

NAME_LETTERS = 24
GIVEN_LETTERS = 2
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))
FORMS = ("program", "piece")


@dataclasses.dataclass(frozen=True)
class CopySettings:
    """Everything besides the length that changes a copy-probe result."""

    data: str = STDLIB_HELD_OUT
    form: str = "program"
    sampling: str = "equidistant"
    n_samples: int = 20
    seed: int = 0
    tokenizer: str = ""
    checkpoint: str = ""
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.n_samples < 1:
            raise ValueError(f"n_samples must be >= 1, got {self.n_samples}")
        if self.form not in FORMS:
            raise ValueError(f"copy probe form must be one of {FORMS}, got {self.form!r}")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class CopySample:
    """One teacher-forced sample: `tokens` [T] end with the name's remaining letters at
    `answer_positions` [A]; `distance` is the tokens from the definition to the question."""

    tokens: np.ndarray
    answer_positions: np.ndarray
    name: str
    depth: float
    distance: int


def filler_stream(data: str, tokenizer: Tokenizer, n_tokens: int) -> np.ndarray:
    """The first `n_tokens` tokens of `data`'s documents joined (no BOS/EOS), repeated from
    the start when the data is shorter."""
    pieces, have = [], 0
    for doc in source_documents(data):
        pieces.append(np.asarray(tokenizer.encode(doc.text), np.int32))
        have += len(pieces[-1])
        if have >= n_tokens:
            break
    if not have:
        raise ValueError(f"--data {data!r}: no text to build copy-probe samples from")
    stream = np.concatenate(pieces)
    return np.resize(stream, max(n_tokens, 1))


def copy_samples(
    tokenizer: Tokenizer, filler: np.ndarray, target_length: int, settings: CopySettings
) -> list[CopySample]:
    """The samples of one length, the same for every run with the same settings: filler
    windows from `filler` (a token stream at least `target_length` long)."""
    rng = np.random.default_rng([settings.seed, target_length])
    names = ["".join(rng.choice(LETTERS, NAME_LETTERS)) for _ in range(settings.n_samples)]
    pieces = [_pieces(tokenizer, name, settings.form) for name in names]
    n_filler = target_length - max(sum(len(p) for p in piece) for piece in pieces)
    if n_filler < 0:
        raise ValueError(
            f"copy probe: length {target_length} is shorter than the probe's own "
            f"{target_length - n_filler} tokens"
        )
    befores = depth_schedule(settings.sampling, settings.n_samples, n_filler, rng)
    starts = rng.integers(0, len(filler) - n_filler + 1, settings.n_samples)
    samples = []
    for name, (definition, question, answer), before, start in zip(
        names, pieces, befores, starts, strict=True
    ):
        text = filler[start : start + n_filler]
        tokens = np.concatenate([text[:before], definition, text[before:], question, answer])
        samples.append(
            CopySample(
                tokens=tokens.astype(np.int32),
                answer_positions=np.arange(len(tokens) - len(answer), len(tokens)),
                name=name,
                depth=before / n_filler if n_filler else 0.0,
                distance=len(tokens) - len(answer) - before,
            )
        )
    return samples


def _pieces(
    tokenizer: Tokenizer, name: str, form: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The definition line, the question up to the given letters, and the rest of the name."""
    encode = lambda text: np.asarray(tokenizer.encode(text), np.int32)
    definition, question = {
        "program": (f"\n{name} = None\n", f"\nprint({name[:GIVEN_LETTERS]}"),
        "piece": (f"\n{name}\n", f"\n{name[:GIVEN_LETTERS]}"),
    }[form]
    return encode(definition), encode(question), encode(name[GIVEN_LETTERS:])


def score_copy_samples(
    scorer: ChunkedForward, samples: Sequence[CopySample], batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per sample: the share of answer tokens predicted, and whether all were (never where
    the logits were not finite). Batches are padded to `batch_size` rows (one shape)."""
    letters, exact = [], []
    for i in range(0, len(samples), batch_size):
        batch = list(samples[i : i + batch_size])
        batch += [batch[-1]] * (batch_size - len(batch))
        length = max(len(s.tokens) for s in batch)
        answers = max(len(s.answer_positions) for s in batch)
        tokens_BxT = np.zeros((len(batch), length), np.int32)
        positions_BxA = np.zeros((len(batch), answers), np.int32)
        mask_BxA = np.zeros((len(batch), answers), bool)
        for row, s in enumerate(batch):
            tokens_BxT[row, : len(s.tokens)] = s.tokens
            n = len(s.answer_positions)
            positions_BxA[row] = np.pad(s.answer_positions, (0, answers - n), mode="edge")
            mask_BxA[row, :n] = True
        logits_BxAxV = scorer.logits_at(tokens_BxT, positions_BxA - 1)
        right_BxA = logits_BxAxV.argmax(-1) == np.take_along_axis(tokens_BxT, positions_BxA, 1)
        finite_B = np.isfinite(logits_BxAxV).all(axis=(1, 2))
        right_BxA &= mask_BxA & finite_B[:, None]
        keep = min(batch_size, len(samples) - i)
        letters.append((right_BxA.sum(1) / mask_BxA.sum(1))[:keep])
        exact.append((right_BxA == mask_BxA).all(1)[:keep])
    return np.concatenate(letters), np.concatenate(exact)


def evaluate_copy(
    scorer: ChunkedForward,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    settings: CopySettings,
    store: ResultStore,
    *,
    batch_size: int,
    train_length: int | None = None,
    label: str = "",
) -> list[dict[str, Any]]:
    """One entry per length (ascending), computing only lengths not yet in `store`."""
    lengths = sorted(set(int(n) for n in lengths))
    todo = [n for n in lengths if store.get(settings.as_dict(), str(n)) is None]
    filler = filler_stream(settings.data, tokenizer, max(todo, default=1))
    results = []
    for n in lengths:
        entry = store.get(settings.as_dict(), str(n))
        if entry is None:
            start = time.perf_counter()
            samples = copy_samples(tokenizer, filler, n, settings)
            letters, exact = score_copy_samples(scorer, samples, min(batch_size, len(samples)))
            entry = {
                "target_length": n,
                "multiple": n / train_length if train_length else None,
                "names": [s.name for s in samples],
                "depths": [s.depth for s in samples],
                "distances": [s.distance for s in samples],
                "letter_accuracy_per_sample": letters.tolist(),
                "correct": exact.tolist(),
                "accuracy": float(exact.mean()),
                "letter_accuracy": float(letters.mean()),
                "seconds_per_sample": (time.perf_counter() - start) / len(samples),
            }
            store.put(settings.as_dict(), str(n), entry)
            logger.info(
                "copy %s: length %d, names %.0f%%, letters %.0f%%",
                label,
                n,
                100 * entry["accuracy"],
                100 * entry["letter_accuracy"],
            )
        results.append(entry)
    return results
