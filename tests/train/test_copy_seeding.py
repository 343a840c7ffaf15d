"""Copy seeding: generic copy documents mixed into a text stream at a share of its characters."""

import re

import numpy as np
import pytest

from bam_configs.training import DataConfig
from bam_jax.io.documents import Document
from bam_train.copy_seeding import STRING_LETTERS, copy_document, with_copy_documents

CORPUS = [
    Document(f"file{i}.py", "".join(f"line {i}.{j} = value\n" for j in range(400)))
    for i in range(30)
]


def _copy_share(docs: list[Document]) -> float:
    copied = sum(len(d.text) for d in docs if d.where.startswith("copy document"))
    return copied / sum(len(d.text) for d in docs)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.6])
def test_copy_documents_take_their_share_of_the_characters(fraction):
    docs = list(with_copy_documents(CORPUS, fraction))
    assert abs(_copy_share(docs) - fraction) < 0.02
    assert [d for d in docs if not d.where.startswith("copy")] == CORPUS


def test_no_copy_seeding_leaves_the_corpus_alone():
    assert list(with_copy_documents(CORPUS, 0.0)) == CORPUS


def test_every_piece_repeats_one_random_string_around_corpus_lines():
    text = copy_document(np.random.default_rng(0), ["a = 1", "b = 2", "c = 3"])
    lines = text.splitlines()
    strings = [line for line in lines if re.fullmatch(r"[a-z]+", line)]
    assert len(strings) % 2 == 0 and len(strings) >= 2
    for first, second in zip(strings[::2], strings[1::2], strict=True):
        assert first == second and STRING_LETTERS[0] <= len(first) <= STRING_LETTERS[1]
    assert set(lines) - set(strings) <= {"a = 1", "b = 2", "c = 3"}
    assert "key" not in text and not re.search(r"\d{3}", text)


def test_copy_documents_are_the_same_on_every_read():
    assert list(with_copy_documents(CORPUS, 0.3)) == list(with_copy_documents(CORPUS, 0.3))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"source": "text", "copy_seeding": 1.0}, r"data\.copy_seeding must be in \[0, 1\)"),
        ({"source": "passkey", "copy_seeding": 0.3}, r"data\.copy_seeding mixes .* 'passkey'"),
    ],
)
def test_bad_copy_seeding_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(**fields)
