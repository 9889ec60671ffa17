"""Checkpoints with orbax: train state + data position + RNG, keep-last-N, exact resume.

    ckpt = Checkpointer(directory, max_to_keep=3)
    ckpt.save(state, data_position={"epoch": 0, "index": 128})
    state, data_position = ckpt.restore(like=state_template)   # latest step by default

`like` is a TrainState with the wanted structure, dtypes and shardings (e.g. a freshly created
state); restored arrays take its shardings, so a run resumes on the same mesh. The RNG lives
in the state; the data position is JSON (whatever the data loader needs to continue). Saving
copies device arrays to host and writes synchronously, so a resumed run on CPU continues
bit-identically.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Tuple

import jax
import orbax.checkpoint as ocp

from steprl_jax.training.state import TrainState


class Checkpointer:
    def __init__(self, directory: str, *, max_to_keep: int = 3):
        if max_to_keep < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep}")
        self.directory = os.path.abspath(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True,
                                               enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(self, state: TrainState, *, data_position: Optional[dict] = None,
             step: Optional[int] = None) -> int:
        """Write `state` at `step` (default: state.step) and return the step."""
        step = int(jax.device_get(state.step)) if step is None else int(step)
        self._manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=ocp.args.JsonSave({"data_position": data_position or {}})))
        self._manager.wait_until_finished()
        return step

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
