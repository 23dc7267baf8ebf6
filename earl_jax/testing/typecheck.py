"""The runtime type checker tests install on earl_jax (via jaxtyping's import hook).

beartype with the PEP 484 numeric tower, so an int is accepted where a float is annotated.
"""

from beartype import BeartypeConf, beartype

checker = beartype(conf=BeartypeConf(is_pep484_tower=True))
