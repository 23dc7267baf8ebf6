"""Errors a user can fix: bad flags, configs, checkpoints, model directories, meshes.

Entry points (`earl_jax.runtime.run`) end the program on a `UserError` with one line,
`error: <message>`, and exit code 2, the `absl.app.UsageError` convention, instead of a traceback;
`--debug` shows the traceback. Every other exception is an internal error and keeps its traceback.
Each `UserError` subclasses `ValueError`, so code that catches `ValueError` keeps working.
"""


class UserError(ValueError):
  """An input the user can fix; its message names the bad value and what was expected."""


class ConfigError(UserError):
  """A config field, or a combination of fields, that cannot run."""
