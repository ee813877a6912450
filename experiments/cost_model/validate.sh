#!/usr/bin/env bash
# The cost model's calibration and validation, each part one short exclusive timing run:
#   experiments/cost_model/validate.sh [OUT]     (default OUT: experiments/cost_model/results)
# On a shared machine, set LOCK to a command prefix that makes each part run alone (it runs as $LOCK env ...).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-experiments/cost_model/results}
PY=${PY:-.venv/bin/python}
LOCK=${LOCK:-}
for part in calibrate grid1 grid2 papers; do
    $LOCK env OMP_NUM_THREADS=1 PYTHONPATH="$PWD" "$PY" experiments/cost_model/run.py --part "$part" --out "$OUT"
done
