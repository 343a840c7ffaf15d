"""Pre-tokenised shards for large runs, and the command that writes them.

Format of a shard directory (read memory-mapped, so a process touches only its rows):

  meta.json                 {"format": "bam-jax-shards", "version": 1, "tokenizer": ...,
                             "vocab_size": V, "bos_id": ..., "eos_id": ...,
                             "shards": [{"name": "shard-00000", "tokens": N, "documents": M,
                                         "min_id": ..., "max_id": ...}]}
  shard-00000.tokens.npy    int32 [N]  documents concatenated, each BOS + text + EOS
  shard-00000.starts.npy    int64 [M]  offset of each document's first token

Write them from a Hugging Face dataset (streamed from the hub, or saved with
`Dataset.save_to_disk`) or from local .txt/.jsonl files:

  python -m train.shards --dataset=HuggingFaceFW/fineweb --subset=sample-10BT --out=DIR

Shards are memory-mapped, so they are read from a file system: shards in a bucket are read
from its mount (`gcsfuse --implicit-dirs BUCKET /mnt/BUCKET`, then data.path=/mnt/BUCKET/DIR)
like any directory. A `file://` URL names its local path; other URLs are refused.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import itertools
import json
import os
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from bam_jax.tokenizers import Tokenizer, encode_checked, get_tokenizer, special_id

FORMAT = "bam-jax-shards"
VERSION = 1
SCAN_CHUNK = 1 << 24


def local_shard_dir(path: str, field: str = "data.path") -> str:
    """The directory `path` names on this machine's file system: a `file://` URL's path, a
    plain path as it is; ValueError for any other URL, which cannot be memory-mapped."""
    if "://" not in path:
        return path
    from train.checkpoint import is_url, local_path_of_file_url

    if path.lower().startswith("file://"):
        return local_path_of_file_url(path, field)
    if not is_url(path):
        return path
    raise ValueError(
        f"{field}: {path!r} is a URL, but shards are memory-mapped from a file system; mount "
        "the bucket (for gs://: gcsfuse --implicit-dirs BUCKET /mnt/BUCKET) and use the "
        "directory under the mount point, or copy the shards to a local disk"
    )


def read_meta(path: str) -> dict:
    """meta.json of a shard directory, checked to have the fields the readers use."""
    path = local_shard_dir(path)
    meta_path = os.path.join(path, "meta.json")
    if not os.path.isfile(meta_path):
        raise ValueError(f"data.path: {path!r} is not a shard directory (no meta.json)")
    with open(meta_path, "rb") as f:
        try:
            meta = json.load(f)
        except ValueError as err:  # JSONDecodeError (names the line) or UnicodeDecodeError
            raise ValueError(f"{meta_path}: not valid JSON ({err})") from None
    is_shards = isinstance(meta, dict) and meta.get("format") == FORMAT
    if not is_shards or meta.get("version") != VERSION:
        raise ValueError(f"data.path: {meta_path} is not {FORMAT} version {VERSION}")
    vocab_size = meta.get("vocab_size")
    if not _is_int(vocab_size) or vocab_size < 1:
        raise ValueError(f"{meta_path}: vocab_size must be a positive integer, got {vocab_size!r}")
    entries = meta.get("shards")
    if not isinstance(entries, list) or not all(map(_is_shard_entry, entries)):
        raise ValueError(
            f'{meta_path}: shards must be a list of {{"name": str, "tokens": int, '
            f'"documents": int}}, got {entries!r:.200}'
        )
    return meta


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_shard_entry(entry: object) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("name"), str)
        and _is_int(entry.get("tokens"))
        and _is_int(entry.get("documents"))
        and ("min_id" in entry) == ("max_id" in entry)
        and all(_is_int(entry.get(key, 0)) for key in ("min_id", "max_id"))
    )


def open_shards(path: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(tokens, document starts) per shard, memory-mapped.

    Each shard is checked against meta.json (lengths, document starts) and its ids against
    [0, vocab_size): from the shard's recorded min_id/max_id, or for shards written without
    them one vectorised pass per file (once per process). A bad shard is a ValueError naming
    the file, the first bad id and its position.
    """
    path = local_shard_dir(path)
    meta = read_meta(path)
    return [_open_shard(path, shard, meta["vocab_size"]) for shard in meta["shards"]]


