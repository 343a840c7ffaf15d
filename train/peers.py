"""A lost peer ends a multi-process run cleanly.

When one process of a multi-process run dies, jax's distributed runtime ends every other
process with an abort (exit 134) and a C++ stack trace: at once when the coordinator
(process 0) is the one lost, otherwise when its heartbeats have been missing for the
runtime's heartbeat timeout. Python cannot catch that abort, so `bam-train` runs a
multi-process training in a child process and watches it (`supervise`):

- the heartbeat timeout is `--peer_timeout` seconds, so every survivor exits within about
  that long after a peer is lost;
- what the runtime writes about the lost peer (its logs, the stack trace) is held back, and
  the survivor prints one line instead, naming the process that stopped and the last
  complete checkpoint, and exits with `PEER_LOST_STATUS` (75, EX_TEMPFAIL: restart me);
  the same command on every process then resumes from that checkpoint;
- `--debug` lets everything through.

In the child, a collective that fails because its peer vanished (gloo's "Connection reset
by peer") raises in Python before the runtime has said which process was lost; the child
then waits for the runtime's verdict (`await_runtime_verdict`) instead of printing a
traceback, and what orbax's background save thread logs about such a failure (its barrier
with the lost peer) is dropped (`quiet_peer_failure_reports`): the error reaches the
training's thread as well, at its next save. The child dies with its parent (Linux:
PR_SET_PDEATHSIG), so killing a process of the run kills its training.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable

from bam_jax.io.checkpoints import checkpoint_dir, checkpoint_steps

# sysexits.h's EX_TEMPFAIL: a temporary failure, the same command may succeed when retried.
PEER_LOST_STATUS = 75
DEFAULT_PEER_TIMEOUT_S = 30
# Set in the environment of the child that trains under `supervise`.
CHILD_ENV = "BAM_TRAIN_SUPERVISED"
# How much longer than the heartbeat timeout a child waits for the runtime's verdict.
VERDICT_MARGIN_S = 15

# What jax's distributed runtime and the CPU collectives write about a lost peer.
RUNTIME_SOURCES = ("coordination_service", "preemption_sync_manager", "client.h]", "distributed")
ABSL_LINE = re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ (\S+:\d+)\] ")
RUNTIME_FATAL = "Terminating process because the JAX distributed service detected fatal errors"
# A Python error of a collective or a runtime call whose peer is gone.
PEER_FAILURE_TEXTS = (
    "Gloo",
    "Connection reset by peer",
    "Connection closed by peer",
    "Socket closed",
    "coordination service",
    "heartbeat timeout",
    # orbax's cross-process barriers (an asynchronous save's commit): a peer that never came
    "barrier",
)
HEARTBEAT_TASKS = re.compile(r"Task (\d+) heartbeat timeout")
UNHEALTHY = "stopped sending heartbeats):"
PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class RunPlace:
    """Where a process stands in its run, for the line that reports a lost peer (None:
    not known to this process, as under a cluster's own launcher)."""

    workdir: str | None
    process_id: int | None = None
    num_processes: int | None = None


def supervise(
    argv: list[str], place: RunPlace, debug: bool, command: list[str] | None = None
) -> int:
    """Runs `argv` (a bam-train command line; `command` replaces the program to run) as a
    child process, passing its output through; its exit status, or PEER_LOST_STATUS with one
    line when a peer of the run was lost."""
    child = subprocess.Popen(
        command or [sys.executable, "-m", "bam_train", *argv[1:]],
        env={**os.environ, CHILD_ENV: "1"},
        stderr=subprocess.PIPE,
        preexec_fn=_die_with_parent,
    )
    previous = _forward_stop_signals(child)
    try:
        held = _pass_through(child.stderr, debug)
        status = child.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held:
        sys.stderr.write(peer_lost_line(held, place) + "\n")
        return PEER_LOST_STATUS
    return 128 - status if status < 0 else status


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the supervising process ends (Linux)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _forward_stop_signals(child: subprocess.Popen) -> dict:
    """SIGTERM goes on to the child; SIGINT (Ctrl-C) reaches it from the terminal's process
    group, so this process leaves it to the child."""

    def forward(signum, frame):
        with contextlib.suppress(ProcessLookupError):
            child.send_signal(signum)

    return {
        signal.SIGTERM: signal.signal(signal.SIGTERM, forward),
        signal.SIGINT: signal.signal(signal.SIGINT, signal.SIG_IGN),
    }


def _pass_through(stream: Iterable[bytes], debug: bool) -> list[str]:
    """Writes the child's stderr through until the runtime reports a lost peer; returns the
    report and everything after it, held back (written through as well under `debug`)."""
    held: list[str] = []
    out = sys.stderr.buffer
    for raw in stream:
        line = raw.decode("utf-8", errors="replace")
        if held or is_runtime_report(line):
            held.append(line)
            if not debug:
                continue
        out.write(raw)
        out.flush()
    return held


def is_runtime_report(line: str) -> bool:
    """Whether a line of stderr is jax's distributed runtime reporting on another task."""
    if RUNTIME_FATAL in line:
        return True
    match = ABSL_LINE.match(line)
    return bool(match) and any(source in match.group(1) + "]" for source in RUNTIME_SOURCES)


def lost_process(report: list[str], process_id: int | None = None) -> str:
    """Which process the runtime's report of this process (`process_id`) says stopped: the
    tasks it names, else the coordinator, whose loss a process other than it learns of from
    a failed call."""
    text = "".join(report)
    tasks = sorted({int(task) for task in HEARTBEAT_TASKS.findall(text)})
    for i, line in enumerate(report):
        if UNHEALTHY in line and i + 1 < len(report):
            tasks += [int(t) for t in re.findall(r"\d+", report[i + 1]) if int(t) not in tasks]
    if tasks:
        noun = "process" if len(tasks) == 1 else "processes"
        return f"{noun} {', '.join(map(str, sorted(tasks)))}"
    return "another process" if process_id == 0 else "process 0 (the coordinator)"


def peer_lost_line(report: list[str], place: RunPlace) -> str:
    of = f" of {place.num_processes}" if place.num_processes else ""
    this = "" if place.process_id is None else f" (process {place.process_id})"
    return (
        f"bam-train: {lost_process(report, place.process_id)}{of} stopped, so this one{this} "
        f"stops too; {last_checkpoint(place.workdir)}: "
        f"restart every process with the same command to resume (exit status "
        f"{PEER_LOST_STATUS})"
    )


def last_checkpoint(workdir: str | None) -> str:
    """Where the restart resumes, as the end of a sentence."""
    if workdir is None:
        return "no workdir"
    try:
        steps = checkpoint_steps(workdir)
    except Exception:  # a storage error must not hide the line; say what is known
        return f"the checkpoints in {checkpoint_dir(workdir)} could not be listed"
    if not steps:
        return f"no checkpoint is complete in {checkpoint_dir(workdir)} (the restart starts at 0)"
    return f"the last complete checkpoint is step {steps[-1]} in {checkpoint_dir(workdir)}"


def is_peer_failure(err: BaseException) -> bool:
    """Whether `err`, or an error it came from, is a collective or runtime call that failed
    because a peer is gone."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if any(text in str(current) for text in PEER_FAILURE_TEXTS):
            return True
        current = current.__cause__ or current.__context__
    return False


class _PeerFailureReports(logging.Filter):
    """Drops log records whose error is a peer failure (`is_peer_failure`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return error is None or not is_peer_failure(error)


def quiet_peer_failure_reports() -> None:
    """Keep orbax's and asyncio's logs of peer failures, with their tracebacks, out of a
    multi-process run's output: the survivor says what happened in one line."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _PeerFailureReports) for f in logger.filters):
            logger.addFilter(_PeerFailureReports())


def await_runtime_verdict(err: BaseException, peer_timeout_s: int, debug: bool) -> None:
    """In a supervised child whose collective failed: wait for the runtime to name the lost
    peer (it aborts this process, and `supervise` reports it); if it never does, say what
    failed and exit with PEER_LOST_STATUS all the same. Never returns."""
    if debug:
        traceback.print_exception(err)
    time.sleep(peer_timeout_s + VERDICT_MARGIN_S)
    summary = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    sys.stderr.write(f"bam-train: a collective with another process failed: {summary}\n")
    sys.stderr.flush()
    os._exit(PEER_LOST_STATUS)
