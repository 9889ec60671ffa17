"""Training metrics: one JSON line per update in `metrics.jsonl` and TensorBoard event files.

    log = MetricsLog(workdir, stage="swirl")
    log.write(step, {"reward/mean": 0.6, "clipfrac": 0.0})
    log.close()

Each line is {"stage", "step", "time", **metrics}, written with one append and fsynced. A resumed
run may repeat steps it logged after its last checkpoint; readers keep the last line per
(stage, step) (`read_metrics`). TensorBoard events go to `tb/<stage>/` through tensorboardX
(no TensorFlow needed).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Mapping


class MetricsLog:
    def __init__(self, workdir: str, stage: str):
        from tensorboardX import SummaryWriter

        self.path = os.path.join(workdir, "metrics.jsonl")
        self.stage = stage
        os.makedirs(workdir, exist_ok=True)
        self._tb = SummaryWriter(os.path.join(workdir, "tb", stage))

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        line = json.dumps({"stage": self.stage, "step": int(step), "time": time.time(), **clean}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        for key, value in clean.items():
            self._tb.add_scalar(f"{self.stage}/{key}", value, int(step))
        self._tb.flush()

    def close(self) -> None:
        self._tb.close()


def read_metrics(workdir: str) -> dict[str, list[dict]]:
    """stage -> its lines in step order, the last line kept per step."""
    path = os.path.join(workdir, "metrics.jsonl")
    by_stage: dict = {}
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:  # a last line cut by an interruption
                continue
            by_stage.setdefault(row["stage"], {})[row["step"]] = row
    return {stage: [rows[s] for s in sorted(rows)] for stage, rows in by_stage.items()}
