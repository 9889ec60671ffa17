"""Token-exact rollout records and their JSONL store.

A record keeps exactly what the policy saw and did: the prompt's token ids, every
action's sampled token ids with the log-probs they were sampled with, every
observation's token ids and text, the tool calls with their results or errors,
and why the episode ended. Training batches are built from these ids, never by
re-tokenising text.

A store is versioned JSONL, one trajectory (or tree) per line. Each record is
written with a single `write` (continued if it stops short) on a file opened
for appending, then fsynced, so an interrupted run leaves at most one
incomplete last line, which a resumed run removes with a warning (it was never
reported done; `RecordStore.removed_ids` says which record it held). A last line
that is whole and only lost its newline gets it back and stays. A write that
fails (a full disk) removes what it wrote and raises an OSError naming the file,
so the store can go on once there is space. Every line read is checked
(`validate_record`, and `check_token_ids` where the store knows the vocabulary
size); a malformed line anywhere else is a `RecordError` naming the file, the
line and the field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
from typing import Any, Iterator, Optional

from steprl_jax.errors import BadInput
from steprl_jax import failpoints
from steprl_jax.io import append_whole, end_torn_line, iter_json_lines

log = logging.getLogger(__name__)

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
    kind: str = ""  # "search" | "math" | "answer" | "tool_call" | "invalid"; code formats: "code" | "text" | "void"
    format_problems: list[str] = dataclasses.field(default_factory=list)
    format_checks: dict = dataclasses.field(default_factory=dict)  # PORTool R_fm checks
    finish_reason: str = ""  # sampler: "stop" | "eos" | "length" | "context"
    action_entropies: Optional[list[float]] = None
    generate_s: float = 0.0
    tool_s: float = 0.0
    # The prompt the action was sampled from where that is not the path's state: a flow rollout's
    # planner call has a fresh prompt each time (agents/schedules/flow.py); None elsewhere.
    prompt_ids: Optional[list[int]] = None
    # The policy version that sampled each action token (the sampler's; None where not recorded):
    # with asynchronous rollouts a weight push may land inside an action, and this says where.
    action_versions: Optional[list[int]] = None


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
    termination: str = ""  # "answer" | "step_cap" | "context" | "unparseable" | "no_answer"
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
    # Which of the query's search trees the step belongs to, where a schedule grows several from one
    # prompt (Tree-GRPO's M trees; agents/schedules/tree_search.py); 0 elsewhere.
    subtree: int = 0


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
    # str(node index) -> the judge's verdict: label, score (= the leaf's outcome; None when it failed),
    # judge, and the judge's detail (reason, votes, ...): `Judging.judge_trees`
    leaf_verdicts: dict = dataclasses.field(default_factory=dict)
    leaf_terminations: dict = dataclasses.field(default_factory=dict)  # str(node index) -> reason
    leaf_answers: dict = dataclasses.field(default_factory=dict)
    reference_answer: Any = None
    metadata: dict = dataclasses.field(default_factory=dict)

    def to_json(self) -> dict:
        return {"version": RECORD_VERSION, "type": "tree", **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, data: dict) -> "TreeRecord":
        data = {k: v for k, v in data.items() if k not in ("version", "type")}
        nodes = [TreeNode(parent=n["parent"], depth=n["depth"], step=Step(**n["step"]), subtree=n.get("subtree", 0))
                 for n in data.pop("nodes", [])]
        if "leaf_verdicts" in data.get("metadata", {}):  # records written before verdicts had their field
            data["metadata"] = dict(data["metadata"])
            data["leaf_verdicts"] = data["metadata"].pop("leaf_verdicts")
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
        nodes = [dataclasses.replace(self.nodes[old], parent=new_index.get(self.nodes[old].parent, -1))
                 for old in keep]
        remap = lambda d: {str(new_index[int(k)]): v for k, v in d.items() if int(k) in new_index}
        return dataclasses.replace(self, nodes=nodes, leaf_terminations=remap(self.leaf_terminations),
                                   leaf_answers=remap(self.leaf_answers), leaf_outcomes=remap(self.leaf_outcomes),
                                   leaf_verdicts=remap(self.leaf_verdicts))

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
    """The Trajectory or TreeRecord of a decoded line, checked first (`validate_record`)."""
    validate_record(data, where)
    if data["type"] == "trajectory":
        return Trajectory.from_json(data)
    return TreeRecord.from_json(data)


class RecordError(BadInput):
    """A records file holds a line that is not a valid record (the message names file and line)."""


# ------------------------------------------------------------ checking a record's JSON
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return (isinstance(v, float) or _is_int(v)) and math.isfinite(v)


def _list_of(check):
    return lambda v: isinstance(v, list) and all(check(x) for x in v)


def _is_ids(v) -> bool:  # the long lists: checked with builtins (bool is not an id)
    return isinstance(v, list) and all(type(x) is int for x in v) and (not v or min(v) >= 0)


def _is_numbers(v) -> bool:
    return isinstance(v, list) and all(type(x) in (float, int) for x in v) and all(map(math.isfinite, v))


# Each field's (check, what the value must be); a field is required where its dataclass has no default.
_ANY = (lambda v: True, "")
_STRING = (lambda v: isinstance(v, str), "a string")
_STRING_OR_NULL = (lambda v: v is None or isinstance(v, str), "a string or null")
_OBJECT = (lambda v: isinstance(v, dict), "an object")
_OBJECTS = (_list_of(lambda x: isinstance(x, dict)), "a list of objects")
_IDS = (_is_ids, "a list of non-negative integer token ids")
_FLOATS = (_is_numbers, "a list of finite numbers")
_NUMBER = (_is_number, "a finite number")
_STEP_FIELDS = {
    "action_text": _STRING, "action_ids": _IDS, "action_logprobs": _FLOATS, "observation_text": _STRING,
    "observation_ids": _IDS, "tool_calls": _OBJECTS, "tool_results": _OBJECTS, "kind": _STRING,
    "format_problems": (_list_of(lambda x: isinstance(x, str)), "a list of strings"), "format_checks": _OBJECT,
    "finish_reason": _STRING, "generate_s": _NUMBER, "tool_s": _NUMBER,
    "action_entropies": (lambda v: v is None or _is_numbers(v), "null or a list of finite numbers"),
    "prompt_ids": (lambda v: v is None or _is_ids(v), "null or a list of non-negative integer token ids"),
    "action_versions": (lambda v: v is None or _is_ids(v), "null or a list of non-negative integer policy versions")}
_RECORD_FIELDS = {"version": _ANY, "type": _ANY, "id": _STRING, "query_id": _STRING, "question": _STRING,
                  "prompt_text": _STRING, "prompt_ids": _IDS, "reference_answer": _ANY, "metadata": _OBJECT}
_TRAJECTORY_FIELDS = {**_RECORD_FIELDS, "steps": _OBJECTS, "final_answer": _STRING_OR_NULL, "termination": _STRING,
                      "judgements": _OBJECT}
_TREE_FIELDS = {**_RECORD_FIELDS, "nodes": _OBJECTS, "leaf_outcomes": _OBJECT, "leaf_verdicts": _OBJECT,
                "leaf_terminations": _OBJECT, "leaf_answers": _OBJECT}
_NODE_FIELDS = {"parent": (_is_int, "an integer"), "depth": (lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
                "step": _OBJECT, "subtree": (lambda v: _is_int(v) and v >= 0, "an integer >= 0")}
_NODE_REQUIRED = {"parent", "depth", "step"}  # `subtree` came later: older records lack it


def _required(cls) -> set:
    return {f.name for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _short(value) -> str:
    text = repr(value) if isinstance(value, float) else json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_fields(data: dict, fields: dict, required: set, where: str, prefix: str = "") -> None:
    for name in data:
        if name not in fields:
            raise RecordError(f"{where}: unknown field '{prefix}{name}'")
    for name in fields:
        if name in required and name not in data:
            raise RecordError(f"{where}: missing field '{prefix}{name}'")
    for name, value in data.items():
        check, what = fields[name]
        if not check(value):
            raise RecordError(f"{where}: field '{prefix}{name}' must be {what}, got {_short(value)}")


def _check_step(step: dict, where: str, prefix: str) -> None:
    _check_fields(step, _STEP_FIELDS, _required(Step), where, prefix)
    ids, logprobs = step["action_ids"], step["action_logprobs"]
    if len(ids) != len(logprobs):
        raise RecordError(f"{where}: field '{prefix}action_logprobs' has {len(logprobs)} values for "
                          f"{len(ids)} action_ids (one log-prob per action token)")
    versions = step.get("action_versions")
    if versions is not None and len(versions) != len(ids):
        raise RecordError(f"{where}: field '{prefix}action_versions' has {len(versions)} values for "
                          f"{len(ids)} action_ids (one policy version per action token)")


def _check_tree(data: dict, where: str) -> None:
    nodes = data.get("nodes", [])
    for i, node in enumerate(nodes):
        _check_fields(node, _NODE_FIELDS, _NODE_REQUIRED, where, f"nodes[{i}].")
        if not -1 <= node["parent"] < i:  # an earlier node: no cycles, every path ends at -1
            raise RecordError(f"{where}: field 'nodes[{i}].parent' is {node['parent']}, not -1 or an "
                              f"earlier node's index")
        _check_step(node["step"], where, f"nodes[{i}].step.")
    for field in ("leaf_outcomes", "leaf_verdicts", "leaf_terminations", "leaf_answers"):
        for key, value in data.get(field, {}).items():
            if not (key.isdigit() and int(key) < len(nodes)):
                raise RecordError(f"{where}: field '{field}' has key {key!r}, not a node index")
            if field == "leaf_outcomes" and not (value is None or _is_number(value)):  # None: no verdict
                raise RecordError(f"{where}: field 'leaf_outcomes.{key}' must be a finite number or null, "
                                  f"got {_short(value)}")


def validate_record(data, where: str) -> None:
    """Raise `RecordError` naming `where` (file:line) and the field unless `data` is a valid record:
    its type's fields, each of the right type; token ids non-negative integers; one finite log-prob
    per action token; a tree's parents earlier nodes (or -1) and its leaf keys node indices."""
    if not isinstance(data, dict):
        raise RecordError(f"{where}: a record must be a JSON object")
    version = data.get("version")
    if version != RECORD_VERSION:
        raise RecordError(f"{where}: record version {version!r} is not supported (expected {RECORD_VERSION})")
    kind = data.get("type")
    if kind == "trajectory":
        _check_fields(data, _TRAJECTORY_FIELDS, _required(Trajectory), where)
        for i, step in enumerate(data.get("steps", [])):
            _check_step(step, where, f"steps[{i}].")
        judgements = data.get("judgements", {})
        if not isinstance(judgements.get("outcome", {}), dict):
            raise RecordError(f"{where}: field 'judgements.outcome' must be an object")
        if not _OBJECTS[0](judgements.get("process", [])):
            raise RecordError(f"{where}: field 'judgements.process' must be a list of objects")
    elif kind == "tree":
        _check_fields(data, _TREE_FIELDS, _required(TreeRecord), where)
        _check_tree(data, where)
    else:
        raise RecordError(f"{where}: unknown record type {kind!r}")


