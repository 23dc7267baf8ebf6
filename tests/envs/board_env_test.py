"""The batched board-game env: outcomes, rewards, penalties, turn order, determinism, text."""

import random

import numpy as np
import pytest

from earl_jax.envs import base, board_env, connect_four, opponents, registry, tic_tac_toe
from earl_jax.errors import ConfigError

C4, TTT = connect_four.ConnectFour(), tic_tac_toe.TicTacToe()


def _env(**changes) -> board_env.BoardGameEnv:
  env = registry.make_env(base.EnvConfig(**changes))
  assert isinstance(env, board_env.BoardGameEnv)
  return env


def _random_replies(env, rng):
  """A uniformly random legal move per episode, as text ('1' for finished episodes)."""
  legal = env.legal_mask()
  moves = np.argmax(np.where(legal, rng.random(legal.shape), -1.0), axis=1)
  return [env.action_text(int(m)) for m in moves]


def _play_out(env, n, seed, policy_seed=0):
  """Random agent until every episode ends; returns the first observations and every result."""
  rng = np.random.default_rng(policy_seed)
  first = env.reset(n, seed)
  results = []
  while not env.done.all():
    results.append(env.step(_random_replies(env, rng)))
  return first, results


def _grid(text):
  return base.grid_from_text(text)


def _counts(boards):
  return (boards == base.AGENT).sum(axis=(1, 2)), (boards == base.OPPONENT).sum(axis=(1, 2))


# Positions where the agent completes four with column 4 (text '4'), one per direction.
AGENT_WINS_WITH_4 = {
  'horizontal': '.......\n' * 4 + '....O..\nXXX.OO.\n',
  'vertical': '.......\n' * 3 + '...X...\n...XO..\n...XOO.\n',
  'diagonal_up_right': '.......\n' * 3 + '..XO...\n.XOX...\nXOOO...\n',
  'diagonal_down_right': '.......\n' * 3 + '...OX..\n...XOX.\n...OOOX\n',
}

