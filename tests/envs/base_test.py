"""The env API: config validation, reply parsing, rendering, the factory, the alphabet."""

import numpy as np
import pytest

from earl_jax.envs import base, connect_four


def test_alphabet_is_the_tokenizer_character_set():
  assert len(set(base.ALPHABET)) == len(base.ALPHABET) == 44
  assert set(base.ALPHABET) == set('0123456789abcdefghijklmnopqrstuvwxyz') | set('XO .\n|:-')


def test_config_defaults():
  config = base.EnvConfig()
  assert (config.game, config.opponent, config.minimax_depth) == ('connect_four', 'random', 4)
  assert (config.win_reward, config.draw_reward, config.loss_reward) == (1.0, 0.0, -1.0)
  assert config.invalid_penalty == -1.0
  assert (config.agent_first, config.observation, config.parse) == ('random', 'board', 'strict')
  assert config.show_legal is False
  assert config.show_illegal is False
  assert config.think_depth == 0
  assert config.replace(opponent='greedy').opponent == 'greedy'


def _validate(**changes):
  """Runs EnvConfig's own validation on a config holding `changes`.

  Tests install a runtime type checker that rejects a value outside a Literal before
  `__post_init__` runs; in production (no checker) `__post_init__` is what the user meets, so its
  messages are tested directly here.
  """
  config = base.EnvConfig()
  for field, value in changes.items():
    object.__setattr__(config, field, value)
  config.__post_init__()


@pytest.mark.parametrize(
  ('field', 'value', 'known'),
  [
    ('game', 'chess', "['connect_four', 'tic_tac_toe']"),
    ('opponent', 'alphazero', "['random', 'greedy', 'minimax']"),
    ('agent_first', 'sometimes', "['always', 'never', 'random']"),
    ('observation', 'pixels', "['board', 'last_move']"),
    ('parse', 'fuzzy', "['strict', 'lenient']"),
  ],
)
def test_config_rejects_unknown_choices_listing_the_known_ones(field, value, known):
  with pytest.raises(ValueError, match=rf'EnvConfig.{field}=.*{value}.*known values: ') as err:
    _validate(**{field: value})
  assert known in str(err.value)
  # Constructing it fails too (the type checker, or in production the same ValueError).
  with pytest.raises((ValueError, TypeError)):
    base.EnvConfig(**{field: value})


@pytest.mark.parametrize('depth', [0, 10, -1, True, 2.0])
def test_config_rejects_bad_minimax_depth(depth):
  with pytest.raises(ValueError, match=r'minimax_depth must be an int in \[1, 9\]'):
    _validate(minimax_depth=depth)
  with pytest.raises((ValueError, TypeError)):
    base.EnvConfig(minimax_depth=depth)


@pytest.mark.parametrize('field', ['win_reward', 'draw_reward', 'loss_reward', 'invalid_penalty'])
@pytest.mark.parametrize('value', [float('nan'), float('inf'), '1', None, True])
def test_config_rejects_non_finite_rewards(field, value):
  with pytest.raises(ValueError, match=f'EnvConfig.{field} must be a finite number'):
    _validate(**{field: value})
  with pytest.raises((ValueError, TypeError)):
    base.EnvConfig(**{field: value})


@pytest.mark.parametrize('depth', [-1, 6, True, 1.0])
def test_config_rejects_bad_think_depth(depth):
  with pytest.raises(ValueError, match=r'think_depth must be an int in \[0, 5\]'):
    _validate(think_depth=depth)
  with pytest.raises((ValueError, TypeError)):
    base.EnvConfig(think_depth=depth)


def test_config_accepts_int_rewards_and_every_depth():
  config = base.EnvConfig(win_reward=2, invalid_penalty=-3, minimax_depth=9)
  assert (config.win_reward, config.invalid_penalty) == (2, -3)
  assert base.EnvConfig(minimax_depth=1).minimax_depth == 1


def test_config_is_frozen():
  config = base.EnvConfig()
  with pytest.raises(AttributeError):
    config.game = 'tic_tac_toe'


@pytest.mark.parametrize(
  ('text', 'expected'),
  [
    ('4', 3),
    ('1', 0),
    ('7', 6),
    (' 4\n', 3),
    ('\t7  ', 6),
    ('0', None),
    ('8', None),
    ('44', None),
    ('4.', None),
    ('column 4', None),
    ('', None),
    ('   ', None),
    ('-1', None),
    ('\u0664', None),  # ARABIC-INDIC DIGIT FOUR: str.isdigit() is True, but it is no move
    ('\uff14', None),  # FULLWIDTH DIGIT FOUR
  ],
)
def test_strict_parsing(text, expected):
  assert base.parse_action(text, 7, 'strict') == expected


@pytest.mark.parametrize(
  ('text', 'expected'),
  [
    ('4', 3),
    ('I will play column 4.', 3),
    ('3 or 5? I choose 5', 4),
    ('Columns 2, 6 are open; answer: 6\n', 5),
    ('<answer>2</answer>', 1),
    ('play 4, not 8', 3),  # 8 is out of range, so 4 is the last in-range digit
    ('12 ways, so 3', 2),
    ('the 4th column', None),
    ('c4', None),
    ('10 20 80', None),
    ('no digits at all', None),
    ('', None),
    ('0', None),
  ],
)
def test_lenient_parsing(text, expected):
  assert base.parse_action(text, 7, 'lenient') == expected


def test_parsing_respects_the_action_range():
  assert base.parse_action('9', 9, 'strict') == 8
  assert base.parse_action('9', 7, 'strict') is None
  assert base.parse_action('cell 9', 9, 'lenient') == 8
  assert base.parse_action('cell 9', 7, 'lenient') is None


def test_render_grids_and_grid_from_text_round_trip():
  board = connect_four.ConnectFour().board_from_moves([3, 3, 4, 2])
  (text,) = base.render_grids(board[None], connect_four.HEADER)
  assert text == '1234567\n.......\n.......\n.......\n.......\n...O...\n..OXX..\n'
  np.testing.assert_array_equal(base.grid_from_text(text), board)
  np.testing.assert_array_equal(base.grid_from_text(text + 'win\n'), board)
  assert base.grid_from_text('X.O\n.X.\n..O\n').tolist() == [[1, 0, -1], [0, 1, 0], [0, 0, -1]]


def test_grid_from_text_rejects_ragged_text():
  with pytest.raises(ValueError, match='No rectangular board'):
    base.grid_from_text('X..\nXO\n')
  with pytest.raises(ValueError, match='No rectangular board'):
    base.grid_from_text('hello\n')


def test_step_result_checks_shapes_and_dtypes():
  info: base.StepInfo = {
    'outcome': None,
    'parsed_action': 0,
    'legal': True,
    'turn': 0,
    'opponent_action': 1,
    'ignored': False,
  }
  good = {
    'observations': ['a'],
    'rewards': np.zeros(1, np.float32),
    'dones': np.zeros(1, bool),
    'infos': [info],
  }
  assert base.StepResult(**good).rewards.dtype == np.float32
  with pytest.raises(ValueError, match='float32 rewards'):
    base.StepResult(**{**good, 'rewards': np.zeros(1, np.float64)})
  with pytest.raises(ValueError, match='infos'):
    base.StepResult(**{**good, 'infos': []})
