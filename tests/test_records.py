"""Token-exact records: JSONL round trip, interrupted writes, corrupt lines, SWiRL decomposition."""
import json

import pytest

from steprl_jax.agents.records import (
    RecordError, RecordStore, Step, TreeNode, TreeRecord, Trajectory, decompose)


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


def test_decompose_keeps_token_ids():
    units = decompose(_trajectory())
    assert [u.step_index for u in units] == [0, 1]
    assert units[0].state_ids == (1, 2) and units[0].action_ids == (10, 11)
    assert units[1].state_ids == (1, 2, 10, 11, 20, 21, 22)
    assert units[1].state_text == "P<math_exp>2+3</math_exp>\n2+3 -> 5\n"
    assert units[1].action_logprobs == (-0.1,)


def test_tree_paths_and_trajectories():
    s = lambda n: Step(f"a{n}", [n], [-1.0])
    tree = TreeRecord("tree0", "q", "Q?", "P", [1], nodes=[
        TreeNode(-1, s(0), 1), TreeNode(0, s(1), 2), TreeNode(0, s(2), 2), TreeNode(2, s(3), 3)],
        leaf_outcomes={"1": 1, "3": -1})
    assert tree.leaves() == [1, 3]
    assert tree.path(3) == [0, 2, 3]
    assert tree.trajectory(3).all_ids() == [1, 0, 2, 3]
    assert TreeRecord.from_json(json.loads(json.dumps(tree.to_json()))) == tree
