"""The multi-turn engine: recorded log-probs match a full forward, masks, growth, determinism,
and slot refill against lock-step."""

import jax
import jax.monitoring
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from earl_jax.config import BucketConfig, ModelConfig
from earl_jax.envs import base as envs
from earl_jax.models import hf_import, qwen2, tokenizer
from earl_jax.programs import Executables, StageSpec
from earl_jax.rollout import engine, sampler
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.testing import fixture_path, multiprocess, rollout_bodies, small_mesh

# Untied, so the fixture below can point the LM head at the digit tokens.
CFG = ModelConfig.preset('tiny-game').replace(tie_word_embeddings=False)
TOK = tokenizer.GameTokenizer()
DIGITS = [TOK.encode(str(d))[0] for d in range(1, 10)]


def _engine(
  *,
  mesh=None,
  cfg=CFG,
  tok=TOK,
  episodes=8,
  buckets=(128, 256, 512, 1024),
  max_new=1,
  temperature=1.0,
  reply_tokens=(),
  slots=None,
  refill=True,
  **env_kw,
):
  env = envs.EnvConfig(**{'game': 'tic_tac_toe', **env_kw})
  sampling = sampler.SamplingConfig(temperature=temperature, max_new_tokens=max_new)
  rollout = engine.RolloutConfig(
    num_episodes=episodes,
    num_slots=slots,
    refill=refill,
    sampling=sampling,
    reply_tokens=reply_tokens,
  )
  spec = StageSpec.for_rollout(rollout, tok, cfg.vocab_size)
  devices = None if mesh is None else list(mesh.devices.flat)
  programs = Executables(cfg, spec=spec, devices=devices)
  return engine.RolloutEngine(
    cfg, tok, env, rollout, BucketConfig(lengths=buckets), programs=programs
  )


def _full_logprobs(graphdef, params, mesh, tokens, temperature=1.0, token_ids=None):
  def fn(params, tokens):
    return qwen2.token_logprobs(nnx.merge(graphdef, params), tokens, temperature, token_ids)

  padded = np.zeros((tokens.shape[0], 1024), np.int32)
  padded[:, : tokens.shape[1]] = tokens
  with jax.set_mesh(mesh):
    return np.asarray(jax.jit(fn)(params, jnp.asarray(padded)))[:, : tokens.shape[1]]


@pytest.fixture(scope='module')
def digit_policy():
  """A random policy whose replies are (almost always) one digit, so games last several turns.

  Every embedding gets +4 on dimension 0, which makes the final hidden state's dimension 0
  reliably positive; the LM head maps dimension 0 onto the digit tokens only.
  """
  mesh = small_mesh(dp=2, tp=2)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=0)
  embed = np.array(params['embed_tokens'][...])
  embed[:, 0] += 4.0
  params['embed_tokens'][...] = jnp.asarray(embed)
  head = np.array(params['lm_head'][...])
  head[0, DIGITS] += 8.0
  params['lm_head'][...] = jnp.asarray(head)
  return mesh, graphdef, params


@pytest.mark.parametrize('temperature', [1.0, 0.7])
def test_logprobs_recorded_while_sampling_match_a_full_forward(digit_policy, temperature):
  mesh, graphdef, params = digit_policy
  traj = _engine(mesh=mesh, temperature=temperature).run(params, mesh, seed=3)
  full = _full_logprobs(graphdef, params, mesh, traj.tokens, temperature)
  m = traj.loss_mask
  assert m.any()
  np.testing.assert_allclose(traj.logprobs[m], full[m], atol=2e-4)
  assert (traj.logprobs[~m] == 0).all()


def test_reply_tokens_constrain_sampling_and_match_the_restricted_forward():
  """With reply_tokens, an untrained policy (mostly non-digits) only ever replies with them."""
  mesh = small_mesh(dp=2, tp=2)
  graphdef, params = qwen2.init_model(CFG, mesh, seed=1)
  allowed = ('2', '5', '9')
  eng = _engine(mesh=mesh, temperature=0.9, reply_tokens=allowed)
  assert eng.token_ids == tuple(sorted(TOK.encode(t)[0] for t in allowed))
  traj = eng.run(params, mesh, seed=5)
  m = traj.loss_mask
  assert set(np.unique(traj.tokens[m]).tolist()) <= set(eng.token_ids)
  assert m.sum() > traj.num_episodes  # several turns: the replies are legal cells most times
  full = _full_logprobs(graphdef, params, mesh, traj.tokens, 0.9, eng.token_ids)
  np.testing.assert_allclose(traj.logprobs[m], full[m], atol=2e-4)
  # The same replies under the unrestricted policy are far less likely.
  free = _full_logprobs(graphdef, params, mesh, traj.tokens, 0.9)
  assert (free[m] < traj.logprobs[m] - 0.5).all()
  free_traj = _engine(mesh=mesh, temperature=0.9).run(params, mesh, seed=5)
  assert not set(free_traj.tokens[free_traj.loss_mask].tolist()) <= set(eng.token_ids)


