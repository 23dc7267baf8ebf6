"""The runtime type checker tests install on earl_jax (via jaxtyping's import hook).

beartype with the PEP 484 numeric tower, so an int is accepted where a float is annotated.
"""

import contextlib

import jaxtyping
from beartype import BeartypeConf, beartype

checker = beartype(conf=BeartypeConf(is_pep484_tower=True))


@contextlib.contextmanager
def unchecked():
  """Turns the runtime shape/type checker off, e.g. to see a config's own validation error.

  Under the test hook a wrong Literal value is rejected by beartype before `__post_init__` can
  raise the error a user would see; tests of those messages run inside this context.
  """
  previous = jaxtyping.config.jaxtyping_disable
  jaxtyping.config.update('jaxtyping_disable', True)
  try:
    yield
  finally:
    jaxtyping.config.update('jaxtyping_disable', previous)
