"""Checkpoints with orbax: train state + data position + RNG, keep-last-N, exact resume.

    ckpt = Checkpointer(directory, max_to_keep=3)
    ckpt.save(state, data_position={"epoch": 0, "index": 128})
    state, data_position = ckpt.restore(like=state_template)   # latest step by default

`like` is a TrainState with the wanted structure, dtypes and shardings (e.g. a freshly created
state); restored arrays take its shardings, so a run resumes on the same mesh. The RNG lives
in the state; the data position is JSON (whatever the data loader needs to continue). Saving
copies device arrays to host and writes synchronously, so a resumed run on CPU continues
bit-identically. A step is complete once orbax has committed it (renamed its temporary folder; a
save killed before that leaves `<step>.orbax-checkpoint-tmp`, never listed nor loaded, replaced
when that step is saved again); a save the storage refuses (a full disk) removes its partial
folder and raises an OSError naming the step's path, and the same Checkpointer saves again once
there is space.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from steprl_jax import failpoints
from steprl_jax.training.state import TrainState


_TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # a step folder orbax has not committed (renamed) yet


def _os_error_code(error: BaseException) -> Optional[int]:
    """The errno of a storage failure: an OSError's, or the one tensorstore writes into its
    message ("[os_error_code='28']"); None for any other error."""
    if isinstance(error, OSError) and error.errno:
        return error.errno
    match = re.search(r"os_error_code='?(\d+)", str(error))
    return int(match.group(1)) if match else None


def _fail_before_commit():
    """Orbax's commit (a marker file, then the rename of `<step>.orbax-checkpoint-tmp` to `<step>`)
    with the fail point "checkpoint.save.mid" just before it: every item of the step is written,
    the step is not committed. Built only when that point is armed, so that no other run depends
    on orbax's temporary-path classes."""

    class FailBeforeCommit(ocp.path.atomicity.AtomicRenameTemporaryPath):
        async def finalize(self, *args, **kwargs):
            if self.get_final().name.isdigit():  # the step's folder, not one of its items'
                failpoints.hit("checkpoint.save.mid")
            return await super().finalize(*args, **kwargs)

    return FailBeforeCommit


class Checkpointer:
    def __init__(self, directory: str, *, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False,
            temporary_path_class=_fail_before_commit() if failpoints.armed("checkpoint.save.mid") else None)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState, *, data_position: Optional[dict] = None,
             step: Optional[int] = None) -> int:
        """Write `state` at `step` (default: state.step) and return the step."""
        step = int(jax.device_get(state.step)) if step is None else int(step)
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=ocp.args.JsonSave({"data_position": data_position or {}})))
            self._manager.wait_until_finished()
        except Exception as error:
            code = _os_error_code(error)
            if code is None:
                raise
            raise self._failed_save(step, code) from error
        failpoints.hit("checkpoint.save.after")
        return step

    def _failed_save(self, step: int, code: int) -> OSError:
        """A save that the storage refused (e.g. a full disk) was never committed: remove its
        temporary folder (it can never become a step, and it holds the space that is short), and
        say so in an OSError naming the step's path."""
        for name in os.listdir(self.directory):
            if name.startswith(f"{step}{_TMP_SUFFIX}"):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        self._manager.reload()
        return OSError(code, f"{os.strerror(code)}: saving checkpoint step {step} failed and its partial files "
                             f"were removed; the latest complete step is {self.latest_step()}. Free space and "
                             "save again", os.path.join(self.directory, str(step)))

    def steps(self):
        return list(self._manager.all_steps())

    def latest_step(self) -> Optional[int]:
        return self._manager.latest_step()

    def restore(self, like: TrainState, step: Optional[int] = None) -> Tuple[TrainState, Any]:
        """(state, data_position) at `step` (default: the latest)."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]["data_position"]

    def close(self):
        self._manager.close()
