"""evaluation.compare on real workdirs written in tmp_path."""
import json
import os
import re
import struct

import pytest

from steprl_jax.evaluation import compare

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _ci(value, n=40):
    return {"value": value, "lo": value - 0.05, "hi": value + 0.05, "n": n}


def _write_run(root, name, algorithm, evals, rewards=(0.1, 0.3, 0.5)):
    """A workdir: run.json, metrics.jsonl (rl lines, a cut last line) and eval files.

    `evals` maps an iteration to the base value v of its metrics (accuracy v, tool_steps 10 v,
    unanswerable v / 2, format_reward v / 4)."""
    workdir = root / name
    (workdir / "eval").mkdir(parents=True)
    (workdir / "run.json").write_text(json.dumps({"job": "rl", "algorithm": algorithm, "seed": 0}))
    lines = [json.dumps({"stage": "rl", "step": s, "time": 0.0, "reward_mean": r, "entropy": 1.0})
             for s, r in enumerate(rewards, 1)]
    lines.append(json.dumps({"stage": "rl", "step": 9, "accuracy": 0.5}))  # no reward_mean
    (workdir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"stage": "rl", "ste')
    for it, v in evals.items():
        ci = {"accuracy": _ci(v), "tool_steps": _ci(10 * v), "unanswerable": _ci(v / 2),
              "format_reward": _ci(v / 4), "per_question": {}}
        (workdir / "eval" / f"iter_{it:05d}.metrics.json").write_text(
            json.dumps({"ci": ci, "accuracy": v, "episodes": 40}))
    (workdir / "eval" / "iter_00005.trajectories.jsonl").write_text("")  # not an eval file
    return str(workdir)


def _png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == PNG_MAGIC
    return struct.unpack(">II", head[16:24])


def test_table_json_and_plot(tmp_path, capsys):
    a = _write_run(tmp_path, "portool_run", "portool", {0: 0.2, 5: 0.4, 10: 0.6})
    b = _write_run(tmp_path, "grpo_run", "grpo", {5: 0.3, 20: 0.5})
    prefix = str(tmp_path / "out" / "cmp")
    assert compare.main([a, b, "--out", prefix]) == 0
    printed = capsys.readouterr().out
    with open(prefix + ".md") as f:
        table = f.read()
    assert printed == table
    lines = table.strip().split("\n")
    assert lines[0] == ("| method | iterations | accuracy | mean tool-call steps | unanswerable rate "
                        "| mean format reward / step |")
    assert lines[2] == ("| sft (warm start) | 0 | 0.200 [0.150, 0.250] | 2.000 [1.950, 2.050] "
                        "| 0.100 [0.050, 0.150] | 0.050 [0.000, 0.100] |")
    assert lines[3].startswith("| portool | 10 | 0.600 [0.550, 0.650] | 6.000 [5.950, 6.050] |")
    assert lines[4].startswith("| grpo | 20 | 0.500 [0.450, 0.550] |")
    assert len(lines) == 5

    with open(prefix + ".json") as f:
        data = json.load(f)
    assert [r["method"] for r in data["rows"]] == ["sft (warm start)", "portool", "grpo"]
    assert data["rows"][0]["workdir"] == a
    assert data["rows"][2]["unanswerable"] == pytest.approx(_ci(0.25))
    portool, grpo = data["curves"]
    assert portool["iterations"] == [0, 5, 10] and grpo["iterations"] == [5, 20]
    assert [c["value"] for c in portool["format_reward"]] == pytest.approx([0.05, 0.1, 0.15])
    assert portool["reward_mean"] == [[1, 0.1], [2, 0.3], [3, 0.5]]

    width, height = _png_size(prefix + ".png")
    assert width > 1000 and height > 200


def test_default_prefix_and_repeated_algorithm(tmp_path, monkeypatch, capsys):
    a = _write_run(tmp_path, "dapo_lr1e-6", "dapo", {0: 0.2, 5: 0.3}, rewards=())
    b = _write_run(tmp_path, "dapo_lr3e-6", "dapo", {5: 0.4})
    c = _write_run(tmp_path / "other", "dapo_lr3e-6", "dapo", {5: 0.5})
    monkeypatch.chdir(tmp_path)
    assert compare.main([a, b, c]) == 0
    with open(tmp_path / "comparison.json") as f:
        rows = json.load(f)["rows"]
    assert [r["method"] for r in rows] == ["sft (warm start)", "dapo_lr1e-6",
                                           os.path.normpath(b), os.path.normpath(c)]
    _png_size(tmp_path / "comparison.png")
    assert "| dapo_lr1e-6 | 5 |" in capsys.readouterr().out


def test_no_warm_start_and_missing_value(tmp_path, capsys):
    a = _write_run(tmp_path, "arpo", "arpo", {3: 0.4})
    path = os.path.join(a, "eval", "iter_00003.metrics.json")
    with open(path) as f:
        data = json.load(f)
    data["ci"]["unanswerable"] = {"value": None, "lo": None, "hi": None, "n": 0}
    with open(path, "w") as f:
        json.dump(data, f)
    assert compare.main([a, "--out", str(tmp_path / "c")]) == 0
    lines = capsys.readouterr().out.strip().split("\n")
    assert len(lines) == 3 and re.match(r"\| arpo \| 3 \| 0\.400 .* \| n/a \| 0\.100 ", lines[2])
    _png_size(tmp_path / "c.png")


def _error(capsys, *argv):
    assert compare.main(list(argv)) == 2
    return capsys.readouterr().err


def test_bad_workdirs_name_the_file(tmp_path, capsys):
    good = _write_run(tmp_path, "good", "grpo", {0: 0.1})
    missing = str(tmp_path / "nope")
    assert f"{missing}: no such workdir" in _error(capsys, good, missing)

    bare = tmp_path / "bare"
    bare.mkdir()
    assert f"{bare / 'run.json'}: missing" in _error(capsys, str(bare))

    (bare / "run.json").write_text('{"job": "rl", "algorithm": "grpo"')
    assert f"{bare / 'run.json'}: malformed JSON" in _error(capsys, str(bare))

    (bare / "run.json").write_text('{"job": "sft"}')
    assert f"{bare / 'run.json'}: expected an object with job 'rl'" in _error(capsys, str(bare))

    (bare / "run.json").write_text('{"job": "rl", "algorithm": "grpo"}')
    assert f"{bare / 'eval'}: no iter_NNNNN.metrics.json" in _error(capsys, str(bare))

    (bare / "eval").mkdir()
    (bare / "eval" / "iter_00001.metrics.json").write_text("{not json")
    assert f"{bare / 'eval' / 'iter_00001.metrics.json'}: malformed JSON" in _error(capsys, str(bare))

    (bare / "eval" / "iter_00001.metrics.json").write_text('{"ci": {"accuracy": {"value": 1}}}')
    err = _error(capsys, str(bare))
    assert "iter_00001.metrics.json: no 'ci' entry for ['tool_steps', 'unanswerable', 'format_reward']" in err
    assert not (tmp_path / "comparison.md").exists()

    with pytest.raises(FileNotFoundError, match="no such workdir"):
        compare.load_run(missing)


def _set_per_question(workdir, iteration, accuracy):
    """Gives an eval file per-question terms: question i answered right when accuracy[i]."""
    path = os.path.join(workdir, "eval", f"iter_{iteration:05d}.metrics.json")
    with open(path) as f:
        data = json.load(f)
    data["ci"]["per_question"] = {
        f"q{i}": {"accuracy": [float(a), 1.0], "tool_steps": [2.0 + a, 1.0], "unanswerable": [0.0, 1.0],
                  "format_reward": [0.25 * a, 2.0]} for i, a in enumerate(accuracy)}
    with open(path, "w") as f:
        json.dump(data, f)


def test_paired_differences_from_the_warm_start_on_the_same_questions(tmp_path, capsys):
    a = _write_run(tmp_path, "portool", "portool", {0: 0.2, 5: 0.4})
    b = _write_run(tmp_path, "grpo", "grpo", {5: 0.3})
    _set_per_question(a, 0, [1, 0, 0, 1, 0, 0, 0, 0])
    _set_per_question(a, 5, [1, 1, 1, 1, 1, 1, 0, 0])  # +4 of 8 questions
    _set_per_question(b, 5, [1, 0, 0, 1, 0, 0, 0, 0, 1])  # q8 was not in the warm start's set
    prefix = str(tmp_path / "c")
    assert compare.main([a, b, "--out", prefix]) == 0
    printed = capsys.readouterr().out
    assert printed == open(prefix + ".md").read()
    rows = [line for line in printed.split("\n") if line.startswith("| portool | 8 |") or line.startswith("| grpo |")]
    portool = next(r for r in rows if r.startswith("| portool | 8 |"))
    cells = [c.strip() for c in portool.strip("|").split("|")]
    assert cells[2].startswith("+0.500 [") and cells[2].endswith("*")  # 8 of 8 draws gain: excludes 0
    assert cells[3].startswith("+0.500 [")  # tool steps 2 + a
    assert cells[4] == "+0.000 [+0.000, +0.000]"
    grpo = next(r for r in rows if r.startswith("| grpo | 8 |"))  # the 8 shared questions only
    assert [c.strip() for c in grpo.strip("|").split("|")][2].startswith("+0.000 [")
    data = json.load(open(prefix + ".json"))
    assert data["rows"][1]["vs_warm_start"]["accuracy"]["n"] == 8
    assert "vs_warm_start" not in data["rows"][0]


def test_the_warm_start_alone_is_not_compared_with_itself(tmp_path, capsys):
    a = _write_run(tmp_path, "warm", "portool", {0: 0.2})
    _set_per_question(a, 0, [1, 0, 1])
    assert compare.main([a, "--out", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    assert "Difference from the reference" not in out and out.count("| sft (warm start) |") == 1



def test_runs_from_other_starts_against_a_named_reference_and_their_own_start(tmp_path, capsys):
    """base (iteration 0 only), an SFT run (iteration 0 only) and an RL run from that SFT policy
    (its iteration 0: the SFT policy's evaluation, copied): each against base, the RL run also
    against its own start."""
    base = _write_run(tmp_path, "base", "torl", {0: 0.1})
    sft = _write_run(tmp_path, "sft", "torl", {0: 0.5})
    rl = _write_run(tmp_path, "rl", "torl", {0: 0.5, 6: 0.7})
    _set_per_question(base, 0, [0, 0, 0, 0, 1, 0, 0, 0])
    for run in (sft, rl):
        _set_per_question(run, 0, [1, 1, 1, 1, 1, 0, 0, 0])
    _set_per_question(rl, 6, [1, 1, 1, 1, 1, 1, 1, 0])
    prefix = str(tmp_path / "c")
    assert compare.main([base, sft, rl, "--out", prefix, "--start-label", "base"]) == 0
    out = capsys.readouterr().out
    data = json.load(open(prefix + ".json"))
    assert [r["method"] for r in data["rows"]] == ["base", "sft", "rl"]  # base once
    assert data["rows"][1]["vs_warm_start"]["accuracy"]["value"] == pytest.approx(0.5)
    assert data["rows"][2]["vs_warm_start"]["accuracy"]["value"] == pytest.approx(0.75)
    assert data["rows"][2]["vs_own_start"]["accuracy"]["value"] == pytest.approx(0.25)
    assert "vs_own_start" not in data["rows"][1]  # its only evaluation is its start
    assert "Difference from the reference (base)" in out and "Difference from the run's own iteration 0" in out
