"""benchmarks.rl_iteration: a dtype that runs far longer than its side's fastest is stopped (a real
child process, killed), and the report goes on without it."""
from steprl_jax.benchmarks import rl_iteration


def test_the_cutoff_follows_the_sides_fastest_finished_child():
    assert rl_iteration.slower_cutoff(3.0, []) == (None, "")
    assert rl_iteration.slower_cutoff(0.0, [{"dtype": "float32", "wall_s": 100.0}]) == (None, "")
    done = [{"dtype": "float32", "wall_s": 100.0}, {"dtype": "bfloat16", "wall_s": 80.0},
            {"dtype": "float16", "failed": "killed by signal 9", "wall_s": 5.0}]
    timeout_s, why = rl_iteration.slower_cutoff(3.0, done)
    assert timeout_s == 240.0
    assert why == "a child running over 3x the bfloat16 child's 80 s is not the faster setting"


def test_a_child_past_its_time_is_killed_and_reported(tmp_path):
    # exporting SmolLM2 (imports, weights, safetensors) takes far longer than 2 s
    out = rl_iteration.run_child("export", {"model_dir": str(tmp_path / "smollm2")}, str(tmp_path), timeout_s=2.0)
    assert out["failed"] == "stopped after 2 s" and out["stopped"]
    assert not (tmp_path / "export_.json").exists()  # no result from a stopped child
    assert not (tmp_path / "smollm2" / "model.safetensors").exists()  # killed before it could finish
