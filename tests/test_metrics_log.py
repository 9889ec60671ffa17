"""TensorBoard event files: each record reads back (lengths, masked CRC-32Cs, the Event protos),
and writing them loads no torch, even where torch is installed."""
import os
import struct
import subprocess
import sys

from steprl_jax.training.metrics_log import EventFile, _tensorboard_records


def _records(path):
    event, _, crc = _tensorboard_records()
    with open(path, "rb") as f:
        data = f.read()
    at, events = 0, []
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == crc(header)
        body = data[at + 12:at + 12 + length]
        assert struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == crc(body)
        events.append(event.FromString(body))
        at += 16 + length
    return events


def test_scalars_read_back_from_the_event_file(tmp_path):
    log = EventFile(str(tmp_path / "tb"))
    log.scalars(3, {"loss": 0.25, "reward/mean": -1.0})
    log.scalars(4, {})  # nothing to write: no record
    log.scalars(5, {"loss": 0.125})
    (name,) = os.listdir(tmp_path / "tb")
    assert name.startswith("events.out.tfevents.")
    first, *scalars = _records(tmp_path / "tb" / name)
    assert first.file_version == "brain.Event:2"
    assert [(e.step, [(v.tag, v.simple_value) for v in e.summary.value]) for e in scalars] == \
        [(3, [("loss", 0.25), ("reward/mean", -1.0)]), (5, [("loss", 0.125)])]


def test_writing_events_loads_no_torch(tmp_path):
    code = ("import sys; from steprl_jax.training.metrics_log import EventFile; "
            f"EventFile({str(tmp_path)!r}).scalars(1, {{'x': 1.0}}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out == "False\n"