def test_thinking_turns_are_counted_per_episode():
  """With `think_depth`, a 't' reply is a turn that thinks instead of moving: the engine counts
  them from the environment's hints, and they match the replies the policy sampled."""
  mesh = small_mesh(dp=2, tp=2)
  _, params = qwen2.init_model(CFG, mesh, seed=2)
  eng = _engine(mesh=mesh, reply_tokens=('t', 'h'), think_depth=2, opponent='minimax')
  traj = eng.run(params, mesh, seed=1)
  think = TOK.encode('t')[0]
  for i in range(traj.num_episodes):
    thoughts, run = 0, 0
    for token in traj.tokens[i][traj.loss_mask[i]].tolist():
      if token == think and run < 2:  # a third 't' before a move plays the hint
        thoughts, run = thoughts + 1, run + 1
      else:
        run = 0
    assert traj.thoughts[i] == thoughts
  assert traj.thoughts.sum() > 0 and set(traj.outcomes) <= {'win', 'loss', 'draw'}
  stats = traj.context_stats()
  moves = sum(len(t) for t in traj.turn_tokens) - traj.thoughts.sum()
  assert stats['move_len_mean'] == pytest.approx(traj.lengths.sum() / moves)


@pytest.mark.parametrize(
  'reply_tokens, message',
  [
    (('1', '12'), "'12' encodes to 2 tokens"),
    (('1', '1'), 'duplicates'),
    (('1', ''), 'non-empty strings'),
  ],
)
def test_bad_reply_tokens_are_refused(reply_tokens, message):
  with pytest.raises(ValueError, match=message):
    _engine(reply_tokens=reply_tokens)


def test_loss_mask_covers_exactly_the_generated_tokens(digit_policy):
  mesh, _, params = digit_policy
  traj = _engine(mesh=mesh).run(params, mesh, seed=4)
  assert traj.loss_mask.sum() == traj.generated_tokens
  for i in range(traj.num_episodes):
    starts = traj.turn_starts[i]
    assert sum(traj.turn_tokens[i]) == traj.lengths[i]
    for k, start in enumerate(starts):
      end = starts[k + 1] if k + 1 < len(starts) else traj.lengths[i]
      turn = traj.tokens[i, start:end]
      gen = traj.loss_mask[i, start:end]
      # Template tokens first, then the one-token reply at the turn's end.
      assert gen.tolist() == [False] * (len(gen) - 1) + [True]
      assert turn[-1] in DIGITS
      n = 1
      prompt = turn[:-n].tolist()
      assert prompt[-1] == TOK.act_id  # the reply follows the compact template's <act>
      assert prompt[0] in (TOK.bos_id, TOK.obs_id, TOK.eot_id)
    assert not traj.loss_mask[i, traj.lengths[i] :].any()


@pytest.mark.parametrize('game', ['tic_tac_toe', 'connect_four'])
def test_legal_moves_label_each_reply_with_the_moves_its_board_allows(digit_policy, game):
  """Batch.legal_moves: at each reply's token, the bits of the moves legal on the board the turn's
  prompt shows (an empty cell, a column with room: read back from the text), 0 elsewhere;
  carried through `episode` / `assemble` and into the batch."""
  mesh, _, params = digit_policy
  kw = {'full_column_starts': 1.0} if game == 'connect_four' else {}
  traj = _engine(mesh=mesh, episodes=8, game=game, **kw).run(params, mesh, seed=2)
  seen = 0
  for i in range(traj.num_episodes):
    starts = [*traj.turn_starts[i], int(traj.lengths[i])]
    for k in range(len(starts) - 1):
      lo, hi = starts[k], starts[k + 1]
      reply = lo + np.flatnonzero(traj.loss_mask[i, lo:hi])[0]
      board = envs.grid_from_text(TOK.decode(traj.tokens[i, lo:reply], skip_special_tokens=True))
      allowed = board[0] == envs.EMPTY if game == 'connect_four' else board.ravel() == envs.EMPTY
      want = int(np.sum(allowed << np.arange(allowed.size)))
      assert traj.legal_moves[i, reply] == want, (i, k)
      seen += not allowed.all()
      others = np.delete(traj.legal_moves[i, lo:hi], reply - lo)
      assert not others.any()
    assert not traj.legal_moves[i, traj.lengths[i] :].any()
  assert seen > 0
  again = traj.assemble([traj.episode(i) for i in range(8)], [traj], group_size=1)
  np.testing.assert_array_equal(again.legal_moves, traj.legal_moves)
  batch = traj.to_batch(bucket=1024, rows=16)
  np.testing.assert_array_equal(batch.legal_moves[:8, : traj.tokens.shape[1]], traj.legal_moves)
  assert not batch.legal_moves[8:].any()


