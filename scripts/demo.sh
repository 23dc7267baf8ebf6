#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job on its embedded default.
# Extra arguments go to the experiment (e.g. scripts/demo.sh --mesh=4x2).
source "$(dirname "$0")/_env.sh"
exec python experiments/generate.py "$@"
