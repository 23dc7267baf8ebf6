#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job on its embedded default: agentic RL on Connect
# Four with the EARL loop, 8 fake CPU devices (see README.md). Extra arguments go to the job, e.g.
#   scripts/demo.sh --config.steps=20 --workdir=runs/try
source "$(dirname "$0")/_env.sh"
# --move_aside: a second demo keeps the first run as runs/default.<time> instead of refusing.
exec python experiments/train.py --move_aside "$@"