def test_rollout_is_deterministic_in_its_seed(digit_policy):
  mesh, _, params = digit_policy
  eng = _engine(mesh=mesh)
  a, b, c = (eng.run(params, mesh, seed=s) for s in (5, 5, 6))
  np.testing.assert_array_equal(a.tokens, b.tokens)
  assert a.outcomes == b.outcomes
  assert not np.array_equal(a.tokens, c.tokens) or a.tokens.shape != c.tokens.shape


def test_cache_grows_through_buckets_and_overflow_forfeits(digit_policy):
  mesh, _, params = digit_policy
  # A largest bucket of 40 tokens holds only the first turn (13-token prompt + 3 + ...).
  eng = _engine(mesh=mesh, buckets=(24, 40))
  traj = eng.run(params, mesh, seed=0)
  assert traj.cache_buckets[0] == 24
  assert set(traj.outcomes) <= {'overflow', 'invalid', 'win', 'loss', 'draw'}
  assert 'overflow' in traj.outcomes
  assert traj.lengths.max() <= 40
  grown = _engine(mesh=mesh, buckets=(24, 1024)).run(params, mesh, seed=0)
  assert grown.cache_buckets == [24, 1024] and 'overflow' not in grown.outcomes


def test_to_batch_pads_rows_and_tokens(digit_policy):
  mesh, _, params = digit_policy
  traj = _engine(mesh=mesh).run(params, mesh, seed=1)
  batch = traj.to_batch(bucket=256, rows=16)
  assert batch.tokens.shape == (16, 256) and batch.valid.sum() == 8
  np.testing.assert_array_equal(batch.tokens[:8, : traj.tokens.shape[1]], traj.tokens)
  assert not batch.loss_mask[8:].any() and (batch.rewards[8:] == 0).all()
  with pytest.raises(ValueError, match='shorter than the longest episode'):
    traj.to_batch(bucket=8, rows=16)


def test_qwen_chat_template_rollout_with_hf_tokenizer():
  """The HF path: Qwen chat template + the tiny HF checkpoint, lenient parsing."""
  mesh = small_mesh(dp=2, tp=2)
  model_dir = fixture_path('qwen2_tiny')
  cfg, graphdef, params = hf_import.load(model_dir, mesh)
  tok = tokenizer.load_tokenizer(model_dir)
  eng = _engine(mesh=mesh, cfg=cfg, tok=tok, episodes=4, buckets=(128, 256, 512), parse='lenient')
  traj = eng.run(params, mesh, seed=0)
  full = _full_logprobs(graphdef, params, mesh, traj.tokens)
  m = traj.loss_mask
  np.testing.assert_allclose(traj.logprobs[m], full[m], atol=2e-4)
  text = tok.decode(traj.tokens[0, : traj.lengths[0]].tolist())
  assert text.startswith('<|im_start|>system\n') and '<|im_start|>assistant\n' in text


def test_bad_inputs_are_refused_before_compiling():
  mesh = small_mesh(dp=4, tp=1)
  _, params = qwen2.init_model(CFG, mesh)
  eng = _engine(mesh=mesh, episodes=6)
  with pytest.raises(
    mesh_lib.ShardingError, match='num_episodes=6 is not divisible by the 4 batch shards'
  ):
    eng.run(params, mesh, seed=0)
  rollout = engine.RolloutConfig(sampling=sampler.SamplingConfig(max_new_tokens=64))
  programs = Executables(CFG, spec=StageSpec.for_rollout(rollout, TOK, CFG.vocab_size))
  with pytest.raises(ValueError, match='per-turn token limit'):
    engine.RolloutEngine(
      CFG, TOK, envs.EnvConfig(), rollout, BucketConfig(lengths=(32, 64)), programs=programs
    )
  with pytest.raises(ValueError, match='group_size=3 must be a positive divisor'):
    engine.RolloutConfig(num_episodes=8, group_size=3)


