"""The step record, the step line and the run's move summary (values from the trainer's
formatting before it moved here), and the JSONL writer's round trip."""

import dataclasses
import math

import numpy as np
import pytest

from earl_jax.rollout.trajectories import EpisodeStats
from earl_jax.run import metrics
from earl_jax.stage import Stage

RECORD = {
  'step': 7,
  'win_rate': 0.25,
  'return_mean': -0.125,
  'eval/win_rate': 0.5,
  'ctx/turn_len_mean': 31.4,
  'ctx/episode_len_mean': 120.2,
  'ctx/episode_len_max': 250,
  'tokens_per_s': 12345.6,
  'plan/rollout': 'dp8.tp1@128',
  'plan/experience': 'dp4.tp2@256',
  'plan/train': 'dp4.tp2@256',
  'dispatch/rollout_experience/bytes': 1234567,
  'dispatch/rollout_experience/ms': 12.3,
  'dispatch/rollout_experience/strategy': 'layout_aware',
  'dispatch/experience_train/bytes': 0,
  'dispatch/experience_train/ms': 0.4,
  'dispatch/experience_train/strategy': 'layout_aware',
  'dispatch/experience_train/wire_bytes': 10,
  'time/reshard_s': 0.01,
  'time/rollout_s': 1.5,
  'time/dispatch_s': 0.02,
  'time/train_s': 0.7,
  'time/step_s': 3.0,
  'time/profile_s': 2.25,
}


def test_the_step_line():
  assert metrics.format_line(RECORD) == (
    'step    7 | win 0.250 | ret -0.125 | eval 0.500 | ctx turn 31 ep 120/250 | 12,346 tok/s | '
    'plan r=dp8.tp1@128 e=dp4.tp2@256 t=dp4.tp2@256 | moved r>e 1.2MB 12ms e>t 0B 0ms | '
    'reshard 0.01s rollout 1.50s dispatch 0.02s train 0.70s profile 2.25s'
  )
  # The wire's share of the moved bytes, where both are known and bytes moved.
  wired = {**RECORD, 'dispatch/rollout_experience/wire_bytes': 1493826}
  assert 'moved r>e 1.2MB wire 1.21x 12ms e>t 0B 0ms |' in metrics.format_line(wired)
  # The rollout's slots: occupancy and padded fractions of decode and prefill.
  slots = {
    **RECORD,
    'rollout/slots': 16.0,
    'rollout/slot_occupancy': 0.8612,
    'rollout/decode_padded': 0.14,
    'rollout/prefill_padded': 0.205,
  }
  assert '12,346 tok/s | slots 16 occ 0.86 pad dec 0.14 pre 0.20 | plan' in metrics.format_line(
    slots
  )
  # A record without moves or evaluation (step 0 has neither).
  line = metrics.format_line({'step': 0, 'time/rollout_s': 1.0})
  assert line.startswith('step    0 | win nan | ret +nan | ctx turn 0 ep 0/0')
  assert 'moved' not in line and 'plan r=? e=? t=?' in line


def test_the_plan_says_which_decisions_were_measured_and_the_models_uncertainty():
  from earl_jax.config import ParallelConfig
  from earl_jax.selector.selector import Decision

  def decision(measured, basis, throughput=176.4, uncertainty=0.05):
    return Decision(
      stage=Stage.ROLLOUT,
      step=0,
      config=ParallelConfig(dp=8),
      bucket=128,
      run_bucket=128,
      rows=16,
      statistic=100.0,
      throughput=throughput,
      measured=measured,
      need_bytes=1,
      budget_bytes=None,
      switched=False,
      previous=None,
      reason='',
      options=(),
      uncertainty=uncertainty,
      basis=basis,
    )

  figures = {
    'rollout': metrics.plan_figures(decision(True, '')),
    'experience': metrics.plan_figures(decision(False, 'dp4.tp2@128', 162.0, 0.35)),
    'train': metrics.plan_figures(decision(False, 'analytic', 5e6, 1.0)),
  }
  assert figures['rollout'] == {'measured': 1.0, 'figure': 176.4, 'uncertainty': 0.05}
  assert figures['train']['figure'] is None  # nominal units: no figure to show
  record = {**RECORD}
  for stage, figure in figures.items():
    record.update({f'plan/{stage}/{k}': v for k, v in figure.items()})
  assert (
    'plan r=dp8.tp1@128 [176] e=dp4.tp2@256 [~162+-35%] t=dp4.tp2@256 [~analytic] |'
    in metrics.format_line(record)
  )
  # A stage ranked by the fewest-splits preference has no figure.
  assert metrics.plan_figures(decision(False, '')) == {}


