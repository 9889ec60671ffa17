import pytest

from steprl_jax.judges.rules import (
    BAD, GOOD, gsm8k_outcome, hotpotqa_outcome, hotpotqa_scores, judge_step, toolworld_outcome)


@pytest.mark.parametrize("prediction, verdict", [
    ("10", "true"), ("10.00", "true"), ("$10", "true"), ("10 dollars", "true"), ("She earned $10.", "true"),
    ("1,000", "false"), ("11", "false"), ("", "false"), (None, "false")])
def test_gsm8k(prediction, verdict):
    assert gsm8k_outcome(prediction, "10") == verdict


def test_hotpotqa():
    assert hotpotqa_outcome("the Chief of Protocol.", ["Chief of Protocol"]) == "true"
    assert hotpotqa_outcome("Chief of Protocol of the US", ["Chief of Protocol"]) == "false"
    assert hotpotqa_outcome("Chief of Protocol of the US", ["Chief of Protocol"], partial_f1=0.7) == "true"
    assert hotpotqa_scores("Paris France", ["Paris"])["f1"] == pytest.approx(2 / 3)


def test_toolworld():
    assert toolworld_outcome("It's sunny and 23°C in Rome.", "sunny, 23°C", tool_failed=False) == "true"
    assert toolworld_outcome("About 1228.6 miles", "1228.5 mi", tool_failed=False) == "false"  # unit word differs
    assert toolworld_outcome("1228.6 mi", "1228.5 mi", tool_failed=False) == "true"  # within 1%
    assert toolworld_outcome("rain, 23°C", "sunny, 23°C", tool_failed=False) == "false"
    assert toolworld_outcome("Sorry, the weather service is unavailable.", "sunny, 23°C", tool_failed=True) == "unable_to_answer"
    assert toolworld_outcome("Sorry, I cannot tell.", "sunny, 23°C", tool_failed=False) == "false"
    assert toolworld_outcome(None, "x", tool_failed=True) == "unable_to_answer"


def test_process_judge():
    q = "Natalia sold 48 clips in April and half as many in May. How many in total?"
    assert judge_step(q, "", "math", "48 / 2").verdict == GOOD
    assert judge_step(q, "\n48 / 2 -> 24\n", "math", "48 + 24").verdict == GOOD
    assert judge_step(q, "", "math", "48 + 37").verdict == BAD
    assert judge_step(q, "", "math", "__import__('os')").verdict == BAD
    assert judge_step(q, "\n48 + 24 -> 72\n", "answer", "72").verdict == GOOD
    assert judge_step(q, "", "answer", "95").verdict == BAD
    hq = "Who portrayed Corliss Archer in Kiss and Tell?"
    assert judge_step(hq, "", "search", "Kiss and Tell film cast").verdict == GOOD
    assert judge_step(hq, "", "search", "kiss and tell film cast", ["Kiss and Tell film cast"]).verdict == BAD
    assert judge_step(hq, "", "search", "banana bread recipe").verdict == BAD
    ctx = "\nKiss and Tell -> Kiss and Tell is a 1945 film starring Shirley Temple as Corliss Archer.\n"
    assert judge_step(hq, ctx, "answer", "Shirley Temple").verdict == GOOD
    assert judge_step(hq, ctx, "answer", "Judy Garland").verdict == BAD
    assert judge_step(hq, ctx, None, None).reasons == ("no well-formed action",)
