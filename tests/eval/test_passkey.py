"""Tests for bam_jax.passkey: the prompt format of docs/spec.md section 10."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from bam_jax import passkey
from bam_jax.passkey import (
    FILLER,
    NEEDLE,
    PREDICTED_DIGITS,
    QUESTION,
    TASK,
    build_passkey_sample,
    build_passkey_samples,
    depth_schedule,
    passkey_template,
)


class ByteTokenizer:
    """UTF-8 bytes as tokens: every character is one token, digits included."""

    vocab_size = 256
    bos_id = 1
    eos_id = 2
    name = "test-bytes"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids).decode("utf-8")


class WordTokenizer:
    """Whitespace-split words, digits split one per token (like the Mistral tokenizer)."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.inverse: dict[int, str] = {}

    def _id(self, piece: str) -> int:
        if piece not in self.vocab:
            self.vocab[piece] = len(self.vocab)
            self.inverse[self.vocab[piece]] = piece
        return self.vocab[piece]

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word.isdigit():
                ids.extend(self._id(ch) for ch in word)
            else:
                ids.append(self._id(word))
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.inverse[int(i)] for i in ids)


def test_strings_are_the_papers() -> None:
    assert TASK.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert TASK.endswith("I will quiz you about the important information there.")
    assert FILLER == (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    )
    assert NEEDLE.format(key=123456) == (
        "The pass key is 123456. Remember it. 123456 is the pass key."
    )
    assert QUESTION == "What is the pass key? The pass key is"


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), WordTokenizer()])
@pytest.mark.parametrize("target", [400, 1000, 1234, 5000])
def test_prompt_format_and_length(tokenizer, target: int) -> None:
    a = min(2, passkey_template(tokenizer).n_filler(target))
    sample = build_passkey_sample(tokenizer, target, key=987654, filler_before=a)
    enc = tokenizer.encode
    n = sample.n_filler
    expected = (
        enc(TASK)
        + enc(FILLER) * a
        + enc(NEEDLE.format(key=987654))
        + enc(FILLER) * (n - a)
        + enc(QUESTION)
        + enc(" 987654")
    )
    assert sample.tokens.dtype == np.int32
    assert sample.tokens.tolist() == expected
    filler_len = len(enc(FILLER))
    # The largest filler count that fits: within one filler line of the target.
    assert target - filler_len < sample.prompt_length <= target
    assert sample.needle_start == len(enc(TASK)) + a * filler_len
    assert sample.filler_before == a and sample.filler_after == n - a


@pytest.mark.parametrize("tokenizer", [ByteTokenizer(), WordTokenizer()])
def test_answer_positions_are_last_digits(tokenizer) -> None:
    sample = build_passkey_sample(tokenizer, 600, key=314159, depth=0.5)
    assert sample.answer_positions.tolist() == list(
        range(len(sample.tokens) - PREDICTED_DIGITS, len(sample.tokens))
    )
    assert tokenizer.decode(sample.answer_tokens) == "14159"
    assert (sample.score_positions == sample.answer_positions - 1).all()
    assert sample.prompt_length <= 600


def test_prefix_digits_change_key_size() -> None:
    tok = ByteTokenizer()
    sample = build_passkey_sample(tok, 500, key=12345, prefix_digits=0, filler_before=0)
    assert tok.decode(sample.answer_tokens) == "12345"
    with pytest.raises(ValueError, match="digits"):
        build_passkey_sample(tok, 500, key=12345, prefix_digits=1, filler_before=0)
    rng = np.random.default_rng(0)
    keys = [passkey.random_key(rng, prefix_digits=3) for _ in range(50)]
    assert all(len(str(k)) == 8 for k in keys)


def test_depth_schedules() -> None:
    assert depth_schedule("equidistant", 5, 10) == [0, 2, 5, 7, 10]
    assert depth_schedule("equidistant", 1, 10) == [0]
    assert depth_schedule("beginning", 3, 7) == [0, 0, 0]
    assert depth_schedule("end", 3, 7) == [7, 7, 7]
    rand = depth_schedule("random", 200, 9, np.random.default_rng(1))
    assert min(rand) >= 0 and max(rand) <= 9 and len(set(rand)) > 5
    with pytest.raises(ValueError, match="rule"):
        depth_schedule("middle", 3, 7)


@pytest.mark.parametrize("sampling", ["equidistant", "random", "beginning", "end"])
def test_samples_place_needle_by_rule(sampling: str) -> None:
    tok = ByteTokenizer()
    samples = build_passkey_samples(tok, 3000, 6, sampling=sampling, rng=np.random.default_rng(2))
    n = samples[0].n_filler
    befores = [s.filler_before for s in samples]
    if sampling == "equidistant":
        assert befores == depth_schedule("equidistant", 6, n)
    elif sampling == "beginning":
        assert befores == [0] * 6
    elif sampling == "end":
        assert befores == [n] * 6
    for s in samples:
        needle = tok.encode(NEEDLE.format(key=s.key))
        assert s.tokens[s.needle_start : s.needle_start + len(needle)].tolist() == needle
        assert len(str(s.key)) == PREDICTED_DIGITS + 1


def test_minimum_length_and_zero() -> None:
    tok = ByteTokenizer()
    template = passkey_template(tok)
    shortest = build_passkey_sample(tok, 0, key=111111, filler_before=0)
    assert shortest.n_filler == 0 and shortest.prompt_length == template.min_length
    with pytest.raises(ValueError, match="minimum"):
        build_passkey_sample(tok, template.min_length - 1, key=111111, filler_before=0)
    with pytest.raises(ValueError, match="filler_before"):
        build_passkey_sample(tok, 1000, key=111111, filler_before=10_000)


def test_long_prompt_is_fast_to_build() -> None:
    tok = ByteTokenizer()
    sample = build_passkey_sample(tok, 500_000, key=271828, depth=1.0)
    assert 500_000 - len(FILLER) < sample.prompt_length <= 500_000
    assert sample.filler_after == 0