def test_the_move_summary_counts_steps_layouts_and_bytes():
  second = {**RECORD, 'step': 8, 'plan/train': 'dp8.tp1@256'}
  second['dispatch/experience_train/bytes'] = 500
  history = [{'step': 0, 'eval/win_rate': 0.1}] + [
    metrics.summary_fields(r) for r in (RECORD, second)
  ]
  assert 'time/step_s' not in history[1] and history[1]['plan/train'] == 'dp4.tp2@256'
  summary = metrics.move_summary(history)
  assert summary['rollout_experience'] == {
    'steps': 2,
    'layouts_differ': 2,
    'bytes_moved_steps': 2,
    'bytes': 2469134,
    'wire_bytes': 0,
    'wire_ratio': 0.0,
    'recycled_bytes': 0,
    'ms': pytest.approx(24.6),
    'strategies': ['layout_aware'],
  }
  assert summary['experience_train'] == {
    'steps': 2,
    'layouts_differ': 1,
    'bytes_moved_steps': 1,
    'bytes': 500,
    'wire_bytes': 20,
    'wire_ratio': 0.04,
    'recycled_bytes': 0,
    'ms': pytest.approx(0.8),
    'strategies': ['layout_aware'],
  }


def test_the_step_record_keys_in_order():
  episodes = EpisodeStats(
    lengths=np.array([100, 100, 100, 100], np.int32),
    returns=np.array([1.0, -1.0, 0.0, 0.0], np.float32),
    turns=np.array([2, 2, 2, 2], np.int32),
    generated=np.array([10, 10, 10, 10], np.int32),
    outcomes=['win', 'loss', 'invalid', 'invalid'],
  )
  record = metrics.step_record(
    episodes=episodes,
    bucket=128,
    train_metrics={'loss': np.float32(0.5)},
    skipped_steps=1,
    moves={'experience_train': {'bytes': 10, 'ms': 1.0}},
    kernels=3,
    switch_ms=0.0,
    plans={Stage.ROLLOUT: 'dp8.tp1@128', Stage.EXPERIENCE: 'dp8.tp1@128', Stage.TRAIN: 'a@1'},
    times={'rollout': 2.0, 'train': 1.0},
    step_s=4.0,
    rss_bytes=3 << 20,
    programs=5,
    rollout={'slots': 16.0, 'slot_occupancy': 0.75},
  )
  assert list(record)[:4] == ['win_rate', 'return_mean', 'invalid_rate', 'overflow_rate']
  assert record['win_rate'] == 0.25 and record['return_mean'] == 0.0
  assert record['tokens_per_s'] == 100.0 and record['rollout_tokens_per_s'] == 20.0
  assert record['invalid_rate'] == 0.5 and record['overflow_rate'] == 0.0
  assert record['ctx/episode_len_mean'] == 100.0
  assert record['loss/loss'] == 0.5 and record['dispatch/bytes_moved'] == 10.0
  assert record['rollout/slots'] == 16.0 and record['rollout/slot_occupancy'] == 0.75
  plans = [k for k in record if k.startswith('plan/')]
  assert plans == ['plan/rollout', 'plan/experience', 'plan/train']
  tail = ['time/rollout_s', 'time/train_s', 'time/step_s', 'host/rss_mib', 'host/programs']
  assert list(record)[-5:] == tail and record['host/rss_mib'] == 3.0


