"""Small text corpora for training tests."""

import json

import numpy as np

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "green", "blue", "sun", "sky")


def write_word_corpus(tmp_path_factory, n_documents: int) -> str:
    """A .jsonl file of `n_documents` short documents of random words (seed 0)."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for _ in range(n_documents):
            words = rng.choice(WORDS, size=int(rng.integers(5, 30)))
            f.write(json.dumps({"text": " ".join(words) + "."}) + "\n")
    return str(path)
