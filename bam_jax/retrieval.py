"""Retrieval tasks beyond one passkey, after RULER, built from the passkey prompt's pieces.

Every task keeps the passkey prompt's frame (task text, filler copies, a question, the
answer teacher-forced) and its vocabulary: needles name their key by one of the filler
nouns ("The sea pass key is 123456."), so a model trained on passkey prompts with the
`passkey:` tokenizer can read every task. Samples are `PasskeySample`s, scored like
passkey samples (greedy predictions of each value's last PREDICTED_DIGITS digits).

- passkey: one needle (bam_jax.passkey).
- multikey: `needles` needles with different nouns and keys; the question asks for one.
- multivalue: `needles` needles with the same noun and different keys; the answer lists
  every key in the order the needles appear.
- vartrack: a chain "The sea pass key is 123456." then "The sky pass key is the sea pass
  key." and so on, `needles` assignments in order; the question asks for the last noun.

The asked needle (multikey), the first value (multivalue) or the chain's start (vartrack)
sits at the depth the sampling rule gives; the other needles at random depths (after the
chain's start, in order, for vartrack).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import pairwise

import numpy as np

from bam_jax.passkey import (
    FILLER,
    FILLER_NOUNS,
    PREDICTED_DIGITS,
    PasskeySample,
    TextEncoder,
    build_passkey_samples,
    depth_schedule,
    passkey_template,
    random_key,
)

TASKS = ("passkey", "multikey", "multivalue", "vartrack")
DEFAULT_NEEDLES = 4
DEPTH_STEPS = 10_000  # the sampling rules' depths are drawn on this grid of fractions


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    """A task and its number of needles (keys, values or assignments; 1 for passkey)."""

    name: str = "passkey"
    needles: int = DEFAULT_NEEDLES

    def __post_init__(self) -> None:
        if self.name not in TASKS:
            raise ValueError(f"task must be one of {TASKS}, got {self.name!r}")
        if self.name != "passkey" and not 2 <= self.needles <= len(FILLER_NOUNS):
            raise ValueError(
                f"needles must be in [2, {len(FILLER_NOUNS)}] for task {self.name!r}, "
                f"got {self.needles}"
            )

    @property
    def answer_values(self) -> int:
        return self.needles if self.name == "multivalue" else 1


@dataclasses.dataclass(frozen=True)
class _Content:
    """What a sample says, before any depth is chosen: needle texts (the first is the one
    the sampling rule places), the question, and each needle's key (None for a chain link)."""

    needles: tuple[str, ...]
    question: str
    keys: tuple[int | None, ...]


def _key_needle(noun: str, key: int) -> str:
    return f"The {noun} pass key is {key}. Remember it. {key} is the {noun} pass key."


def _question(noun: str) -> str:
    return f"What is the {noun} pass key? The {noun} pass key is"


def _draw_keys(rng: np.random.Generator, count: int, prefix_digits: int) -> list[int]:
    keys: list[int] = []
    while len(keys) < count:
        key = random_key(rng, prefix_digits)
        if key not in keys:
            keys.append(key)
    return keys


def _content(task: RetrievalTask, rng: np.random.Generator, prefix_digits: int) -> _Content:
    nouns = [str(n) for n in rng.choice(FILLER_NOUNS, size=task.needles, replace=False)]
    keys = _draw_keys(rng, task.needles, prefix_digits)
    if task.name == "multikey":
        needles = tuple(_key_needle(n, k) for n, k in zip(nouns, keys, strict=True))
        return _Content(needles, _question(nouns[0]), tuple(keys))
    if task.name == "multivalue":
        needles = tuple(_key_needle(nouns[0], k) for k in keys)
        return _Content(needles, _question(nouns[0]), tuple(keys))
    links = [f"The {new} pass key is the {old} pass key." for old, new in pairwise(nouns)]
    start = f"The {nouns[0]} pass key is {keys[0]}. Remember it."
    return _Content((start, *links), _question(nouns[-1]), (keys[0], *[None] * len(links)))


def _depths(task: RetrievalTask, rng: np.random.Generator, depth: int, n_filler: int) -> list[int]:
    """Filler copies before each needle: the first at `depth`, the others random (a chain's
    links after its start, in order)."""
    others = rng.integers(depth if task.name == "vartrack" else 0, n_filler + 1, task.needles - 1)
    others = sorted(others) if task.name == "vartrack" else others
    return [depth, *(int(d) for d in others)]


def _answer_keys(task: RetrievalTask, content: _Content, depths: Sequence[int]) -> list[int]:
    """The keys the answer gives: every value in the order they appear (multivalue), else
    the first needle's key (the asked key, or the chain's value)."""
    if task.name != "multivalue":
        return [content.keys[0]]
    order = sorted(range(len(depths)), key=lambda i: (depths[i], i))
    return [content.keys[i] for i in order]


def _answer_text(question: str, keys: Sequence[int]) -> str:
    """The teacher-forced answer: " 123456", then ". The sea pass key is 234567" and so on
    for every further value."""
    asked = question.split("? ", 1)[1]
    return f" {keys[0]}" + "".join(f". {asked} {key}" for key in keys[1:])


def _encode_answer(
    tokenizer: TextEncoder, question: str, keys: Sequence[int]
) -> tuple[list[int], list[int]]:
    """The answer's tokens and the indices in them of each key's last PREDICTED_DIGITS
    digits (found by encoding the answer up to each key: a prefix of the whole)."""
    ids = tokenizer.encode(_answer_text(question, keys))
    positions: list[int] = []
    for count in range(1, len(keys) + 1):
        prefix = tokenizer.encode(_answer_text(question, keys[:count]))
        digits = str(keys[count - 1])[-PREDICTED_DIGITS:]
        last = prefix[-PREDICTED_DIGITS:]
        if ids[: len(prefix)] != prefix or tokenizer.decode(last) != digits:
            raise ValueError(
                f"tokenizer must encode digits one per token: {_answer_text(question, keys)!r}"
                f" -> {ids}"
            )
        positions += range(len(prefix) - PREDICTED_DIGITS, len(prefix))
    return ids, positions


