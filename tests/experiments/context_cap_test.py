"""Fig. 1's summary: the capped buckets, the smoothed return's peak and fall, and which EARL
run a cap sweep keeps."""

import json

import pytest

from earl_jax.errors import UserError
from earl_jax.run import metrics
from experiments import context_cap


def test_capped_buckets_stop_at_the_cap():
  assert context_cap.capped_buckets((128, 256, 384, 512), 300, 60) == (128, 256, 300)
  with pytest.raises(UserError, match='--cap 50: expected at least the first turn'):
    context_cap.capped_buckets((128, 256), 50, 60)
  with pytest.raises(UserError, match='expected less than the largest bucket, 256'):
    context_cap.capped_buckets((128, 256), 256, 60)


def test_smoothed_is_the_trailing_mean():
  assert context_cap.smoothed([1.0, 3.0, 5.0, 7.0], window=2) == [1.0, 2.0, 4.0, 6.0]
  assert context_cap.smoothed([2.0, 4.0], window=5) == [2.0, 3.0]


def test_peak_and_fall_of_a_return_that_rises_then_collapses():
  steps = list(range(1, 13))
  # Rises to 0 at step 6, then falls to -1 and stays there.
  returns = [-1.0, -0.8, -0.6, -0.4, -0.2, 0.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0]
  r = context_cap.peak_and_fall(steps, returns)
  ref = [
    sum(returns[max(0, i - 4) : i + 1]) / len(returns[max(0, i - 4) : i + 1]) for i in range(12)
  ]
  i = max(range(12), key=ref.__getitem__)
  assert r['peak_step'] == steps[i] == 6 and r['peak'] == pytest.approx(-0.4)
  assert r['low_after_peak'] == pytest.approx(-1.0) and r['last'] == pytest.approx(-1.0)
  assert r['fall'] == pytest.approx(0.6) and r['low_step'] == 11  # the first 5-step mean of -1
  # The largest fall, not the one after the best value: a dip, then a rise above the old peak.
  dip = [1.0] * 5 + [0.0] * 5 + [3.0] * 10
  d = context_cap.peak_and_fall(list(range(1, 21)), dip)
  assert (d['peak'], d['peak_step'], d['low_after_peak'], d['low_step']) == (1.0, 1, 0.0, 10)
  assert d['fall'] == 1.0 and d['last'] == 3.0
  # From step 11 on (once the cap is reached, say) the series only rises: no fall.
  late = context_cap.peak_and_fall(list(range(1, 21)), dip, start=11)
  assert late['fall'] == 0.0 and late['peak_step'] == late['low_step'] == 15  # first 5-step 3.0
  # A return that only rises does not fall.
  rising = context_cap.peak_and_fall(steps, [0.1 * s for s in steps])
  assert rising['peak_step'] == rising['low_step'] == 12 and rising['fall'] == 0.0


def test_turn_level_is_tokens_per_move_with_a_fallback_for_older_runs():
  run = {'ctx/turn_len_mean': [10.0, 9.0], 'ctx/move_len_mean': [18.0, 33.0]}
  assert context_cap.turn_level(run) == [18.0, 33.0]  # thoughts count toward their move
  old = {'ctx/turn_len_mean': [60.0, 61.0], 'ctx/move_len_mean': [None, None]}
  assert context_cap.turn_level(old) == [60.0, 61.0]


def test_summary_reports_the_cap_step_and_each_runs_context_growth():
  def run(returns, overflow, move_len, thoughts):
    n = len(returns)
    return {
      'step': list(range(1, n + 1)),
      'return_mean': returns,
      'win_rate': [r / 4 for r in returns],
      'overflow_rate': overflow,
      'ctx/turn_len_mean': [8.0] * n,
      'ctx/move_len_mean': move_len,
      'ctx/thoughts_per_move': thoughts,
      'ctx/episode_len_mean': [100.0 * (i + 1) for i in range(n)],
      'plan/rollout': ['dp8@256'] * n,
      'plan/train': ['dp4.tp2@256'] * n,
    }

  capped = run([0.0, 1.0, 2.0, 0.5], [0.0, 0.0, 0.25, 0.5], [10.0, 20, 30, 25], [0.2, 1, 2, 1.5])
  earl = run([0.0, 1.0, 2.0, 2.5], [0.0] * 4, [10.0, 20, 30, 35], [0.2, 1, 2, 2.5])
  s = context_cap.summarize(capped, earl, cap=640)
  assert s['capped_reaches_cap_at_step'] == 3
  assert s['capped']['return_before'] == pytest.approx(0.5)
  assert s['capped']['return_after'] == pytest.approx(1.25)
  assert s['capped']['overflow_rate_after'] == pytest.approx(0.375)
  assert (s['capped']['overflow_rate_max'], s['capped']['overflow_rate_max_step']) == (0.5, 4)
  assert s['capped']['smoothed_win_rate']['peak_step'] == 3
  assert s['capped']['smoothed_win_rate']['fall'] == pytest.approx((3 / 3 - 3.5 / 4) / 4)
  assert s['earl']['smoothed']['fall'] == 0.0
  assert (s['capped']['turn_len_first'], s['capped']['turn_len_last']) == (10.0, 25.0)
  assert s['earl']['thoughts_per_move_last'] == 2.5 and s['earl']['rollout_layouts'] == ['dp8']


def test_a_finished_earl_run_is_kept_only_for_the_same_command_and_every_step(tmp_path):
  cmd = ['-m', 'experiments.train', f'--workdir={tmp_path}', '--config=think', '--config.steps=3']
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
  for step in (1, 2):
    writer.write(step, {'ctx/turn_len_mean': 9.0, 'return_mean': 0.5})
  assert not context_cap._finished(str(tmp_path), cmd, 3)  # no recorded command
  (tmp_path / context_cap.COMMAND_FILE).write_text(json.dumps(cmd))
  assert not context_cap._finished(str(tmp_path), cmd, 3)  # step 3 is missing
  writer.write(3, {'ctx/turn_len_mean': 9.0, 'return_mean': 0.5})
  assert context_cap._finished(str(tmp_path), cmd, 3)
  assert not context_cap._finished(str(tmp_path), [*cmd[:-1], '--config.steps=4'], 3)
  assert not context_cap._finished(str(tmp_path / 'missing'), cmd, 3)
