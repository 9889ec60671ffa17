import json

import pytest

from steprl_jax.agents.formats import parse_tagged_action
from steprl_jax.data.gsm8k import load_gsm8k
from steprl_jax.data.hotpotqa import load_hotpotqa
from steprl_jax.data.jsonl import DataFormatError, LoadReport

GSM = {"question": "Natalia sold 48 clips in April and half as many in May. Total?",
       "answer": "In May: 48/2 = <<48/2=24>>24.\nTotal: 48+24 = <<48+24=72>>72.\n#### 72"}


def test_gsm8k_steps_and_demonstration(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GSM) + "\n\n" + json.dumps(GSM) + "\n")
    problem = load_gsm8k(path)[0]
    assert problem.answer == "72" and problem.steps == (("48/2", "24"), ("48+24", "72"))
    text = problem.demonstration().as_text()
    assert "<math_exp>48/2</math_exp>\n48/2 -> 24\n" in text and text.endswith("<answer>72</answer>")
    actions = [parse_tagged_action(s.action) for s in problem.demonstration().steps]
    assert [a.kind for a in actions] == ["math", "math", "answer"] and all(a.ok for a in actions)


def test_malformed_lines_name_file_and_line(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text(json.dumps(GSM) + "\n" + "{oops\n" + json.dumps({"question": "q", "answer": "no final"}) + "\n")
    with pytest.raises(DataFormatError, match=r"g.jsonl:2: invalid JSON"):
        load_gsm8k(path)
    report = LoadReport(str(path))
    assert len(load_gsm8k(path, skip_malformed=True, report=report)) == 1
    assert report.skipped == 2 and "g.jsonl:3" in report.first_errors[1]


def test_hotpotqa(tmp_path):
    record = {"question_id": "x1", "question_text": "Who?", "answers_objects": [{"spans": ["Shirley Temple"]}],
              "contexts": [{"id": "0", "title": "A", "paragraph_text": "a", "is_supporting": True},
                           {"id": "1", "title": "B", "paragraph_text": "b", "is_supporting": False}]}
    path = tmp_path / "h.jsonl"
    path.write_text(json.dumps(record) + "\n" + json.dumps({**record, "contexts": [{"title": 3}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"h.jsonl:2: contexts\[0\]: field 'title' must be str"):
        load_hotpotqa(path)
    example = load_hotpotqa(path, skip_malformed=True)[0]
    assert example.answers == ("Shirley Temple",) and example.supporting_titles == ("A",)
