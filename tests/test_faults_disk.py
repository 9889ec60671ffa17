"""A full disk under records, metrics and checkpoints: a real tmpfs mounted for each test (needs root
or CAP_SYS_ADMIN to mount a tmpfs; skipped otherwise, with the reason) and filled up with a filler file.

What must hold: the write that meets the full disk raises an OSError with errno ENOSPC that names
the file; nothing half-written stays behind (no torn JSONL line, no checkpoint step that loads as
complete); after space is freed the same store / log / checkpointer goes on, and a resumed one reads
everything written before and after. And a checkpoint step damaged on disk (no tmpfs needed): the
run resumes from the step before it.
"""
import contextlib
import errno
import json
import os
import subprocess
import threading

import numpy as np
import pytest

from steprl_jax.agents.records import RecordStore, Step, Trajectory

KB = 1024


@contextlib.contextmanager
def tmpfs(path, size: str):
    """A tmpfs of `size` mounted at `path` for the block, unmounted after it whatever happens."""
    os.makedirs(path, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or mounted.returncode}); "
                    "these tests need root or CAP_SYS_ADMIN")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


@pytest.fixture
def disk(tmp_path):
    """A 512 KB tmpfs at tmp_path/disk."""
    with tmpfs(tmp_path / "disk", "512k") as path:
        yield path


def free_bytes(path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def fill(path, leave: int) -> str:
    """A filler file that leaves `leave` bytes (whole pages) free on the filesystem of `path`."""
    filler = os.path.join(path, "filler")
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        os.write(fd, b"\0" * max(0, free_bytes(path) - leave))
    finally:
        os.close(fd)
    assert free_bytes(path) <= leave
    return filler


def remount(path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True)


def _trajectory(i: int) -> Trajectory:
    """About 10 KB of JSON (prompt ids, an action with log-probs)."""
    return Trajectory(id=f"t{i}", query_id=f"q{i}", question=f"question {i}", prompt_text="p" * 2000,
                      prompt_ids=list(range(1000)),
                      steps=[Step("<answer>19</answer>", [1, 2, 3], [-0.5, -0.25, -0.125], kind="answer")],
                      final_answer="19", termination="answer")


def test_records_on_a_full_disk(disk):
    path = disk / "trajectories.jsonl"
    store = RecordStore(path)
    for i in range(3):
        store.append(_trajectory(i))
    before = path.read_bytes()
    line = len(json.dumps(_trajectory(3).to_json(), ensure_ascii=False)) + 1
    filler = fill(disk, leave=4 * KB)  # room for part of the next line only: the write stops short
    assert 0 < free_bytes(disk) < line
    for _ in range(2):  # and again, on a disk that is now quite full
        with pytest.raises(OSError) as failure:
            store.append(_trajectory(3))
        assert failure.value.errno == errno.ENOSPC
        assert str(path) in str(failure.value) and "no partial line stays" in str(failure.value)
        assert path.read_bytes() == before  # no torn line
    assert [r.id for r in RecordStore(path).load()] == ["t0", "t1", "t2"]

    os.remove(filler)
    store.append(_trajectory(3))  # the same store goes on
    resumed = RecordStore(path)  # and a resumed run reads every record, then continues
    assert resumed.done_ids() == {"t0", "t1", "t2", "t3"}
    resumed.append(_trajectory(4))
    assert [r.id for r in resumed.load()] == ["t0", "t1", "t2", "t3", "t4"]
    assert resumed.load()[3] == _trajectory(3)


def _tf_records(path) -> list:
    """The events of a TensorBoard event file, every record's framing and CRCs checked."""
    import struct

    from tensorboardX.proto import event_pb2
    from tensorboardX.record_writer import masked_crc32c

    data, events, at = open(path, "rb").read(), [], 0
    while at < len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header)
        body = data[at + 12:at + 12 + length]
        assert len(body) == length and struct.unpack("<I", data[at + 12 + length:at + 16 + length])[0] == \
            masked_crc32c(body)
        events.append(event_pb2.Event.FromString(body))
        at += 16 + length
    return events


def test_metrics_log_on_a_full_disk(disk):
    """The JSONL line and the TensorBoard event of a step: each whole or not there, and a failure is
    an error, never a hang. The event folder is a second, separate tmpfs, so that the line can fit
    where the event does not (tensorboardX's own writer thread died there and the next add_scalar
    blocked for ever)."""
    from steprl_jax.training.metrics_log import MetricsLog, memory_gb, read_metrics

    workdir = disk / "run"
    wide = {f"metric/{k}": float(k) for k in range(300)}  # about 6 KB per line and per event
    with tmpfs(workdir / "tb", "64k") as tb:
        log = MetricsLog(str(workdir), stage="rl")
        log.write(0, wide)
        path, (events,) = workdir / "metrics.jsonl", list((tb / "rl").iterdir())
        before, events_before = path.read_bytes(), events.read_bytes()

        filler = fill(disk, leave=0)  # only the slack of the last page of metrics.jsonl is left
        with pytest.raises(OSError) as failure:
            log.write(1, wide)
        assert failure.value.errno == errno.ENOSPC and str(path) in str(failure.value)
        assert path.read_bytes() == before and events.read_bytes() == events_before
        os.remove(filler)

        tb_filler = fill(tb, leave=0)  # now the line fits and the event does not
        outcome = []
        writer = threading.Thread(target=lambda: outcome.append(_raised(log.write, 1, wide)), daemon=True)
        writer.start()
        writer.join(timeout=60)
        assert not writer.is_alive(), "MetricsLog.write blocked on a full disk"
        (failure,) = outcome
        assert isinstance(failure, OSError) and failure.errno == errno.ENOSPC and str(events) in str(failure)
        assert events.read_bytes() == events_before
        os.remove(tb_filler)

        log.write(1, wide)  # the step again, as a resumed run would
        log.write(2, {"loss": 0.5})
        log.close()
        rows = read_metrics(str(workdir))["rl"]  # the last line per step
        assert [r["step"] for r in rows] == [0, 1, 2] and rows[1]["metric/299"] == 299.0
        assert all(line.endswith("}") for line in path.read_text().splitlines())
        logged = [(e.step, len(e.summary.value)) for e in _tf_records(events) if e.summary.value]
        memory = len(memory_gb())  # the process's memory, on every line and event
        assert logged == [(0, 300 + memory), (1, 300 + memory), (2, 1 + memory)]


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as error:  # the test looks at it
        return error
    return None


