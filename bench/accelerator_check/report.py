"""The check's markdown table, written to disk after every row, and its global deadline."""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path


class UserError(Exception):
    """A bad flag or an unsuitable machine: printed as one line, exit status 2."""


@dataclasses.dataclass
class Report:
    """Markdown lines, printed and written to `path` after every addition."""

    path: Path
    lines: list[str] = dataclasses.field(default_factory=list)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def add(self, *lines: str) -> None:
        with self.lock:
            self.lines.extend(lines)
            print("\n".join(lines), flush=True)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            partial = self.path.with_name(self.path.name + ".partial")
            partial.write_text("\n".join(self.lines) + "\n")
            os.replace(partial, self.path)

    def table(self, title: str, columns: tuple[str, ...]) -> None:
        self.add(
            "", f"## {title}", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"
        )

    def row(self, *cells: object) -> None:
        self.add("| " + " | ".join(_cell(c) for c in cells) + " |")


def _cell(value: object) -> str:
    text = f"{value:.3g}" if isinstance(value, float) else str(value)
    return text.replace("|", "/").replace("\n", " ")


@dataclasses.dataclass
class Deadline:
    limit_s: float
    start: float = dataclasses.field(default_factory=time.perf_counter)

    def remaining(self) -> float:
        return self.limit_s - (time.perf_counter() - self.start)


def stop_at_deadline(report: Report, deadline: Deadline) -> threading.Timer:
    """Ends the process at the deadline, even inside a call, after noting it in the table."""

    def stop() -> None:
        report.add("", f"STOPPED: the deadline of {deadline.limit_s:.0f} s was reached.")
        os._exit(3)

    timer = threading.Timer(max(deadline.remaining(), 0.0), stop)
    timer.daemon = True
    timer.start()
    return timer


def one_line(error: BaseException, limit: int = 200) -> str:
    text = f"{type(error).__name__}: {error}".replace("\n", " ")
    return text[:limit]
