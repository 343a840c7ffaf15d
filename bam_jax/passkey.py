"""Passkey retrieval prompts (docs/spec.md section 10): the paper's strings, the prompt builder and
the needle-depth schedules.

A prompt is ``task + filler * a + needle + filler * b + question`` (each piece tokenised
separately without BOS, token lists concatenated); ``a + b`` is the largest filler count that
keeps the prompt within the target length, and ``a`` (the needle depth) comes from a sampling
rule. The model is fed ``prompt + tokens(" " + key)`` with teacher forcing; a sample is correct
when the greedy predictions of the key's last ``PREDICTED_DIGITS`` digits all match.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Protocol

import numpy as np

TASK = (
    "There is an important info hidden inside a lot of irrelevant text. "
    "Find it and memorize them. I will quiz you about the important information there."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key? The pass key is"

# Words of the varied filler paragraphs that training prompts use besides FILLER.
FILLER_SENTENCE = "The {noun} is {adjective}."
FILLER_NOUNS = ("grass", "sky", "sun", "sea", "road", "house", "tree", "river", "cloud", "stone")
FILLER_ADJECTIVES = (
    "green",
    "blue",
    "yellow",
    "red",
    "quiet",
    "tall",
    "old",
    "warm",
    "bright",
    "wide",
)
FILLER_PHRASES = (
    "Here we go.",
    "There and back again.",
    "On we walk.",
    "So it goes.",
    "Look around.",
)

PREDICTED_DIGITS = 5
SAMPLINGS = ("equidistant", "random", "beginning", "end")


class TextEncoder(Protocol):
    """The part of the tokenizer protocol the builder needs."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


@dataclasses.dataclass(frozen=True)
class PasskeySample:
    """One teacher-forced passkey sample.

    tokens: int32 [prompt_length + len(key tokens)], the prompt followed by tokens(" " + key).
    answer_positions: int32 [PREDICTED_DIGITS], indices in ``tokens`` of the key's last digits;
      the logits at ``answer_positions - 1`` predict them (see ``score_positions``).
    """

    tokens: np.ndarray
    prompt_length: int
    answer_positions: np.ndarray
    key: int
    filler_before: int
    filler_after: int
    needle_start: int
    needle_length: int
    target_length: int
    prefix_digits: int

    @property
    def n_filler(self) -> int:
        return self.filler_before + self.filler_after

    @property
    def answer_tokens(self) -> np.ndarray:
        return self.tokens[self.answer_positions]

    @property
    def score_positions(self) -> np.ndarray:
        return self.answer_positions - 1


@dataclasses.dataclass(frozen=True)
class PasskeyTemplate:
    """The fixed token pieces of the prompt for one tokenizer, filler and key size."""

    task: tuple[int, ...]
    filler: tuple[int, ...]
    question: tuple[int, ...]
    needle_budget: int
    prefix_digits: int

    @classmethod
    def from_tokenizer(
        cls, tokenizer: TextEncoder, *, prefix_digits: int = 1, filler: str = FILLER
    ) -> PasskeyTemplate:
        if prefix_digits < 0:
            raise ValueError(f"prefix_digits must be >= 0, got {prefix_digits}")
        filler_ids = tuple(tokenizer.encode(filler))
        if not filler_ids:
            raise ValueError("filler must encode to at least one token")
        widest_key = 10 ** (PREDICTED_DIGITS + prefix_digits) - 1
        return cls(
            task=tuple(tokenizer.encode(TASK)),
            filler=filler_ids,
            question=tuple(tokenizer.encode(QUESTION)),
            needle_budget=len(tokenizer.encode(NEEDLE.format(key=widest_key))),
            prefix_digits=prefix_digits,
        )

    @property
    def min_length(self) -> int:
        """Prompt length with no filler (the shortest prompt)."""
        return len(self.task) + self.needle_budget + len(self.question)

    def n_filler(self, target_length: int) -> int:
        """Largest filler count keeping the prompt within ``target_length``.

        ``target_length == 0`` is the spec sweep's first point: the shortest prompt, no filler.
        """
        if target_length == 0:
            return 0
        if target_length < self.min_length:
            raise ValueError(
                f"target_length {target_length} is below the passkey prompt's minimum of "
                f"{self.min_length} tokens (use 0 for the shortest prompt)"
            )
        return (target_length - self.min_length) // len(self.filler)

    def prompt_length(self, target_length: int) -> int:
        """Prompt length (key tokens excluded) for the widest key at ``target_length``."""
        return self.min_length + self.n_filler(target_length) * len(self.filler)


@functools.lru_cache(maxsize=32)
def _cached_template(tokenizer: TextEncoder, prefix_digits: int, filler: str) -> PasskeyTemplate:
    return PasskeyTemplate.from_tokenizer(tokenizer, prefix_digits=prefix_digits, filler=filler)


def passkey_template(
    tokenizer: TextEncoder, *, prefix_digits: int = 1, filler: str = FILLER
) -> PasskeyTemplate:
    """Template for ``tokenizer``, cached when the tokenizer is hashable."""
    try:
        return _cached_template(tokenizer, prefix_digits, filler)
    except TypeError:
        return PasskeyTemplate.from_tokenizer(tokenizer, prefix_digits=prefix_digits, filler=filler)


