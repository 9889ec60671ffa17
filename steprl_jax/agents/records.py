"""Token-exact rollout records and their JSONL store.

A record keeps exactly what the policy saw and did: the prompt's token ids, every
action's sampled token ids with the log-probs they were sampled with, every
observation's token ids and text, the tool calls with their results or errors,
and why the episode ended. Training batches are built from these ids, never by
re-tokenising text.

A store is versioned JSONL, one trajectory (or tree) per line. Each record is
written with a single `write` (continued if it stops short) on a file opened
for appending, then fsynced, so an interrupted run leaves at most one
incomplete last line, which a resumed run drops (it was never reported done).
A write that fails (a full disk) removes what it wrote and raises an OSError
naming the file, so the store can go on once there is space. A malformed line
anywhere else is an error naming the file and the line.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator, Optional

from steprl_jax.errors import BadInput
from steprl_jax import failpoints
from steprl_jax.data.jsonl import append_whole

RECORD_VERSION = 1


@dataclasses.dataclass
class Step:
    """One action `a_i` and the observation `o_i` that followed it."""

    action_text: str
    action_ids: list[int]
    action_logprobs: list[float]
    observation_text: str = ""
    observation_ids: list[int] = dataclasses.field(default_factory=list)
    tool_calls: list[dict] = dataclasses.field(default_factory=list)  # [{"name", "arguments"}]
    tool_results: list[dict] = dataclasses.field(default_factory=list)  # ToolResult.to_json()
    kind: str = ""  # "search" | "math" | "answer" | "tool_call" | "invalid"
    format_problems: list[str] = dataclasses.field(default_factory=list)
    format_checks: dict = dataclasses.field(default_factory=dict)  # PORTool R_fm checks
    finish_reason: str = ""  # sampler: "stop" | "eos" | "length" | "context"
    action_entropies: Optional[list[float]] = None
    generate_s: float = 0.0
    tool_s: float = 0.0


@dataclasses.dataclass
class Trajectory:
    """A whole episode: `s_1` (the prompt), then steps. `s_{i+1} = s_i + a_i + o_i`."""

    id: str
    query_id: str
    question: str
    prompt_text: str
    prompt_ids: list[int]
    steps: list[Step] = dataclasses.field(default_factory=list)
    reference_answer: Any = None
    final_answer: Optional[str] = None
    termination: str = ""  # "answer" | "step_cap" | "context" | "unparseable"
    judgements: dict = dataclasses.field(default_factory=dict)
    metadata: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": RECORD_VERSION, "type": "trajectory", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "Trajectory":
        data = {k: v for k, v in data.items() if k not in ("version", "type")}
        steps = [Step(**s) for s in data.pop("steps", [])]
        return cls(steps=steps, **data)

    def state_ids(self, step_index: int) -> list[int]:
        """Token ids of state `s_{i+1}` before action `step_index` (0-based): prompt + earlier steps."""
        ids = list(self.prompt_ids)
        for step in self.steps[:step_index]:
            ids += step.action_ids + step.observation_ids
        return ids

    def all_ids(self) -> list[int]:
        return self.state_ids(len(self.steps))


@dataclasses.dataclass
class TreeNode:
    """A step in a rollout tree; `parent` is the index of the previous step, -1 for a first step."""

    parent: int
    step: Step
    depth: int  # 1-based


@dataclasses.dataclass
class TreeRecord:
    """PORTool's rollout tree for one query: nodes (steps) sharing prefixes, leaves with outcomes."""

    id: str
    query_id: str
    question: str
    prompt_text: str
    prompt_ids: list[int]
    nodes: list[TreeNode] = dataclasses.field(default_factory=list)
    leaf_outcomes: dict = dataclasses.field(default_factory=dict)  # str(node index) -> +1 / 0 / -1
    leaf_terminations: dict = dataclasses.field(default_factory=dict)  # str(node index) -> reason
    leaf_answers: dict = dataclasses.field(default_factory=dict)
    reference_answer: Any = None
    metadata: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": RECORD_VERSION, "type": "tree", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "TreeRecord":
        data = {k: v for k, v in data.items() if k not in ("version", "type")}
        nodes = [TreeNode(parent=n["parent"], depth=n["depth"], step=Step(**n["step"])) for n in data.pop("nodes", [])]
        return cls(nodes=nodes, **data)

    def leaves(self) -> list[int]:
        has_child = {n.parent for n in self.nodes}
        return [i for i in range(len(self.nodes)) if i not in has_child]

    def path(self, leaf: int) -> list[int]:
        """Node indices from the first step to `leaf`."""
        out = []
        while leaf >= 0:
            out.append(leaf)
            leaf = self.nodes[leaf].parent
        return out[::-1]

    def restrict(self, leaves) -> "TreeRecord":
        """The tree of the steps on the paths to `leaves` only (node indices renumbered, leaf
        dicts remapped); e.g. the judged leaves of a partly judged tree."""
        keep = sorted({i for leaf in leaves for i in self.path(int(leaf))})
        if len(keep) == len(self.nodes):
            return self
        new_index = {old: new for new, old in enumerate(keep)}
        nodes = [TreeNode(parent=new_index.get(self.nodes[old].parent, -1), step=self.nodes[old].step,
                          depth=self.nodes[old].depth) for old in keep]
        remap = lambda d: {str(new_index[int(k)]): v for k, v in d.items() if int(k) in new_index}
        metadata = dict(self.metadata)
        if "leaf_verdicts" in metadata:
            metadata["leaf_verdicts"] = remap(metadata["leaf_verdicts"])
        return dataclasses.replace(self, nodes=nodes, leaf_terminations=remap(self.leaf_terminations),
                                   leaf_answers=remap(self.leaf_answers), leaf_outcomes=remap(self.leaf_outcomes),
                                   metadata=metadata)

    @classmethod
    def from_group(cls, tree_id: str, trajectories: list) -> "TreeRecord":
        """Independent trajectories of one query as a tree whose branches meet only at the prompt
        (GRPO-style groups share the tree code: judging, batch building, records)."""
        first = trajectories[0]
        record = cls(tree_id, first.query_id, first.question, first.prompt_text, first.prompt_ids,
                     reference_answer=first.reference_answer, metadata=dict(first.metadata))
        for t in trajectories:
            parent = -1
            for depth, step in enumerate(t.steps, start=1):
                record.nodes.append(TreeNode(parent=parent, step=step, depth=depth))
                parent = len(record.nodes) - 1
            if parent < 0:
                raise ValueError(f"trajectory {t.id} has no step")
            record.leaf_terminations[str(parent)] = t.termination
            record.leaf_answers[str(parent)] = t.final_answer
        return record

    def trajectory(self, leaf: int) -> Trajectory:
        """The leaf's root-to-leaf path as a Trajectory (shares the same token ids)."""
        return Trajectory(
            id=f"{self.id}/leaf{leaf}", query_id=self.query_id, question=self.question,
            prompt_text=self.prompt_text, prompt_ids=self.prompt_ids,
            steps=[self.nodes[i].step for i in self.path(leaf)], reference_answer=self.reference_answer,
            final_answer=self.leaf_answers.get(str(leaf)), termination=self.leaf_terminations.get(str(leaf), ""),
        )


