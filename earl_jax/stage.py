"""The three stages of an RL step, each with its own program and its own parallel layout.

  ROLLOUT     multi-turn generation against a KV cache (prefill of a turn, then decode);
  EXPERIENCE  old and reference log-probs of the finished trajectories;
  TRAIN       the optimizer update.

`Stage` is a `str` enum, so its members are their own JSON and log spelling ('rollout', ...).
Text from a user (a flag, a cached profile) becomes a member through `Stage.parse`, which names
the known stages when the text is not one of them.

  from earl_jax.stage import Stage
  Stage.parse('train') is Stage.TRAIN   # True
  f'{Stage.ROLLOUT}'                     # 'rollout'
"""

import enum

from earl_jax.errors import ConfigError


class Stage(enum.StrEnum):
  ROLLOUT = 'rollout'
  EXPERIENCE = 'experience'
  TRAIN = 'train'

  @classmethod
  def parse(cls, value: 'str | Stage') -> 'Stage':
    """The member named `value`; ConfigError (a ValueError) naming the known stages otherwise."""
    try:
      return cls(value)
    except ValueError:
      raise ConfigError(
        f'Unknown stage {value!r}; stages are {tuple(s.value for s in cls)}.'
      ) from None


STAGES: tuple[Stage, ...] = tuple(Stage)
