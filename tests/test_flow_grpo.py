"""Flow-GRPO (AgentFlow): the advantage math (ops/flow_grpo.py), hand-computed."""
import math

import pytest

from steprl_jax.ops.flow_grpo import flow_advantages, rollout_total_weights


# ---- advantages ---------------------------------------------------------------------------
def test_per_rollout_advantage_is_the_group_zscore_of_the_outcomes_and_each_rollout_weighs_one():
    # rewards 1, 0, 0, 1: mean 1/2, sample std sqrt(4 * 1/4 / 3) = sqrt(1/3)
    tokens = [[4], [2, 6], [5, 5, 10], [8]]
    out = flow_advantages([1.0, 0.0, 0.0, 1.0], tokens, normalize="rollout")
    a = 0.5 / math.sqrt(1 / 3)
    assert [w.advantage for w in out] == pytest.approx([a, -a, -a, a], abs=1e-5)
    # a token mean inside each rollout: 1 / (its response tokens)
    assert [w.token_weight for w in out] == pytest.approx([1 / 4, 1 / 8, 1 / 20, 1 / 8])
    assert rollout_total_weights(out, tokens) == pytest.approx([1.0, 1.0, 1.0, 1.0])


def test_per_row_advantage_counts_every_planner_call_and_weighs_every_token():
    # rows: rollout 0 has 1 row (r=1), rollout 1 has 3 rows (r=0): the rows' rewards are 1, 0, 0, 0
    tokens = [[10], [10, 10, 10]]
    out = flow_advantages([1.0, 0.0], tokens, normalize="row")
    mean, std = 0.25, math.sqrt((0.75 ** 2 + 3 * 0.25 ** 2) / 3)
    assert out[0].advantage == pytest.approx((1 - mean) / std, abs=1e-5)
    assert out[1].advantage == pytest.approx((0 - mean) / std, abs=1e-5)
    assert [w.token_weight for w in out] == [1.0, 1.0]
    assert rollout_total_weights(out, tokens) == [10.0, 30.0]


def test_a_long_failing_rollout_among_short_successes_differs_between_the_two_normalisations():
    rewards, tokens = [1.0, 0.0, 1.0, 1.0], [[10], [10, 10, 10], [10], [10]]
    per_rollout = flow_advantages(rewards, tokens, normalize="rollout")
    per_row = flow_advantages(rewards, tokens, normalize="row")
    # per rollout: 1, 0, 1, 1 -> mean 3/4, std sqrt(3/4 / 3) = 1/2 -> +1/2 and -3/2
    assert [w.advantage for w in per_rollout] == pytest.approx([0.5, -1.5, 0.5, 0.5], abs=1e-5)
    # per row: 1, 0, 0, 0, 1, 1 -> mean 1/2, std sqrt(6/4 / 5) -> +-0.9129: the failure is pushed
    # down less, the successes up more
    s = math.sqrt(1.5 / 5)
    assert [w.advantage for w in per_row] == pytest.approx([0.5 / s, -0.5 / s, 0.5 / s, 0.5 / s], abs=1e-5)
    # loss shares: equal per rollout; per row the failing rollout carries half the batch's tokens
    assert rollout_total_weights(per_rollout, tokens) == pytest.approx([1, 1, 1, 1])
    assert rollout_total_weights(per_row, tokens) == [10, 30, 10, 10]


def test_failed_verdicts_and_empty_rollouts_count_nowhere_and_a_tie_has_no_signal():
    out = flow_advantages([1.0, None, 0.0, 1.0], [[3], [3], [3], []], normalize="rollout")
    assert out[1] is None and out[3] is None
    assert [out[0].advantage, out[2].advantage] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], abs=1e-5)
    assert all(w.advantage == 0 for w in flow_advantages([1.0, 1.0, 1.0], [[2], [2, 2], [1]], normalize="row"))
    assert flow_advantages([1.0], [[2]], normalize="rollout")[0].advantage == 0.0  # one member, ddof 1
    with pytest.raises(ValueError, match="normalize"):
        flow_advantages([1.0], [[1]], normalize="token")
