"""Copy seeding: generic documents in which random strings recur, mixed into a text stream.

A small language model trained on code alone learns to copy late or not at all, and without
copying no positional encoding can retrieve anything. A copy document teaches only that:
it is made of pieces, each a random string of lowercase letters on a line of its own, a few
lines of the corpus, and the same string again. There are no passkey words, digits or "key"
phrasing, so a passkey prompt stays out of distribution.

`with_copy_documents` puts copy documents after the corpus documents, in order, so that
`fraction` of the characters of the stream are in copy documents.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from bam_jax.io.documents import Document

STRING_LETTERS = (8, 20)
LINES_BETWEEN = (2, 6)
DOCUMENT_CHARS = 1024
LETTERS = np.array(list("abcdefghijklmnopqrstuvwxyz"))


def copy_piece(rng: np.random.Generator, lines: Sequence[str]) -> str:
    """A random string, `LINES_BETWEEN` lines drawn from `lines`, and the string again."""
    string = "".join(rng.choice(LETTERS, int(rng.integers(*STRING_LETTERS, endpoint=True))))
    count = int(rng.integers(*LINES_BETWEEN, endpoint=True))
    between = [lines[int(i)] for i in rng.integers(0, len(lines), count)]
    return "\n".join([string, *between, string]) + "\n"


def copy_document(rng: np.random.Generator, lines: Sequence[str]) -> str:
    """Copy pieces up to about `DOCUMENT_CHARS` characters."""
    pieces, chars = [], 0
    while chars < DOCUMENT_CHARS:
        pieces.append(copy_piece(rng, lines))
        chars += len(pieces[-1])
    return "".join(pieces)


def with_copy_documents(docs: Iterable[Document], fraction: float) -> Iterator[Document]:
    """`docs`, each followed by the copy documents (built from its own lines) that keep the
    copy documents' share of the characters so far at `fraction`. Deterministic: the k-th
    copy document depends only on k and the document before it."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"data.copy_seeding must be in [0, 1), got {fraction}")
    corpus_chars = copy_chars = made = 0
    for doc in docs:
        yield doc
        corpus_chars += len(doc.text)
        lines = [line for line in doc.text.splitlines() if line.strip()]
        if not lines or fraction == 0.0:
            continue
        while copy_chars < fraction / (1.0 - fraction) * corpus_chars:
            text = copy_document(np.random.default_rng([made]), lines)
            yield Document(f"copy document {made} (after {doc.where})", text)
            copy_chars += len(text)
            made += 1
