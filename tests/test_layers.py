"""The import layers of DESIGN.md hold: `lint-imports` (import-linter) checks the contracts in
`.importlinter` at the repository root, and fails with its report naming each import that breaks
one. The contracts themselves are checked on a copy of the package with a deliberate upward
import (inside a function, as lazy imports are) and a deliberate cycle between two subpackages of
one layer: both must break them."""
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The linter run in the folder `cwd` on the package found there (the folder comes first on the
# path, before any installed copy).
_LINT = ("import sys; from importlinter.cli import lint_imports; "
         "sys.exit(lint_imports(config_filename='.importlinter', no_cache=True, no_logo=True))")


def lint(cwd: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _LINT], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": cwd, "NO_COLOR": "1", "COLUMNS": "200"})


def test_the_layers_hold():
    run = lint(ROOT)
    assert run.returncode == 0, f"import-linter: a contract is broken\n{run.stdout}\n{run.stderr}"
    assert "Contracts: 3 kept, 0 broken." in run.stdout, run.stdout


def _copy(tmp_path) -> str:
    shutil.copytree(os.path.join(ROOT, "steprl_jax"), tmp_path / "steprl_jax",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(ROOT, ".importlinter"), tmp_path / ".importlinter")
    return str(tmp_path)


def _append(root: str, module: str, text: str) -> None:
    with open(os.path.join(root, *module.split(".")) + ".py", "a", encoding="utf-8") as f:
        f.write("\n\n" + text)


def test_a_lazy_upward_import_breaks_the_layers(tmp_path):
    root = _copy(tmp_path)
    _append(root, "steprl_jax.judges.verdicts",
            "def _upward():\n    from steprl_jax.agents import rollout  # noqa: F401\n")
    run = lint(root)
    assert run.returncode == 1, run.stdout
    assert "steprl_jax.judges is not allowed to import steprl_jax.agents" in run.stdout, run.stdout
    assert "steprl_jax.judges.verdicts -> steprl_jax.agents.rollout" in run.stdout, run.stdout


def test_a_cycle_inside_one_layer_breaks_the_acyclic_contract(tmp_path):
    root = _copy(tmp_path)  # one layer: training importing sampling and sampling importing training
    _append(root, "steprl_jax.training.pack",
            "def _one_way():\n    from steprl_jax.sampling import params  # noqa: F401\n")
    _append(root, "steprl_jax.sampling.params",
            "def _cycle():\n    from steprl_jax.training import step  # noqa: F401\n")
    run = lint(root)
    assert run.returncode == 1, run.stdout
    assert "No cycles are allowed in steprl_jax." in run.stdout, run.stdout
    assert "Layers: each module imports only its own layer or lower ones KEPT" in run.stdout, run.stdout
