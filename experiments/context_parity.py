"""The model on context-parallel layouts against the unsplit model: logits and gradients (issue 44).

  python experiments/context_parity.py --out=runs/context_parity
  python experiments/context_parity.py --layouts=dp2.cp4 --pads=0    # one layout (seconds)

The committed tiny HF Qwen2 checkpoint (`tests/fixtures/qwen2_tiny`), float32, on each layout of
--layouts over 8 fake CPU devices, against the same weights on a mesh of its data ways alone (the
sequence unsplit): the logits of the fixture's reference tokens (rows repeated to fill the batch
shards), and the value and gradients of sum(token log-probs x fixed random weights), the
quantity a policy-gradient loss differentiates. Each --pads entry appends that many tokens, so
that T = 32 runs in zig-zag order (2 cp divides it) and T = 36 over cp = 4 in the contiguous one;
a layout whose cp does not divide a T is skipped there, and said so.
Each also packed: every row two sequences (13 and T - 13 tokens, positions from 0 in each,
attention within each), compared by their token log-probs. Per row: the largest absolute
difference of the logits (packed: the log-probs), the loss's relative difference, and the largest
gradient difference over each parameter's own scale (its largest absolute value, at least 1).

Writes <out>/context_parity.json (every row, the flags, date, JAX version) and prints the table.
"""

import datetime
import json
import os

import numpy as np
from absl import flags

from earl_jax import runtime

_LAYOUTS = flags.DEFINE_list(
  'layouts', ['dp2.cp4', 'dp2.tp2.cp2', 'dp1.cp8'], 'Context-parallel layouts (cp > 1).'
)
_PADS = flags.DEFINE_list('pads', ['0', '4'], 'Tokens appended to the 32 reference tokens.')
_OUT = flags.DEFINE_string('out', 'runs/context_parity', 'Output folder.')


def _measure(parallel, pad: int, packed: bool) -> dict:
  """One layout against its data ways alone, at 32 + pad tokens (`packed`: each row two
  sequences of 13 and T - 13 tokens, each with positions from 0, attending within itself)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from earl_jax.models import context_attention, hf_import, qwen2
  from earl_jax.testing import fixture_path, small_mesh

  reference = np.load(fixture_path('qwen2_tiny_reference.npz'))['tokens']
  shards = parallel.dp * parallel.fsdp
  rows = -(-reference.shape[0] // shards) * shards
  tokens = np.pad(np.resize(reference, (rows, reference.shape[1])), ((0, 0), (0, pad)), 'wrap')
  tokens = jnp.asarray(tokens)
  weights = jnp.asarray(np.random.default_rng(0).standard_normal(tokens.shape), jnp.float32)
  T = tokens.shape[1]
  if packed:
    first = np.arange(T) < 13
    segment_ids = jnp.broadcast_to(jnp.asarray(np.where(first, 1, 2)), tokens.shape)
    positions = jnp.broadcast_to(
      jnp.asarray(np.where(first, np.arange(T), np.arange(T) - 13)), tokens.shape
    )
    segments = (segment_ids, positions)
  else:
    segments = None

  def run(mesh):
    _, graphdef, state = hf_import.load(fixture_path('qwen2_tiny'), mesh)

    def logits(state):  # unpacked: the logits; packed: the token log-probs
      model = nnx.merge(graphdef, state)
      if packed:
        return qwen2.token_logprobs(model, tokens, segments=segments)
      hidden, _ = model(tokens, jnp.broadcast_to(jnp.arange(T), tokens.shape))
      return model.logits(hidden)

    def loss(state):
      logprobs = qwen2.token_logprobs(nnx.merge(graphdef, state), tokens, segments=segments)
      return jnp.sum(logprobs * weights)

    with jax.set_mesh(mesh):
      out = jax.jit(logits)(state)
      value, grads = jax.jit(jax.value_and_grad(loss))(state)
    return np.asarray(out), float(value), [np.asarray(g) for g in jax.tree.leaves(grads)]

  split = run(small_mesh(dp=parallel.dp, fsdp=parallel.fsdp, tp=parallel.tp, cp=parallel.cp))
  whole = run(small_mesh(dp=parallel.dp, fsdp=parallel.fsdp))
  grads = [
    float(np.max(np.abs(a - b)) / max(1.0, float(np.max(np.abs(b)))))
    for a, b in zip(split[2], whole[2])
  ]
  return {
    'layout': parallel.name,
    'tokens': int(tokens.shape[1]),
    'zigzag': context_attention.uses_zigzag(int(tokens.shape[1]), parallel.cp),
    'packed': packed,
    'logits_max_abs_diff': float(np.max(np.abs(split[0] - whole[0]))),
    'logits_max_abs': float(np.max(np.abs(whole[0]))),
    'loss_rel_diff': abs(split[1] - whole[1]) / abs(whole[1]),
    'grad_max_rel_diff': max(grads),
  }


def main(argv):
  del argv
  runtime.setup(cpu_devices=8)
  import jax

  from earl_jax.config import ParallelConfig
  from earl_jax.errors import UserError

  layouts = [ParallelConfig.parse(name) for name in _LAYOUTS.value]
  for parallel in layouts:
    if parallel.cp < 2 or parallel.num_devices != 8:
      raise UserError(
        f'--layouts: {parallel.name} is not a context-parallel layout of 8 devices; expected '
        'cp > 1 and dp x fsdp x cp x tp = 8, e.g. dp2.cp4.'
      )
  try:
    pads = [int(p) for p in _PADS.value]
  except ValueError:
    raise UserError(f'--pads={",".join(_PADS.value)}: expected ints >= 0, e.g. 0,4.') from None
  if any(p < 0 for p in pads):
    raise UserError(f'--pads={",".join(_PADS.value)}: expected ints >= 0, e.g. 0,4.')
  # The fixture's 32 reference tokens plus each pad, where cp divides it.
  pairs = [(parallel, pad) for parallel in layouts for pad in pads if (32 + pad) % parallel.cp == 0]
  skipped = [
    f'{parallel.name} at T = {32 + pad}: cp = {parallel.cp} does not divide it'
    for parallel in layouts
    for pad in pads
    if (32 + pad) % parallel.cp
  ]
  rows = [_measure(parallel, pad, packed) for parallel, pad in pairs for packed in (False, True)]
  print(
    '| layout | T | order | rows | logits (packed: log-probs) max abs diff | loss rel diff | '
    'grads max diff / scale |'
  )
  print('|---|---:|---|---|---:|---:|---:|')
  for r in rows:
    order = 'zig-zag' if r['zigzag'] else 'contiguous'
    kind = 'packed 13 + T-13' if r['packed'] else 'one sequence'
    print(
      f'| {r["layout"]} | {r["tokens"]} | {order} | {kind} | {r["logits_max_abs_diff"]:.1e} (of '
      f'{r["logits_max_abs"]:.1f}) | {r["loss_rel_diff"]:.1e} | {r["grad_max_rel_diff"]:.1e} |'
    )
  for reason in skipped:
    print(f'skipped: {reason}')
  os.makedirs(_OUT.value, exist_ok=True)
  result = {
    'rows': rows,
    'skipped': skipped,
    'flags': {'layouts': _LAYOUTS.value, 'pads': pads},
    'date': datetime.date.today().isoformat(),
    'jax': jax.__version__,
  }
  with open(os.path.join(_OUT.value, 'context_parity.json'), 'w') as f:
    json.dump(result, f, indent=2)
  print(f'wrote {_OUT.value}/context_parity.json')


if __name__ == '__main__':
  runtime.run(main)