def record_from_json(data: dict, where: str):
    if not isinstance(data, dict):
        raise RecordError(f"{where}: a record must be a JSON object")
    version = data.get("version")
    if version != RECORD_VERSION:
        raise RecordError(f"{where}: record version {version!r} is not supported (expected {RECORD_VERSION})")
    kind = data.get("type")
    try:
        if kind == "trajectory":
            return Trajectory.from_json(data)
        if kind == "tree":
            return TreeRecord.from_json(data)
    except TypeError as err:
        raise RecordError(f"{where}: malformed {kind} record ({err})") from None
    raise RecordError(f"{where}: unknown record type {kind!r}")


class RecordError(BadInput):
    """A records file holds a line that is not a valid record (the message names file and line)."""


class RecordStore:
    """Append-only JSONL store of records; `done_ids()` tells a resumed run what to skip."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._repair_incomplete_tail()

    def _repair_incomplete_tail(self) -> None:
        """Drop a last line without its newline: the write it belonged to never finished."""
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data and not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)

    def __iter__(self) -> Iterator:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{self.path}:{number}"
                try:
                    data = json.loads(line)
                except ValueError as err:
                    raise RecordError(f"{where}: invalid JSON ({err})") from None
                yield record_from_json(data, where)

    def load(self) -> list:
        return list(self)

    def done_ids(self) -> set[str]:
        return {record.id for record in self}

    def append(self, record) -> None:
        """One line, all or nothing (`data.jsonl.append_whole`: a failed write leaves no torn line)."""
        data = (json.dumps(record.to_json(), ensure_ascii=False) + "\n").encode("utf-8")
        if failpoints.armed("records.append.mid"):
            self._append_in_halves(data)
        else:
            append_whole(self.path, data)
        failpoints.hit("records.append.after")

    def _append_in_halves(self, data: bytes) -> None:
        """The fail point "records.append.mid": half the line is on disk when it kills."""
        start = os.path.getsize(self.path) if os.path.exists(self.path) else 0
        append_whole(self.path, data[:len(data) // 2])
        failpoints.hit("records.append.mid")
        try:
            append_whole(self.path, data[len(data) // 2:])
        except OSError:
            os.truncate(self.path, start)  # still all or nothing
            raise


# ------------------------------------------------------------ SWiRL decomposition
@dataclasses.dataclass(frozen=True)
class StepUnit:
    """SWiRL's unit (state s_i, action a_i, i): token ids kept, nothing re-tokenised."""

    trajectory_id: str
    step_index: int  # 0-based i
    state_ids: tuple
    action_ids: tuple
    action_logprobs: tuple
    state_text: str
    action_text: str
    question: str


def decompose(trajectory: Trajectory) -> list[StepUnit]:
    """A trajectory with k actions becomes k units; observations become part of later states."""
    units, state_text, state_ids = [], trajectory.prompt_text, list(trajectory.prompt_ids)
    for i, step in enumerate(trajectory.steps):
        units.append(StepUnit(
            trajectory_id=trajectory.id, step_index=i, state_ids=tuple(state_ids),
            action_ids=tuple(step.action_ids), action_logprobs=tuple(step.action_logprobs),
            state_text=state_text, action_text=step.action_text, question=trajectory.question))
        state_ids += step.action_ids + step.observation_ids
        state_text += step.action_text + step.observation_text
    return units
