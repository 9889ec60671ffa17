"""Token-exact records: JSONL round trip, interrupted writes, corrupt lines and fields, bad bytes, token ids
outside the vocabulary, the state before each step."""
import json
import re

import pytest

from steprl_jax.agents.records import (
    RecordError, RecordStore, Step, TreeNode, TreeRecord, Trajectory, check_token_ids, validate_record)


def _trajectory(i=0):
    return Trajectory(
        id=f"t{i}", query_id="q0", question="2+3?", prompt_text="P", prompt_ids=[1, 2],
        steps=[Step("<math_exp>2+3</math_exp>", [10, 11], [-0.5, -0.25], "\n2+3 -> 5\n", [20, 21, 22], kind="math"),
               Step("<answer>5</answer>", [30], [-0.1], kind="answer")],
        reference_answer="5", final_answer="5", termination="answer")


def test_round_trip_and_resume(tmp_path):
    store = RecordStore(tmp_path / "r.jsonl")
    store.append(_trajectory(0))
    store.append(_trajectory(1))
    again = RecordStore(tmp_path / "r.jsonl")
    assert again.done_ids() == {"t0", "t1"}
    assert again.load()[0] == _trajectory(0)


def test_incomplete_last_line_is_dropped_not_fatal(tmp_path):
    path = tmp_path / "r.jsonl"
    RecordStore(path).append(_trajectory(0))
    with open(path, "a") as f:
        f.write(json.dumps(_trajectory(1).to_json())[:40])  # a write cut short
    store = RecordStore(path)
    assert store.done_ids() == {"t0"}
    store.append(_trajectory(1))
    assert RecordStore(path).done_ids() == {"t0", "t1"}


def test_corrupt_middle_line_names_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    RecordStore(path).append(_trajectory(0))
    with open(path, "a") as f:
        f.write("{not json}\n")
    RecordStore(path).append(_trajectory(1))
    with pytest.raises(RecordError, match=r"r\.jsonl:2: invalid JSON"):
        RecordStore(path).load()


def test_wrong_version_is_refused(tmp_path):
    path = tmp_path / "r.jsonl"
    data = _trajectory(0).to_json()
    data["version"] = 99
    path.write_text(json.dumps(data) + "\n")
    with pytest.raises(RecordError, match=r":1: record version 99"):
        RecordStore(path).load()


def test_state_ids_are_the_prompt_then_each_earlier_action_and_its_observation():
    t = _trajectory()
    assert t.state_ids(0) == [1, 2]
    assert t.state_ids(1) == [1, 2, 10, 11, 20, 21, 22]
    assert t.all_ids() == [1, 2, 10, 11, 20, 21, 22, 30]


def test_tree_paths_and_trajectories():
    s = lambda n: Step(f"a{n}", [n], [-1.0])
    tree = TreeRecord("tree0", "q", "Q?", "P", [1], nodes=[
        TreeNode(-1, s(0), 1), TreeNode(0, s(1), 2), TreeNode(0, s(2), 2), TreeNode(2, s(3), 3)],
        leaf_outcomes={"1": 1, "3": -1})
    assert tree.leaves() == [1, 3]
    assert tree.path(3) == [0, 2, 3]
    assert tree.trajectory(3).all_ids() == [1, 0, 2, 3]
    assert TreeRecord.from_json(json.loads(json.dumps(tree.to_json()))) == tree


