"""evaluation.seeds: seed means and their two-level bootstrap intervals against hand-computed
cases, and the table command over real evaluation files."""
import json

import numpy as np
import pytest

from steprl_jax.evaluation import seeds
from steprl_jax.evaluation.stats import paired_diff_ci

# Two seeds, three questions, (numerator, denominator) per question.
SEED0 = {"q1": (1, 1), "q2": (0, 1), "q3": (1, 1)}  # 2/3
SEED1 = {"q1": (1, 1), "q2": (1, 1), "q3": (1, 1)}  # 1


def test_the_seed_mean_is_the_mean_of_each_seeds_ratio():
    ci = seeds.seeds_ci({0: SEED0, 1: SEED1})
    assert ci["value"] == pytest.approx(5 / 6)
    assert ci["per_seed"] == {"0": pytest.approx(2 / 3), "1": 1.0}
    assert ci["seeds"] == 2 and ci["questions"] == 3
    assert 0 <= ci["lo"] <= ci["value"] <= ci["hi"] <= 1


def test_a_ratio_metric_weighs_questions_by_their_denominators():
    # process correctness: q1 has 3 judged steps (1 GOOD), q2 one (GOOD): 2/4 = 0.5, not (1/3 + 1) / 2
    ci = seeds.seeds_ci({0: {"q1": (1, 3), "q2": (1, 1)}})
    assert ci["value"] == pytest.approx(0.5)


def test_no_spread_gives_a_point_interval():
    same = {f"q{i}": (1, 2) for i in range(5)}
    ci = seeds.seeds_ci({0: same, 1: same, 2: same})
    assert ci["value"] == ci["lo"] == ci["hi"] == pytest.approx(0.5)


def test_a_reference_with_fewer_seeds_pairs_with_those_only():
    # GRPO has run seed 0 so far, PORTool seeds 0 and 1: PORTool's seed 1 has nothing to pair with
    diff = seeds.paired_seeds_diff_ci({0: SEED0}, {0: SEED0, 1: SEED1})
    assert diff["seeds"] == 1 and diff["per_seed"] == {"0": pytest.approx(0.0)}


def test_seeds_pair_with_their_own_seed_and_unpaired_seeds_are_left_out():
    diff = seeds.paired_seeds_diff_ci({0: SEED0, 1: SEED1}, {1: SEED0, 2: SEED1})
    assert diff["seeds"] == 1 and diff["per_seed"] == {"1": pytest.approx(-1 / 3)}
    assert seeds.paired_seeds_diff_ci({0: SEED0}, {}) is None


def test_with_one_seed_the_interval_is_the_question_bootstrap():
    rng = np.random.default_rng(3)
    a = {f"q{i}": (float(rng.integers(0, 2)), 1.0) for i in range(64)}
    b = {f"q{i}": (float(rng.integers(0, 2)), 1.0) for i in range(64)}
    two_level = seeds.paired_seeds_diff_ci({0: a}, {0: b})
    questions_only = paired_diff_ci(a, b)
    assert two_level["value"] == pytest.approx(questions_only["value"])
    # the same bootstrap by other draws: the bounds agree to the draws' noise
    assert two_level["lo"] == pytest.approx(questions_only["lo"], abs=0.03)
    assert two_level["hi"] == pytest.approx(questions_only["hi"], abs=0.03)


def test_seeds_that_disagree_widen_the_interval():
    rng = np.random.default_rng(5)
    qs = [f"q{i}" for i in range(48)]
    low = {q: (float(rng.random() < 0.3), 1.0) for q in qs}
    high = {q: (float(rng.random() < 0.7), 1.0) for q in qs}
    mixed = seeds.seeds_ci({0: low, 1: high, 2: low, 3: high})
    agreeing = seeds.seeds_ci({0: low, 1: low, 2: low, 3: low})
    assert agreeing["hi"] - agreeing["lo"] == pytest.approx(seeds.seeds_ci({0: low})["hi"] - seeds.seeds_ci({0: low})["lo"])
    assert mixed["hi"] - mixed["lo"] > 1.3 * (agreeing["hi"] - agreeing["lo"])


def _evaluation(path, terms):
    path.parent.mkdir(parents=True, exist_ok=True)
    per_question = {q: {"accuracy": list(t), "mean_actions": [2.0 * t[1], t[1]]} for q, t in terms.items()}
    path.write_text(json.dumps({"ci": {"per_question": per_question}}))


