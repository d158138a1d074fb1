#!/bin/bash
# Fetch into .whl/ (git-ignored locally) the wheels the GPU run imports beyond what
# the GPU machine's image has (its Python 3.12 has torch, torchvision, pytest,
# pytest-timeout, nvidia-ml-py, typing-extensions): the agent's pydantic and
# websockets. The gpu tests run without pytest-django (bench/gpu/script.py says why).
# Versions are the ones installed in this checkout's .venv (pyproject's pins).
#   bash bench/gpu/wheels.sh [PYTHON_VERSION]   (default 3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
TARGET=${1:-3.12}
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
mapfile -t pins < <("$PY" - <<'PYEOF'
from importlib.metadata import version
for name in ["pydantic", "pydantic-core", "annotated-types", "typing-inspection",
             "websockets"]:
    print(f"{name}=={version(name)}")
PYEOF
)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" \
    --implementation cp "${platforms[@]}" -d .whl "${pins[@]}"
ls .whl
du -sh .whl
