"""Progress messages of the project's commands through the standard `logging` module.

Training and evaluation log to loggers under "bam" (`logging.getLogger("bam.train")`, ...).
A program that configures logging itself sees them through its own handlers; the command-line
entry points call `log_to_stdout()` so that a run shows one line per logged step.
"""

from __future__ import annotations

import logging
import sys

LOGGER = "bam"
FORMAT = "%(asctime)s %(message)s"
DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


class _CurrentStdout(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is when a record is emitted (it may be replaced after
    the handler is installed, e.g. by a test's output capture)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        """The stream is always the current sys.stdout."""


def log_to_stdout(level: int = logging.INFO) -> None:
    """Show the "bam" loggers' messages on standard output, once per process."""
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level)
    if not any(isinstance(h, _CurrentStdout) for h in logger.handlers):
        handler = _CurrentStdout()
        handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
        logger.addHandler(handler)
    logger.propagate = False
