"""Text documents: .txt files (one document each), .jsonl files (one per line), Hugging
Face datasets (streamed from the hub or saved with `Dataset.save_to_disk`), and the running
interpreter's standard library ("python-stdlib", a corpus on every machine)."""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import itertools
import json
import os
import sysconfig
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import NamedTuple

TEXT_SUFFIXES = (".txt", ".jsonl")
HF_PREFIX = "hf:"
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
STDLIB = "python-stdlib"
STDLIB_HELD_OUT = f"{STDLIB}:held-out"
# Folders of the standard library that are not its own code: installed packages, test
# suites (with their data files) and bytecode caches.
STDLIB_SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
# Whole top-level modules and packages are held out, taken in the order of a hash of their
# names while they fit in this share of the library's bytes.
STDLIB_HELD_OUT_SHARE = 1 / 8
# A held-out file is evaluated only when at most this share of its long lines (stripped, at
# least STDLIB_OVERLAP_LINE_CHARS characters) also occurs in some training file.
STDLIB_MAX_LINE_OVERLAP = 0.05
STDLIB_OVERLAP_LINE_CHARS = 24


def text_files(path: str) -> list[str]:
    """The .txt/.jsonl files named by a file, a directory or a glob, sorted."""
    if os.path.isdir(path):
        files = [os.path.join(path, f) for f in os.listdir(path)]
    elif os.path.isfile(path):
        files = [path]
    else:
        files = glob.glob(path)
    files = sorted(f for f in files if f.endswith(TEXT_SUFFIXES) and os.path.isfile(f))
    if not files:
        raise ValueError(f"data.path: no .txt or .jsonl files found at {path!r}")
    return files


class Document(NamedTuple):
    """A document's text and where it came from ("FILE" or "FILE line N"), for errors."""

    where: str
    text: str


