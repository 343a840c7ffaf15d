"""One JSON results file per model and task, extended by later runs instead of recomputed.

Layout: ``{"model": {...}, "runs": {settings_key: {"settings": {...}, "entries": {id: {...}}}}}``.
A run's settings key names everything that changes the numbers (checkpoint step, sampling,
sample count, seed, ...); entries are keyed by length (passkey) or by data source
(perplexity). Files are rewritten atomically after each new entry, so an interrupted
sweep keeps what it finished.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def settings_key(settings: dict[str, Any]) -> str:
    """A stable, readable key for a settings dict."""
    return ",".join(f"{k}={settings[k]}" for k in sorted(settings))


class ResultStore:
    """Results of one model for one task, backed by a JSON file."""

    def __init__(self, path: str, model_info: dict[str, Any] | None = None):
        self.path = path
        self.data: dict[str, Any] = {"model": model_info or {}, "runs": {}}
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    self.data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"results file {path} is not valid JSON: {e}") from e
            if not isinstance(self.data.get("runs"), dict):
                raise ValueError(f"results file {path} has no 'runs' table")
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
        self.run(settings)[entry_id] = entry
        self.save()

    def save(self) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)
