"""One training per workdir: a run holds `WORKDIR/train.lock` from start to end.

The lock is an `flock` on that file, which the kernel releases when the holding process
ends in any way, so a lock left by a killed run is free for the next one. While held, the
file names the holder (host, pid, start time, command); a second run on the workdir is
refused with those. A run that finds the file still naming a holder whose lock is free
takes it over and says so (that run ended without releasing it). A clean end empties the
file.

Several processes of one run hold it once, from process 0, and all stop when it is held
elsewhere. Workdirs on object stores (gs://, s3://, ...) have no file locks: they are not
locked, and launching one run there twice is the user's to avoid.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from collections.abc import Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from bam_jax.io.files import is_url

LOCK_FILE = "train.lock"


class WorkdirInUseError(ValueError):
    """Another live training holds the workdir."""


@contextlib.contextmanager
def hold_workdir(workdir: str) -> Iterator[str | None]:
    """Holds the workdir's lock for the `with` block; yields a note for the user when the
    lock was taken over from a run that ended without releasing it, else None. Raises
    WorkdirInUseError, naming the holder, when a live run holds it."""
    if is_url(workdir):
        yield None
        return
    fd, note, problem = None, None, None
    if jax.process_index() == 0:
        try:
            fd, note = _acquire(workdir)
        except WorkdirInUseError as err:
            problem = str(err)
    _agree_on(problem)
    try:
        yield note
    finally:
        if fd is not None:
            _release(fd)


def _agree_on(problem: str | None) -> None:
    """Every process raises when process 0 could not take the lock."""
    if jax.process_count() > 1:
        refused = multihost_utils.broadcast_one_to_all(np.int32(problem is not None))
        if int(refused) and problem is None:
            problem = "workdir: process 0 found the workdir held by another training"
    if problem is not None:
        raise WorkdirInUseError(problem)


def _acquire(workdir: str) -> tuple[int, str | None]:
    path = os.path.join(workdir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_holder(fd)
        os.close(fd)
        raise WorkdirInUseError(
            f"workdir: {workdir!r} is in use by another training ({_describe(holder)}); "
            f"wait for it or stop it, or use another workdir"
        ) from None
    previous = _read_holder(fd)
    note = None
    if previous:
        note = (
            f"took over the lock of {workdir!r} from a training that ended without releasing "
            f"it ({_describe(previous)})"
        )
    _write_holder(fd, _this_holder())
    return fd, note


def _release(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.close(fd)


def _this_holder() -> dict:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(sys.argv),
    }


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 1 << 16).decode("utf-8", errors="replace")
    try:
        holder = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"unreadable": text[:80]}
    return holder if isinstance(holder, dict) else {"unreadable": text[:80]}


def _write_holder(fd: int, holder: dict) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    os.fsync(fd)


def _describe(holder: dict) -> str:
    if not holder:
        return "its holder did not say who it is"
    if "unreadable" in holder:
        return f"lock file reads {holder['unreadable']!r}"
    return (
        f"pid {holder.get('pid', '?')} on host {holder.get('host', '?')}, started "
        f"{holder.get('started', '?')}: {holder.get('command', '?')}"
    )
