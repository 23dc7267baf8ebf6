#!/usr/bin/env bash
# Sets up .venv if needed, then regenerates every notebook: each notebooks/*.py executed in a
# fresh kernel and written as its .ipynb with the outputs. Arguments go to
# scripts/make_notebooks.py, e.g.
#   scripts/make_notebooks.sh notebooks/quickstart.py
source "$(dirname "$0")/_env.sh"
exec python scripts/make_notebooks.py "$@"