def check_token_ids(record, vocab_size: int, where: str) -> None:
    """Raise `RecordError` naming `where` and the field if a token id of `record` (a Trajectory or
    a TreeRecord) is outside the vocabulary [0, vocab_size)."""
    if isinstance(record, Trajectory):
        steps = [(f"steps[{i}].", s) for i, s in enumerate(record.steps)]
    else:
        steps = [(f"nodes[{i}].step.", n.step) for i, n in enumerate(record.nodes)]
    fields = [("prompt_ids", record.prompt_ids)]
    for prefix, step in steps:
        fields += [(prefix + "action_ids", step.action_ids), (prefix + "observation_ids", step.observation_ids),
                   (prefix + "prompt_ids", step.prompt_ids or [])]
    for field, ids in fields:
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise RecordError(f"{where}: field '{field}' holds token id {bad}, outside the vocabulary "
                              f"[0, {vocab_size}) (records made with another tokenizer?)")


# ------------------------------------------------------------ the store
_LINE_HEAD = re.compile(rb'^\{"version": \d+, "type": "\w+", "id": ("(?:[^"\\]|\\.)*")')


def _record_id(line: bytes) -> Optional[str]:
    """The id at the head of a cut line (records are written version, type, id first), if it is whole."""
    match = _LINE_HEAD.match(line)
    try:
        return json.loads(match.group(1).decode("utf-8")) if match else None
    except ValueError:
        return None


