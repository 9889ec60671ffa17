"""The main job as a user runs it (`python -m steprl_jax.main`, real processes): how it ends on
bad input, a crash and an interruption, and that an interrupted run resumes with nothing lost,
duplicated or mixed. A tiny random model with SmolLM2's tokenizer keeps each run to seconds."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from steprl_jax import cli
from steprl_jax.errors import BadInput
from swirl_helpers import smol_tokenizer, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from steprl_jax.models import export_hf

    tok = smol_tokenizer()
    return export_hf(tiny_model(tok, seed=11), tok, str(tmp_path_factory.mktemp("main_job") / "model"))


def _swirl(workdir, model="unused", *overrides) -> list:
    """SWiRL at test sizes: 4 questions, K = 2, 2 at a time, 2 steps of at most 16 tokens, no training."""
    return [sys.executable, "-m", "steprl_jax.main", "--config=configs/swirl_arithmetic.py",
            f"--config.model.source={model}", f"--config.workdir={workdir}", "--config.progress=False",
            "--config.task.num_tasks=4", "--config.rollout.batch_size=2", "--config.rollout.max_new_tokens=16", "--config.rollout.max_steps=2",
            "--config.swirl.filter=none", "--config.stages=collect,judge,filter", *overrides]


def _run(command, timeout=300):
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def _last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def test_refusals_are_one_line_and_come_before_the_model_loads(tmp_path):
    # A workdir made by the swirl job: the evaluate job would append its episodes to its records.
    swirl_dir = tmp_path / "swirl"
    swirl_dir.mkdir()
    (swirl_dir / "run.json").write_text(json.dumps({"job": "swirl"}))
    out = _run([sys.executable, "-m", "steprl_jax.main", "--config=configs/demo.py", f"--config.workdir={swirl_dir}",
                "--config.model.source=unused"])
    assert out.returncode == cli.EXIT_BAD_INPUT and "Traceback" not in out.stderr, out.stderr
    assert _last_line(out.stderr) == (f"error: {swirl_dir}/run.json: this workdir holds a 'swirl' run; the "
                                      "'evaluate' job would write into it and mix their records: use another "
                                      "--config.workdir")
    assert not (swirl_dir / "trajectories.jsonl").exists()

    # A collect stage interrupted at temperature 0.7 and resumed at 1.3 with another prompt format.
    workdir = tmp_path / "collect"
    (workdir / "stages").mkdir(parents=True)
    (workdir / "stages" / "collect.json").write_text(json.dumps(
        {"key": {"temperature": 0.7, "env.few_shot": 1}, "complete": False}))
    (workdir / "trajectories.jsonl").write_text("{}\n")  # what it collected (never read: refused first)
    out = _run(_swirl(workdir, "unused", "--config.env.few_shot=0", "--config.rollout.temperature=1.3"))
    assert out.returncode == cli.EXIT_BAD_INPUT and "Traceback" not in out.stderr, out.stderr
    line = _last_line(out.stderr)
    assert line.startswith(f"error: {workdir}/stages/collect.json: stage 'collect' was run with other settings "
                           "(env.few_shot: recorded 1, now 0; temperature: recorded 0.7, now 1.3); going on would "
                           "mix them in trajectories.jsonl"), line
    assert "unused" not in out.stderr  # refused before the model (which does not exist) was looked for


def test_a_crash_is_one_line_with_its_traceback_in_the_log(tmp_path, capsys):
    log = tmp_path / "main.log"
    try:
        {}["missing"]
    except KeyError as err:
        assert cli.outcome(err, str(log), debug=False) == cli.EXIT_CRASH
    (line,) = capsys.readouterr().err.splitlines()
    assert line == f"crashed: KeyError: 'missing'; traceback in {log} (--debug prints it here)"
    assert "Traceback (most recent call last)" in log.read_text() and "{}[\"missing\"]" in log.read_text()
    assert cli.outcome(BadInput("tasks.jsonl:3: invalid JSON"), None, debug=False) == cli.EXIT_BAD_INPUT
    assert cli.outcome(FileNotFoundError("no model at /x"), None, debug=False) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines() == ["error: tasks.jsonl:3: invalid JSON", "error: no model at /x"]


def _records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def _sampled(records) -> dict:
    """What each episode sampled and saw, by id (not how long it took)."""
    return {r["id"]: [(s["action_ids"], s["action_logprobs"], s["observation_ids"]) for s in r["steps"]]
            for r in records}


@pytest.fixture(scope="module")
def whole(tmp_path_factory, model_dir):
    """An uninterrupted run's workdir (collect, judge, filter) and its records by id."""
    workdir = tmp_path_factory.mktemp("whole") / "run"
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    records = {r["id"]: r for r in _records(workdir / "trajectories.jsonl")}
    assert len(records) == 8
    return workdir, records


def _copy(workdir, tmp_path):
    return shutil.copytree(workdir, tmp_path / "copy")