def located_documents(files: Sequence[str], text_key: str = "text") -> Iterator[Document]:
    """One document per non-blank .jsonl line (field `text_key`), one per other file.

    A file that is not UTF-8, a line that is not a JSON object, or a record without a string
    `text_key` field is a ValueError naming the file and line.
    """
    for name in files:
        if not name.endswith(".jsonl"):
            with open(name, "rb") as f:
                yield Document(name, _utf8(f.read(), name, first_line=1))
            continue
        with open(name, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                line = _utf8(raw, name, first_line=line_no)
                if line.strip():
                    where = f"{name} line {line_no}"
                    yield Document(where, _record_text(line, where, text_key))


def iter_documents(files: Sequence[str], text_key: str = "text") -> Iterator[str]:
    """The texts of `located_documents`."""
    return (doc.text for doc in located_documents(files, text_key))


def _utf8(data: bytes, name: str, first_line: int) -> str:
    """`data` (which starts at line `first_line` of file `name`) decoded, a BOM dropped."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = first_line + data.count(b"\n", 0, err.start)
        column = err.start - data.rfind(b"\n", 0, err.start)
        raise ValueError(
            f"{name} line {line}: not UTF-8 (byte 0x{data[err.start]:02x} at column "
            f"{column}); save the file as UTF-8"
        ) from None


JSON_KINDS = {
    dict: "an object",
    list: "an array",
    str: "a string",
    bool: "a boolean",
    type(None): "null",
}


def _record_text(line: str, where: str, text_key: str) -> str:
    try:
        record = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{where}: not valid JSON at column {err.colno} ({err.msg.removesuffix(' at')}); "
            "each line of a .jsonl file must be one JSON object"
        ) from None
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected a JSON object with a {text_key!r} field, got "
            f"{JSON_KINDS.get(type(record), 'a number')}"
        )
    if text_key not in record:
        raise ValueError(
            f"{where}: no field {text_key!r} (fields: {sorted(record)}); set data.text_key "
            "(--text-key for bam_train.shards) to the field that holds the text"
        )
    text = record[text_key]
    if not isinstance(text, str):
        raise ValueError(
            f"{where}: field {text_key!r} is {JSON_KINDS.get(type(text), 'a number')}, "
            "expected a string"
        )
    return text


def is_stdlib_source(source: str) -> bool:
    """Whether `source` names the standard library corpus (either split)."""
    return source in (STDLIB, STDLIB_HELD_OUT)


def stdlib_files(source: str) -> list[str]:
    """The .py files of the running interpreter's standard library, sorted by relative path:
    for "python-stdlib" the training files, for "python-stdlib:held-out" the evaluation files
    (`stdlib_split`). Installed packages, test folders and caches are left out."""
    if not is_stdlib_source(source):
        raise ValueError(f"data.path: expected {STDLIB!r} or {STDLIB_HELD_OUT!r}, got {source!r}")
    split = stdlib_split(sysconfig.get_paths()["stdlib"])
    chosen = split.held_out if source == STDLIB_HELD_OUT else split.training
    return [os.path.join(split.root, r) for r in chosen]


class StdlibSplit(NamedTuple):
    """The standard library's split, as paths relative to `root`.

    Whole top-level modules and packages are held out, so a package's near-identical
    siblings (the codec tables of `encodings`) fall on one side: the modules in the order of
    a hash of their names, skipping any that would take the held-out bytes past
    STDLIB_HELD_OUT_SHARE of the library. A held-out file is then evaluated only if at most
    STDLIB_MAX_LINE_OVERLAP of its long lines occur in a training file; `overlap` maps each
    held-out file to that share, `dropped` lists those above it (neither trained nor
    evaluated). The split is the same on every machine with the same Python version.
    """

    root: str
    training: list[str]
    held_out: list[str]
    dropped: list[str]
    overlap: dict[str, float]


@lru_cache(maxsize=2)
def stdlib_split(root: str) -> StdlibSplit:
    relative = sorted(_stdlib_relative_paths(root))
    if not relative:
        raise ValueError(
            f"data.path {STDLIB!r}: no standard library .py files under {root!r} (the "
            "interpreter's sysconfig stdlib path); use a Python installation with its "
            "standard library sources, or pass .txt/.jsonl files"
        )
    held_modules = _held_out_modules(root, relative)
    training = [r for r in relative if _top_level(r) not in held_modules]
    training_lines = set().union(*(_long_lines(os.path.join(root, r)) for r in training))
    overlap = {
        r: _line_overlap(os.path.join(root, r), training_lines)
        for r in relative
        if _top_level(r) in held_modules
    }
    held_out = [r for r, share in overlap.items() if share <= STDLIB_MAX_LINE_OVERLAP]
    dropped = [r for r, share in overlap.items() if share > STDLIB_MAX_LINE_OVERLAP]
    return StdlibSplit(root, training, held_out, dropped, overlap)


def _top_level(relative_path: str) -> str:
    return relative_path.replace(os.sep, "/").split("/")[0].removesuffix(".py")


def _held_out_modules(root: str, relative: Sequence[str]) -> frozenset[str]:
    sizes: dict[str, int] = {}
    for r in relative:
        sizes[_top_level(r)] = sizes.get(_top_level(r), 0) + os.path.getsize(os.path.join(root, r))
    budget = STDLIB_HELD_OUT_SHARE * sum(sizes.values())
    held, held_bytes = set(), 0
    for module in sorted(sizes, key=lambda name: hashlib.sha256(name.encode()).digest()):
        if held_bytes + sizes[module] <= budget:
            held.add(module)
            held_bytes += sizes[module]
    return frozenset(held)


def _long_lines(path: str) -> set[str]:
    with open(path, encoding="utf-8", errors="replace") as f:
        stripped = (line.strip() for line in f)
        return {line for line in stripped if len(line) >= STDLIB_OVERLAP_LINE_CHARS}


def _line_overlap(path: str, training_lines: set[str]) -> float:
    lines = _long_lines(path)
    return len(lines & training_lines) / len(lines) if lines else 0.0


def held_out_source(source: str) -> str:
    """The held-out split of a text corpus that has one ("python-stdlib" ->
    "python-stdlib:held-out"), for evaluating a model on files it was not trained on."""
    if source != STDLIB:
        raise ValueError(
            f"data.path: {source!r} has no held-out split of whole files to evaluate "
            f"perplexity on; expected {STDLIB!r}"
        )
    return STDLIB_HELD_OUT


def _stdlib_relative_paths(root: str) -> Iterator[str]:
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIPPED_DIRS]
        for name in names:
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(folder, name), root)


def source_documents(source: str, text_key: str = "text") -> Iterator[Document]:
    """The documents of a text source: "hf:NAME[:SUBSET][@SPLIT]" (a Hugging Face dataset,
    streamed from the hub), a directory written by `Dataset.save_to_disk`, "python-stdlib"
    or "python-stdlib:held-out" (the interpreter's standard library, one document per .py
    file; `stdlib_files`), or .txt/.jsonl files (a file, a directory or a glob)."""
    if is_stdlib_source(source):
        return located_documents(stdlib_files(source), text_key)
    if source.startswith(HF_PREFIX):
        name, _, split = source.removeprefix(HF_PREFIX).partition("@")
        name, _, subset = name.partition(":")
        return _dataset_documents(name, subset or None, split or "train", text_key)
    if is_saved_dataset(source):
        return _dataset_documents(source, None, "train", text_key)
    return located_documents(text_files(source), text_key)


def check_dataset_reader(source: str) -> None:
    """A ValueError, before any reading starts, when `source` is a Hugging Face dataset and
    the `datasets` package is missing."""
    if source.startswith(HF_PREFIX) or is_saved_dataset(source):
        _require_datasets(source)


def _require_datasets(source: str) -> None:
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(
            f"dataset: reading {source!r} needs the `datasets` package (pip install 'bam-jax[hf]')"
        )


def iter_dataset_texts(
    dataset: str, *, subset: str | None = None, split: str = "train", text_key: str = "text"
) -> Iterator[str]:
    """Texts from local .txt/.jsonl files, a `save_to_disk` directory, or the hub (streamed)."""
    if dataset.endswith(TEXT_SUFFIXES) or (
        os.path.isdir(dataset) and not is_saved_dataset(dataset)
    ):
        return iter_documents(text_files(dataset), text_key)
    return (doc.text for doc in _dataset_documents(dataset, subset, split, text_key))


def _dataset_documents(
    dataset: str, subset: str | None, split: str, text_key: str
) -> Iterator[Document]:
    _require_datasets(dataset)
    import datasets

    if is_saved_dataset(dataset):
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
                f"{where}: no field {text_key!r} (fields: {sorted(record)}); set the text key "
                "(data.text_key, --text-key) to the field that holds the text"
            )
        if not isinstance(record[text_key], str):
            raise ValueError(
                f"{where}: field {text_key!r} is a {type(record[text_key]).__name__}, "
                "expected a string"
            )
        yield Document(where, record[text_key])


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a directory written by `Dataset.save_to_disk` (or a DatasetDict's)."""
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, marker)) for marker in SAVED_DATASET_MARKERS
    )