def build_task_sample(
    tokenizer: TextEncoder,
    task: RetrievalTask,
    target_length: int,
    rng: np.random.Generator,
    depth: float,
    prefix_digits: int = 1,
    filler: str = FILLER,
) -> PasskeySample:
    """One prompt of at most `target_length` tokens (the answer comes on top) whose placed
    needle sits at the fraction `depth` in [0, 1] of the filler."""
    template = passkey_template(tokenizer, prefix_digits=prefix_digits, filler=filler)
    content = _content(task, rng, prefix_digits)
    fixed = len(template.task) + len(tokenizer.encode(content.question))
    fixed += sum(len(tokenizer.encode(text)) for text in content.needles)
    n_filler = max(0, (target_length - fixed) // len(template.filler))
    depths = _depths(task, rng, round(depth * n_filler), n_filler)
    sample = _assemble(tokenizer, task, template, n_filler, content, depths)
    return dataclasses.replace(sample, target_length=target_length, prefix_digits=prefix_digits)


def build_task_samples(
    tokenizer: TextEncoder,
    task: RetrievalTask,
    target_length: int,
    n_samples: int,
    *,
    sampling: str = "equidistant",
    rng: np.random.Generator,
    prefix_digits: int = 1,
) -> list[PasskeySample]:
    """`n_samples` prompts of one task at one length, placed needles by `sampling`."""
    if task.name == "passkey":
        return build_passkey_samples(
            tokenizer,
            target_length,
            n_samples,
            sampling=sampling,
            rng=rng,
            prefix_digits=prefix_digits,
        )
    fractions = np.asarray(depth_schedule(sampling, n_samples, DEPTH_STEPS, rng)) / DEPTH_STEPS
    return [
        build_task_sample(tokenizer, task, target_length, rng, float(f), prefix_digits)
        for f in fractions
    ]


def task_min_length(tokenizer: TextEncoder, task: RetrievalTask, prefix_digits: int = 1) -> int:
    """The longest prompt without filler (widest keys, every noun): a shorter target length
    than this, other than 0 (no filler), is refused."""
    template = passkey_template(tokenizer, prefix_digits=prefix_digits)
    if task.name == "passkey":
        return template.min_length
    widest = 10 ** (PREDICTED_DIGITS + prefix_digits) - 1

    def longest(texts: Sequence[str]) -> int:
        return max(len(tokenizer.encode(t)) for t in texts)

    needle = longest([_key_needle(n, widest) for n in FILLER_NOUNS])
    if task.name == "vartrack":
        link = longest(
            [f"The {a} pass key is the {b} pass key." for a in FILLER_NOUNS for b in FILLER_NOUNS]
        )
        needle_tokens = needle + (task.needles - 1) * link
    else:
        needle_tokens = task.needles * needle
    return len(template.task) + longest([_question(n) for n in FILLER_NOUNS]) + needle_tokens


def check_target_length(
    tokenizer: TextEncoder, task: RetrievalTask, target_length: int, prefix_digits: int = 1
) -> None:
    minimum = task_min_length(tokenizer, task, prefix_digits)
    if target_length != 0 and target_length < minimum:
        raise ValueError(
            f"target_length {target_length} is below the {task.name} prompt's minimum of "
            f"{minimum} tokens (use 0 for the shortest prompt)"
        )


def task_token_budget(
    tokenizer: TextEncoder, task: RetrievalTask, target_length: int, prefix_digits: int = 1
) -> int:
    """An upper bound on a sample's tokens at `target_length`: the prompt and its answer."""
    widest = 10 ** (PREDICTED_DIGITS + prefix_digits) - 1
    if task.name == "passkey":
        template = passkey_template(tokenizer, prefix_digits=prefix_digits)
        return template.prompt_length(target_length) + len(tokenizer.encode(f" {widest}"))
    answers = [_answer_text(_question(n), [widest] * task.answer_values) for n in FILLER_NOUNS]
    return target_length + max(len(tokenizer.encode(a)) for a in answers)


def _assemble(
    tokenizer: TextEncoder,
    task: RetrievalTask,
    template,
    n_filler: int,
    content: _Content,
    depths: list[int],
) -> PasskeySample:
    filler = list(template.filler)
    tokens: list[int] = list(template.task)
    placed_start = placed_length = copies = 0
    for i in sorted(range(len(depths)), key=lambda i: (depths[i], i)):
        tokens += filler * (depths[i] - copies)
        copies = depths[i]
        ids = tokenizer.encode(content.needles[i])
        if i == 0:
            placed_start, placed_length = len(tokens), len(ids)
        tokens += ids
    tokens += filler * (n_filler - copies)
    tokens += tokenizer.encode(content.question)
    prompt_length = len(tokens)
    keys = _answer_keys(task, content, depths)
    answer_ids, answer_at = _encode_answer(tokenizer, content.question, keys)
    tokens += answer_ids
    answer_positions = [prompt_length + i for i in answer_at]
    return PasskeySample(
        tokens=np.asarray(tokens, np.int32),
        prompt_length=prompt_length,
        answer_positions=np.asarray(answer_positions, np.int32),
        key=content.keys[0],
        filler_before=depths[0],
        filler_after=n_filler - depths[0],
        needle_start=placed_start,
        needle_length=placed_length,
        target_length=0,
        prefix_digits=0,
    )
