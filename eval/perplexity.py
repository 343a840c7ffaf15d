"""Perplexity by position over long sequences (docs/spec.md section 11).

Each sequence of ``seq_len + 1`` tokens runs through the cached model in chunks (full
causal context, never a [T, vocab] array); the next-token loss is averaged per window of
``window`` positions over all sequences, so the curve shows what happens past the
training length.

Data sources:
- a directory of pre-tokenised shards (``meta.json``, as written by ``python -m bam_train.shards``)
  or a ``.npy`` file of token ids;
- ``.txt`` / ``.jsonl`` files (a file, a directory or a glob);
- ``python-stdlib:held-out``: the standard library files held out of ``python-stdlib``;
- ``hf:NAME[:SUBSET][@SPLIT]`` (a Hugging Face dataset, streamed) or a dataset directory
  saved with ``save_to_disk``; both need the ``hf`` extra (``datasets``).

Packing: "concat" joins documents with BOS/EOS removed and cuts rows (the held-out
FineWeb protocol); "documents" keeps only documents of at least ``seq_len + 1`` tokens,
one row each, starting with BOS (the long-Wikipedia-articles protocol).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from bam_jax.inference import ChunkedForward
from bam_jax.io.documents import source_documents
from bam_jax.io.shards import open_shards, read_meta
from bam_jax.tokenizers import Tokenizer

PACKINGS = ("concat", "documents")


def _documents(source: str, text_key: str) -> Iterator[str]:
    return (doc.text for doc in source_documents(source, text_key))


def _token_documents(source: str, tokenizer: Tokenizer, text_key: str) -> Iterator[np.ndarray]:
    """Documents as int32 token arrays, BOS first, no EOS."""
    if source.endswith(".npy"):
        if not os.path.isfile(source):
            raise ValueError(f"data {source!r} does not exist")
        yield np.load(source, mmap_mode="r").astype(np.int32)
        return
    if os.path.isfile(os.path.join(source, "meta.json")):
        meta = read_meta(source)
        if meta.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
            raise ValueError(
                f"data {source!r} was tokenised with {meta.get('tokenizer')!r} (vocabulary "
                f"{meta.get('vocab_size')}), not with {tokenizer.name!r} "
                f"(vocabulary {tokenizer.vocab_size})"
            )
        for tokens, starts in open_shards(source):
            ends = [*starts[1:].tolist(), len(tokens)]
            for start, end in zip(starts.tolist(), ends, strict=True):
                yield np.asarray(tokens[start:end], np.int32)
        return
    for text in _documents(source, text_key):
        yield np.asarray([tokenizer.bos_id, *tokenizer.encode(text)], np.int32)


def load_rows(
    source: str,
    tokenizer: Tokenizer,
    seq_len: int,
    n_sequences: int,
    *,
    packing: str = "concat",
    text_key: str = "text",
) -> np.ndarray:
    """Up to ``n_sequences`` rows of ``seq_len + 1`` tokens, int32 [N, seq_len + 1]."""
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    if seq_len < 1 or n_sequences < 1:
        raise ValueError(f"seq_len and n_sequences must be >= 1, got {seq_len}, {n_sequences}")
    row_len = seq_len + 1
    rows: list[np.ndarray] = []
    docs = _token_documents(source, tokenizer, text_key)
    if packing == "documents":
        for doc in docs:
            doc = doc[doc != tokenizer.eos_id]
            if len(doc) >= row_len:
                rows.append(doc[:row_len])
            if len(rows) == n_sequences:
                break
    else:
        special = np.asarray([tokenizer.bos_id, tokenizer.eos_id], np.int32)
        pending, have = [], 0
        for doc in docs:
            doc = doc[~np.isin(doc, special)]
            pending.append(doc)
            have += len(doc)
            if have >= row_len * n_sequences:
                break
        joined = np.concatenate(pending) if pending else np.zeros(0, np.int32)
        count = min(n_sequences, len(joined) // row_len)
        rows = list(joined[: count * row_len].reshape(count, row_len))
    if not rows:
        raise ValueError(
            f"data {source!r} has no {packing} row of {row_len} tokens; lower --seq-len or "
            f"use --packing concat"
        )
    return np.stack(rows).astype(np.int32)


def evaluate_perplexity(
    scorer: ChunkedForward,
    rows_BxT: np.ndarray,
    *,
    window: int,
    batch_size: int = 1,
    progress: bool = True,
    label: str = "",
) -> dict[str, Any]:
    """Mean next-token loss and perplexity per window of positions. A window where some
    sequence's logits were not finite (its loss NaN) has NaN loss and perplexity;
    `non_finite_sequences` counts those sequences per window."""
    seq_len = rows_BxT.shape[1] - 1
    if window < 1 or seq_len % window:
        raise ValueError(f"window must divide seq_len {seq_len}, got {window}")
    n_windows = seq_len // window
    loss_sum_W = np.zeros(n_windows)
    loss_sq_W = np.zeros(n_windows)
    non_finite_W = np.zeros(n_windows, np.int64)
    start = time.perf_counter()
    bar = tqdm(
        total=len(rows_BxT),
        disable=not progress or not sys.stderr.isatty(),
        desc=f"perplexity {label}".strip(),
    )
    for i in range(0, len(rows_BxT), batch_size):
        loss_BxT = scorer.next_token_loss(rows_BxT[i : i + batch_size]).astype(np.float64)
        loss_BxWxT = loss_BxT.reshape(len(loss_BxT), n_windows, window)
        loss_sum_W += loss_BxWxT.mean(-1).sum(0)
        loss_sq_W += (loss_BxWxT**2).mean(-1).sum(0)
        non_finite_W += (~np.isfinite(loss_BxWxT)).any(-1).sum(0)
        bar.update(len(loss_BxT))
    bar.close()
    mean_W = loss_sum_W / len(rows_BxT)
    std_W = np.sqrt(np.maximum(loss_sq_W / len(rows_BxT) - mean_W**2, 0.0))
    return {
        "positions": [(k + 1) * window for k in range(n_windows)],
        "loss": mean_W.tolist(),
        "loss_std": std_W.tolist(),
        "perplexity": np.exp(mean_W).tolist(),
        "non_finite_sequences": non_finite_W.tolist(),
        "n_sequences": len(rows_BxT),
        "seq_len": seq_len,
        "window": window,
        "seconds": time.perf_counter() - start,
    }
