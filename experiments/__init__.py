"""Thin absl entry points (train, dispatch_latency, selector_heatmap, ...) and their presets.

Run them as modules (`python -m experiments.train`) or as scripts (`python experiments/train.py`);
both import this package from the project's installation (`pip install -e .`).
"""