def test_token_returns_are_discounted_rewards_to_go(digit_policy):
  mesh, _, params = digit_policy
  traj = _engine(mesh=mesh, legal_move_reward=0.1).run(params, mesh, seed=2)
  gamma = 0.5
  returns = traj.token_returns(gamma)
  for i in range(traj.num_episodes):
    r = traj.turn_rewards[i]
    assert len(r) == len(traj.turn_starts[i])
    np.testing.assert_allclose(sum(r), traj.returns[i], rtol=1e-6)
    gen = np.flatnonzero(traj.loss_mask[i])  # one generated token per turn here
    expected = [sum(gamma ** (k - t) * r[k] for k in range(t, len(r))) for t in range(len(r))]
    np.testing.assert_allclose(returns[i, gen], expected, rtol=1e-6)
    assert (returns[i][~traj.loss_mask[i]] == 0).all()
  assert max(len(r) for r in traj.turn_rewards) > 1  # several turns were played


def test_move_rewards_recorded_per_turn_count_for_their_own_turn(digit_policy):
  mesh, _, params = digit_policy
  traj = _engine(mesh=mesh, legal_move_reward=0.1).run(params, mesh, seed=2)
  gamma = 0.5
  own = traj.token_returns(gamma, move_credit='own_turn')
  for i in range(traj.num_episodes):
    r, m = traj.turn_rewards[i], traj.turn_move_rewards[i]
    last_is_invalid = traj.outcomes[i] == 'invalid'
    np.testing.assert_allclose(
      m, [-1.0 if last_is_invalid and t == len(r) - 1 else 0.1 for t in range(len(r))], rtol=1e-6
    )
    o = [a - b for a, b in zip(r, m)]  # what the game gave: nothing for an invalid reply
    expected = [
      m[t] + sum(gamma ** (k - t) * o[k] for k in range(t, len(o))) for t in range(len(o))
    ]
    np.testing.assert_allclose(own[i, np.flatnonzero(traj.loss_mask[i])], expected, rtol=1e-6)
  assert 'invalid' in traj.outcomes and {'win', 'loss'} & set(traj.outcomes)


# -- slots: refill against lock-step --------------------------------------------------------------


def _same_episodes(a, b):
  """Token for token and log-prob for log-prob (float tolerance), in episode-id order."""
  np.testing.assert_array_equal(a.row_ids, b.row_ids)
  np.testing.assert_array_equal(a.lengths, b.lengths)
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  assert a.outcomes == b.outcomes and a.turn_rewards == b.turn_rewards
  np.testing.assert_array_equal(a.returns, b.returns)


@pytest.mark.parametrize('episodes, slots', [(12, 4), (10, 4)])
def test_refill_plays_the_episodes_of_lock_step_token_for_token(digit_policy, episodes, slots):
  """The same M episodes (M a multiple of B or not) on B slots, refilled as slots free up or in
  lock-step waves, and all M at once: identical episodes, since a token's randomness depends on
  (episode, turn, token index) alone; refill pads less and needs fewer calls."""
  mesh, _, params = digit_policy
  kw = {'mesh': mesh, 'episodes': episodes, 'temperature': 1.3}
  refill = _engine(slots=slots, **kw).run(params, mesh, seed=7)
  lock = _engine(slots=slots, refill=False, **kw).run(params, mesh, seed=7)
  at_once = _engine(**kw).run(params, mesh, seed=7)
  assert len(set(refill.lengths.tolist())) > 2  # episodes of very different lengths
  _same_episodes(refill, lock)
  _same_episodes(refill, at_once)
  assert refill.batch_rows == episodes and refill.num_episodes == episodes
  fast, slow = refill.rollout_stats, lock.rollout_stats
  assert fast['slots'] == slow['slots'] == slots
  assert fast['calls'] < slow['calls']
  assert fast['slot_occupancy'] > slow['slot_occupancy']
  assert fast['decode_padded'] < slow['decode_padded']
  assert 0 < fast['drain_calls'] < 1 and 0 <= fast['drain_occupancy'] <= 1
  assert (refill.episode_seconds > 0).all()


def test_refill_equals_lock_step_with_thinking_against_minimax():
  """Cohorts of a board game step as one batch (`BoardGameEnv.step_many`): minimax answers and
  thinking searches still draw each episode's own noise, so refill and lock-step agree."""
  mesh = small_mesh(dp=2, tp=2)
  _, params = qwen2.init_model(CFG, mesh, seed=2)
  kw = {
    'mesh': mesh,
    'episodes': 12,
    'slots': 4,
    'reply_tokens': ('t', 'h'),
    'think_depth': 2,
    'opponent': 'minimax',
    'minimax_depth': 2,
  }
  refill = _engine(**kw).run(params, mesh, seed=1)
  lock = _engine(refill=False, **kw).run(params, mesh, seed=1)
  _same_episodes(refill, lock)
  np.testing.assert_array_equal(refill.thoughts, lock.thoughts)
  assert refill.thoughts.sum() > 0 and refill.rollout_stats['calls'] < lock.rollout_stats['calls']


