"""Experiment presets (get by name; override fields with --config.a.b=value)."""