class RecordStore:
    """Append-only JSONL store of records; `done_ids()` tells a resumed run what to skip.

    With `vocab_size`, every record read must have its token ids in [0, vocab_size). After opening,
    `removed_ids` holds the id of the record on an incomplete last line that was removed ([] when
    none was, [None] when the cut line no longer shows its id) and `removed_lines` counts such
    lines (0 or 1): the stage that writes the file must write that record again."""

    def __init__(self, path: str | os.PathLike, vocab_size: Optional[int] = None):
        self.path = os.fspath(path)
        self.vocab_size = vocab_size
        self.removed_ids: list = []
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self._repair_incomplete_tail()

    @property
    def removed_lines(self) -> int:
        return len(self.removed_ids)

    def _repair_incomplete_tail(self) -> None:
        """A last line without its newline: whole JSON (only the newline was lost) gets the newline
        back and stays; anything else is a write that never finished, and is removed."""
        removed = end_torn_line(self.path)
        if removed is not None:
            number, tail = removed
            self.removed_ids = [_record_id(tail)]
            log.warning("%s:%d: removed an incomplete last line (%d bytes, record id %s): its write never "
                        "finished, so that record is not done and is written again", self.path, number,
                        len(tail), "unreadable" if self.removed_ids[0] is None else repr(self.removed_ids[0]))

    def __iter__(self) -> Iterator:
        if not os.path.exists(self.path):
            return
        for number, data in iter_json_lines(self.path, RecordError):
            where = f"{self.path}:{number}"
            record = record_from_json(data, where)
            if self.vocab_size is not None:
                check_token_ids(record, self.vocab_size, where)
            yield record

    def load(self) -> list:
        return list(self)

    def done_ids(self) -> set[str]:
        return {record.id for record in self}

    def append(self, record) -> None:
        """One line, all or nothing (`io.append_whole`: a failed write leaves no torn line)."""
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
