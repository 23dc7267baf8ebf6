"""How many updates the game model needs to read which columns are full, taught directly.

  python experiments/board_reading.py                     # the default's model, 150 updates
  python experiments/board_reading.py --steps=300 --learning_rate=1e-2 --out=reading.json
  python experiments/board_reading.py --model_set=num_layers=3,num_heads=8

The default preset's greedy policy stacks one column and loses a third of its games by playing
into it once it is full (docs/results/main-job.md, "Where the default plateaus"). This asks
whether its model can read that state from the board text at all, and how fast, with the
label given outright rather than earned by reward: Connect Four games against the random
opponent, the agent stacking a column of its own (`--stack`) or else playing a random legal
one, are turned into the rollout's token rows (`tokenizer.conversation_ids`, the default's
board observation), and every agent reply is labelled with the columns that are full there.
The model (`--model`, from scratch) is trained on -log(1 - p(full)), p(full) the probability
its column-digit policy (the default's replies constrained to '1'..'7') gives the full
columns, on the games that have a full column at some reply. Printed and written to `--out`
every `--every` updates: p(full) averaged over the held-out replies that have a full column
(1/7 a full column for a uniform policy), and over the training batch.

One device; the games are fixed by `--seed`.
"""

import json
import os
import time

import numpy as np
from absl import flags, logging

from earl_jax import config_cli, runtime

_MODEL = flags.DEFINE_string('model', 'tiny-game', 'Model preset (from scratch).')
_MODEL_SET = flags.DEFINE_list(
  'model_set',
  [],
  "ModelConfig fields to change, as name=value (e.g. 'num_layers=3').",
)
_STEPS = flags.DEFINE_integer('steps', 150, 'Updates.', lower_bound=1)
_BATCH = flags.DEFINE_integer('batch', 64, 'Games an update.', lower_bound=1)
_GAMES = flags.DEFINE_integer(
  'games', 512, 'Training games (each with a full column).', lower_bound=1
)
_HELDOUT = flags.DEFINE_integer('heldout', 64, 'Held-out games.', lower_bound=1)
_BUCKET = flags.DEFINE_integer(
  'bucket', 1024, 'Tokens a row (a game is cut there).', lower_bound=128
)
_STACK = flags.DEFINE_float(
  'stack', 0.7, 'Chance that an agent move plays its own column while it is legal.', lower_bound=0
)
_LR = flags.DEFINE_float('learning_rate', 3e-3, 'Adam rate (the default preset: 3e-3).')
_EVERY = flags.DEFINE_integer('every', 25, 'Updates between reports.', lower_bound=1)
_SEED = flags.DEFINE_integer('seed', 0, 'Seed of the games and of the model.')
_OUT = flags.DEFINE_string('out', None, 'JSON output (default: none).')


def main(argv):
  del argv
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  runtime.setup(cpu_devices=1)
  import jax
  import jax.numpy as jnp
  import optax
  from flax import nnx

  from earl_jax.config import ModelConfig
  from earl_jax.evaluation import board_eval, code_eval
  from earl_jax.models import qwen2
  from earl_jax.models import tokenizer as tokenizer_lib

  pairs = [item.partition('=')[::2] for item in _MODEL_SET.value]
  cfg = config_cli.apply_overrides(ModelConfig.preset(_MODEL.value), pairs, flag='model_set')
  tokenizer = tokenizer_lib.load_tokenizer('game')
  digits = jnp.asarray([tokenizer.encode(str(c + 1))[0] for c in range(7)])
  train_x, train_full = board_eval.full_column_rows(
    _GAMES.value, _SEED.value, _BUCKET.value, _STACK.value
  )
  test_x, test_full = board_eval.full_column_rows(
    _HELDOUT.value, _SEED.value + 1, _BUCKET.value, _STACK.value
  )
  print(
    f'replies with a full column: {int((train_full > 0).sum())} in {_GAMES.value} training '
    f'games, {int((test_full > 0).sum())} in {_HELDOUT.value} held-out',
    flush=True,
  )
  with jax.set_mesh(code_eval.eval_mesh()):  # the one device
    graphdef, params = nnx.split(qwen2.Qwen2(cfg, rngs=nnx.Rngs(_SEED.value)))
  optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(_LR.value))
  opt_state = optimizer.init(params)

  def full_mass(params, tokens, full):
    """(the loss, p(full) averaged over the replies that have a full column)."""
    model = nnx.merge(graphdef, params)
    B, T = tokens.shape
    h, _ = model(tokens, jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)))
    # The hidden state before a reply predicts it: the policy over the 7 column digits.
    logp = jax.nn.log_softmax(model.logits(h[:, :-1])[..., digits], axis=-1)  # [B, T-1, 7]
    bits = (full[:, 1:, None] >> jnp.arange(7)) & 1
    labelled = (full[:, 1:] > 0).astype(jnp.float32)
    log_full = jax.nn.logsumexp(jnp.where(bits > 0, logp, -1e30), axis=-1)
    log_full = jnp.where(labelled > 0, log_full, -1e30)
    loss = -jnp.log(jnp.maximum(-jnp.expm1(log_full), 1e-6))  # -log(1 - p(full))
    count = jnp.maximum(jnp.sum(labelled), 1.0)
    return jnp.sum(loss * labelled) / count, jnp.sum(jnp.exp(log_full) * labelled) / count

  @jax.jit
  def update(params, opt_state, tokens, full):
    (_, mass), grads = jax.value_and_grad(full_mass, has_aux=True)(params, tokens, full)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, mass

  heldout = jax.jit(lambda p: full_mass(p, test_x, test_full)[1])
  rng = np.random.default_rng(_SEED.value)
  records, start, train_mass = [], time.perf_counter(), None
  for step in range(_STEPS.value + 1):
    if step % _EVERY.value == 0 or step == _STEPS.value:
      record = {'step': step, 'heldout_p_full': float(heldout(params))}
      if train_mass is not None:  # the last update's batch
        record['train_p_full'] = float(train_mass)
      records.append(record)
      print(
        f'step {step:4d} | held-out p(full) {record["heldout_p_full"]:.3f} | '
        f'{time.perf_counter() - start:.0f} s',
        flush=True,
      )
    if step == _STEPS.value:
      break
    rows = rng.choice(len(train_x), min(_BATCH.value, len(train_x)), replace=False)
    params, opt_state, train_mass = update(params, opt_state, train_x[rows], train_full[rows])
  if _OUT.value:
    with open(_OUT.value + '.tmp', 'w') as f:
      settings = {f.name: f.value for f in flags.FLAGS.get_flags_for_module(__name__)}
      json.dump({'flags': settings, 'records': records}, f)
    os.replace(_OUT.value + '.tmp', _OUT.value)
    print(f'wrote {_OUT.value}', flush=True)


if __name__ == '__main__':
  runtime.run(main)
