"""Pre-tokenised shards for large runs, and the command that writes them.

Format of a shard directory (read memory-mapped, so a process touches only its rows):

  meta.json                 {"format": "bam-jax-shards", "version": 1, "tokenizer": ...,
                             "vocab_size": V, "bos_id": ..., "eos_id": ...,
                             "shards": [{"name": "shard-00000", "tokens": N, "documents": M}]}
  shard-00000.tokens.npy    int32 [N]  documents concatenated, each BOS + text + EOS
  shard-00000.starts.npy    int64 [M]  offset of each document's first token

Write them from a Hugging Face dataset (streamed from the hub, or saved with
`Dataset.save_to_disk`) or from local .txt/.jsonl files:

  python -m train.shards --dataset=HuggingFaceFW/fineweb --subset=sample-10BT --out=DIR
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
from collections.abc import Iterable, Iterator

import numpy as np

from bam_jax.tokenizers import Tokenizer, get_tokenizer

FORMAT = "bam-jax-shards"
VERSION = 1


def read_meta(path: str) -> dict:
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise ValueError(f"data.path: {path!r} is not a shard directory (no meta.json)")
    with open(meta_path, encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"data.path: {meta_path} is not {FORMAT} version {VERSION}")
    return meta


def open_shards(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document starts) per shard, memory-mapped."""
    meta = read_meta(path)
    out = []
    for shard in meta["shards"]:
        base = os.path.join(path, shard["name"])
        tokens = np.load(base + ".tokens.npy", mmap_mode="r")
        starts = np.load(base + ".starts.npy")
        out.append((tokens, starts))
    return out


def write_shards(
    texts: Iterable[str],
    out_dir: str,
    tokenizer: Tokenizer,
    *,
    shard_tokens: int = 1 << 26,
    max_tokens: int | None = None,
) -> dict:
    """Tokenise `texts` (BOS + text + EOS each) into shards of about `shard_tokens` tokens."""
    if shard_tokens < 1:
        raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict] = []
    pending: list[list[int]] = []
    pending_tokens, total = 0, 0
    for text in texts:
        ids = [tokenizer.bos_id, *tokenizer.encode(text), tokenizer.eos_id]
        pending.append(ids)
        pending_tokens += len(ids)
        total += len(ids)
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
        "bos_id": tokenizer.bos_id,
        "eos_id": tokenizer.eos_id,
        "shards": shards,
    }
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
    return meta


def _write_one(out_dir: str, index: int, docs: list[list[int]]) -> dict:
    name = f"shard-{index:05d}"
    lengths = np.asarray([len(d) for d in docs], np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    tokens = np.fromiter(itertools.chain.from_iterable(docs), np.int32, int(lengths.sum()))
    np.save(os.path.join(out_dir, name + ".tokens.npy"), tokens)
    np.save(os.path.join(out_dir, name + ".starts.npy"), starts)
    return {"name": name, "tokens": int(lengths.sum()), "documents": len(docs)}


def iter_dataset_texts(
    dataset: str, *, subset: str | None = None, split: str = "train", text_key: str = "text"
) -> Iterator[str]:
    """Texts from local .txt/.jsonl files, a `save_to_disk` directory, or the hub (streamed)."""
    from train.data import TEXT_SUFFIXES, iter_documents, text_files

    if dataset.endswith(TEXT_SUFFIXES) or (
        os.path.isdir(dataset) and not _is_saved_dataset(dataset)
    ):
        yield from iter_documents(text_files(dataset), text_key)
        return
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            f"dataset: reading {dataset!r} needs the `datasets` package (pip install 'bam-jax[hf]')"
        )
    import datasets

    if _is_saved_dataset(dataset):
        data = datasets.load_from_disk(dataset)
        if isinstance(data, datasets.DatasetDict):
            data = data[split]
    else:
        try:
            data = datasets.load_dataset(dataset, subset, split=split, streaming=True)
            records = iter(data)
            first = next(records)
        except Exception as err:  # the hub client raises many kinds when offline
            raise ValueError(
                f"dataset: could not stream {dataset!r} from the Hugging Face hub ({err}). "
                "Without network, save the dataset with `datasets.Dataset.save_to_disk` "
                "elsewhere and pass that directory, or pass local .txt/.jsonl files."
            ) from err
        data = itertools.chain([first], records)
    for record in data:
        if text_key not in record:
            raise ValueError(f"text_key: records have no field {text_key!r}")
        yield record[text_key]


def _is_saved_dataset(path: str) -> bool:
    markers = ("dataset_info.json", "state.json", "dataset_dict.json")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, m)) for m in markers)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m train.shards", description="Write pre-tokenised training shards."
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
    meta = write_shards(
        texts,
        args.out,
        get_tokenizer(args.tokenizer),
        shard_tokens=args.shard_tokens,
        max_tokens=args.max_tokens,
    )
    n_tokens = sum(s["tokens"] for s in meta["shards"])
    print(f"wrote {len(meta['shards'])} shards, {n_tokens} tokens to {args.out}")


if __name__ == "__main__":
    main()
