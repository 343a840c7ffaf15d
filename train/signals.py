"""Stop requests: SIGTERM and Ctrl-C ask the run to save and stop after the current step."""

from __future__ import annotations

import signal
import threading
from typing import Any

import jax
from jax.experimental import multihost_utils

# The exit status of a run stopped by Ctrl-C: 128 + SIGINT, what shells report for it.
INTERRUPTED_STATUS = 130


class StopRequests:
    """SIGTERM and a first SIGINT (Ctrl-C) as a request the loop checks after each step; a
    second SIGINT kills the process at once (its default action), saving nothing.

    One process: Python signal handlers (main thread only; a SIGINT that was ignored when
    the run started stays ignored). Several processes: JAX's preemption service (started
    by `jax.distributed.initialize`) tells every process of a SIGTERM, and all of them stop
    at the same step; SIGINT keeps its KeyboardInterrupt there, since one process cannot
    save alone.
    """

    def __init__(self):
        self._signal_name: str | None = None
        self._previous: dict[int, Any] = {}
        self._multi_process = jax.process_count() > 1

    def __enter__(self):
        if self._multi_process or not _in_main_thread():
            return self
        self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._terminate)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)
        return self

    def _terminate(self, signum, frame):
        self._signal_name = self._signal_name or "SIGTERM"

    def _interrupt(self, signum, frame):
        self._signal_name = self._signal_name or "SIGINT"
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    def requested(self, step: int) -> str | None:
        """The signal that asks the run to save and stop ("SIGTERM", "SIGINT"), or None."""
        if self._multi_process:
            return "SIGTERM" if multihost_utils.reached_preemption_sync_point(step) else None
        return self._signal_name

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
