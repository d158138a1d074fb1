#!/bin/bash
# The prepared real-GPU run (issue #26), as the device machine executes it:
#   bash bench/gpu/run.sh [script options]     (command limit 330 s)
# with .whl/ carried (bash bench/gpu/wheels.sh fetches it). Installs the carried
# wheels into /tmp/site (never gpulab itself: the machine's Python is 3.12), then
# runs bench/gpu/script.py with its output in $OUT and a copy of its log there.
set -u
OUT=${OUT:-/tmp/gpulab-gpu-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
        --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -3
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
set -o pipefail
python3 -m bench.gpu.script --out "$OUT" "$@" 2>&1 | tee "$OUT/log.txt"