def _bare_record(episodes: EpisodeStats, *, step_s: float, processes: int = 1) -> dict:
  """The record of a step of `episodes` with no update, move or timing but a 2 s rollout."""
  return metrics.step_record(
    episodes=episodes,
    bucket=512,
    train_metrics={},
    skipped_steps=0,
    moves={},
    kernels=0,
    switch_ms=0.0,
    plans={Stage.ROLLOUT: 'a@1', Stage.EXPERIENCE: 'a@1', Stage.TRAIN: 'a@1'},
    times={'rollout': 2.0},
    step_s=step_s,
    rss_bytes=None,
    programs=1,
    processes=processes,
  )


def test_groups_whose_episodes_all_returned_the_same_are_counted_and_shown():
  """Three groups of two or more (a lone episode is no group): one flat at 1.0, one flat at
  0.0, one that differs; the record and the step line say 2 of 3 teach nothing."""
  episodes = EpisodeStats(
    lengths=np.full(7, 100, np.int32),
    returns=np.array([1.0, 1.0, 0.0, 0.0, 0.0, 1.0, -1.0], np.float32),
    turns=np.full(7, 2, np.int32),
    generated=np.full(7, 10, np.int32),
    outcomes=['win'] * 7,
    groups=np.array([0, 0, 1, 1, 2, 2, 3], np.int32),
  )
  assert episodes.group_stats() == {'count': 3.0, 'flat_rate': 2 / 3}
  assert dataclasses.replace(episodes, groups=np.arange(7, dtype=np.int32)).group_stats() == {}
  assert dataclasses.replace(episodes, groups=None).group_stats() == {}
  record = _bare_record(episodes, step_s=1.0)
  assert record['groups/count'] == 3.0 and record['groups/flat_rate'] == 2 / 3
  assert '| ret +0.286 | flat 0.67 | ctx' in metrics.format_line({**record, 'step': 1})


def _code_episodes() -> EpisodeStats:
  """Four code episodes as `EpisodeStats.gather` hands them on, with their environment's
  reports (`CodeEnv.episode_stats`)."""
  return EpisodeStats(
    lengths=np.array([150, 400, 420, 380], np.int32),
    returns=np.array([1.0, 1.0, 0.4, 1.0], np.float32),
    turns=np.array([1, 2, 3, 2], np.int32),
    generated=np.array([20, 40, 60, 40], np.int32),
    outcomes=['win', 'win', 'loss', 'win'],
    env_stats={
      'pass_first_rate': np.array([1.0, 0, 0, 0]),
      'pass_final_rate': np.array([1.0, 1, 0, 1]),
      'programs': np.array([1.0, 2, 3, 2]),
      'timeouts': np.array([0.0, 0, 1, 0]),
      'crashes': np.array([0.0, 1, 0, 0]),
      'sandbox_s': np.array([0.1, 0.2, 0.5, 0.2]),
    },
  )


def test_environment_reports_in_the_record_the_line_and_the_evaluation():
  episodes = _code_episodes()
  record = _bare_record(episodes, step_s=2.0, processes=2)
  # '_rate': the mean over the episodes; else the sum; seconds also as their share of the step
  # per process.
  assert record['env/pass_first_rate'] == 0.25 and record['env/pass_final_rate'] == 0.75
  assert record['env/programs'] == 8 and record['env/timeouts'] == record['env/crashes'] == 1
  assert record['env/sandbox_s'] == pytest.approx(1.0)
  assert record['env/sandbox_s_share'] == pytest.approx(0.25)
  assert record['ctx/turns_mean'] == 2.0 and record['ctx/turn_len_mean'] == 1350 / 8
  evals = metrics.eval_record(episodes)
  line = metrics.format_line({**record, **evals, 'step': 3})
  assert line.startswith(
    'step    3 | win 0.750 | ret +0.850 | eval 0.750 | pass 0.25>0.75 turns 2.0 eval 0.25>0.75 | '
    'ctx turn 169 ep 338/420 | '
  )
  assert ' | sandbox 1.00s 25% prog 8 timeout 1 crash 1 | plan ' in line
  assert evals['eval/pass_first_rate'] == 0.25 and evals['eval/programs'] == 8
  assert evals['eval/turns_mean'] == 2.0 and evals['eval/turn_len_mean'] == 1350 / 8
  assert metrics.eval_line({**evals, 'step': 0}) == 'step    0 | eval win 0.750 | pass 0.250>0.750'
  # A board game reports nothing: its record, evaluation and line have none of it.
  board = metrics.eval_record(dataclasses.replace(episodes, env_stats={}))
  assert not any(k.startswith(('eval/pass', 'eval/turn')) for k in board)
  assert metrics.eval_line({**board, 'step': 0}) == 'step    0 | eval win 0.750'