def vocabulary_texts() -> list[str]:
    """Texts that together use every token of any passkey prompt: the paper's strings, a
    needle and a key with each of the ten digits, and every varied filler sentence."""
    keys = ("1234567890", "9876543210")
    sentences = [
        FILLER_SENTENCE.format(noun=noun, adjective=adjective)
        for noun in FILLER_NOUNS
        for adjective in FILLER_ADJECTIVES
    ]
    return [
        TASK,
        FILLER,
        QUESTION,
        *(NEEDLE.format(key=key) for key in keys),
        *(f" {key}" for key in keys),
        " ".join(sentences + list(FILLER_PHRASES)),
        *FILLER_PHRASES,
    ]


def random_key(rng: np.random.Generator, prefix_digits: int = 1) -> int:
    """A key with exactly ``PREDICTED_DIGITS + prefix_digits`` digits, uniformly drawn."""
    digits = PREDICTED_DIGITS + prefix_digits
    return int(rng.integers(10 ** (digits - 1), 10**digits))


def depth_schedule(
    rule: str, n_samples: int, n_filler: int, rng: np.random.Generator | None = None
) -> list[int]:
    """Filler copies before the needle for each sample, each in [0, n_filler].

    equidistant: floor(linspace(0, n_filler, n_samples)); random: uniform integers;
    beginning: all 0; end: all n_filler.
    """
    if n_samples < 1:
        raise ValueError(f"n_samples must be >= 1, got {n_samples}")
    if n_filler < 0:
        raise ValueError(f"n_filler must be >= 0, got {n_filler}")
    if rule == "equidistant":
        return [int(a) for a in np.floor(np.linspace(0, n_filler, n_samples))]
    if rule == "random":
        if rng is None:
            raise ValueError("rule 'random' needs rng (a numpy Generator)")
        return [int(a) for a in rng.integers(0, n_filler + 1, size=n_samples)]
    if rule == "beginning":
        return [0] * n_samples
    if rule == "end":
        return [n_filler] * n_samples
    raise ValueError(f"rule must be one of {SAMPLINGS}, got {rule!r}")


def _key_tokens(tokenizer: TextEncoder, key: int) -> list[int]:
    ids = tokenizer.encode(" " + str(key))
    last_digits = str(key)[-PREDICTED_DIGITS:]
    if len(ids) < PREDICTED_DIGITS or tokenizer.decode(ids[-PREDICTED_DIGITS:]) != last_digits:
        raise ValueError(
            f"tokenizer must encode digits one per token: ' {key}' -> {ids} does not end in "
            f"{PREDICTED_DIGITS} single-digit tokens"
        )
    return ids


def build_passkey_sample(
    tokenizer: TextEncoder,
    target_length: int,
    *,
    key: int,
    filler_before: int | None = None,
    depth: float | None = None,
    prefix_digits: int = 1,
    filler: str = FILLER,
) -> PasskeySample:
    """Build one prompt of at most ``target_length`` tokens (key tokens come on top).

    Give the needle position either as ``filler_before`` (filler copies before the needle,
    0..n_filler) or as ``depth`` in [0, 1] (fraction of the filler before the needle).
    """
    template = passkey_template(tokenizer, prefix_digits=prefix_digits, filler=filler)
    n_filler = template.n_filler(target_length)
    digits = PREDICTED_DIGITS + prefix_digits
    if len(str(key)) != digits or key < 0:
        raise ValueError(f"key must have exactly {digits} digits, got {key}")
    if (filler_before is None) == (depth is None):
        raise ValueError("give exactly one of filler_before or depth")
    if depth is not None:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
        filler_before = round(depth * n_filler)
    assert filler_before is not None
    if not 0 <= filler_before <= n_filler:
        raise ValueError(f"filler_before must be in [0, {n_filler}], got {filler_before}")

    needle = tokenizer.encode(NEEDLE.format(key=key))
    key_ids = _key_tokens(tokenizer, key)
    filler_ids = np.asarray(template.filler, np.int32)
    pieces = [
        np.asarray(template.task, np.int32),
        np.tile(filler_ids, filler_before),
        np.asarray(needle, np.int32),
        np.tile(filler_ids, n_filler - filler_before),
        np.asarray(template.question, np.int32),
        np.asarray(key_ids, np.int32),
    ]
    tokens = np.concatenate(pieces)
    prompt_length = len(tokens) - len(key_ids)
    return PasskeySample(
        tokens=tokens,
        prompt_length=prompt_length,
        answer_positions=np.arange(len(tokens) - PREDICTED_DIGITS, len(tokens), dtype=np.int32),
        key=key,
        filler_before=filler_before,
        filler_after=n_filler - filler_before,
        needle_start=len(template.task) + filler_before * len(template.filler),
        needle_length=len(needle),
        target_length=target_length,
        prefix_digits=prefix_digits,
    )


def build_passkey_samples(
    tokenizer: TextEncoder,
    target_length: int,
    n_samples: int,
    *,
    sampling: str = "equidistant",
    rng: np.random.Generator,
    prefix_digits: int = 1,
    filler: str = FILLER,
) -> list[PasskeySample]:
    """``n_samples`` prompts at one length, needles placed by ``sampling``, random keys."""
    template = passkey_template(tokenizer, prefix_digits=prefix_digits, filler=filler)
    depths = depth_schedule(sampling, n_samples, template.n_filler(target_length), rng)
    return [
        build_passkey_sample(
            tokenizer,
            target_length,
            key=random_key(rng, prefix_digits),
            filler_before=a,
            prefix_digits=prefix_digits,
            filler=filler,
        )
        for a in depths
    ]
