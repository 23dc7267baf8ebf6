#!/usr/bin/env bash
# The prepared one-GPU check (experiments/gpu_check.py): decode throughput, train MFU, the
# selector's budget from the device's memory, weight reshard; writes one JSON (default
# runs/gpu_check.json). On a machine with one H100/H200 it sets up .venv with the cuda12 extra
# and finishes in under 8 minutes:
#   scripts/gpu_check.sh
# Tiny shapes on fake CPU devices, no GPU needed (the tests run this):
#   scripts/gpu_check.sh --cpu --out=/tmp/gpu_check.json
source "$(dirname "$0")/_env.sh"
cpu=0
for a in "$@"; do [ "$a" = "--cpu" ] && cpu=1; done
if [ "$cpu" = 0 ] && ! python -c 'import jax_cuda12_plugin' >/dev/null 2>&1; then
  echo "[earl_jax] installing the cuda12 extra into .venv" >&2
  python -m pip install --quiet -r requirements-cuda12.txt
fi
exec python experiments/gpu_check.py "$@"