def _train_state(seed: int):
    """A real TrainState of a tiny llama (about 550 KB of incompressible float32 parameters),
    built from shapes and filled with random values (no initialisation to compile)."""
    import jax
    import optax
    from flax import nnx

    from steprl_jax.models import ModelConfig, Transformer
    from steprl_jax.training.state import create_train_state

    config = ModelConfig.tiny("llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                              num_heads=2, num_kv_heads=1, head_dim=32, max_position_embeddings=256,
                              tie_embeddings=False)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    state = jax.tree.map(lambda leaf: jax.numpy.asarray(rng.standard_normal(leaf.shape).astype(leaf.dtype)), state)
    return create_train_state(nnx.merge(graphdef, state), optax.sgd(1e-3))[1]


@pytest.mark.parametrize("leave_kb", [0, 128])
def test_checkpoint_on_a_full_disk(disk, leave_kb):
    """leave_kb=0: orbax cannot even make the step's folder (a bare OSError); 128: tensorstore runs
    out of space while writing arrays (a ValueError saying RESOURCE_EXHAUSTED)."""
    import jax

    from steprl_jax.training.checkpoint import Checkpointer

    first, second = _train_state(0), _train_state(1)
    remount(disk, "1m")  # room for one step
    directory = disk / "checkpoints"
    ckpt = Checkpointer(str(directory), max_to_keep=3)
    ckpt.save(first, data_position={"index": 1}, step=1)
    filler = fill(disk, leave=leave_kb * KB)
    with pytest.raises(OSError) as failure:
        ckpt.save(second, data_position={"index": 2}, step=2)
    assert failure.value.errno == errno.ENOSPC
    assert failure.value.filename == str(directory / "2") and "latest complete step is 1" in str(failure.value)
    # Nothing of step 2 is left: no step that loads as complete, no partial folder holding space.
    assert sorted(os.listdir(directory)) == ["1"]
    assert ckpt.steps() == [1] and Checkpointer(str(directory)).steps() == [1]
    restored, position = Checkpointer(str(directory)).restore(like=second)
    assert position == {"index": 1}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(first)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    remount(disk, "3m")  # more space (the filler stays)
    assert os.path.exists(filler)
    assert ckpt.save(second, data_position={"index": 2}, step=2) == 2  # the same checkpointer goes on
    resumed = Checkpointer(str(directory))
    assert resumed.steps() == [1, 2]
    restored, position = resumed.restore(like=first)
    assert position == {"index": 2}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(second)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ckpt.close()
    resumed.close()


def test_damaged_checkpoint_step_falls_back_to_the_step_before(tmp_path, caplog):
    """A committed step whose array files were damaged afterwards: restore warns naming its folder,
    moves it aside, and resumes bit-identically from the newest step that restores; that step can
    be saved again. With no step left that restores: one error naming the directory and the way on."""
    import glob

    import jax

    from steprl_jax.training.checkpoint import Checkpointer, DamagedCheckpointError

    states = {step: _train_state(step) for step in (1, 2, 3)}
    directory = tmp_path / "checkpoints"
    ckpt = Checkpointer(str(directory), max_to_keep=3)
    for step, state in states.items():
        ckpt.save(state, data_position={"index": step}, step=step)
    ckpt.close()

    def damage(step):
        data = glob.glob(str(directory / str(step) / "state" / "d" / "*"))
        assert data
        for path in data:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)

    def same(a, b):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))

    damage(3)
    resumed = Checkpointer(str(directory), max_to_keep=3)
    restored, position = resumed.restore(like=states[1])
    assert position == {"index": 2}
    same(restored, states[2])
    assert f"{directory / '3'}: checkpoint step 3 does not restore" in caplog.text
    assert f"moved the damaged checkpoint step to {directory / '3.damaged'}; resuming from step 2" in caplog.text
    assert resumed.steps() == [1, 2] and sorted(os.listdir(directory)) == ["1", "2", "3.damaged"]
    resumed.save(states[3], data_position={"index": 3}, step=3)  # the run saves that step again
    resumed.close()
    again = Checkpointer(str(directory))
    restored, position = again.restore(like=states[1])
    assert position == {"index": 3}
    same(restored, states[3])

    for step in (1, 2, 3):
        damage(step)
    with pytest.raises(DamagedCheckpointError) as failure:
        again.restore(like=states[1])
    message = str(failure.value)
    assert message.startswith(f"{directory}: no checkpoint step restores (steps [3, 2, 1]; the newest, 3: ")
    assert f"Delete the damaged step's folder ({directory / '3'})" in message and "delete the directory" in message
    assert sorted(os.listdir(directory)) == ["1", "2", "3", "3.damaged"]  # nothing moved when nothing restores
    with pytest.raises(DamagedCheckpointError, match=r"/2: checkpoint step 2 does not restore"):
        again.restore(like=states[1], step=2)
    again.close()
