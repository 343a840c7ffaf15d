"""The command that writes pre-tokenised shards for large runs (the format and its readers
are in `bam_jax.io.shards`).

Write them from a Hugging Face dataset (streamed from the hub, or saved with
`Dataset.save_to_disk`) or from local .txt/.jsonl files:

  python -m bam_train.shards --dataset=HuggingFaceFW/fineweb --subset=sample-10BT --out=DIR

Shards are memory-mapped, so they are read from a file system: shards in a bucket are read
from its mount (`gcsfuse --implicit-dirs BUCKET /mnt/BUCKET`, then data.path=/mnt/BUCKET/DIR)
like any directory. A `file://` URL names its local path; other URLs are refused.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable

import numpy as np

from bam_jax.io.documents import iter_dataset_texts
from bam_jax.io.files import write_text_atomically
from bam_jax.io.shards import FORMAT, VERSION, local_shard_dir
from bam_jax.tokenizers import Tokenizer, encode_checked, get_tokenizer, special_id


def write_shards(
    texts: Iterable[str],
    out_dir: str,
    tokenizer: Tokenizer,
    *,
    shard_tokens: int = 1 << 26,
    max_tokens: int | None = None,
) -> dict:
    """Tokenise `texts` (BOS + text + EOS each) into shards of about `shard_tokens` tokens.

    Refuses a directory that already holds shards (meta.json), and any id outside the
    tokenizer's vocabulary; records each shard's smallest and largest id in meta.json.
    """
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out_dir = local_shard_dir(out_dir, "--out")
    if os.path.exists(os.path.join(out_dir, "meta.json")):
        raise ValueError(
            f"{out_dir!r} already holds shards (meta.json), which are kept; write to a new "
            "directory"
        )
    bos, eos = special_id(tokenizer, "bos"), special_id(tokenizer, "eos")
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict] = []
    pending: list[np.ndarray] = []
    pending_tokens, total = 0, 0
    for index, text in enumerate(texts):
        ids = encode_checked(tokenizer, text, f"{out_dir}: document {index}")
        doc = np.concatenate([[bos], ids, [eos]]).astype(np.int32)
        pending.append(doc)
        pending_tokens += len(doc)
        total += len(doc)
        if pending_tokens >= shard_tokens:
            shards.append(_write_one(out_dir, len(shards), pending))
            pending, pending_tokens = [], 0
        if max_tokens is not None and total >= max_tokens:
            break
    if pending:
        shards.append(_write_one(out_dir, len(shards), pending))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "bos_id": bos,
        "eos_id": eos,
        "shards": shards,
    }
    write_text_atomically(os.path.join(out_dir, "meta.json"), json.dumps(meta, indent=1))
    return meta


def _write_one(out_dir: str, index: int, docs: list[np.ndarray]) -> dict:
    name = f"shard-{index:05d}"
    lengths = np.asarray([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.concatenate(docs)
    np.save(os.path.join(out_dir, name + ".tokens.npy"), tokens)
    np.save(os.path.join(out_dir, name + ".starts.npy"), starts)
    return {
        "name": name,
        "tokens": len(tokens),
        "documents": len(docs),
        "min_id": int(tokens.min()),
        "max_id": int(tokens.max()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bam_train.shards", description="Write pre-tokenised training shards."
    )
    parser.add_argument(
        "--dataset",
        required=True,
        help="hub name (e.g. HuggingFaceFW/fineweb), a save_to_disk directory, "
        "or .txt/.jsonl files (file, directory or glob)",
    )
    parser.add_argument("--subset", default=None, help="hub configuration, e.g. sample-10BT")
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-key", default="text")
    parser.add_argument("--tokenizer", default="mistral", help="mistral, byte or a file path")
    parser.add_argument("--out", required=True, help="output shard directory")
    parser.add_argument("--shard-tokens", type=int, default=1 << 26)
    parser.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args(argv)
    texts = iter_dataset_texts(
        args.dataset, subset=args.subset, split=args.split, text_key=args.text_key
    )
    try:
        meta = write_shards(
            texts,
            args.out,
            get_tokenizer(args.tokenizer),
            shard_tokens=args.shard_tokens,
            max_tokens=args.max_tokens,
        )
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    n_tokens = sum(s["tokens"] for s in meta["shards"])
    print(f"wrote {len(meta['shards'])} shards, {n_tokens} tokens to {args.out}")


if __name__ == "__main__":
    main()
