"""Readers of pre-tokenised shard directories (written by `python -m bam_train.shards`).

  meta.json                 {"format": "bam-jax-shards", "version": 1, "tokenizer": ...,
                             "vocab_size": V, "bos_id": ..., "eos_id": ...,
                             "shards": [{"name": "shard-00000", "tokens": ..., "documents": ...,
                                         "min_id": ..., "max_id": ...}]}
  shard-00000.tokens.npy    int32 [tokens]     documents concatenated, each BOS + text + EOS
  shard-00000.starts.npy    int64 [documents]  offset of each document's first token

Shards are memory-mapped, so they are read from a file system: a `file://` URL names its
local path; other URLs are refused (read a bucket through its mount).
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from bam_jax.io.files import is_url, local_path_of_file_url

FORMAT = "bam-jax-shards"
VERSION = 1
SCAN_CHUNK = 1 << 24


def local_shard_dir(path: str, field: str = "data.path") -> str:
    """The directory `path` names on this machine's file system: a `file://` URL's path, a
    plain path as it is; ValueError for any other URL, which cannot be memory-mapped."""
    if "://" not in path:
        return path
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
    tokens = _load_array(base + ".tokens.npy", shard["tokens"], mmap_mode="r")
    starts = _load_array(base + ".starts.npy", shard["documents"])
    if len(tokens) and (
        not len(starts)
        or starts[0] != 0
        or np.any(np.diff(starts) < 0)
        or starts[-1] >= len(tokens)
    ):
        raise ValueError(
            f"{base}.starts.npy: document starts must rise from 0 and stay below the shard's "
            f"{len(tokens)} tokens; the shard is damaged, write the shards again"
        )
    recorded = (shard["min_id"], shard["max_id"]) if "min_id" in shard else None
    check_token_ids(base + ".tokens.npy", tokens, vocab_size, recorded)
    return tokens, starts


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
    file: str, tokens: np.ndarray, vocab_size: int, id_range: tuple[int, int] | None = None
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
    position = _first_outside(tokens, vocab_size)
    found = (
        f"token id {tokens[position]} at position {position}"
        if position is not None
        else f"ids in [{low}, {high}] by meta.json"
    )
    raise ValueError(
        f"{file}: {found}, outside the vocabulary [0, {vocab_size}); the data is damaged "
        "or was written with another tokenizer: write the shards again with "
        "`python -m bam_train.shards`"
    )


@functools.cache
def _id_range(file: str, size: int, mtime_ns: int) -> tuple[int, int]:
    """(min, max) id of a tokens file; `size` and `mtime_ns` key the cache to its version."""
    tokens = np.load(file, mmap_mode="r")
    if not len(tokens):
        return 0, -1
    return int(tokens.min()), int(tokens.max())


def _first_outside(tokens: np.ndarray, vocab_size: int) -> int | None:
    """Position of the first id outside [0, vocab_size), read in chunks of a memory map."""
    for start in range(0, len(tokens), SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + SCAN_CHUNK])
        bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
        if bad.size:
            return start + int(bad[0])
    return None
