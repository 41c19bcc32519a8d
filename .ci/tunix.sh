#!/usr/bin/env bash
# CI for the tunix integration, in its own fresh virtual environment (google-tunix
# pins its own stack; it stays out of the main [dev] environment): install
# ".[tunix,test]", check that pip kept the jax the project uses, run tests/test_tunix.py
# and the example.
set -euo pipefail
cd "$(dirname "$0")/.."

venv="$(mktemp -d)/venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[tunix,test]"
python -c "import jax, flax, tunix; print('jax', jax.__version__, 'flax', flax.__version__)"
python - <<'PY'
import importlib.metadata as md
jax = tuple(int(p) for p in md.version("jax").split(".")[:2])
assert jax >= (0, 10), f"pip resolved jax {md.version('jax')}, the project needs >= 0.10"
PY

echo "== tests/test_tunix.py =="
python -m pytest -q -n 0 -W ignore::DeprecationWarning tests/test_tunix.py

echo "== examples/tunix_grpo.py =="
python -W ignore examples/tunix_grpo.py --steps 4
echo "== .ci/tunix.sh passed =="