def test_the_writer_round_trips_and_drops_a_cut_last_line(tmp_path):
  writer = metrics.MetricsWriter(str(tmp_path), tensorboard=False)
  writer.write(1, {'a': np.float32(1.5), 'b': float('nan'), 'c': 'x'})
  writer.close()
  with open(tmp_path / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 2, "a"')  # a run killed mid-line
  assert metrics.read_jsonl(str(tmp_path / 'metrics.jsonl')) == [
    {'a': 1.5, 'b': None, 'c': 'x', 'step': 1}
  ]


def _history(tmp_path, content: bytes, step: int):
  path = tmp_path / 'metrics.jsonl'
  path.write_bytes(content)
  rows, note = metrics.resume_history(str(path), step)
  return [r['step'] for r in rows], note


def _lines(steps) -> bytes:
  return b''.join(b'{"step": %d, "win_rate": 0.5}\n' % s for s in steps)


def test_a_whole_history_resumes_without_a_word(tmp_path):
  # Rows after the checkpoint (logged by the run that died) and a last row cut short are dropped.
  steps, note = _history(tmp_path, _lines(range(7)) + b'{"step": 7, "win', 4)
  assert steps == [0, 1, 2, 3, 4] and note is None
  # Step 0 (the first evaluation) is optional; blank lines are no rows.
  assert _history(tmp_path, _lines([1, 2]) + b'\n' + _lines([3]), 3) == ([1, 2, 3], None)


def test_a_damaged_history_keeps_its_readable_rows_and_says_what_is_lost(tmp_path):
  where = f'metrics.jsonl of {tmp_path}'
  # A garbled line in the middle costs only its own step.
  content = _lines([0, 1]) + b'{"step": 2, "win_ra\n' + _lines([3, 4, 5])
  assert _history(tmp_path, content, 4) == (
    [0, 1, 3, 4],
    f'{where}: line 3 unreadable; step 2 missing; resuming from step 4 with the 4 readable rows '
    'up to it.',
  )
  # A truncated file: the steps it lost are named.
  assert _history(tmp_path, _lines([0, 1]), 4) == (
    [0, 1],
    f'{where}: steps 2-4 missing; resuming from step 4 with the 2 readable rows up to it.',
  )
  # Binary garbage (not UTF-8), JSON that is no row, and rows in any order; a repeated step
  # keeps its last row (two runs wrote this file).
  content = (
    _lines([1, 2, 3])
    + b'\x89PNG\r\n\x1a\n\xff\xfe\x00garbage\n'
    + b'[1, 2]\n{"step": "4"}\n{"step": true}\n'
    + _lines([6, 5])
    + b'{"step": 2, "win_rate": 0.75}\n'
  )
  (tmp_path / 'metrics.jsonl').write_bytes(content)
  rows, note = metrics.resume_history(str(tmp_path / 'metrics.jsonl'), 6)
  assert [r['step'] for r in rows] == [1, 2, 3, 5, 6] and rows[1]['win_rate'] == 0.75
  assert note == (
    f'{where}: lines 4-9 unreadable; step 4 missing; step 2 logged more than once (the '
    'last kept); resuming from step 6 with the 5 readable rows up to it.'
  )
  # Many lost rows: the first runs, then how many more.
  content = b''.join(b'x\n' if s % 2 else b'{"step": %d}\n' % s for s in range(1, 21))
  assert _history(tmp_path, content, 20)[1] == (
    f'{where}: lines 1, 3, 5, 7, 9 and 5 more unreadable; steps 1, 3, 5, 7, 9 and 5 more '
    'missing; resuming from step 20 with the 10 readable rows up to it.'
  )


def test_a_missing_or_unreadable_history_file_is_said(tmp_path):
  rows, note = metrics.resume_history(str(tmp_path / 'metrics.jsonl'), 2)
  assert rows == [] and note == (
    f'metrics.jsonl of {tmp_path}: the file is missing; steps 1-2 missing; resuming from step 2 '
    'with the 0 readable rows up to it.'
  )
  (tmp_path / 'metrics.jsonl').mkdir()
  rows, note = metrics.resume_history(str(tmp_path / 'metrics.jsonl'), 2)
  assert rows == [] and note.startswith(
    f'metrics.jsonl of {tmp_path}: the file is unreadable (Is a directory); steps 1-2 missing'
  )


def test_sampled_pass_at_k_per_task_as_human_eval_counts_it():
  """Three tasks of 4 samples each: 0, 1 and 3 pass at the end, 0, 0 and 1 at the first turn.
  pass@1 is the mean pass rate (0 + 1/4 + 3/4) / 3; pass@4 the share of tasks with a pass;
  the same by human-eval's `estimate_pass_at_k` formula 1 - C(n - c, k) / C(n, k). Groups of
  another size than k are refused."""
  final = np.array([0, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0, 1], float)
  first = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0], float)
  episodes = EpisodeStats(
    lengths=np.full(12, 100, np.int32),
    returns=final.astype(np.float32),
    turns=np.full(12, 2, np.int32),
    generated=np.full(12, 10, np.int32),
    outcomes=['win' if f else 'loss' for f in final],
    env_stats={'pass_first_rate': first, 'pass_final_rate': final},
    groups=np.repeat(np.arange(3, dtype=np.int32), 4),
  )
  record = metrics.pass_at_k_record(episodes, k=4)
  assert record == pytest.approx(
    {
      'eval/pass_at_1_final': (0 + 0.25 + 0.75) / 3,
      'eval/pass_at_4_final': 2 / 3,
      'eval/pass_at_1_first': 0.25 / 3,
      'eval/pass_at_4_first': 1 / 3,
    }
  )
  # The same 12 samples as 6 tasks of 2: pass@2 by 1 - C(n - c, k) / C(n, k).
  two = dataclasses.replace(episodes, groups=np.repeat(np.arange(6, dtype=np.int32), 2))
  assert metrics.pass_at_k_record(two, k=2)['eval/pass_at_2_final'] == pytest.approx(
    np.mean([1 - math.comb(2 - c, 2) / math.comb(2, 2) for c in (0, 0, 1, 0, 1, 1)])
  )
  with pytest.raises(ValueError, match=r'groups of \[4\] samples, expected 2'):
    metrics.pass_at_k_record(episodes, k=2)
  line = metrics.eval_line(
    {
      'step': 0,
      'eval/win_rate': 0.5,
      'eval/pass_final_rate': 0.5,
      'eval/pass_first_rate': 0.25,
      **record,
    }
  )
  assert line.endswith('| pass 0.250>0.500 | sampled pass@1 0.08>0.33 pass@4 0.33>0.67')


