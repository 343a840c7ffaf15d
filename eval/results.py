"""One JSON results file per model and task, extended by later runs instead of recomputed.

Layout: ``{"model": {...}, "invocations": [...], "runs": {settings_key: {"settings": {...},
"entries": {id: {...}}}}}``. A run's settings key names everything that changes the numbers
(checkpoint step, sampling, sample count, seed, ...); entries are keyed by length (passkey)
or by data source (perplexity). "model" holds the model's config, its training run's config
and its parameters' fingerprint. Each command that adds entries appends its provenance
(`bam_jax.provenance`: code version, machine, command line, start time, wall seconds) to
"invocations", and each entry names the one that computed it by index. Files are rewritten
atomically after each new entry, so an interrupted sweep keeps what it finished. A file that
does not have this layout is refused, never overwritten: it may be someone's results. A
fresh store starts empty and leaves the file as it is until its first entry replaces it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from typing import Any

from bam_jax.io.files import write_text_atomically
from bam_jax.provenance import provenance


def settings_key(settings: dict[str, Any]) -> str:
    """A stable, readable key for a settings dict."""
    return ",".join(f"{k}={settings[k]}" for k in sorted(settings))


class ResultStore:
    """Results of one model for one task, backed by a JSON file (``path`` None: kept in
    memory only).

    ``entry_fields``: keys every stored entry must have (checked when the file is read).
    ``fresh``: start without the file's results (it is not read; the first entry written
    replaces it, so a run that fails before any leaves it as it was).
    """

    def __init__(
        self,
        path: str | None,
        model_info: dict[str, Any] | None = None,
        entry_fields: Sequence[str] = (),
        *,
        fresh: bool = False,
    ):
        self.path = path
        self.started = time.perf_counter()
        self.invocation: int | None = None
        self.data: dict[str, Any] = {"model": model_info or {}, "invocations": [], "runs": {}}
        if path is not None and not fresh and os.path.lexists(path):
            self.data = _read_results(path, entry_fields)
            if model_info:
                self.data["model"] = model_info

    def run(self, settings: dict[str, Any]) -> dict[str, Any]:
        """The entries table of the run with these settings (created empty if new)."""
        key = settings_key(settings)
        run = self.data["runs"].setdefault(key, {"settings": dict(settings), "entries": {}})
        return run["entries"]

    def get(self, settings: dict[str, Any], entry_id: str) -> dict[str, Any] | None:
        return self.data["runs"].get(settings_key(settings), {}).get("entries", {}).get(entry_id)

    def put(self, settings: dict[str, Any], entry_id: str, entry: dict[str, Any]) -> None:
        invocations = self.data.setdefault("invocations", [])
        if self.invocation is None:
            invocations.append(provenance())
            self.invocation = len(invocations) - 1
        invocations[self.invocation]["wall_seconds"] = round(time.perf_counter() - self.started, 2)
        entry["invocation"] = self.invocation
        self.run(settings)[entry_id] = entry
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            write_text_atomically(self.path, json.dumps(self.data, indent=1))
        except OSError as error:
            raise ValueError(f"cannot write results file {self.path}: {error}") from error


def _read_results(path: str, entry_fields: Sequence[str]) -> dict[str, Any]:
    """The parsed file, or a ValueError naming the file and what is wrong with it."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as error:
        raise ValueError(f"results file {path} cannot be read: {error.strerror}") from error
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _malformed(path, f"it is not valid JSON ({error})") from error
    problem = _layout_problem(data, entry_fields)
    if problem:
        raise _malformed(path, problem)
    return data


def _layout_problem(data: Any, entry_fields: Sequence[str]) -> str | None:
    """What keeps ``data`` from being a results file, or None."""
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        return "expected a JSON object with a 'runs' object"
    for key, run in data["runs"].items():
        if not isinstance(run, dict) or not isinstance(run.get("entries"), dict):
            return f"run {key!r} is not an object with an 'entries' object"
        for entry_id, entry in run["entries"].items():
            if not isinstance(entry, dict):
                return f"entry {entry_id!r} of run {key!r} is not an object"
            missing = [field for field in entry_fields if field not in entry]
            if missing:
                return f"entry {entry_id!r} of run {key!r} lacks {', '.join(missing)}"
    return None


def _malformed(path: str, problem: str) -> ValueError:
    return ValueError(
        f"results file {path} is malformed: {problem}; it was left untouched: move it "
        "away or choose another --out, and run again"
    )
