"""The RL batch: one row per episode, every field padded to a context bucket.

Rows are whole multi-turn conversations (prompt, observations and the policy's replies) in one
token sequence; `loss_mask` marks the positions the policy generated. Every stage adds fields:

  rollout     tokens, loss_mask, sample_logprobs, rewards (the episode return), returns (each
              generated token's discounted reward-to-go from its turn on), legal_moves (at
              the first token of each reply, the moves the rules allowed there: bit a set when
              move a was legal; 0 elsewhere and for tasks without moves), lengths,
              group_ids, valid
  experience  old_logprobs (current params), ref_logprobs (frozen reference)
  advantages  advantages (per token)

`segment_ids` and `positions` say which sequence every token belongs to and where in it: one
episode per row (segment 1 on its tokens, 0 on padding; positions 0..T-1), or several episodes
packed side by side into a row (`rl.packing`), which the packed programs attend within.

Padding rows (added so the batch divides the mesh) have valid == False and an all-False mask, so
they contribute nothing to any loss or statistic. Log-prob columns are aligned with tokens:
column t holds log p(tokens[t] | tokens[:t]); column 0 is 0.
"""

import typing

import flax.struct
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from earl_jax.sharding import rules

# Fields are device arrays on a mesh, or host numpy while the rollout assembles them.
Arr = Array | np.ndarray

# Logical axes of each field: rows are the batch, tokens the sequence.
ROW = ('batch',)
ROW_TOKEN = ('batch', 'seq')


# Pytree container: its fields also hold shardings and ShapeDtypeStructs (for jit and AOT), so
# the shape annotations document it and the runtime checker skips it.
@typing.no_type_check
@flax.struct.dataclass
class Batch:
  tokens: Int[Arr, 'B T']
  loss_mask: Bool[Arr, 'B T']
  sample_logprobs: Float[Arr, 'B T']
  old_logprobs: Float[Arr, 'B T']
  ref_logprobs: Float[Arr, 'B T']
  advantages: Float[Arr, 'B T']
  returns: Float[Arr, 'B T']
  legal_moves: Int[Arr, 'B T']
  segment_ids: Int[Arr, 'B T']
  positions: Int[Arr, 'B T']
  rewards: Float[Arr, ' B']
  lengths: Int[Arr, ' B']
  group_ids: Int[Arr, ' B']
  valid: Bool[Arr, ' B']

  @property
  def num_rows(self) -> int:
    return self.tokens.shape[0]

  @property
  def bucket(self) -> int:
    return self.tokens.shape[1]

  @classmethod
  def logical_axes(cls) -> 'Batch':
    """The logical axis names of every field (a Batch of tuples)."""
    return cls(
      tokens=ROW_TOKEN,
      loss_mask=ROW_TOKEN,
      sample_logprobs=ROW_TOKEN,
      old_logprobs=ROW_TOKEN,
      ref_logprobs=ROW_TOKEN,
      advantages=ROW_TOKEN,
      returns=ROW_TOKEN,
      legal_moves=ROW_TOKEN,
      segment_ids=ROW_TOKEN,
      positions=ROW_TOKEN,
      rewards=ROW,
      lengths=ROW,
      group_ids=ROW,
      valid=ROW,
    )

  @classmethod
  def shardings(cls, mesh) -> 'Batch':
    """The train layout: rows split over data x fsdp, replicated over tensor."""
    axes = cls.logical_axes()
    return cls(**{f: rules.sharding(getattr(axes, f), mesh) for f in _FIELDS})

  @classmethod
  def zeros(cls, rows: int, bucket: int, *, xp=np) -> 'Batch':
    """An all-padding batch (host numpy by default); positions 0..T-1 in every row."""
    f = lambda shape, dtype: xp.zeros(shape, dtype)  # noqa: E731
    return cls(
      tokens=f((rows, bucket), xp.int32),
      loss_mask=f((rows, bucket), bool),
      sample_logprobs=f((rows, bucket), xp.float32),
      old_logprobs=f((rows, bucket), xp.float32),
      ref_logprobs=f((rows, bucket), xp.float32),
      advantages=f((rows, bucket), xp.float32),
      returns=f((rows, bucket), xp.float32),
      legal_moves=f((rows, bucket), xp.int32),
      segment_ids=f((rows, bucket), xp.int32),
      positions=xp.broadcast_to(xp.arange(bucket, dtype=xp.int32), (rows, bucket)) + 0,
      rewards=f((rows,), xp.float32),
      lengths=f((rows,), xp.int32),
      group_ids=f((rows,), xp.int32),
      valid=f((rows,), bool),
    )


_FIELDS = tuple(f.name for f in Batch.__dataclass_fields__.values())
