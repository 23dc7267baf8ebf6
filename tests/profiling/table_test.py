"""The profile as pure data: cells, coverage, load bins, merging, and its JSON round trip and cache
file, without compiling or measuring anything."""

import dataclasses
import json

import pytest
from absl import logging

from earl_jax.config import ParallelConfig
from earl_jax.profiling.table import (
  FORMAT_VERSION,
  Cell,
  MeasureConfig,
  Profile,
  ProfileSettings,
  key_mismatch,
  load_cached,
  pooled,
  refusal,
)
from earl_jax.stage import Stage

DP8, TP8 = ParallelConfig(dp=8), ParallelConfig(tp=8)


def _cell(bucket, config, throughput, *, rows=16, oom=False, times=(1.0, 2.0, 4.0)):
  return Cell(
    stage=Stage.ROLLOUT,
    config=config.name,
    bucket=bucket,
    rows=rows,
    peak_bytes=1000 * bucket,
    oom=oom,
    throughput=throughput,
    times_ms=times,
    compile_ms=12.5,
  )


def _profile(buckets=(1024, 2048)) -> Profile:
  cells = {}
  for bucket in buckets:
    for config, tgs in ((DP8, 300.0 / bucket), (TP8, 200.0 / bucket)):
      cell = _cell(bucket, config, tgs if bucket < 2048 or config == TP8 else None)
      cells[(Stage.ROLLOUT, bucket, 16, config.name)] = cell
  key = {
    'hardware': {'platform': 'cpu', 'num_devices': 8},
    'stages': ['rollout'],
    'candidates': {'rollout': [DP8.name, TP8.name]},
    'buckets': [1024, 2048],
    'rows': [16, 64],
  }
  return Profile(key=key, cells=cells, wall_s=3.5)


def test_json_round_trip_keeps_every_cell():
  profile = _profile()
  data = json.loads(json.dumps(profile.to_json()))
  assert data['format'] == FORMAT_VERSION
  back = Profile.from_json(data)
  assert back.cells == profile.cells and back.key == profile.key and back.wall_s == 3.5
  cell = back.cell(Stage.ROLLOUT, 1024, 16, 'dp8.tp1')
  assert cell.stage is Stage.ROLLOUT and cell.times_ms == (1.0, 2.0, 4.0)
  assert cell.spread == pytest.approx((3.0 - 1.5) / 2.0)  # (p75 - p25) / median


def test_lookups_coverage_load_bins_and_the_best_cell():
  profile = _profile(buckets=(1024,))
  assert profile.stages == (Stage.ROLLOUT,) and profile.buckets == (1024, 2048)
  assert profile.candidates(Stage.ROLLOUT) == [DP8, TP8]
  assert profile.covers(Stage.ROLLOUT, 1024, 16)
  assert not profile.covers(Stage.ROLLOUT, 2048, 16)  # not measured yet
  assert not profile.covers(Stage.TRAIN, 1024, 16)  # not a profiled stage
  assert profile.rows_bin(10) == 16 and profile.rows_bin(17) == 64
  with pytest.raises(ValueError, match='100 responses is more than the largest profiled load 64'):
    profile.rows_bin(100)
  with pytest.raises(KeyError, match=r'no cell \(rollout, bucket 2048, rows 16, dp8.tp1\)'):
    profile.cell(Stage.ROLLOUT, 2048, 16, DP8)
  assert profile.best(Stage.ROLLOUT, 1024, 16).config == DP8.name
  # Merging adds a bucket; the other profile's cells win where both have one.
  later = _profile(buckets=(1024, 2048))
  merged = profile.merged(later)
  assert merged.covers(Stage.ROLLOUT, 2048, 16) and merged.wall_s == 7.0
  assert merged.best(Stage.ROLLOUT, 2048, 16).config == TP8.name  # dp8 is OOM-like (None)


