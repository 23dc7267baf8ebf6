"""The warm start's programs: the next-token loss of an `SFTBatch` and one AdamW update on it.

`earl_jax.programs.builders` builds them as the train and experience programs of objective
'sft' (`ProgramKey.objective`), so that the warm start compiles, caches and sizes them through
the same `Executables` as the RL job's stage programs:

  key = exe.key(Stage.TRAIN, layout, bucket=320, rows=32, objective='sft')
  state, out = exe.get(key)(state, batch)          # `sft_step`, the state donated
  sums = exe.get(exe.key(Stage.EXPERIENCE, layout, 320, 32, objective='sft'))(params, batch)

Dimension letters as in `earl_jax.config`.
"""

import typing
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Float, Int

from earl_jax.models import qwen2
from earl_jax.rl import train_step
from earl_jax.sharding import rules


# Pytree container: its fields also hold shardings and ShapeDtypeStructs (for jit and AOT), so
# the shape annotations document it and the runtime checker skips it.
@typing.no_type_check
@flax.struct.dataclass
class SFTBatch:
  tokens: Int[Array | np.ndarray, 'B T']
  loss_mask: Bool[Array | np.ndarray, 'B T']

  @property
  def bucket(self) -> int:
    return self.tokens.shape[1]

  @classmethod
  def shardings(cls, mesh: jax.sharding.Mesh) -> 'SFTBatch':
    """Rows split over data x fsdp, replicated over tensor (the RL batch's train layout)."""
    sharding = rules.sharding(('batch', 'seq'), mesh)
    return cls(tokens=sharding, loss_mask=sharding)

  @classmethod
  def abstract(cls, rows: int, bucket: int, shardings: 'SFTBatch') -> 'SFTBatch':
    return cls(
      tokens=jax.ShapeDtypeStruct((rows, bucket), jnp.int32, sharding=shardings.tokens),
      loss_mask=jax.ShapeDtypeStruct((rows, bucket), jnp.bool_, sharding=shardings.loss_mask),
    )


def sft_loss(
  params: nnx.State, graphdef: nnx.GraphDef, batch: SFTBatch
) -> tuple[Float[Array, ''], dict[str, Float[Array, '']]]:
  """The mean negative log-likelihood of the masked tokens (every reply token weighs the same),
  with the sum and the count it divides."""
  model = nnx.merge(graphdef, params)
  logp = qwen2.token_logprobs(model, batch.tokens)  # column t: log p(tokens[t] | tokens[:t])
  weights = batch.loss_mask.astype(jnp.float32)
  nll_sum, tokens = -jnp.sum(logp * weights), jnp.sum(weights)
  return nll_sum / jnp.maximum(tokens, 1.0), {'nll_sum': nll_sum, 'tokens': tokens}


def sft_step(
  state: train_step.TrainState,
  batch: SFTBatch,
  *,
  graphdef: nnx.GraphDef,
  optimizer: Any,
) -> tuple[train_step.TrainState, dict[str, Float[Array, '']]]:
  """One AdamW update on the batch's loss (skipped, as in RL, when anything is not finite)."""
  grad_fn = jax.value_and_grad(sft_loss, has_aux=True)
  (loss, aux), grads = grad_fn(state.params, graphdef, batch)
  state, grad_norm, finite = train_step.apply_gradients(state, loss, grads, optimizer)
  return state, {
    'loss': loss,
    'grad_norm': grad_norm,
    'finite': finite.astype(jnp.float32),
    'loss_tokens': aux['tokens'],
  }
