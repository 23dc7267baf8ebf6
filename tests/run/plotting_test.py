"""The main job's plots: written from a metrics file, and the layout-per-stage series they show."""

import json

from earl_jax.run import plotting


def _rows():
  plans = [
    ('dp8.tp1@128', 'dp8.tp1@128', 'dp8.tp1@128'),
    ('dp8.tp1@256', 'dp8.tp1@256', 'dp4.tp2@256'),  # train switches at step 2
    ('dp4.tp2@256', 'dp8.tp1@256', 'dp4.tp2@256'),  # rollout switches at step 3
    ('dp4.tp2@512', 'dp8.tp1@512', 'dp8.tp1@512'),  # train back at step 4; new buckets
  ]
  rows = [{'step': 0, 'eval/win_rate': 0.0}]
  for step, (r, e, t) in enumerate(plans, start=1):
    rows.append({
      'step': step, 'win_rate': 0.1 * step, 'invalid_rate': 0.5, 'bucket': 128,
      'ctx/turn_len_mean': 60.0, 'ctx/episode_len_mean': 60.0 * step,
      'ctx/episode_len_max': 90.0 * step,
      'plan/rollout': r, 'plan/experience': e, 'plan/train': t,
    })  # fmt: skip
  return rows


def test_stage_layouts_counts_layout_changes_not_bucket_changes():
  series = plotting.stage_layouts(_rows())
  assert series['rollout']['switches'] == [3]
  assert series['experience']['switches'] == []
  assert series['train']['switches'] == [2, 4]
  assert series['rollout']['buckets'] == [128, 256, 256, 512]
  assert series['train']['layouts'] == ['dp8.tp1', 'dp4.tp2', 'dp4.tp2', 'dp8.tp1']
  assert series['rollout']['model_only'] == [False] * 4  # rows without figures: measured
  assert not series['rollout']['profiled']  # ... by the preference, which the title says


def test_stage_layouts_marks_the_decisions_taken_on_the_model_alone(tmp_path):
  rows = _rows()
  for row, measured in zip(rows[1:], (0.0, 1.0, 0.0, 1.0)):  # rows[0]: the evaluation
    row['plan/train/measured'] = measured
  series = plotting.stage_layouts(rows)
  assert series['train']['model_only'] == [True, False, True, False]
  assert series['train']['profiled'] and not series['rollout']['profiled']
  path = plotting.plot_stage_layouts(rows, str(tmp_path / 'stage_layouts.png'))
  assert path and (tmp_path / 'stage_layouts.png').stat().st_size > 10_000


def test_plot_training_writes_every_png(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  path.write_text(''.join(json.dumps(r) + '\n' for r in _rows()))
  paths = plotting.plot_training(str(path), str(tmp_path))
  names = sorted(p.rsplit('/', 1)[1] for p in paths)
  assert names == ['context_lengths.png', 'learning_curve.png', 'stage_layouts.png']
  assert all((tmp_path / n).stat().st_size > 10_000 for n in names)


def _png_width(path) -> int:
  with open(path, 'rb') as f:
    return int.from_bytes(f.read(24)[16:20], 'big')  # the IHDR chunk's width


def test_a_code_run_plots_its_pass_rates_beside_the_context(tmp_path):
  rows = _rows()
  for row in rows[1:]:
    row.update({'env/pass_first_rate': 0.2, 'env/pass_final_rate': 0.3})
  rows.append({'step': 4, 'eval/pass_first_rate': 0.25, 'eval/pass_final_rate': 0.35})
  for folder, series in (('code', rows), ('game', _rows())):
    (tmp_path / folder).mkdir()
    path = tmp_path / folder / 'metrics.jsonl'
    path.write_text(''.join(json.dumps(r) + '\n' for r in series))
    plotting.plot_training(str(path), str(tmp_path / folder))
  # Three panels (pass rates, context per turn and episode, learning diagnostics) for code; the
  # win rate and the diagnostics for games.
  assert _png_width(tmp_path / 'code' / 'learning_curve.png') == 16 * 120
  assert _png_width(tmp_path / 'game' / 'learning_curve.png') == 12 * 120


def test_the_diagnostics_panel_plots_what_the_run_logged():
  """Entropy, flat groups, clip fraction and KL per step, each where logged and positive (a log
  scale); the sampled pass@k beside the greedy pass rates."""
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  rows = [
    {'step': 1, 'loss/entropy_proxy': 0.5, 'groups/flat_rate': 0.75, 'loss/clip_frac': 0.0},
    {'step': 2, 'loss/entropy_proxy': 0.4, 'groups/flat_rate': 0.5, 'loss/clip_frac': 0.1},
  ]
  fig, ax = plt.subplots()
  plotting._plot_diagnostics(ax, rows)
  lines = {line.get_label(): line.get_xydata().tolist() for line in ax.get_lines()}
  plt.close(fig)
  assert lines == {
    'entropy proxy: -log p of the sampled tokens': [[1, 0.5], [2, 0.4]],
    'flat groups (zero advantage)': [[1, 0.75], [2, 0.5]],
    'clipped tokens': [[2, 0.1]],
  }
