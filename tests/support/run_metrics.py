"""Reading back the metrics a training run wrote."""

from __future__ import annotations

import glob
import os
import struct
from collections.abc import Iterator
from typing import Any

from tensorboardX.proto.event_pb2 import Event, SessionLog


def records_without_time(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics records less the wall-clock time each record carries."""
    return [{k: v for k, v in r.items() if k != "time"} for r in records]


def tensorboard_scalars(workdir: str | os.PathLike) -> list[tuple[str, int, float]]:
    """The (tag, step, value) of every scalar TensorBoard shows for `WORKDIR/tensorboard`:
    event files read in name (time) order, and a SessionLog.START at step S dropping the
    events read before it at step S or later, as TensorBoard's purge of orphaned data does."""
    shown: list[tuple[str, int, float]] = []
    for path in sorted(glob.glob(os.path.join(workdir, "tensorboard", "events.out.tfevents.*"))):
        for event in _events(path):
            if event.session_log.status == SessionLog.START:
                shown = [scalar for scalar in shown if scalar[1] < event.step]
            shown += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
    return shown


def _events(path: str) -> Iterator[Event]:
    """The events of a TFRecord file: length (8 bytes), its CRC (4), data, data's CRC (4)."""
    with open(path, "rb") as f:
        data = f.read()
    offset = 0
    while offset < len(data):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        yield Event.FromString(data[offset + 12 : offset + 12 + length])
        offset += 12 + length + 4