def test_the_table_command_reads_rows_by_seed(tmp_path, capsys):
    _evaluation(tmp_path / "base.json", {"q1": (0, 1), "q2": (0, 1), "q3": (1, 1)})
    _evaluation(tmp_path / "s0" / "swirl.json", SEED0)
    _evaluation(tmp_path / "s1" / "swirl.json", SEED1)  # seed 2 has not run yet
    out = tmp_path / "table"
    assert seeds.main(["--seeds", "0", "1", "2", "--reference", "base", "--metrics", "accuracy", "mean_actions",
                       "--row", f"base={tmp_path}/base.json", "--row", f"SWiRL={tmp_path}/s{{seed}}/swirl.json",
                       "--out", str(out)]) == 0
    table = json.loads((tmp_path / "table.json").read_text())["rows"]
    assert table["SWiRL"]["seeds"] == [0, 1]
    assert table["SWiRL"]["accuracy"]["value"] == pytest.approx(5 / 6)
    assert table["SWiRL"]["diff"]["accuracy"]["value"] == pytest.approx(0.5)
    # the shared base pairs with every seed
    assert table["SWiRL"]["diff"]["accuracy"]["per_seed"] == {"0": pytest.approx(1 / 3), "1": pytest.approx(2 / 3)}
    assert table["SWiRL"]["mean_actions"]["value"] == pytest.approx(2.0)
    text = (tmp_path / "table.md").read_text()
    assert "| SWiRL | 2 | 83.3 [" in text and "(66.7, 100.0)" in text and "| 2.00 [2.00, 2.00]" in text
    assert "Paired difference from base" in text and "+0.500" in text
    assert table["base"]["shared"] and "shared" not in table["SWiRL"]
    assert "| base | shared | 33.3 [0.0, 100.0] | 2.00 [2.00, 2.00] |" in text  # one evaluation, not three
    assert text in capsys.readouterr().out


def test_named_pairs_are_paired_by_seed_and_question(tmp_path):
    _evaluation(tmp_path / "s0" / "sft.json", {"q1": (1, 1), "q2": (0, 1), "q3": (0, 1)})
    _evaluation(tmp_path / "s1" / "sft.json", {"q1": (1, 1), "q2": (1, 1), "q3": (0, 1)})
    _evaluation(tmp_path / "s0" / "swirl.json", SEED0)
    _evaluation(tmp_path / "s1" / "swirl.json", SEED1)
    rows = ["--row", f"SFT={tmp_path}/s{{seed}}/sft.json", "--row", f"SWiRL={tmp_path}/s{{seed}}/swirl.json"]
    assert seeds.main(["--seeds", "0", "1", *rows, "--pair", "SWiRL vs SFT", "--out", str(tmp_path / "t")]) == 0
    pair = json.loads((tmp_path / "t.json").read_text())["pairs"]["SWiRL vs SFT"]["accuracy"]
    swirl = {s: sum(t[0] for t in terms.values()) / 3 for s, terms in ((0, SEED0), (1, SEED1))}
    assert pair["per_seed"] == {"0": pytest.approx(swirl[0] - 1 / 3), "1": pytest.approx(swirl[1] - 2 / 3)}
    assert "| SWiRL vs SFT |" in (tmp_path / "t.md").read_text()
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", "0", *rows, "--pair", "SWiRL vs DPO", "--out", str(tmp_path / "t")])


def test_a_reference_row_short_of_seeds_pairs_by_seed_in_the_table(tmp_path):
    _evaluation(tmp_path / "s0" / "grpo.json", SEED0)  # GRPO's seed 1 has not run yet
    _evaluation(tmp_path / "s0" / "portool.json", SEED0)
    _evaluation(tmp_path / "s1" / "portool.json", SEED1)
    assert seeds.main(["--seeds", "0", "1", "--reference", "GRPO", "--row", f"GRPO={tmp_path}/s{{seed}}/grpo.json",
                       "--row", f"PORTool={tmp_path}/s{{seed}}/portool.json", "--pair", "PORTool vs GRPO",
                       "--out", str(tmp_path / "t")]) == 0
    result = json.loads((tmp_path / "t.json").read_text())
    for diff in (result["rows"]["PORTool"]["diff"]["accuracy"], result["pairs"]["PORTool vs GRPO"]["accuracy"]):
        assert diff["per_seed"] == {"0": pytest.approx(0.0)} and diff["seeds"] == 1


def test_bad_rows_are_named(tmp_path):
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: malformed JSON"):
        seeds.read_row(str(tmp_path / "bad.json"), [0])
    (tmp_path / "plain.json").write_text(json.dumps({"accuracy": 0.5}))
    with pytest.raises(ValueError, match="plain.json: not an evaluation's metrics"):
        seeds.read_row(str(tmp_path / "plain.json"), [0])
    with pytest.raises(SystemExit):
        seeds.main(["--seeds", "0", "--row", "no-equals-sign", "--out", str(tmp_path / "t")])


@pytest.mark.parametrize("config_name", ["swirl_arithmetic", "portool_toolworld"])
def test_every_seed_of_a_run_sees_the_same_generated_questions(config_name):
    """The run's seed varies training, never the generated held-out questions (task.seed does,
    and gives them other ids: two question sets never pair by id)."""
    import importlib

    from steprl_jax.agents.tasks import build_suite

    def held_out(seed=0, task_seed=0):
        config = importlib.import_module(f"configs.{config_name}").get_config()
        config.seed, config.task.seed = seed, task_seed
        return [(t.id, t.question) for t in build_suite(config, split="test").tasks[:8]]

    same = held_out()
    assert held_out(seed=1) == same
    other = held_out(task_seed=1)
    assert not {i for i, _ in other} & {i for i, _ in same}
    assert [q for _, q in other] != [q for _, q in same]
