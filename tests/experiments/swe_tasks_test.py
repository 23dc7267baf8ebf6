"""The SWE commands as a user runs them: the scripted agents on built instances (gold solves
every one, no-op none, the valid ones written out), and bad input in one line."""

import json
import sys

from earl_jax.testing import helpers, swe


def test_the_scripted_agents_on_the_miniature_instances(tmp_path):
  jsonl = swe.mini_instances(str(tmp_path / 'tasks'))
  r = helpers.run_module(
    'experiments.swe_agents', f'--instances={jsonl}', f'--python={sys.executable}',
    '--batch=4', '--workers=2', f'--valid_out={tmp_path}/valid.jsonl', f'--out={tmp_path}/r.json',
  )  # fmt: skip
  assert r.returncode == 0, r.stderr[-2000:]
  assert 'gold   solves     8 (100.0%)' in r.stdout and 'no-op  solves     0 (0.0%)' in r.stdout
  with open(tmp_path / 'r.json') as f:
    report = json.load(f)
  assert report['invalid'] == [] and 0 < report['run_seconds_median'] < 10
  with open(jsonl) as a, open(tmp_path / 'valid.jsonl') as b:
    assert a.read() == b.read()


def test_bad_input_is_one_line_and_exit_code_2(tmp_path):
  for module, args, fragment in (
    ('experiments.build_swe_tasks', ['--projects=toolz,numpy'], "unknown ['numpy']"),
    ('experiments.build_swe_tasks', ['--cache_dir=/tmp/c'], 'the sandbox hides /tmp'),
    ('experiments.swe_agents', [f'--instances={tmp_path}/none.jsonl'], 'none.jsonl'),
  ):
    r = helpers.run_module(module, *args, f'--out={tmp_path}/out')
    assert r.returncode == 2, r.stderr[-2000:]
    lines = [x for x in r.stderr.splitlines() if x.startswith('error:')]
    assert len(lines) == 1 and fragment in lines[0], r.stderr[-2000:]
    assert 'Traceback' not in r.stderr
