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

A committed step that no longer restores (damaged files) is not the end of a run: `restore` falls
back to the newest step that does, with a warning, and moves the damaged step's folder aside to
`<step>.damaged` (kept to look at; never listed nor loaded) so that the step can be saved again.
When no step restores, `DamagedCheckpointError` names the directory and the way on.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from steprl_jax import failpoints
from steprl_jax.errors import BadInput
from steprl_jax.training.state import TrainState

log = logging.getLogger(__name__)


_TMP_SUFFIX = ocp.path.step.TMP_DIR_SUFFIX  # a step folder orbax has not committed (renamed) yet
_DAMAGED_SUFFIX = ".damaged"  # a step folder that did not restore, moved aside


class DamagedCheckpointError(BadInput):
    """No checkpoint step restores (the message names the directory and how to go on)."""


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
        """(state, data_position) at `step`, or by default at the newest step that restores: a
        newer one that does not is moved aside (`<step>.damaged`) with a warning."""
        if step is not None:
            try:
                return self._restore(like, step)
            except Exception as error:
                raise DamagedCheckpointError(
                    f"{self._step_dir(step)}: checkpoint step {step} does not restore ({_one_line(error)}); "
                    "delete that folder to resume from an earlier step") from error
        steps = sorted(self.steps(), reverse=True)
        if not steps:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        damaged = []
        for candidate in steps:
            try:
                out = self._restore(like, candidate)
            except Exception as error:
                log.warning("%s: checkpoint step %d does not restore (%s); trying the step before it",
                            self._step_dir(candidate), candidate, _one_line(error))
                damaged.append((candidate, error))
                continue
            if damaged:
                self._set_aside([s for s, _ in damaged], restored=candidate)
            return out
        newest, error = damaged[0]
        raise DamagedCheckpointError(
            f"{self.directory}: no checkpoint step restores (steps {steps}; the newest, {newest}: "
            f"{_one_line(error)}). Delete the damaged step's folder ({self._step_dir(newest)}) to resume from "
            "the step before it, or delete the directory to start this stage over") from error

    def _restore(self, like: TrainState, step: int) -> Tuple[TrainState, Any]:
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), data=ocp.args.JsonRestore()))
        return out["state"], out["data"]["data_position"]

    def _step_dir(self, step: int) -> str:
        return os.path.join(self.directory, str(step))

    def _set_aside(self, steps: list, restored: int) -> None:
        """Rename the folders of `steps` (newer than `restored`, which restored) to `<step>.damaged`:
        orbax no longer lists them, and those steps can be saved again."""
        from steprl_jax.training import distributed

        if distributed.is_primary():
            for step in steps:
                target = self._step_dir(step) + _DAMAGED_SUFFIX
                n = 1
                while os.path.exists(target):
                    target, n = f"{self._step_dir(step)}{_DAMAGED_SUFFIX}{n}", n + 1
                os.rename(self._step_dir(step), target)
                log.warning("%s: moved the damaged checkpoint step to %s; resuming from step %d",
                            self._step_dir(step), target, restored)
        distributed.barrier(f"checkpoint steps {steps} set aside")
        self._manager.reload()

    def close(self):
        self._manager.close()
