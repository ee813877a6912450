#!/usr/bin/env bash
# The cost model's calibration and validation (issue 17), each part one short exclusive timing run:
#   scripts/cost_model_validate.sh [OUT]     (default OUT: experiments/cost_model/results)
# Set LOCK= to run without /work/scratch/machine.py (e.g. on a machine of your own).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-experiments/cost_model/results}
PY=${PY:-.venv/bin/python}
[ -x "$PY" ] || PY=/work/main/.venv/bin/python
LOCK=${LOCK-/work/scratch/machine.py time}
for part in calibrate grid1 grid2 papers; do
    $LOCK env OMP_NUM_THREADS=1 PYTHONPATH="$PWD" "$PY" scripts/cost_model_experiment.py --part "$part" --out "$OUT"
done
