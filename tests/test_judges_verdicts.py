"""Verdict parsing, majority vote, and what each judge prompt may (not) show."""
import pytest

from steprl_jax.judges import prompts
from steprl_jax.judges.verdicts import (OUTCOME_LABELS, PROCESS_LABELS, TRAJECTORY_LABELS, TRAJECTORY_REWARDS,
                                        majority, parse_label)


@pytest.mark.parametrize("text, expected", [
    ("Verdict: GOOD", "GOOD"),
    ("The step searches for the right entity.\nVerdict: BAD", "BAD"),
    ("**Verdict:** good", "GOOD"),
    ("GOOD.", "GOOD"),
    ('"BAD"', "BAD"),
    ('{"verdict": "GOOD", "reason": "fine"}', "GOOD"),
    ("It looks good to me", "GOOD"),  # exactly one label word
    ("Is it good or bad? Hard to say.", None),  # two labels, no marker: not guessed
    ("Verdict: GOOD ... on reflection, Verdict: BAD", "BAD"),  # the last marked label wins
    ("", None),
    ("I cannot decide.", None),
    ("GOODNESS gracious", None),  # not a word match
])
def test_parse_process_labels(text, expected):
    assert parse_label(text, PROCESS_LABELS) == expected


@pytest.mark.parametrize("text, expected", [
    ("Verdict: unable_to_answer", "unable_to_answer"),
    ("Verdict: Unable to answer", "unable_to_answer"),
    ("The tools failed, so: unable-to-answer", "unable_to_answer"),
    ("Verdict: true", "true"),
    ("verdict: FALSE", "false"),
    ('{"verdict": true}', "true"),
    ("It is true the tool returned 5, but the answer says 6. Verdict: false", "false"),
    ("true or false, who knows", None),
])
def test_parse_trajectory_labels(text, expected):
    assert parse_label(text, TRAJECTORY_LABELS) == expected


def test_parse_outcome_and_non_text():
    assert parse_label("The answers agree.\nVerdict: YES", OUTCOME_LABELS) == "YES"
    assert parse_label(None, OUTCOME_LABELS) is None


def test_majority_counts_unparsed_and_never_guesses():
    verdict = majority(["Verdict: true", "Verdict: false", "Verdict: true", "???", "Verdict: unable_to_answer"],
                       TRAJECTORY_LABELS, TRAJECTORY_REWARDS)
    assert verdict.label == "true" and verdict.score == 1.0 and verdict.ok
    assert verdict.votes == {"true": 2, "false": 1, "unable_to_answer": 1} and verdict.unparsed == 1
    assert len(verdict.raw) == 5

    unreadable = majority(["hmm", "no idea"], PROCESS_LABELS)
    assert unreadable.label is None and unreadable.failure_code == "unparsed" and unreadable.unparsed == 2
    assert unreadable.score is None

    tie = majority(["Verdict: GOOD", "Verdict: BAD"], PROCESS_LABELS)
    assert tie.label is None and tie.failure_code == "tie" and tie.votes == {"GOOD": 1, "BAD": 1}


def test_process_prompt_has_no_golden_answer_and_shows_state_and_action():
    history = [{"role": "assistant", "content": "<search_query>Eiffel tower height</search_query>"},
               {"role": "tool", "name": "search", "content": "330 m"}]
    messages = prompts.process_messages("How tall is the Eiffel tower?", history, "<answer>330 m</answer>")
    text = "\n".join(m["content"] for m in messages)
    assert "How tall is the Eiffel tower?" in text and "330 m" in text and "<answer>330 m</answer>" in text
    assert "answer key" not in text.lower() and "reference" not in text.lower()
    assert "Verdict: GOOD" in text
    # There is no way to pass a golden answer.
    with pytest.raises(TypeError):
        prompts.process_messages("q", "", "a", golden="x")


def test_outcome_and_trajectory_prompts():
    outcome = prompts.outcome_messages("2+2?", None, "4")[1]["content"]
    assert "(no answer given)" in outcome and "<answer_key>\n4\n</answer_key>" in outcome
    trajectory = [{"role": "user", "content": "weather in Paris now?"},
                  {"role": "assistant", "content": "<think>ask</think>",
                   "tool_calls": [{"function": {"name": "weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": '{"error": {"type": "tool_failure", "message": "down"}}'}]
    with_reference = prompts.trajectory_messages("weather?", trajectory, reference="sunny")[1]["content"]
    assert "tool_failure" in with_reference and 'weather({"city": "Paris"})' in with_reference
    assert "<reference>\nsunny\n</reference>" in with_reference
    without = prompts.trajectory_messages("weather?", trajectory)[1]["content"]
    assert "no fixed reference answer" in without and "<reference>" not in without


def test_long_history_keeps_its_end():
    text = prompts.render_history("x" * 100 + "END", max_chars=10)
    assert text.endswith("xxxxxxxEND") and "93 earlier characters omitted" in text