def _open_shard(path: str, shard: dict, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    base = os.path.join(path, shard["name"])
    tokens_N = _load_array(base + ".tokens.npy", shard["tokens"], mmap_mode="r")
    starts_M = _load_array(base + ".starts.npy", shard["documents"])
    if len(tokens_N) and (
        not len(starts_M)
        or starts_M[0] != 0
        or np.any(np.diff(starts_M) < 0)
        or starts_M[-1] >= len(tokens_N)
    ):
        raise ValueError(
            f"{base}.starts.npy: document starts must rise from 0 and stay below the shard's "
            f"{len(tokens_N)} tokens; the shard is damaged, write the shards again"
        )
    recorded = (shard["min_id"], shard["max_id"]) if "min_id" in shard else None
    check_token_ids(base + ".tokens.npy", tokens_N, vocab_size, recorded)
    return tokens_N, starts_M


def _load_array(file: str, length: int, mmap_mode: str | None = None) -> np.ndarray:
    """A 1-D integer array of `length` (meta.json's count) from a .npy file."""
    if not os.path.isfile(file):
        raise ValueError(f"{file} is missing; the shard directory is incomplete")
    try:
        array = np.load(file, mmap_mode=mmap_mode)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(f"{file}: not a readable .npy array ({err})") from None
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer) or len(array) != length:
        raise ValueError(
            f"{file}: expected {length} integers (meta.json), got a {array.dtype} array of "
            f"shape {array.shape}; the shard is damaged, write the shards again"
        )
    return array


def check_token_ids(
    file: str, tokens_N: np.ndarray, vocab_size: int, id_range: tuple[int, int] | None = None
) -> None:
    """Raise ValueError naming `file`, the first id outside [0, vocab_size) and its position.

    `id_range` (smallest, largest id) when known, e.g. from meta.json, spares the pass over
    the data; without it one vectorised pass per file version is made and remembered.
    """
    if id_range is None:
        stat = os.stat(file)
        id_range = _id_range(file, stat.st_size, stat.st_mtime_ns)
    low, high = id_range
    if low >= 0 and high < vocab_size:
        return
    position = _first_outside(tokens_N, vocab_size)
    found = (
        f"token id {tokens_N[position]} at position {position}"
        if position is not None
        else f"ids in [{low}, {high}] by meta.json"
    )
    raise ValueError(
        f"{file}: {found}, outside the vocabulary [0, {vocab_size}); the data is damaged "
        "or was written with another tokenizer: write the shards again with "
        "`python -m train.shards`"
    )


@functools.cache
def _id_range(file: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """(min, max) id of a tokens file; `size` and `mtime_ns` key the cache to its version."""
    tokens_N = np.load(file, mmap_mode="r")
    if not len(tokens_N):
        return 0, -1
    return int(tokens_N.min()), int(tokens_N.max())


def _first_outside(tokens_N: np.ndarray, vocab_size: int) -> int | None:
    """Position of the first id outside [0, vocab_size), read in chunks of a memory map."""
    for start in range(0, len(tokens_N), SCAN_CHUNK):
        chunk = np.asarray(tokens_N[start : start + SCAN_CHUNK])
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if bad.size:
            return start + int(bad[0])
    return None


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
    tmp = os.path.join(out_dir, "meta.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "meta.json"))
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
    for index, record in enumerate(data):
        where = f"{dataset} record {index}"
        if text_key not in record:
            raise ValueError(
                f"{where}: no field {text_key!r} (fields: {sorted(record)}); set --text-key "
                "to the field that holds the text"
            )
        if not isinstance(record[text_key], str):
            raise ValueError(
                f"{where}: field {text_key!r} is a {type(record[text_key]).__name__}, "
                "expected a string"
            )
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