def test_the_cache_file_is_used_only_for_its_own_key(tmp_path, monkeypatch):
  warnings = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *a: warnings.append(msg % a))
  path = str(tmp_path / 'sub' / 'profile.json')
  profile = _profile()
  assert load_cached(path, profile.key) is None  # no file
  profile.save(path)
  assert load_cached(path, profile.key).cells == profile.cells
  other = {**profile.key, 'hardware': {'platform': 'gpu', 'num_devices': 8}}
  assert key_mismatch(other, profile.key) == ['hardware.{platform}']
  assert load_cached(path, other) is None and 'differs in' in warnings[-1]
  with open(path, 'w') as f:
    json.dump({**profile.to_json(), 'format': FORMAT_VERSION - 1}, f)
  assert load_cached(path, profile.key) is None and 'unreadable' in warnings[-1]


def test_measure_config_validation():
  with pytest.raises(ValueError, match='warmup must be >= 1'):
    MeasureConfig(warmup=0)
  with pytest.raises(ValueError, match='rounds must be >= 1'):
    MeasureConfig(rounds=0)
  with pytest.raises(ValueError, match='min_seconds must be >= 0'):
    MeasureConfig(min_seconds=-1.0)


def test_a_cell_timed_again_pools_both_sessions_calls():
  """The pooled figure is the median of both sessions' calls (throughput ~ 1 / median call),
  its sessions counted, whose calls and its compile time kept from the first; and a cell
  without calls (or over the budget) does not pool."""
  first = _cell(1024, DP8, 100.0, times=(10.0, 10.0, 11.0))  # median 10 ms
  again = dataclasses.replace(
    _cell(1024, DP8, 50.0, times=(20.0, 21.0, 22.0)), compile_ms=0.0, timed_by='run'
  )
  both = pooled(first, again)
  assert both.times_ms == (10.0, 10.0, 11.0, 20.0, 21.0, 22.0)
  assert both.throughput == pytest.approx(100.0 * 10.0 / 15.5)  # the median of six: 15.5 ms
  assert (both.sessions, both.timed_by, both.compile_ms) == (2, 'profile', 12.5)
  assert pooled(both, first).sessions == 3
  with pytest.raises(ValueError, match='only two timings of a cell pool'):
    pooled(first, _cell(1024, DP8, None, oom=True))
  with pytest.raises(ValueError, match='only two timings of a cell pool'):
    pooled(_cell(1024, DP8, 100.0, times=()), again)
  with pytest.raises(ValueError, match='retimes must be an int >= 0'):
    ProfileSettings(retimes=-1)


def test_a_profile_file_for_another_model_or_device_count_is_refused_in_one_line(
  tmp_path, monkeypatch
):
  """The shareable table: used only for the setup its key names; a mismatch is never used, and
  the refusal is one line naming what differs."""
  warnings = []
  monkeypatch.setattr(logging, 'warning', lambda msg, *a: warnings.append(msg % a))
  path = str(tmp_path / 'table.json')
  profile = _profile()
  profile.key['model'] = {'name': 'tiny', 'hidden_size': 64}
  profile.save(path)
  for change, named in (
    ({'hardware': {'platform': 'cpu', 'num_devices': 4}}, 'hardware.{num_devices}'),
    ({'model': {'name': 'tiny-wide', 'hidden_size': 128}}, 'model.{hidden_size, name}'),
  ):
    other = {**profile.key, **change}
    assert load_cached(path, other) is None
    line = warnings[-1]
    assert '\n' not in line and named in line and 'not used' in line, line
    assert line == refusal(path, other, profile.key)
  assert refusal(path, profile.key, profile.key) is None


def test_only_measurements_are_kept_and_an_unwritable_table_is_not_an_error(tmp_path):
  profile = _profile()
  guess = Cell(
    stage=Stage.ROLLOUT,
    config='dp8.tp1',
    bucket=4096,
    rows=16,
    peak_bytes=1,
    oom=False,
    throughput=1.0,
    measured=False,
    prior='analytic',
  )
  mixed = Profile(
    key=profile.key, cells={**profile.cells, (Stage.ROLLOUT, 4096, 16, 'dp8.tp1'): guess}
  )
  assert mixed.measured_only().cells == profile.cells
  path = tmp_path / 'table.json'
  assert mixed.save(str(path))
  assert load_cached(str(path), profile.key).cells == profile.cells  # the prior is not written
  # Where it cannot be written (here: under a file), the run goes on without it.
  (tmp_path / 'a_file').write_text('')
  assert not mixed.save(str(tmp_path / 'a_file' / 'table.json'))
