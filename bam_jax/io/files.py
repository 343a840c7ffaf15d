"""Locations of runs and data (local paths, `file://` URLs, bucket URLs) and atomic writes."""

from __future__ import annotations

import os
import pathlib
import re
import tempfile
import uuid
from collections.abc import Callable
from typing import IO
from urllib.parse import urlsplit
from urllib.request import url2pathname

from etils import epath

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` is a URL (`scheme://...`); `run:1` or `a:b` are local names."""
    return _URL.match(os.fspath(location)) is not None


def local_path_of_file_url(url: str, field: str) -> str:
    """The local path of a `file://` URL (`file:///tmp/x`, `file://localhost/tmp/x`)."""
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(
            f"{field}: {url!r} is not a local file URL; expected file:///ABSOLUTE/PATH"
        )
    return url2pathname(parts.path)


def run_path(location: str | os.PathLike) -> epath.Path:
    """A workdir (or a file in it) as an epath: URLs untouched, `file://` URLs and other
    locations as absolute local paths. ValueError for a scheme epath cannot write to."""
    text = os.fspath(location)
    if not text:
        raise ValueError("workdir: empty; expected a directory or a URL")
    if text.lower().startswith("file://"):
        return epath.Path(pathlib.Path(local_path_of_file_url(text, "workdir")))
    if not is_url(text):
        # Through pathlib, so that a local name holding "://" is never taken for a URL.
        return epath.Path(pathlib.Path(os.path.abspath(text)))
    try:
        return epath.Path(text)
    except KeyError:
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"workdir: {text!r} has the URL scheme {scheme}://, which etils.epath does not "
            "support; use gs://, s3://, az://, hf://, file:// or a local path"
        ) from None


def write_atomically(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Writes a file so that readers see the old one or the whole new one, never a part.

    `write(handle)` fills a temporary file next to `path` (binary mode), which is then
    renamed over `path`; on any error the temporary file is removed. Local files are
    fsynced before the rename; a URL (gs://, ...) is written and renamed through epath.
    """
    if is_url(path):
        _write_through_epath(epath.Path(path), write)
        return
    path = pathlib.Path(path)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def _write_through_epath(path: epath.Path, write: Callable[[IO[bytes]], object]) -> None:
    temporary = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    try:
        with temporary.open("wb") as handle:
            write(handle)
        temporary.replace(path)
    except BaseException:
        if temporary.exists():
            temporary.unlink()
        raise


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """`write_atomically` for UTF-8 text."""
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))