def test_the_step_line_shows_entropy_clip_and_kl_once_the_policy_updates():
  record = {**RECORD, 'loss/entropy_proxy': 1.234, 'loss/clip_frac': 0.05}
  assert '| ret -0.125 | ent 1.23 clip 0.05 | eval 0.500 |' in metrics.format_line(record)
  # A board game's evaluation: distinct moves (columns) a game and the games lost to an illegal one.
  board = {**record, 'eval/distinct_moves_mean': 1.25, 'eval/illegal_rate': 0.336}
  assert '| eval 0.500 distinct 1.2 illegal 0.34 |' in metrics.format_line(board)
  exact = {**record, 'loss/entropy': 0.9, 'loss/kl_ref': 0.0123}
  assert '| ent 0.90 clip 0.05 kl 0.012 |' in metrics.format_line(exact)
  rules = {**exact, 'loss/illegal_move_prob': 0.083}
  assert '| ent 0.90 clip 0.05 kl 0.012 p(illegal) 0.08 |' in metrics.format_line(rules)
  adaptive = {**rules, 'loss/rate_scale': 0.4444}
  assert '| ent 0.90 clip 0.05 kl 0.012 p(illegal) 0.08 rate x0.44 |' in metrics.format_line(
    adaptive
  )
  assert ' ent ' not in metrics.format_line(RECORD)
