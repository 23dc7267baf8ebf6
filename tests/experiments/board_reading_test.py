"""The labelled games of experiments/board_reading.py."""

import numpy as np

from earl_jax.models import tokenizer as tokenizer_lib
from experiments.board_reading import play_games


def test_each_reply_is_labelled_with_the_full_columns_of_the_board_before_it():
  """Read back from the rows: at every agent reply, bit c is set exactly where the top row of
  the board text just before it has a stone in column c + 1, and every game meets one."""
  tokenizer = tokenizer_lib.load_tokenizer('game')
  tokens, full = play_games(6, seed=3, bucket=2048, stack=0.7)
  digits = {tokenizer.encode(str(c + 1))[0] for c in range(7)}
  act = tokenizer.turn_prompt_ids('', first=False)[-1]  # the token before every reply
  for row, labels in zip(tokens, full):
    replies = np.flatnonzero(np.isin(row, list(digits)) & (np.roll(row, 1) == act))
    assert replies.size and (labels > 0).any()
    assert set(np.flatnonzero(labels)) <= set(replies)
    for at in replies:
      board = tokenizer.decode(row[:at].tolist()).rsplit('1234567\n', 1)[1]
      top = board.split('\n')[0]
      assert len(top) == 7
      want = sum(1 << c for c, cell in enumerate(top) if cell != '.')
      assert labels[at] == want, (at, top, labels[at])
