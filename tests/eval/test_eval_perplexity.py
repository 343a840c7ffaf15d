"""Perplexity data loading and per-window averaging."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bam_eval.perplexity import evaluate_perplexity, load_rows
from bam_jax.tokenizers import ByteTokenizer

TOKENIZER = ByteTokenizer()


def _write_jsonl(path, texts: list[str]) -> None:
    path.write_text("\n".join(json.dumps({"text": t}) for t in texts))


def test_concat_removes_bos_eos_and_cuts_rows(tmp_path) -> None:
    data = tmp_path / "docs.jsonl"
    _write_jsonl(data, ["abcdefghij", "klmnopqrst", "uvwxyz"])
    rows = load_rows(str(data), TOKENIZER, seq_len=7, n_sequences=3)
    assert rows.shape == (3, 8)
    assert TOKENIZER.decode(rows.ravel().tolist()) == "abcdefghijklmnopqrstuvwx"


def test_documents_keeps_only_long_ones_with_bos(tmp_path) -> None:
    data = tmp_path / "docs.jsonl"
    _write_jsonl(data, ["short", "a long enough document", "another long document"])
    rows = load_rows(str(data), TOKENIZER, seq_len=9, n_sequences=5, packing="documents")
    assert rows.shape == (2, 10)
    assert (rows[:, 0] == TOKENIZER.bos_id).all()
    assert TOKENIZER.decode(rows[0, 1:].tolist()) == "a long en"
    with pytest.raises(ValueError, match="no documents row"):
        load_rows(str(data), TOKENIZER, seq_len=500, n_sequences=1, packing="documents")


def test_npy_tokens(tmp_path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, np.arange(10, 60, dtype=np.int32))
    rows = load_rows(str(path), TOKENIZER, seq_len=15, n_sequences=10)
    assert rows.shape == (3, 16) and rows[1, 0] == 26


class _FixedLoss:
    """A scorer whose loss at position t is t (so window means are known)."""

    def next_token_loss(self, tokens_BxT: np.ndarray) -> np.ndarray:
        return np.tile(np.arange(tokens_BxT.shape[1] - 1, dtype=np.float32), (len(tokens_BxT), 1))


def test_window_means() -> None:
    rows = np.zeros((3, 9), np.int32)
    out = evaluate_perplexity(_FixedLoss(), rows, window=4, batch_size=2, progress=False)
    assert out["positions"] == [4, 8]
    np.testing.assert_allclose(out["loss"], [1.5, 5.5])
    np.testing.assert_allclose(out["perplexity"], np.exp([1.5, 5.5]), rtol=1e-6)
    with pytest.raises(ValueError, match="window"):
        evaluate_perplexity(_FixedLoss(), rows, window=3, progress=False)