# A full board with no four in a row: cell (r, c) is X when c + r // 2 is even.
FULL_NO_WINNER = np.array(
  [[1 if (c + r // 2) % 2 == 0 else -1 for c in range(7)] for r in range(6)], dtype=np.int8
)


@pytest.mark.parametrize('direction', list(AGENT_WINS_WITH_4))
def test_agent_wins_in_every_direction(direction):
  env = _env(opponent='greedy', win_reward=2.0)
  start = _grid(AGENT_WINS_WITH_4[direction])
  assert connect_four.winner(start[None]).tolist() == [0]
  env.reset(1, seed=0, start_boards=start[None])
  result = env.step(['4'])
  assert result.rewards.tolist() == [2.0]
  assert result.dones.tolist() == [True]
  info = result.infos[0]
  assert (info['outcome'], info['parsed_action'], info['legal']) == ('win', 3, True)
  assert info['opponent_action'] is None  # the game ended on the agent's move
  assert result.observations[0].endswith('win\n')
  final = base.grid_from_text(result.observations[0])
  assert connect_four.winner(final[None]).tolist() == [base.AGENT]
  assert (final != start).sum() == 1


def test_loss_when_the_opponent_completes_four():
  env = _env(opponent='greedy', loss_reward=-0.5)
  start = _grid('.......\n' * 4 + 'X......\nXOOO..X\n')
  env.reset(1, seed=0, start_boards=start[None])
  result = env.step(['7'])  # does not block column 5
  assert result.rewards.tolist() == [-0.5]
  assert result.dones.tolist() == [True]
  assert result.infos[0]['outcome'] == 'loss'
  assert result.infos[0]['opponent_action'] == 4
  assert result.observations[0].endswith('\nloss\n')
  final = base.grid_from_text(result.observations[0])
  assert final[5].tolist() == [1, -1, -1, -1, -1, 0, 1]


def test_draw_when_the_agent_fills_the_board():
  env = _env(draw_reward=0.25)
  start = FULL_NO_WINNER.copy()
  start[0, 0] = base.EMPTY
  env.reset(1, seed=0, start_boards=start[None])
  result = env.step(['1'])
  assert result.rewards.tolist() == [0.25]
  assert result.dones.tolist() == [True]
  assert result.infos[0]['outcome'] == 'draw'
  assert result.infos[0]['opponent_action'] is None
  assert result.observations[0].endswith('draw\n')


def test_draw_when_the_opponent_fills_the_board():
  env = _env(draw_reward=0.25, opponent='minimax', minimax_depth=2)
  start = FULL_NO_WINNER.copy()
  start[0, 0:2] = base.EMPTY
  env.reset(1, seed=0, start_boards=start[None])
  result = env.step(['1'])
  assert result.infos[0]['outcome'] == 'draw'
  assert result.infos[0]['opponent_action'] == 1
  assert result.rewards.tolist() == [0.25]
  np.testing.assert_array_equal(env.boards[0], FULL_NO_WINNER)


def test_a_full_column_is_an_invalid_reply_that_ends_the_episode():
  env = _env(invalid_penalty=-2.5)
  start = _grid('O......\nX......\n' * 3)
  env.reset(2, seed=0, start_boards=np.stack([start, start]))
  result = env.step(['1', '2'])
  assert result.rewards.tolist() == [-2.5, 0.0]
  assert result.dones.tolist() == [True, False]
  info = result.infos[0]
  assert (info['outcome'], info['parsed_action'], info['legal']) == ('invalid', 0, False)
  assert info['opponent_action'] is None
  assert result.observations[0] == C4.render(start[None])[0] + 'invalid\n'
  np.testing.assert_array_equal(env.boards[0], start)  # nothing was played
  assert result.infos[1]['legal'] and result.infos[1]['outcome'] is None


def test_episode_stats_count_distinct_moves_and_illegal_endings():
  """A stacker that plays into its full column (illegal), one that spreads over three columns
  and then says something that is not a move (invalid, not illegal), and one still running."""
  env = _env(opponent='random')
  start = _grid('.......\n' + 'O......\nX......\n' * 2 + 'X......\n')  # column 1: one free cell
  env.reset(3, seed=0, start_boards=np.stack([start] * 3))
  env.step(['1', '2', '2'])  # column 1 is full now for the first episode
  env.step(['1', '3', '3'])
  env.step(['5', 'x', '4'])
  stats = env.episode_stats()
  assert stats['distinct_moves_mean'].tolist() == [1.0, 2.0, 3.0]
  assert stats['illegal_rate'].tolist() == [1.0, 0.0, 0.0]
  assert env.outcomes[:2] == ['invalid', 'invalid']
  env.reset(2, seed=1)
  assert env.episode_stats()['distinct_moves_mean'].tolist() == [0.0, 0.0]  # a reset clears them


@pytest.mark.parametrize('observation', ['board', 'last_move'])
def test_show_legal_lists_the_legal_moves_of_running_episodes(observation):
  env = _env(show_legal=True, observation=observation)
  plain = _env(observation=observation)
  start = _grid('O......\nX......\n' * 3)  # column 1 is full
  open_start = np.zeros_like(start)
  first = env.reset(2, seed=0, start_boards=np.stack([start, open_start]))
  assert first[0].endswith('legal:234567\n') and first[1].endswith('legal:1234567\n')
  plain_first = plain.reset(2, seed=0, start_boards=np.stack([start, open_start]))
  assert [f.removesuffix(f.splitlines()[-1] + '\n') for f in first] == plain_first
  result = env.step(['1', '2'])  # episode 0: a full column ends it; no list after the outcome
  assert result.observations[0].endswith('invalid\n') and 'legal:' not in result.observations[0]
  legal = ''.join(str(a + 1) for a in np.flatnonzero(env.legal_mask()[1]))
  assert result.observations[1].endswith(f'legal:{legal}\n')


@pytest.mark.parametrize('show_legal', [False, True])
def test_show_illegal_lists_the_illegal_moves_only_when_there_are_some(show_legal):
  env = _env(show_illegal=True, show_legal=show_legal, observation='last_move')
  start = _grid('O......\nX......\n' * 3)  # column 1 is full
  full_1_and_7 = _grid('O.....O\nX.....X\n' * 3)
  open_start = np.zeros_like(start)
  first = env.reset(3, seed=0, start_boards=np.stack([start, full_1_and_7, open_start]))
  legal_line = ['legal:234567\n', 'legal:23456\n', 'legal:1234567\n'] if show_legal else [''] * 3
  assert first[0].endswith(legal_line[0] + 'illegal:1\n')
  assert first[1].endswith(legal_line[1] + 'illegal:17\n')
  assert first[2].endswith(legal_line[2]) and 'illegal' not in first[2]
  result = env.step(['1', '2', '3'])  # episode 0 ends (full column): no list after the outcome
  assert result.observations[0].endswith('invalid\n') and 'illegal' not in result.observations[0]
  assert result.observations[1].endswith('illegal:17\n')
  illegal = ''.join(str(a + 1) for a in np.flatnonzero(~env.legal_mask()[2]))
  assert ('illegal' in result.observations[2]) == bool(illegal)


@pytest.mark.parametrize(
  ('game', 'reply'),
  [
    ('connect_four', '0'),
    ('connect_four', '8'),
    ('connect_four', '44'),
    ('connect_four', 'four'),
    ('connect_four', ''),
    ('connect_four', '\uff14'),
    ('tic_tac_toe', '0'),
    ('tic_tac_toe', '5'),  # occupied (see below)
    ('tic_tac_toe', '10'),
  ],
)
def test_bad_replies_get_the_penalty(game, reply):
  env = _env(game=game, invalid_penalty=-3.0, agent_first='always')
  if game == 'tic_tac_toe':
    start = TTT.board_from_moves([4, 0])[None]
  else:
    start = None
  env.reset(1, seed=0, start_boards=start)
  result = env.step([reply])
  assert result.rewards.tolist() == [-3.0]
  assert result.dones.tolist() == [True]
  assert result.infos[0]['outcome'] == 'invalid'


def test_occupied_tic_tac_toe_cell_is_parsed_but_illegal():
  env = _env(game='tic_tac_toe')
  env.reset(1, seed=0, start_boards=TTT.board_from_moves([4, 0])[None])
  info = env.step(['5']).infos[0]
  assert (info['parsed_action'], info['legal'], info['outcome']) == (4, False, 'invalid')


def test_lenient_parsing_plays_chatty_replies():
  env = _env(parse='lenient', agent_first='always')
  env.reset(2, seed=0)
  result = env.step(['Let me think. Column 4 is the centre, so: 4', 'I play 9? No, 2.'])
  assert [i['parsed_action'] for i in result.infos] == [3, 1]
  assert all(i['legal'] for i in result.infos)
  assert env.boards[0, 5, 3] == env.boards[1, 5, 1] == base.AGENT


def test_arbitrary_replies_never_raise():
  rng = random.Random(0)
  pool = '0123456789 \n\t.,:;!?-abcXO\u0664\uff14\u00e9\U0001f600\x00\\'
  for game in ('connect_four', 'tic_tac_toe'):
    for parse in ('strict', 'lenient'):
      env = _env(game=game, parse=parse, opponent='greedy')
      env.reset(32, seed=1)
      outcomes = set()
      for _ in range(40):
        replies = [
          ''.join(rng.choice(pool) for _ in range(rng.choice([0, 1, 1, 2, 5, 40])))
          for _ in range(32)
        ]
        result = env.step(replies)
        outcomes |= {info['outcome'] for info in result.infos} - {None}
      assert env.done.all()
      assert outcomes <= {'win', 'loss', 'draw', 'invalid'}
      assert 'invalid' in outcomes


def test_finished_episodes_can_be_stepped_and_are_ignored():
  env = _env(agent_first='always', opponent='random')
  env.reset(3, seed=0)
  first = env.step(['x', '4', '4'])
  assert first.dones.tolist() == [True, False, False]
  assert [i['turn'] for i in first.infos] == [0, 0, 0]
  for turn in (1, 2):
    result = env.step(['4', '3', '5'])
    assert result.observations[0] == ''
    assert result.rewards[0] == 0.0
    assert result.dones[0]
    info = result.infos[0]
    assert info['ignored'] and info['outcome'] == 'invalid'
    assert info['parsed_action'] is None and not info['legal'] and info['turn'] == 1
    assert [i['ignored'] for i in result.infos[1:]] == [False, False]
    assert [i['turn'] for i in result.infos[1:]] == [turn, turn]
  assert env.turns.tolist() == [1, 3, 3]
  assert env.legal_moves()[0] == []
  assert len(env.legal_moves()[1]) > 0
  # A batch whose episodes have all ended can still be stepped.
  env.step(['x', 'x', 'x'])
  result = env.step(['1', '1', '1'])
  assert result.observations == ['', '', ''] and result.rewards.tolist() == [0.0, 0.0, 0.0]
  assert all(i['ignored'] for i in result.infos)


def test_episodes_end_at_different_times():
  env = _env(opponent='random')
  first, results = _play_out(env, 128, seed=3)
  assert len(first) == 128
  end_step = np.array([next(t for t, r in enumerate(results) if r.dones[i]) for i in range(128)])
  assert len(np.unique(end_step)) >= 5
  rewards = np.stack([r.rewards for r in results])  # [T, N]
  dones = np.stack([r.dones for r in results])
  assert (np.diff(dones.astype(int), axis=0) >= 0).all()  # once done, always done
  for i in range(128):
    assert (rewards[: end_step[i], i] == 0).all() and (rewards[end_step[i] + 1 :, i] == 0).all()
    assert results[end_step[i]].infos[i]['outcome'] is not None
    assert all(r.observations[i] == '' for r in results[end_step[i] + 1 :])
    assert env.turns[i] == end_step[i] + 1
  assert {'win', 'loss'} <= set(env.outcomes)
  outcome_rewards = {'win': 1.0, 'loss': -1.0, 'draw': 0.0, 'invalid': -1.0}
  np.testing.assert_array_equal(rewards.sum(0), [outcome_rewards[o] for o in env.outcomes])


@pytest.mark.parametrize('game', ['connect_four', 'tic_tac_toe'])
def test_agent_and_opponent_alternate(game):
  env = _env(game=game, opponent='random', agent_first='random')
  rng = np.random.default_rng(0)
  env.reset(64, seed=5)
  agent_first = env.agent_first
  assert 0 < agent_first.sum() < 64
  x, o = _counts(env.boards)
  np.testing.assert_array_equal(o - x, np.where(agent_first, 0, 1))
  while not env.done.all():
    running = ~env.done
    result = env.step(_random_replies(env, rng))
    x_next, o_next = _counts(env.boards)
    played = np.array([i['legal'] for i in result.infos])
    answered = np.array([i['opponent_action'] is not None for i in result.infos])
    np.testing.assert_array_equal(played, running)  # the random agent always plays legally
    np.testing.assert_array_equal(x_next - x, played.astype(int))
    np.testing.assert_array_equal(o_next - o, answered.astype(int))
    still = ~result.dones
    assert (answered[still]).all()  # a game goes on only after the opponent answered
    np.testing.assert_array_equal((o_next - x_next)[still], np.where(agent_first, 0, 1)[still])
    assert (np.abs(x_next - o_next) <= 1).all()
    x, o = x_next, o_next


def test_reset_is_deterministic_given_the_seed():
  def run(seed):
    env = _env(opponent='greedy')
    first, results = _play_out(env, 16, seed=seed, policy_seed=1)
    return first, [(r.observations, r.rewards.tolist(), r.infos) for r in results]

  assert run(7) == run(7)
  assert run(7) != run(8)


def test_an_episode_does_not_depend_on_the_other_episodes_replies():
  def run(replies_for_others):
    env = _env(opponent='random', agent_first='random')
    env.reset(4, seed=11)
    trace = []
    for turn in range(21):
      replies = [str(1 + (turn * 3) % 7), *replies_for_others(turn)]
      result = env.step(replies)
      trace.append((result.observations[0], result.rewards[0], result.infos[0]))
      if result.dones[0]:
        break
    return trace

  a = run(lambda turn: ['1', '2', '3'])
  b = run(lambda turn: ['nonsense', str(7 - turn % 7), '5'])
  assert a == b


def test_agent_first_modes():
  n = 200
  always = _env(agent_first='always')
  obs = always.reset(n, seed=0)
  assert all(o == '1234567\n' + '.......\n' * 6 for o in obs)
  assert always.agent_first.all()

  never = _env(agent_first='never')
  obs = never.reset(n, seed=0)
  x, o = _counts(never.boards)
  assert (x == 0).all() and (o == 1).all()
  assert all(text.count('O') == 1 and text.count('X') == 0 for text in obs)
  assert not never.agent_first.any()
  # The opponent's opening stone is on the bottom row.
  assert (never.boards[:, 5] == base.OPPONENT).sum() == n

  random_first = _env(agent_first='random')
  obs = random_first.reset(n, seed=0)
  agent_first = random_first.agent_first
  # A fair coin per episode: 100 expected, binomial sd 7.1, so 60..140 is over 5 sigma.
  assert 60 < agent_first.sum() < 140
  assert [text.count('O') for text in obs] == (~agent_first).astype(int).tolist()


@pytest.mark.parametrize('game', ['connect_four', 'tic_tac_toe'])
def test_random_openings_start_the_episodes_from_varied_positions(game):
  """k random moves a side before the agent's first reply, in turn from the first mover (who
  then plays its real move if it is the opponent): the agent to move, no game over, the same
  openings for the same seed and within a group, and without openings the draws of before."""
  n, k = 64, base.MAX_OPENING_MOVES[game]
  env = _env(game=game, opening_moves=k)
  env.reset(n, seed=3, group_size=2)
  x, o = _counts(env.boards)
  first = env.agent_first
  assert (x == k).all() and (o == np.where(first, k, k + 1)).all()
  g = env.game
  assert not (g.winner(env.boards) != 0).any() and not g.is_full(env.boards).any()
  boards = env.boards.copy()
  assert len({b.tobytes() for b in boards}) > n // 4  # varied, not one opening
  assert (boards[0::2] == boards[1::2]).all()  # a group shares its opening
  env.reset(n, seed=3, group_size=2)
  assert (env.boards == boards).all()
  # The openings are drawn after the first-move coins: the same episodes move first.
  plain = _env(game=game)
  plain.reset(n, seed=3, group_size=2)
  assert (plain.agent_first == first).all()
  with pytest.raises(ConfigError, match=rf'opening_moves must be an int in \[0, {k}\]'):
    base.EnvConfig(game=game, opening_moves=k + 1)


def test_full_column_starts_put_every_column_full_on_their_share_of_the_episodes():
  """With a share of 1 every training episode starts with one column full of alternating
  stones (the opponent's at the bottom, no line), every column in turn among 128 episodes, a
  group sharing its column; the agent cannot play it. With 0.25, about a quarter; the first-move
  coins are those of before; another game or a share out of [0, 1] is refused."""
  n = 128
  env = _env(full_column_starts=1.0, agent_first='always')
  env.reset(n, seed=5, group_size=2)
  g = env.game
  full = ~g.legal_mask(env.boards)
  assert (full.sum(axis=1) == 1).all()
  assert set(full.argmax(axis=1).tolist()) == set(range(7))
  assert (env.boards[0::2] == env.boards[1::2]).all()
  column = env.boards[np.arange(n), :, full.argmax(axis=1)]  # [n, rows], top row first
  assert (column[:, -1] == base.OPPONENT).all() and (column[:, -2] == base.AGENT).all()
  assert (np.abs(column.sum(axis=1)) == 0).all() and not (g.winner(env.boards) != 0).any()
  quarter = _env(full_column_starts=0.25)
  quarter.reset(1024, seed=5)
  started = (~g.legal_mask(quarter.boards)).any(axis=1)
  assert 0.18 < started.mean() < 0.32  # binomial sd 0.014
  plain = _env()
  plain.reset(1024, seed=5)
  assert (plain.agent_first == quarter.agent_first).all()
  with pytest.raises(ConfigError, match=r'full_column_starts must be in \[0, 1\], got 1.5'):
    base.EnvConfig(full_column_starts=1.5)
  with pytest.raises(ConfigError, match='full_column_starts is for connect_four'):
    base.EnvConfig(game='tic_tac_toe', full_column_starts=0.5)


def test_stacked_full_column_starts_are_a_stacking_games_position_with_the_agent_to_move():
  """'stack' plays the game a policy that stacks the drawn column plays against the opponent
  until the column is full: no line on the board, every agent stone in that column, the agent
  to move (as many stones each where it moved first, one more for the opponent otherwise), the
  opponent's last move on top of its column. Where four such games end first, the alternating
  column; that is rarer than not. A group shares its start."""
  n = 256
  for first in ('always', 'never'):
    env = _env(
      full_column_starts=1.0, full_column_fill='stack', observation='last_move', agent_first=first
    )
    obs = env.reset(n, seed=7, group_size=2)
    g, boards = env.game, env.boards
    assert (boards[0::2] == boards[1::2]).all()
    full = ~g.legal_mask(boards)
    assert (full.sum(axis=1) == 1).all() and not (g.winner(boards) != 0).any()
    column = full.argmax(axis=1)
    agent = (boards == base.AGENT).sum(axis=(1, 2))
    opponent = (boards == base.OPPONENT).sum(axis=(1, 2))
    assert (opponent - agent == (0 if first == 'always' else 1)).all()
    in_column = (boards[np.arange(n), :, column] == base.AGENT).sum(axis=1)  # [n]
    assert (in_column == agent).all()  # the stacker plays nowhere else (nor does the fallback)
    for i in range(n):
      if obs[i] == 'o:-\n':  # only the fallback's column, agent first, has no opponent move
        assert first == 'always' and agent[i] + opponent[i] == 6
        continue
      last = int(obs[i][2]) - 1
      top = np.flatnonzero(boards[i, :, last] != base.EMPTY)[0]
      assert boards[i, top, last] == base.OPPONENT
  # Agent first, a fallback is the only start with exactly the alternating column, the
  # opponent's stone at its bottom, and nothing else on the board (the stacker moves first).
  env = _env(full_column_starts=1.0, full_column_fill='stack', agent_first='always')
  env.reset(n, seed=7, group_size=2)
  boards = env.boards
  column = (~env.game.legal_mask(boards)).argmax(axis=1)
  alternating = np.where(np.arange(6) % 2 == 0, base.OPPONENT, base.AGENT)
  fallback = (boards[np.arange(n), ::-1, column] == alternating).all(axis=1) & (
    (boards != base.EMPTY).sum(axis=(1, 2)) == 6
  )
  assert 0.1 < fallback[0::2].mean() < 0.45  # 4 tries of about 0.28 each: 0.27, sd 0.04


def test_tic_tac_toe_observations():
  env = _env(game='tic_tac_toe', agent_first='never', opponent='minimax', minimax_depth=9)
  obs = env.reset(2, seed=0)
  assert all(len(o) == 12 and o.count('O') == 1 and o.count('.') == 8 for o in obs)
  result = env.step(['5', '1'])
  for text in result.observations:
    assert len(text) == 12 and text.count('X') == 1 and text.count('O') == 2


def test_last_move_observations():
  env = _env(observation='last_move', agent_first='random', opponent='random')
  obs = env.reset(64, seed=2)
  boards = env.boards
  for text, board, agent_first in zip(obs, boards, env.agent_first):
    if agent_first:
      assert text == 'o:-\n'
    else:
      column = int(np.flatnonzero(board[5] == base.OPPONENT)[0])
      assert text == f'o:{column + 1}\n'
  rng = np.random.default_rng(0)
  while not env.done.all():
    running = ~env.done
    result = env.step(_random_replies(env, rng))
    for i in np.flatnonzero(running):
      text, info = result.observations[i], result.infos[i]
      reply = info['opponent_action']
      move = 'o:-\n' if reply is None else f'o:{reply + 1}\n'
      ending = '' if info['outcome'] is None else info['outcome'] + '\n'
      assert text == move + ending


@pytest.mark.parametrize('game', ['connect_four', 'tic_tac_toe'])
@pytest.mark.parametrize('observation', ['board', 'last_move'])
@pytest.mark.parametrize('show_legal', [False, True])
def test_every_observation_uses_only_the_alphabet(game, observation, show_legal):
  show_illegal = show_legal  # both lists, or neither
  alphabet = set(base.ALPHABET)
  seen = set()
  longest = 0
  for parse, seed in (('strict', 0), ('lenient', 1)):
    env = _env(
      game=game,
      observation=observation,
      parse=parse,
      agent_first='random',
      show_legal=show_legal,
      show_illegal=show_illegal,
    )
    first, results = _play_out(env, 64, seed=seed)
    texts = first + [t for r in results for t in r.observations]
    # Force every ending: an invalid reply, then play out the rest.
    env.reset(8, seed=seed)
    texts += env.step(['x'] * 8).observations
    outcomes = {i['outcome'] for r in results for i in r.infos}
    assert {'win', 'loss'} <= outcomes
    for text in texts:
      seen |= set(text)
      longest = max(longest, len(text))
      assert set(text) <= alphabet, repr(text)
  if observation == 'board':
    assert {'X', 'O', '.'} <= seen
  else:
    assert {'o', ':', '-'} <= seen
  assert longest <= (64 if game == 'connect_four' else 20) + (34 if show_legal else 0)


def test_start_boards_are_validated():
  env = _env()
  with pytest.raises(ValueError, match=r'shape \(1, 3, 3\); expected \(1, 6, 7\)'):
    env.reset(1, 0, start_boards=np.zeros((1, 3, 3), np.int8))
  won = _grid('.......\n' * 2 + 'X......\n' * 4)
  with pytest.raises(ValueError, match=r'start_boards \[1\] are already won or full'):
    env.reset(2, 0, start_boards=np.stack([C4.empty_boards(1)[0], won]))
  with pytest.raises(ValueError, match='cells must be -1, 0 or'):
    env.reset(1, 0, start_boards=np.full((1, 6, 7), 2, np.int8))


def test_misuse_raises_clear_errors():
  env = _env()
  with pytest.raises(RuntimeError, match='reset'):
    env.step(['1'])
  with pytest.raises(RuntimeError, match='reset'):
    env.legal_mask()
  with pytest.raises(ValueError, match='positive number of episodes'):
    env.reset(0, 0)
  with pytest.raises(ValueError, match='non-negative int seed'):
    env.reset(1, -1)
  env.reset(2, 0)
  with pytest.raises(ValueError, match=r'one reply per episode \(2\), got 3 replies'):
    env.step(['1', '2', '3'])
  with pytest.raises(ValueError, match='a single str'):
    env.step('12')


def test_mismatched_game_and_config():
  with pytest.raises(ValueError, match='does not match'):
    board_env.BoardGameEnv(
      base.EnvConfig(game='tic_tac_toe'),
      connect_four.ConnectFour(),
      opponents.RandomOpponent(connect_four.ConnectFour()),
    )


def _win_rate(game, agent_first, n, seed):
  env = _env(game=game, agent_first=agent_first, opponent='random')
  _play_out(env, n, seed=seed, policy_seed=seed + 100)
  outcomes = env.outcomes
  return {o: outcomes.count(o) / n for o in ('win', 'loss', 'draw', 'invalid')}


def test_random_agent_against_random_opponent_statistics():
  # Random against random in Connect Four: the first player wins about 55.6% of games, the second
  # about 44.2%, 0.2% are drawn. Over 1000 games the standard error of a rate near 0.5 is 0.016;
  # the bounds below are about 4 standard errors wide on each side.
  first = _win_rate('connect_four', 'always', 1000, seed=0)
  assert 0.49 < first['win'] < 0.62, first
  assert first['invalid'] == 0 and first['draw'] < 0.02
  second = _win_rate('connect_four', 'never', 1000, seed=1)
  assert 0.38 < second['win'] < 0.51, second
  assert first['win'] > second['win']
  # Tic-Tac-Toe: the first player wins 58.5%, loses 28.8%, draws 12.7%.
  ttt = _win_rate('tic_tac_toe', 'always', 1000, seed=2)
  assert 0.52 < ttt['win'] < 0.65 and 0.22 < ttt['loss'] < 0.35 and 0.08 < ttt['draw'] < 0.18, ttt


def test_perfect_play_draws_tic_tac_toe_and_minimax_never_loses():
  game = tic_tac_toe.TicTacToe()
  env = _env(game='tic_tac_toe', opponent='minimax', minimax_depth=9, agent_first='random')
  env.reset(32, seed=0)
  while not env.done.all():
    running = np.flatnonzero(~env.done)
    values = opponents.minimax_values(game, env.boards[running], base.AGENT, 9)
    replies = ['1'] * 32
    for i, row in zip(running, values):
      replies[i] = env.action_text(int(np.argmax(row)))
    env.step(replies)
  assert set(env.outcomes) == {'draw'}

  env = _env(game='tic_tac_toe', opponent='minimax', minimax_depth=9, agent_first='random')
  _play_out(env, 300, seed=4)
  assert 'win' not in env.outcomes
  assert env.outcomes.count('loss') > 150


def test_groups_share_start_and_opponent_randomness():
  env = registry.make_env(
    base.EnvConfig(game='connect_four', opponent='random', agent_first='random')
  )
  obs = env.reset(8, seed=3, group_size=4)
  assert obs[0:4] == [obs[0]] * 4 and obs[4:8] == [obs[4]] * 4
  # Same replies inside a group: identical games; a different reply: a different game.
  replies = ['4', '4', '4', '1', '2', '2', '2', '2']
  for _ in range(3):
    env.step(replies)
  boards = env.boards
  np.testing.assert_array_equal(boards[0], boards[1])
  np.testing.assert_array_equal(boards[4], boards[7])
  assert not np.array_equal(boards[0], boards[3])
  with pytest.raises(ValueError, match='group_size=3 must be a positive divisor of n=8'):
    env.reset(8, seed=0, group_size=3)


def test_legal_move_reward_is_paid_per_legal_move():
  config = base.EnvConfig(game='connect_four', agent_first='always', legal_move_reward=0.25)
  env = registry.make_env(config)
  env.reset(3, seed=0)
  r1 = env.step(['1', 'x', '2']).rewards
  np.testing.assert_allclose(r1, [0.25, config.invalid_penalty, 0.25])
  r2 = env.step(['1', '1', '2']).rewards
  np.testing.assert_allclose(r2, [0.25, 0.0, 0.25])  # the ended episode earns nothing


def test_move_rewards_are_the_part_of_the_reward_the_reply_earned():
  # The agent stacks column 1 until its episode ends.
  config = base.EnvConfig(
    game='connect_four', agent_first='always', legal_move_reward=0.25, invalid_penalty=-2.0
  )
  env = registry.make_env(config)
  env.reset(2, seed=0)
  first = env.step(['1', 'x'])
  np.testing.assert_allclose(first.rewards, [0.25, -2.0])
  np.testing.assert_allclose(first.move_rewards, [0.25, -2.0])  # neither a win nor a loss
  result = first
  while not result.dones[0]:
    result = env.step(['1', '1'])
  outcome = result.infos[0]['outcome']
  move = -2.0 if outcome == 'invalid' else 0.25  # the column may have filled first
  game = {'win': 1.0, 'loss': -1.0, 'draw': 0.0, 'invalid': 0.0}[outcome]
  np.testing.assert_allclose(result.rewards[0], game + move)
  np.testing.assert_allclose(result.move_rewards[0], move)
  np.testing.assert_allclose(result.move_rewards[1], 0.0)  # ended: earns nothing


@pytest.mark.parametrize('game', ['connect_four', 'tic_tac_toe'])
def test_a_subset_of_rows_plays_the_same_games_as_the_whole_batch(game):
  """Each process of a multi-process rollout plays only its rows: row i must play exactly the
  game it plays in the full batch (same draws, same opponent moves), whatever else is played."""
  config = base.EnvConfig(game=game, opponent='random', agent_first='random')
  full, part = registry.make_env(config), registry.make_env(config)
  rows = [1, 4, 5, 7]
  obs_full = full.reset(8, seed=11, group_size=2)
  obs_part = part.reset(8, seed=11, group_size=2, rows=rows)
  assert part.num_envs == 4 and obs_part == [obs_full[i] for i in rows]
  rng = np.random.default_rng(0)
  for _ in range(full.max_turns):
    replies = [str(rng.integers(1, full.num_actions + 1)) for _ in range(8)]
    a = full.step(replies)
    b = part.step([replies[i] for i in rows])
    assert b.observations == [a.observations[i] for i in rows]
    np.testing.assert_array_equal(b.rewards, a.rewards[rows])
    np.testing.assert_array_equal(b.dones, a.dones[rows])
    np.testing.assert_array_equal(part.boards, full.boards[rows])
  with pytest.raises(ValueError, match=r'rows must be distinct episodes in \[0, 8\)'):
    part.reset(8, seed=0, rows=[1, 1])
  with pytest.raises(ValueError, match=r'rows must be distinct episodes in \[0, 8\)'):
    part.reset(8, seed=0, rows=[8])


def test_thinking_hints_the_move_of_a_search_one_ply_deeper_per_thought():
  """'t' plays nothing: the opponent waits, the reward is 0, and the answer is the move a
  minimax search of k + 1 plies would play after k thoughts, until the next move."""
  # The agent can win at once with column 4; the opponent threatens column 1.
  start = _grid('.......\n' * 3 + '...X...\nO..XO..\nO..XO..\n')
  env = _env(game='connect_four', opponent='greedy', think_depth=2)
  env.reset(1, seed=0, start_boards=start[None])
  r = env.step([' t '])
  assert r.observations == ['h2:4\n'] and r.rewards.tolist() == [0.0] and not r.dones[0]
  assert r.infos[0]['hint'] == 3 and r.infos[0]['parsed_action'] is None
  np.testing.assert_array_equal(env.boards[0], start)  # nobody moved
  r = env.step(['t'])
  assert r.observations == ['h3:4\n'] and r.infos[0]['hint'] == 3
  r = env.step(['t'])  # a third thought exceeds think_depth=2: it plays the last hint
  assert r.dones[0] and r.infos[0]['outcome'] == 'win' and r.infos[0]['hint'] is None
  assert r.infos[0]['parsed_action'] == 3 and r.rewards.tolist() == [env.config.win_reward]
  assert env.turns.tolist() == [3] and env.max_turns == 21 * 3


def test_thoughts_restart_at_two_plies_after_a_move_and_match_minimax():
  env = _env(game='connect_four', opponent='random', agent_first='always', think_depth=3)
  env.reset(16, seed=3)
  rng = np.random.default_rng(0)
  for _ in range(3):  # a few random moves, so the positions differ
    env.step(_random_replies(env, rng))
  running = np.flatnonzero(~env.done)
  for thoughts in (1, 2, 3):
    boards = env.boards
    replies = ['t' if i in running else '1' for i in range(16)]
    r = env.step(replies)
    values = opponents.minimax_values(env.game, boards[running], base.AGENT, thoughts + 1)
    for row, i in enumerate(running.tolist()):
      hint = r.infos[i]['hint']
      assert values[row, hint] == values[row].max()  # a best move of the (k + 1)-ply search
      assert r.observations[i] == f'h{thoughts + 1}:{hint + 1}\n'
  env.step(_random_replies(env, rng))  # a move: the next thought searches 2 plies again
  still = [i for i in running.tolist() if not env.done[i]]
  r = env.step(['t'] * 16)
  assert still and all(r.observations[i].startswith('h2:') for i in still)


def test_thinking_is_an_invalid_reply_when_it_is_off():
  env = _env(game='connect_four')
  env.reset(1, seed=0)
  r = env.step(['t'])
  assert r.dones[0] and r.infos[0]['outcome'] == 'invalid' and r.infos[0]['hint'] is None


def test_play_hint_plays_the_last_thought_or_a_one_ply_search():
  # Column 4 wins at once for the agent; a 1-ply search finds it.
  start = _grid('.......\n' * 3 + '...X...\nO..XO..\nO..XO..\n')
  env = _env(game='connect_four', opponent='greedy', think_depth=2)
  env.reset(2, seed=0, start_boards=np.stack([start, start]))
  r = env.step(['h', 't'])  # episode 0 plays a 1-ply search's move unthought
  assert r.infos[0]['parsed_action'] == 3 and r.infos[0]['outcome'] == 'win'
  assert r.observations[1] == 'h2:4\n'
  r = env.step(['1', 'h'])  # episode 1 plays its hint
  assert r.infos[1]['parsed_action'] == 3 and r.infos[1]['outcome'] == 'win'
  assert r.rewards.tolist() == [0.0, env.config.win_reward]
  off = _env(game='connect_four')  # without thinking 'h' is an unparseable reply
  off.reset(1, seed=0)
  assert off.step(['h']).infos[0]['outcome'] == 'invalid'


def test_a_thinking_policy_wins_more_often_the_longer_it_thinks():
  """What makes a policy learn to think: every thought is a ply, and deeper moves win more
  against a 2-ply minimax opponent (measured: 7, 26, 44 and 50 of 64 for 0-3 thoughts)."""
  wins = []
  for thoughts in (0, 1, 3):
    env = _env(game='connect_four', opponent='minimax', minimax_depth=2, think_depth=3)
    env.reset(64, seed=5)
    while not env.done.all():
      env.step(['t' if t < thoughts else 'h' for t in env.thoughts.tolist()])
    wins.append(sum(o == 'win' for o in env.outcomes))
  assert wins[0] + 10 < wins[1] < wins[2] - 10, wins


def test_step_many_equals_stepping_each_environment():
  """Several environments (cohorts of a rollout, started at different steps) stepped as one
  batch give each the results and the state its own `step` would: each draws its own noise."""
  config = {'opponent': 'minimax', 'minimax_depth': 2, 'think_depth': 2}
  replies = ['t', 'h', '4', 't', '9', 'h', 't']
  pairs = []
  for _ in range(2):
    envs = [_env(**config) for _ in range(3)]
    for k, (env, rows) in enumerate(zip(envs, ([0, 1, 2], [3], [4, 5, 6]))):
      env.reset(7, 11, rows=rows)
      for _ in range(k):  # the cohorts are at different turns
        env.step([replies[r] for r in rows])
    pairs.append(envs)
  rng = random.Random(0)
  for _ in range(4):
    texts = [[rng.choice(replies) for _ in range(env.num_envs)] for env in pairs[0]]
    batched = board_env.BoardGameEnv.step_many(pairs[0], texts)
    alone = [env.step(t) for env, t in zip(pairs[1], texts)]
    for a, b in zip(batched, alone):
      assert a.observations == b.observations and a.infos == b.infos
      np.testing.assert_array_equal(a.rewards, b.rewards)
      np.testing.assert_array_equal(a.dones, b.dones)
  for a, b in zip(*pairs):
    np.testing.assert_array_equal(a.boards, b.boards)
    assert a.outcomes == b.outcomes and (a.thoughts == b.thoughts).all()
    for name, values in a.episode_stats().items():
      np.testing.assert_array_equal(values, b.episode_stats()[name])


def test_a_match_plays_its_games_in_one_context():
  """With `series_games`, every episode plays that many games one after the other: a game that
  ends while the match goes on shows its final board and outcome, then the next game's first
  observation; each game's reward comes at its last step, and the episode ends after the last."""
  env = _env(series_games=3, agent_first='always')
  first, results = _play_out(env, 6, seed=5)
  assert first == C4.render(np.zeros((6, 6, 7), np.int8))
  assert env.done.all() and env.max_turns == 3 * 21
  stats = env.episode_stats()
  np.testing.assert_array_equal(stats['games_mean'], np.full(6, 3.0))
  outcomes = ('win', 'loss', 'draw', 'invalid')
  for i in range(6):
    steps = [r for r in results if not r.infos[i]['ignored']]
    ends = [r for r in steps if r.infos[i]['outcome'] in outcomes]
    assert len(ends) == 3 and steps[-1] is ends[-1]  # the match ends with its third game
    assert [r.dones[i] for r in steps].count(True) == 1
    for r in ends[:-1]:  # the final board, its outcome, then a fresh board (the agent starts)
      text = r.observations[i]
      outcome = r.infos[i]['outcome']
      final, fresh = text.split(f'{outcome}\n')
      assert final.startswith('1234567\n') and fresh == C4.render(np.zeros((1, 6, 7), np.int8))[0]
    rewards = {'win': 1.0, 'loss': -1.0, 'draw': 0.0, 'invalid': -1.0}
    assert sum(r.rewards[i] for r in steps) == sum(rewards[r.infos[i]['outcome']] for r in ends)
    assert stats['games_won_mean'][i] == sum(r.infos[i]['outcome'] == 'win' for r in ends)
    assert env.outcomes[i] == ends[-1].infos[i]['outcome']


def test_an_invalid_reply_forfeits_its_game_and_the_match_goes_on():
  env = _env(series_games=2, agent_first='always', invalid_penalty=-2.5)
  start = _grid('O......\nX......\n' * 3)
  env.reset(1, seed=0, start_boards=start[None])
  result = env.step(['1'])  # column 1 is full
  assert result.rewards.tolist() == [-2.5] and not result.dones[0]
  assert result.infos[0]['outcome'] == 'invalid'
  assert result.observations[0] == (
    C4.render(start[None])[0] + 'invalid\n' + C4.render(np.zeros((1, 6, 7), np.int8))[0]
  )
  assert env.outcomes == [None] and not env.boards.any()  # the second game has started
  assert env.episode_stats()['games_mean'].tolist() == [1.0]
  assert env.episode_stats()['illegal_rate'].tolist() == [1.0]


def test_a_reset_plays_fewer_games_of_the_match_and_refuses_more():
  env = _env(series_games=4)
  env.reset(4, seed=3, games=2)
  rng = np.random.default_rng(0)
  while not env.done.all():
    env.step(_random_replies(env, rng))
  assert env.episode_stats()['games_mean'].tolist() == [2.0] * 4
  for games in (0, 5):
    with pytest.raises(
      ValueError, match=r'games must be an int in \[1, EnvConfig.series_games=4\]'
    ):
      env.reset(4, seed=3, games=games)
  with pytest.raises(ConfigError, match=r'series_games must be an int in \[1, 256\], got 0'):
    base.EnvConfig(series_games=0)


def test_a_match_is_deterministic_and_a_subset_of_rows_plays_the_same_games():
  """A match draws a coin and an opening every step, so that a row's games depend only on
  (n, seed, row, its replies), as a single game's do: a process playing some rows plays them
  exactly, and the opponent moves first in some of the later games."""
  config = base.EnvConfig(series_games=5, opponent='random', agent_first='random')
  full, part, again = (registry.make_env(config) for _ in range(3))
  rows = [0, 3, 6]
  assert part.reset(8, seed=2, group_size=2, rows=rows) == [
    o for i, o in enumerate(full.reset(8, seed=2, group_size=2)) if i in rows
  ]
  again.reset(8, seed=2, group_size=2)
  rng = np.random.default_rng(1)
  openings = []  # the first board of every later game: empty, or the opponent's first move
  while not full.done.all():
    replies = [str(rng.integers(1, 8)) for _ in range(8)]
    a, b, c = full.step(replies), part.step([replies[i] for i in rows]), again.step(replies)
    assert b.observations == [a.observations[i] for i in rows] and c.observations == a.observations
    np.testing.assert_array_equal(b.rewards, a.rewards[rows])
    for text, done in zip(a.observations, a.dones):
      if text.count('1234567\n') == 2 and not done:
        openings.append(text.split('1234567\n')[-1].count('O'))
  assert set(openings) == {0, 1}  # each side opened some of the later games
  np.testing.assert_array_equal(part.episode_stats()['games_mean'], np.full(3, 5.0))


def test_step_many_equals_stepping_each_match():
  config = {'series_games': 3, 'agent_first': 'random'}
  pairs = []
  for _ in range(2):
    envs = [_env(**config) for _ in range(2)]
    envs[0].reset(4, 9, rows=[0, 1])
    envs[1].reset(4, 9, rows=[2, 3])
    pairs.append(envs)
  rng = np.random.default_rng(0)
  while not all(e.done.all() for e in pairs[0]):
    texts = [[str(rng.integers(1, 8)) for _ in range(2)] for _ in range(2)]
    batched = board_env.BoardGameEnv.step_many(pairs[0], texts)
    alone = [env.step(t) for env, t in zip(pairs[1], texts)]
    for a, b in zip(batched, alone):
      assert a.observations == b.observations and a.infos == b.infos
      np.testing.assert_array_equal(a.rewards, b.rewards)
  for a, b in zip(*pairs):
    for name, values in a.episode_stats().items():
      np.testing.assert_array_equal(values, b.episode_stats()[name])


@pytest.mark.parametrize(
  'changes',
  [
    {},
    {'show_legal': True, 'show_illegal': True},
    {'series_games': 4, 'show_illegal': True},
    {'series_games': 4, 'show_legal': True, 'agent_first': 'never'},
    {'game': 'tic_tac_toe', 'series_games': 4, 'show_legal': True, 'show_illegal': True},
    {'observation': 'last_move', 'series_games': 3, 'think_depth': 2},
  ],
)
def test_no_observation_is_longer_than_the_longest_observation(changes):
  """What the prompt buckets are checked against (`ExperimentConfig.check_tokenizer`) bounds
  every observation random play meets, and is met by some observation of the running game."""
  env = _env(**changes)
  bound = len(env.longest_observation())
  rng = np.random.default_rng(0)
  seen = env.reset(16, seed=4)
  while not env.done.all():
    replies = _random_replies(env, rng)
    if env.config.think_depth:
      replies = [r if rng.random() < 0.7 else base.THINK for r in replies]
    seen += env.step(replies).observations
  assert max(len(o) for o in seen) <= bound
