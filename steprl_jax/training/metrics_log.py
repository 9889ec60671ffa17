"""Training metrics: one JSON line per update in `metrics.jsonl` and TensorBoard event files.

    log = MetricsLog(workdir, stage="swirl")
    log.write(step, {"reward/mean": 0.6, "clipfrac": 0.0})
    log.close()

Each line is {"stage", "step", "time", "rss_gb", "peak_rss_gb", **metrics} (the process's resident
memory now and at its peak, GiB, Linux), written with one append and fsynced. A metric that is not
finite is written as null and named under "non_finite" ({"loss": "nan"}), so that the line stays
valid JSON and the value is seen (TensorBoard gets the value itself). A resumed
run may repeat steps it logged after its last checkpoint; readers keep the last line per
(stage, step) (`read_metrics`). TensorBoard events go to `tb/<stage>/`: one event per update with
every scalar, framed as TensorBoard's records (tensorboardX's protos; no TensorFlow needed) and
appended in the calling thread. (tensorboardX's SummaryWriter writes from a thread of its own,
which dies on a full disk, after which `add_scalar` blocks for ever.)

A write that fails (a full disk) leaves no partial line or record behind and raises an OSError
naming the file; the log can go on once there is space.
"""
from __future__ import annotations

import json
import logging
import math
import os
import socket
import struct
import sys
import time
from typing import Mapping

from steprl_jax.io import DataFormatError, append_whole, decode_line, end_torn_line, parse_line


log = logging.getLogger(__name__)


class MetricsLog:
    def __init__(self, workdir: str, stage: str):
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.stage = stage
        os.makedirs(workdir, exist_ok=True)
        removed = end_torn_line(self.path)  # else the next line would join a cut one mid-file
        if removed is not None:
            log.warning("%s:%d: removed an incomplete last line (%d bytes)", self.path, removed[0], len(removed[1]))
        self._events = EventFile(os.path.join(workdir, "tb", stage))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        values = {**memory_gb(), **{k: float(v) for k, v in metrics.items() if v is not None}}
        row = {"stage": self.stage, "step": int(step), "time": time.time(),
               **{k: v if math.isfinite(v) else None for k, v in values.items()}}
        non_finite = {k: str(v) for k, v in values.items() if not math.isfinite(v)}
        if non_finite:
            row["non_finite"] = non_finite
        append_whole(self.path, (json.dumps(row, allow_nan=False) + "\n").encode())
        self._events.scalars(int(step), {f"{self.stage}/{key}": value for key, value in values.items()})

    def close(self) -> None:
        pass  # every write is on disk when it returns


def memory_gb() -> dict:
    """{"rss_gb", "peak_rss_gb"}: this process's resident memory now and at its peak, in GiB
    ({} where /proc is not there). A run that grows from update to update shows here first."""
    try:
        with open("/proc/self/status") as f:
            kib = {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}
        return {"rss_gb": kib["VmRSS"] / 2**20, "peak_rss_gb": kib["VmHWM"] / 2**20}
    except (OSError, ValueError, IndexError, KeyError):
        return {}


class EventFile:
    """A TensorBoard event file `events.out.tfevents.<time>.<host>` in `folder`, written synchronously:
    each event is one TFRecord (length, masked CRC-32C of the length, data, masked CRC-32C of the
    data), appended whole or not at all."""

    def __init__(self, folder: str):
        self._event, self._summary, self._crc = _tensorboard_records()
        os.makedirs(folder, exist_ok=True)
        self.path = os.path.join(folder, f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}")
        self._append(self._event(wall_time=time.time(), file_version="brain.Event:2"))

    def scalars(self, step: int, values: Mapping[str, float]) -> None:
        if values:
            summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)
                                           for tag, value in values.items()])
            self._append(self._event(wall_time=time.time(), step=step, summary=summary))

    def _append(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        append_whole(self.path, header + struct.pack("<I", self._crc(header)) + data
                     + struct.pack("<I", self._crc(data)))


def read_metrics(workdir: str) -> dict[str, list[dict]]:
    """stage -> its lines in step order, the last line kept per step. A last line cut short (no
    newline) is skipped; any other line that is not a JSON object with "stage" and "step" is a
    `DataFormatError` naming the file and the line. Non-finite metrics read as None (their
    values are under "non_finite")."""
    path = os.path.join(workdir, "metrics.jsonl")
    by_stage: dict = {}
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            where = f"{path}:{number}"
            if not raw.endswith(b"\n"):  # the last line: an interruption may have cut it
                try:
                    row = json.loads(raw.decode("utf-8"))
                except ValueError:
                    continue
            else:
                text = decode_line(raw, where)
                if not text.strip():
                    continue
                row = parse_line(text, where)
            if not (isinstance(row, dict) and isinstance(row.get("stage"), str) and _is_int(row.get("step"))):
                raise DataFormatError(f"{where}: a metrics line must be an object with a 'stage' and an integer "
                                      "'step'")
            by_stage.setdefault(row["stage"], {})[row["step"]] = row
    return {stage: [rows[s] for s in sorted(rows)] for stage, rows in by_stage.items()}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _tensorboard_records():
    """tensorboardX's (Event, Summary, masked_crc32c). Its package __init__ imports torch where torch
    is installed (seconds at every process start, for a type check of its writer that is not used
    here): torch reads as absent for this one import unless the process has loaded it already."""
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX.proto import event_pb2, summary_pb2
        from tensorboardX.record_writer import masked_crc32c
    finally:
        if hide:
            del sys.modules["torch"]
    return event_pb2.Event, summary_pb2.Summary, masked_crc32c