def test_a_record_that_lost_only_its_newline_is_kept(whole, tmp_path, model_dir):
    workdir = _copy(whole[0], tmp_path)
    path = workdir / "trajectories.jsonl"
    path.write_bytes(path.read_bytes()[:-1])  # every line still valid JSON
    os.remove(workdir / "judged.jsonl")
    os.remove(workdir / "stages" / "judge.json")
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(_records(path)) == 8 and len(_records(workdir / "judged.jsonl")) == 8
    assert "removed" not in out.stderr


def test_a_torn_last_record_is_named_and_collected_again(whole, tmp_path, model_dir):
    workdir = _copy(whole[0], tmp_path)
    path = workdir / "trajectories.jsonl"
    data = path.read_bytes()
    last_start = data[:-1].rfind(b"\n") + 1
    path.write_bytes(data[:last_start + 40])  # the last write stopped 40 bytes in
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"{path}:8: removed an incomplete last line" in out.stderr
    assert "holds 7 trajectories, its marker counted 8" in out.stderr
    assert _sampled(_records(path)) == _sampled(whole[1].values())  # sampled again with its own key
    assert len(_records(workdir / "judged.jsonl")) == 8


@pytest.mark.parametrize("damage, message", [  # the type checks themselves: tests/test_records.py
    (lambda r: r["steps"][0]["action_ids"].__setitem__(0, 10 ** 6),
     "trajectories.jsonl:1: field 'steps[0].action_ids' holds token id 1000000, outside the vocabulary"),
])
def test_a_record_of_the_wrong_shape_is_refused_when_read(whole, tmp_path, model_dir, damage, message):
    workdir = _copy(whole[0], tmp_path)
    path = workdir / "trajectories.jsonl"
    lines = path.read_text().splitlines()
    first = json.loads(lines[0])
    damage(first)
    path.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    os.remove(workdir / "judged.jsonl")
    os.remove(workdir / "stages" / "judge.json")
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == cli.EXIT_BAD_INPUT and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert message in _last_line(out.stderr), _last_line(out.stderr)
    assert not (workdir / "judged.jsonl").exists() or not _records(workdir / "judged.jsonl")


def test_a_damaged_marker_or_manifest_is_named_with_a_way_on(whole, tmp_path, model_dir):
    workdir = _copy(whole[0], tmp_path)
    (workdir / "stages" / "judge.json").write_text('{"key": {"outcome": "ru')
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == cli.EXIT_BAD_INPUT, out.stderr[-3000:]
    assert _last_line(out.stderr).startswith(f"error: {workdir}/stages/judge.json: not valid JSON (")
    assert _last_line(out.stderr).endswith("; delete it to run the stage again")
    (workdir / "run.json").write_bytes(b"\xff\xfe")
    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == cli.EXIT_BAD_INPUT, out.stderr[-3000:]
    assert _last_line(out.stderr).startswith(f"error: {workdir}/run.json: not valid JSON (")


def test_sigterm_mid_collect_then_resume_equals_an_uninterrupted_run(whole, tmp_path, model_dir):
    expected = whole[1]

    # SIGTERM right after the third record is on disk (a fail point sends it; the job's own
    # handler stops the run): it exits 130 and says how to go on.
    workdir = tmp_path / "stopped"
    records = workdir / "trajectories.jsonl"
    out = subprocess.run(_swirl(workdir, model_dir), cwd=ROOT, env={**ENV, "STEPRL_JAX_TERM_AT": "records.append.after:3"},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == cli.EXIT_INTERRUPTED, out.stderr[-3000:]
    assert "fail point records.append.after:3: SIGTERM" in out.stderr
    assert _last_line(out.stderr) == "interrupted; the same command resumes the run"
    kept = _records(records)
    assert len(kept) == 3  # stopped mid-stage

    out = _run(_swirl(workdir, model_dir))
    assert out.returncode == 0, out.stderr[-3000:]
    resumed = _records(records)
    assert len(resumed) == 8 and {r["id"] for r in resumed} == set(expected)  # nothing lost or duplicated
    assert _sampled(resumed) == _sampled(expected.values())  # token for token the uninterrupted run's


def test_the_schema_knows_every_job():
    from steprl_jax import config_schema, main

    assert set(config_schema.JOBS) == set(main.JOBS)


def test_a_second_signal_exits_at_once():
    # a job that is slow to stop (it waits after the first interrupt, then would exit 0 printing
    # 'stopped'): the second signal ends it there, with the interrupted status and nothing after
    # (`ready` is printed inside the try: the signal may land before print returns). The
    # communicate timeout only guards against a hang; what is checked is how the process ended.
    code = ("import time\nfrom steprl_jax import cli\ncli.install_interrupt_handlers()\n"
            "try:\n    print('ready', flush=True)\n    time.sleep(600)\nexcept KeyboardInterrupt:\n"
            "    print('stopping', flush=True)\n    time.sleep(30)\n    print('stopped', flush=True)\n")
    process = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "ready\n"
    process.send_signal(signal.SIGTERM)  # SIGTERM is handled like Ctrl-C
    assert process.stdout.readline() == "stopping\n"
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == cli.EXIT_INTERRUPTED and "stopped" not in stdout
    assert "SIGTERM: stopping (again to exit at once)" in stderr