def test_refilling_slots_compiles_nothing_after_warm_up(digit_policy):
  """One program serves every slot: the slot a new episode takes is data, not a shape, so a
  rollout that refills slots over and over compiles nothing once its shapes were seen."""
  mesh, _, params = digit_policy
  eng = _engine(mesh=mesh, episodes=16, slots=4)
  first = eng.run(params, mesh, seed=3)
  compiled = eng.programs.compiles
  events = []

  def listen(event, duration, **kwargs):
    if event == '/jax/core/compile/backend_compile_duration':
      events.append(event)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    again = eng.run(params, mesh, seed=3)
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  _same_episodes(first, again)
  assert again.rollout_stats['calls'] > max(len(t) for t in again.turn_tokens)  # refills ran
  assert eng.programs.compiles == compiled and not events


def test_a_turn_puts_its_four_row_inputs_in_one_transfer_each(digit_policy, monkeypatch):
  """On one process a turn's inputs (prompt, num_prompt, episode_ids, turns) each go over in a
  single device_put, never one per device, and the key and end-of-turn id once per rollout."""
  mesh, _, params = digit_policy
  eng = _engine(mesh=mesh, episodes=8, slots=4)
  eng.run(params, mesh, seed=3)  # compiles, builds the cache ops
  puts = []
  device_put = jax.device_put

  def counted(x, *args, **kwargs):
    puts.append(np.shape(x))
    return device_put(x, *args, **kwargs)

  def per_device(*args):
    raise AssertionError('put one device at a time')

  monkeypatch.setattr(jax, 'device_put', counted)
  monkeypatch.setattr(mesh_lib, '_explicit', per_device)
  traj = eng.run(params, mesh, seed=3)
  calls = int(traj.rollout_stats['calls'])
  assert calls > 2 and len(puts) == 4 * calls + 2


def test_an_episode_that_outgrows_the_bucket_mid_refill_grows_the_cache(digit_policy):
  """A refilled batch whose episode outgrows the cache bucket moves to the next one, as a
  lock-step batch does; past the largest bucket the episode forfeits ('overflow')."""
  mesh, _, params = digit_policy
  kw = {'mesh': mesh, 'episodes': 12, 'slots': 4, 'temperature': 1.3}
  refill = _engine(buckets=(24, 48, 1024), **kw).run(params, mesh, seed=7)
  lock = _engine(buckets=(24, 48, 1024), refill=False, **kw).run(params, mesh, seed=7)
  assert refill.cache_buckets == [24, 48, 1024]
  _same_episodes(refill, lock)
  capped = _engine(buckets=(24, 48), **kw).run(params, mesh, seed=7)
  assert 'overflow' in capped.outcomes and capped.lengths.max() <= 48


@pytest.mark.parametrize(
  'kwargs, message',
  [
    ({'num_slots': 0}, 'num_slots must be None or an int >= 1'),
    ({'num_slots': -3}, 'num_slots must be None or an int >= 1'),
  ],
)
def test_bad_slot_settings_are_refused(kwargs, message):
  with pytest.raises(ValueError, match=message):
    engine.RolloutConfig(num_episodes=8, **kwargs)
  assert engine.RolloutConfig(num_episodes=8, num_slots=32).slots == 8


@pytest.mark.multiprocess
def test_two_processes_refilling_their_own_slots_play_the_episodes_of_one():
  """2 processes x 4 devices, each refilling its own slots from its own episodes (the rows of
  the whole batch its devices hold), play the episodes one process plays on all 8 devices."""
  kwargs = {'episodes': 16, 'slots': 8, 'layout': 'dp8', 'seed': 3}
  one = rollout_bodies.refill_rollout(**kwargs)
  two = multiprocess.run(
    'earl_jax.testing.rollout_bodies:refill_rollout',
    num_processes=2,
    devices_per_process=4,
    kwargs=kwargs,
  )
  assert [r['row_ids'] for r in two] == [list(range(8)), list(range(8, 16))]
  assert one['row_ids'] == list(range(16))
  merged = {k: two[0][k] + two[1][k] for k in ('lengths', 'tokens', 'outcomes')}
  assert merged == {k: one[k] for k in merged}
  got = np.concatenate([np.concatenate(r['logprobs']) for r in two])
  np.testing.assert_allclose(got, np.concatenate(one['logprobs']), atol=1e-5)
  assert two[0]['stats'] == two[1]['stats']  # every process logs the same statistics
  assert len(set(one['lengths'])) > 2
