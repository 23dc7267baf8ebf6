#!/usr/bin/env bash
# Sets up .venv if needed, then regenerates the paper's artefacts at small scale into results/
# (a JSON and a PNG each, and results/README.md next to the paper's numbers). Arguments go to
# experiments/reproduce_paper.py, e.g.
#   scripts/reproduce_paper.sh --quick                   # tiny sizes, checked (CI)
#   scripts/reproduce_paper.sh --artefacts=fig4,table1 --out_dir=/tmp/r
source "$(dirname "$0")/_env.sh"
exec python experiments/reproduce_paper.py "$@"