def test_incomplete_last_line_is_removed_with_a_warning_naming_it(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    RecordStore(path).append(_trajectory(0))
    line = json.dumps({**_trajectory(1).to_json(), "question": "é" * 40}, ensure_ascii=False).encode()
    cut = line[:line.index("é".encode()) + 1]  # cut inside a character: not even valid UTF-8
    with open(path, "ab") as f:
        f.write(cut)
    store = RecordStore(path)
    assert store.removed_lines == 1 and store.removed_ids == ["t1"]
    assert f"r.jsonl:2: removed an incomplete last line ({len(cut)} bytes, record id 't1')" in caplog.text
    assert store.done_ids() == {"t0"} and path.read_bytes().endswith(b"}\n")
    with open(path, "ab") as f:
        f.write(b'{"version": 1, "ty')  # cut before its id
    assert RecordStore(path).removed_ids == [None]


def test_last_line_that_lost_only_its_newline_is_kept(tmp_path, caplog):
    path = tmp_path / "r.jsonl"
    store = RecordStore(path)
    store.append(_trajectory(0))
    store.append(_trajectory(1))
    path.write_bytes(path.read_bytes()[:-1])  # every line whole, the last newline gone
    again = RecordStore(path)
    assert again.removed_lines == 0 and again.removed_ids == [] and "removed" not in caplog.text
    assert again.done_ids() == {"t0", "t1"} and path.read_bytes().endswith(b"}\n")
    again.append(_trajectory(2))  # the next record starts on a line of its own
    assert [r.id for r in RecordStore(path)] == ["t0", "t1", "t2"]


def _tree_json():
    s = lambda n: Step(f"a{n}", [n], [-1.0])
    return TreeRecord("tree0", "q", "Q?", "P", [1], nodes=[TreeNode(-1, s(0), 1), TreeNode(0, s(1), 2)],
                      leaf_outcomes={"1": 1}).to_json()


def _set(data, path, value):
    """A copy of `data` with the value at `path` (keys and indices) replaced, or removed for ..."""
    data = json.loads(json.dumps(data))
    node = data
    for key in path[:-1]:
        node = node[key]
    if value is ...:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return data


@pytest.mark.parametrize("path, value, message", [
    (("steps", 0, "action_ids"), "oops",
     "field 'steps[0].action_ids' must be a list of non-negative integer token ids, got \"oops\""),
    (("steps", 0, "action_ids"), [10, True], "field 'steps[0].action_ids' must be a list of non-negative integer"),
    (("prompt_ids",), [1, -2], "field 'prompt_ids' must be a list of non-negative integer token ids, got [1, -2]"),
    (("steps", 1, "observation_ids"), [1.5], "field 'steps[1].observation_ids' must be a list of non-negative"),
    (("steps", 0, "action_logprobs"), [-0.5], "field 'steps[0].action_logprobs' has 1 values for 2 action_ids"),
    (("steps", 0, "action_logprobs"), [-0.5, "x"], "field 'steps[0].action_logprobs' must be a list of finite numbers"),
    (("steps", 0, "action_logprobs"), [-0.5, float("nan")],
     "field 'steps[0].action_logprobs' must be a list of finite numbers, got [-0.5, NaN]"),
    (("steps", 0, "action_versions"), [3], "field 'steps[0].action_versions' has 1 values for 2 action_ids"),
    (("steps", 0, "action_versions"), [3, -1], "field 'steps[0].action_versions' must be null or a list of"),
    (("steps", 0, "action_text"), 3, "field 'steps[0].action_text' must be a string, got 3"),
    (("steps", 0, "tool_calls"), ["f"], "field 'steps[0].tool_calls' must be a list of objects"),
    (("steps", 0, "color"), 1, "unknown field 'steps[0].color'"),
    (("steps", 1, "action_ids"), ..., "missing field 'steps[1].action_ids'"),
    (("steps",), {"0": {}}, "field 'steps' must be a list of objects"),
    (("id",), 7, "field 'id' must be a string, got 7"),
    (("query_id",), ..., "missing field 'query_id'"),
    (("final_answer",), ["5"], "field 'final_answer' must be a string or null"),
    (("judgements",), {"outcome": "true"}, "field 'judgements.outcome' must be an object"),
    (("type",), "movie", "unknown record type 'movie'"),
])
def test_every_field_is_checked_when_read(tmp_path, path, value, message):
    """A malformed record fails where it is read, naming the file, the line and the field (here
    line 2), instead of passing on to later stages."""
    store = RecordStore(tmp_path / "r.jsonl")
    store.append(_trajectory(0))
    with open(store.path, "a") as f:
        f.write(json.dumps(_set(_trajectory(1).to_json(), path, value)) + "\n")
    with pytest.raises(RecordError) as failure:
        store.load()
    assert str(failure.value).startswith(f"{store.path}:2: {message}")


@pytest.mark.parametrize("path, value, message", [
    (("nodes", 1, "parent"), 1, "field 'nodes[1].parent' is 1, not -1 or an earlier node's index"),
    (("nodes", 0, "parent"), -2, "field 'nodes[0].parent' is -2"),
    (("nodes", 1, "depth"), 0, "field 'nodes[1].depth' must be an integer >= 1"),
    (("nodes", 1, "step", "action_ids"), "oops", "field 'nodes[1].step.action_ids' must be a list of non-negative"),
    (("leaf_outcomes",), {"5": 1}, "field 'leaf_outcomes' has key '5', not a node index"),
    (("leaf_outcomes",), {"1": "good"}, "field 'leaf_outcomes.1' must be a finite number or null"),
])
def test_tree_records_are_checked_when_read(tmp_path, path, value, message):
    path_ = tmp_path / "r.jsonl"
    path_.write_text(json.dumps(_tree_json()) + "\n" + json.dumps(_set(_tree_json(), path, value)) + "\n")
    with pytest.raises(RecordError, match=r"r\.jsonl:2: " + re.escape(message)):
        RecordStore(path_).load()


def test_token_ids_outside_the_vocabulary(tmp_path):
    path = tmp_path / "r.jsonl"
    RecordStore(path).append(_trajectory(0))  # ids up to 30
    assert len(RecordStore(path, vocab_size=31).load()) == 1
    with pytest.raises(RecordError, match=r"r\.jsonl:1: field 'steps\[0\]\.observation_ids' holds token id 21, "
                                          r"outside the vocabulary \[0, 21\)"):
        RecordStore(path, vocab_size=21).load()
    tree = TreeRecord.from_json(_set(_tree_json(), ("prompt_ids",), [0]))
    with pytest.raises(RecordError, match=r"here: field 'nodes\[1\]\.step\.action_ids' holds token id 1"):
        check_token_ids(tree, 1, "here")


def test_bad_bytes_name_the_file_and_the_line(tmp_path):
    path = tmp_path / "r.jsonl"
    RecordStore(path).append(_trajectory(0))
    with open(path, "ab") as f:
        f.write(json.dumps(_trajectory(1).to_json()).replace("2+3?", "2+3\xff").encode("latin-1") + b"\n")
    with pytest.raises(RecordError, match=r"r\.jsonl:2: not valid UTF-8 \(byte 0xff"):
        RecordStore(path).load()


def test_tree_records_keep_verdicts_and_subtrees_and_read_older_ones(tmp_path):
    verdict = {"label": "true", "score": 1.0, "judge": "rule"}
    tree = TreeRecord.from_json(_tree_json())
    tree.leaf_verdicts["1"] = verdict
    tree.nodes[1] = TreeNode(0, tree.nodes[1].step, 2, subtree=1)
    store = RecordStore(str(tmp_path / "r.jsonl"))
    store.append(tree)
    (back,) = list(RecordStore(str(tmp_path / "r.jsonl")))
    assert back.leaf_verdicts == {"1": verdict} and back.nodes[1].subtree == 1
    # records written before the verdicts had a field of their own: read into it
    old = _tree_json()
    old["metadata"] = {"leaf_verdicts": {"1": verdict}}
    for node in old["nodes"]:
        del node["subtree"]
    del old["leaf_verdicts"]
    (tmp_path / "old.jsonl").write_text(json.dumps(old) + "\n")
    (back,) = list(RecordStore(str(tmp_path / "old.jsonl")))
    assert back.leaf_verdicts == {"1": verdict} and back.metadata == {} and back.nodes[0].subtree == 0
    # a judged tree restricted to some leaves keeps their verdicts
    assert tree.restrict([1]).leaf_verdicts == {"1": verdict}
    with pytest.raises(RecordError, match="field 'leaf_verdicts' has key '7', not a node index"):
        bad = _set(_tree_json(), ("leaf_verdicts",), {"7": verdict})
        validate_record(bad, "r.jsonl:1")
