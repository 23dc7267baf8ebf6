#!/usr/bin/env bash
# Sets up .venv if needed, then runs the main job on its embedded default: agentic RL on Connect
# Four with the EARL loop, 8 fake CPU devices (see README.md). Extra arguments go to the job, e.g.
#   scripts/demo.sh --config.steps=20 --workdir=runs/try
#   scripts/demo.sh --config=code    # code RL: the supervised warm start first (runs/code_sft),
#                                    # then RL from it (runs/code)
source "$(dirname "$0")/_env.sh"
for arg in "$@"; do
  if [ "$arg" = --config=code ]; then
    # The warm start the `code` preset starts from (its init_from): made once, continued if cut.
    if [ -f runs/code_sft/summary.json ]; then
      echo "[earl_jax] reusing the warm start in runs/code_sft" >&2
    elif [ -d runs/code_sft/checkpoints ]; then
      python experiments/sft.py --config=code --resume
    else
      python experiments/sft.py --config=code
    fi
  fi
done
# --move_aside: a second demo keeps the first run as runs/<preset>.<time> instead of refusing.
exec python experiments/train.py --move_aside "$@"
