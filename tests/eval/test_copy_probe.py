"""The copy probe: a random name defined once in held-out text and asked for at the end."""

from __future__ import annotations

import numpy as np
import pytest

from bam_eval.copy_probe import (
    GIVEN_LETTERS,
    NAME_LETTERS,
    CopySettings,
    copy_samples,
    filler_stream,
    score_copy_samples,
)
from bam_jax.io.documents import STDLIB_HELD_OUT
from bam_jax.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()


class _Oracle:
    """Logits that put all weight on the true next token, or on token `fixed`."""

    def __init__(self, fixed: int | None = None):
        self.fixed = fixed

    def logits_at(self, tokens_BxT: np.ndarray, positions_BxP: np.ndarray) -> np.ndarray:
        nxt = np.take_along_axis(tokens_BxT, positions_BxP + 1, 1)
        chosen = nxt if self.fixed is None else np.full_like(nxt, self.fixed)
        return np.eye(TOKENIZER.vocab_size, dtype=np.float32)[chosen]


@pytest.fixture(scope="module")
def filler() -> np.ndarray:
    return filler_stream(STDLIB_HELD_OUT, TOKENIZER, 4096)


def _text(tokens: np.ndarray) -> str:
    return TOKENIZER.decode(tokens.tolist())


def test_each_sample_defines_its_name_once_and_asks_for_it_at_the_end(filler):
    settings = CopySettings(n_samples=5)
    samples = copy_samples(TOKENIZER, filler, 2048, settings)
    assert [s.name for s in samples] == [
        s.name for s in copy_samples(TOKENIZER, filler, 2048, settings)
    ]
    for s in samples:
        text = _text(s.tokens)
        assert len(s.tokens) == 2048 and len(s.name) == NAME_LETTERS and s.name.isalpha()
        assert text.count(s.name) == 2 and text.count(f"\n{s.name} = None\n") == 1
        assert text.endswith(f"\nprint({s.name})"[:-1])
        assert _text(s.tokens[s.answer_positions]) == s.name[GIVEN_LETTERS:]
        assert s.distance == len(text) - text.index(f"\n{s.name} = None") - len(s.answer_positions)
    assert [s.depth for s in samples] == sorted(s.depth for s in samples)
    assert samples[0].depth == 0 and samples[-1].depth == 1
    assert samples[0].distance > 2000 > 100 > samples[-1].distance


def test_the_piece_form_writes_the_name_alone_on_a_line_as_copy_documents_do(filler):
    settings = CopySettings(n_samples=4, form="piece")
    samples = copy_samples(TOKENIZER, filler, 1024, settings)
    program = copy_samples(TOKENIZER, filler, 1024, CopySettings(n_samples=4))
    assert [s.name for s in samples] == [s.name for s in program]
    for s in samples:
        text = _text(s.tokens)
        assert len(s.tokens) == 1024 and text.count(s.name) == 2
        assert text.count(f"\n{s.name}\n") == 1 and f"{s.name} = None" not in text
        assert text.endswith(f"\n{s.name}")
        assert _text(s.tokens[s.answer_positions]) == s.name[GIVEN_LETTERS:]
    assert samples[0].distance > 900 > 100 > samples[-1].distance


def test_an_unknown_form_is_refused_naming_the_forms():
    with pytest.raises(ValueError, match=r"form must be one of \('program', 'piece'\), got 'code'"):
        CopySettings(form="code")


def test_scores_count_letters_and_whole_names(filler):
    samples = copy_samples(TOKENIZER, filler, 512, CopySettings(n_samples=3))
    letters, exact = score_copy_samples(_Oracle(), samples, batch_size=2)
    assert letters.tolist() == [1.0, 1.0, 1.0] and exact.all()
    first = samples[0].tokens[samples[0].answer_positions[0]]
    letters, exact = score_copy_samples(_Oracle(fixed=int(first)), samples[:1], batch_size=1)
    answer = samples[0].tokens[samples[0].answer_positions]
    assert letters[0] == pytest.approx(np.mean(answer == first)) and not exact[0]


def test_a_length_shorter_than_the_probe_is_refused(filler):
    with pytest.raises(ValueError, match="shorter than the probe's own"):
        copy_samples(TOKENIZER, filler, 40, CopySettings(n_samples=1))
