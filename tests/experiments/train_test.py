"""The jobs' entry points as a user runs them, `experiments/train.py` (RL) and `experiments/sft.py`
(the warm start), on the one run layer they share (`earl_jax.run`): every bad input ends in one
line, exit code 2, and leaves the workdir as it was; SIGTERM and Ctrl-C stop at a saved step that
--resume continues bitwise; a second Ctrl-C stops at once; a full or read-only disk stops in one
line; a kill during a save loses nothing complete."""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from earl_jax.run import metrics
from earl_jax.testing import entry_runs, helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True)
class Entry:
  """A job's entry point, on its `smoke` preset.

  Attributes:
    module: what `python -m` runs.
    run: the run the fault tests interrupt (its steps `steps`), evaluated on the way.
    keep: the logged values an interrupted and resumed run must share with the uninterrupted one.
    long: arguments of a run long enough to be interrupted whenever the test is ready.
  """

  module: str
  run: tuple[str, ...]
  steps: int
  keep: tuple[str, ...]
  long: tuple[str, ...]


ENTRIES = {
  'train': Entry(
    module='experiments.train',
    run=('--config.steps=4', '--config.eval_every=2'),
    steps=4,
    keep=('step', 'win_rate', 'return_mean', 'loss/loss', 'eval/win_rate'),
    long=('--config.steps=50',),
  ),
  'sft': Entry(
    module='experiments.sft',
    run=('--config.steps=6', '--config.eval_every=2'),
    steps=6,
    keep=('step', 'loss', 'grad_norm', 'heldout/loss'),
    long=('--config.steps=500', '--config.eval_every=0'),
  ),
}

# (case, extra arguments, a fragment the one-line error must contain). Each runs in its own
# process on the `smoke` preset, in the test's folder (so that a default workdir would land there
# too); '{tmp}' is that folder. Every case fails before anything compiles.
BAD_INPUTS = [
  ('unknown preset', ['--config=nope'], '--config=nope'),
  ('unknown field', ['--config.nope=1'], "no field 'nope'"),
  ('unknown nested field', ['--config.optim.nope=1'], "OptimConfig has no field 'nope'"),
  ('not an int', ['--config.steps=abc'], "'abc' is not an int"),
  ('zero steps', ['--config.steps=0'], 'steps must be a positive int, got 0'),
  ('negative steps', ['--config.steps=-3'], 'steps must be a positive int, got -3'),
  (
    'steps past the int32 step counter',
    ['--config.steps=12345678901234567890'],
    'steps=12345678901234567890: expected at most 2,147,483,647',
  ),
  (
    'grpo with groups of one',
    ['--config.advantages.estimator=grpo', '--config.rollout.group_size=1'],
    "estimator='grpo' with rollout.group_size=1: each episode is its group's only member",
  ),
  ('infinite advantage eps', ['--config.advantages.eps=inf'], 'eps must be in (0, 1]'),
  (
    'an evaluation that plays training tasks',
    ['--config=code', '--config.env.heldout_fraction=0.2'],
    "--config.env.heldout_fraction=0.2: env (split='train', heldout_fraction=0.2, split_seed=0) "
    "and eval_env (split='heldout', heldout_fraction=0.4, split_seed=0) can share 'functions' "
    'tasks',
  ),
  (
    'a temperature that skips every step',
    ['--config.rollout.sampling.temperature=1e-30'],
    'temperature must be a number >= 0.01',
  ),
  ('override without value', ['--config.steps'], 'overrides need a value'),
  (
    'infinite learning rate',
    ['--config.optim.learning_rate=inf'],
    'learning_rate must be a finite number (float32 holds up to 3.4e38), got inf',
  ),
  (
    'learning rate past float32',
    ['--config.optim.learning_rate=1e39'],
    'learning_rate must be a finite number (float32 holds up to 3.4e38), got 1e+39',
  ),
  ('negative learning rate', ['--config.optim.learning_rate=-1'], 'learning_rate must be > 0'),
  ('not a number', ['--config.optim.b1=fast'], "'fast' is not a number"),
  ('Adam b2 of 1', ['--config.optim.b2=1'], 'OptimConfig.b2 must be in [0, 1), got 1.0'),
  ('NaN KL coefficient', ['--config.loss.kl_coef=nan'], 'LossConfig.kl_coef must be a finite'),
  ('reward past float32', ['--config.env.win_reward=1e39'], 'win_reward must be a finite'),
  ('seed that replays seed 0', ['--config.seed=2147483647'], 'seed=2147483647'),
  ('no checkpoints kept', ['--config.keep_checkpoints=0'], 'keep_checkpoints must be a positive'),
  ('empty name', ['--config.name='], "ExperimentConfig.name=''"),
  ('unknown schedule', ['--config.optim.schedule=cubic'], "'cubic' is not one of"),
  ('not a bool', ['--config.pack=maybe'], "'maybe' is not a bool"),
  ('buckets out of order', ['--config.buckets.lengths=512,256'], 'strictly increasing'),
  ('no buckets', ['--config.buckets.lengths='], 'lengths is empty'),
  (
    'evaluation episodes no layout splits',
    ['--config.eval_episodes=3'],
    'eval_episodes=3: the evaluation plays on the rollout layout',
  ),
  ('unknown model preset', ['--config.model=huge'], "Unknown model preset 'huge'"),
  ('missing model dir', ['--config.model_dir={tmp}/no_model'], 'no_model'),
  ('truncated config.json', ['--config.model_dir={tmp}/truncated_model'], 'is not valid JSON'),
  ('unknown tokenizer', ['--config.tokenizer=gpt9'], "Unknown tokenizer 'gpt9'"),
  ('no tokenizer.json', ['--config.tokenizer={tmp}/no_tokenizer'], 'No tokenizer.json in'),
  (
    'reply tokens outside the tokenizer',
    ['--config.rollout.reply_tokens=A,B'],
    "rollout.reply_tokens=('A', 'B'): GameTokenizer cannot encode character 'A'",
  ),
  ('prompt buckets too small', ['--config.rollout.prompt_buckets=4'], 'prompt_buckets=(4,)'),
  ('unknown game', ['--config.env.game=chess'], 'chess'),
  ('unknown opponent', ['--config.eval_env.opponent=alphazero'], 'alphazero'),
  ('unknown strategy', ['--config.dispatch.strategy=teleport'], 'teleport'),
  ('negative temperature', ['--config.rollout.sampling.temperature=-1'], 'temperature'),
  ('micro-batches that do not divide', ['--config.micro_batches=3'], 'micro_batches=3'),
  ('unparsable layout', ['--config.selector.candidates=dp3x'], 'dp3x'),
  ('no layouts', ['--config.selector.candidates='], 'SelectorConfig.candidates is empty'),
  ('layout over too many devices', ['--config.selector.candidates=dp16'], 'dp16'),
  ('layout that does not divide the model', ['--config.selector.candidates=dp1.tp8'], 'tp=8'),
  ('negative budget', ['--config.selector.budget_mib=-5'], 'budget_mib'),
  ('infinite budget', ['--config.selector.budget_mib=inf'], 'budget_mib must be a finite'),
  ('unknown fsdp stage', ['--config.selector.with_fsdp=train,nope'], "Unknown stage 'nope'"),
  ('unknown flag', ['--nosuchflag'], 'nosuchflag'),  # from here on: both entry points
  ('unclosed tuple', ['--config.buckets.lengths=(64,128'], "'(64,128' is not a tuple"),
  ('no fake devices', ['--cpu_devices=0'], 'cpu_devices'),
  ('resume without a checkpoint', ['--resume'], 'no checkpoint in'),
  ('workdir under a file', ['--workdir={tmp}/a_file/run'], 'is a file'),
  ('used workdir', ['--workdir={tmp}/used'], 'holds a run'),
  (
    'set aside for a bad tokenizer',
    ['--move_aside', '--workdir={tmp}/used', '--config.tokenizer=gpt9'],
    "Unknown tokenizer 'gpt9'",
  ),
  ('workdir name too long', ['--workdir={tmp}/' + 'w' * 256], 'w' * 256),
  ('empty workdir', ['--workdir='], '--workdir'),
  ('missing warm start', ['--config.init_from={tmp}/nope'], 'does not exist or is not a folder'),
  (
    'code without its warm start',  # its init_from, runs/code_sft/checkpoints, is not there
    ['--config=code'],
    "init_from='runs/code_sft/checkpoints' does not exist or is not a folder: expected the "
    'checkpoints folder of a warm start; run it first, e.g. `python experiments/sft.py '
    '--config=code`',
  ),
]


# The same in experiments/sft.py: its own config's fields, and from 'unknown flag' on in
# BAD_INPUTS the flags and workdirs both entry points share.
SFT_BAD_INPUTS = [
  ('unknown preset', ['--config=nope'], '--config=nope'),
  ('unknown field', ['--config.nope=1'], "no field 'nope'"),
  ('unknown nested field', ['--config.optim.nope=1'], "OptimConfig has no field 'nope'"),
  ('not an int', ['--config.steps=abc'], "'abc' is not an int"),
  ('zero steps', ['--config.steps=0'], 'steps must be a positive int, got 0'),
  ('steps past the int32 step counter', ['--config.steps=99999999999'], 'expected at most'),
  (
    'infinite learning rate',
    ['--config.optim.learning_rate=inf'],
    'learning_rate must be a finite number (float32 holds up to 3.4e38), got inf',
  ),
  ('seed that replays seed 0', ['--config.seed=2147483647'], 'seed=2147483647'),
  ('negative guard', ['--config.max_skipped_in_a_row=-1'], 'max_skipped_in_a_row must be an int'),
  ('no checkpoints kept', ['--config.keep_checkpoints=0'], 'keep_checkpoints must be a positive'),
  ('empty name', ['--config.name='], "SFTConfig.name=''"),
  ('no buckets', ['--config.buckets.lengths='], 'lengths is empty'),
  ('buckets too short', ['--config.buckets.lengths=64'], 'expected a largest bucket >='),
  ('unknown model preset', ['--config.model=huge'], "Unknown model preset 'huge'"),
  ('missing model dir', ['--config.model_dir={tmp}/no_model'], 'no_model'),
  ('unknown tokenizer', ['--config.tokenizer=gpt9'], "Unknown tokenizer 'gpt9'"),
  ('task without references', ['--config.env.task=repo_repair'], 'reference solutions'),
]


def _bad_inputs(entry: str) -> list[tuple[str, list[str], str]]:
  if entry == 'train':
    return BAD_INPUTS
  shared = [name for name, _, _ in BAD_INPUTS].index('unknown flag')
  return SFT_BAD_INPUTS + BAD_INPUTS[shared:-2]  # not the RL job's warm starts


def _run(args: list[str], cwd: str = ROOT, entry: str = 'train') -> subprocess.CompletedProcess:
  """`python -m <entry's module> --config=smoke args` in `cwd`, as a user runs it."""
  env = helpers.entry_point_env()
  return subprocess.run(
    [sys.executable, '-m', ENTRIES[entry].module, '--config=smoke', *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=300,
  )


def _listing(folder) -> dict[str, tuple[int, int] | None]:
  """Every folder (None) and file ((size, mtime)) under `folder`, recursively."""
  out = {}
  for dirpath, dirnames, files in os.walk(folder):
    for d in dirnames:
      out[os.path.relpath(os.path.join(dirpath, d), folder) + os.sep] = None
    for f in files:
      path = os.path.join(dirpath, f)
      stat = os.stat(path)
      out[os.path.relpath(path, folder)] = (stat.st_size, stat.st_mtime_ns)
  return out


@pytest.mark.parametrize('entry', ENTRIES)
def test_every_bad_input_ends_in_one_line_and_writes_nothing(tmp_path, entry):
  (tmp_path / 'a_file').write_text('not a folder')
  (tmp_path / 'used').mkdir()
  (tmp_path / 'used' / 'metrics.jsonl').write_text('{"step": 1}\n')
  (tmp_path / 'no_tokenizer').mkdir()
  (tmp_path / 'truncated_model').mkdir()
  config_json = helpers.fixture_path('qwen2_tiny', 'config.json')
  with open(config_json) as f:
    text = f.read()
  (tmp_path / 'truncated_model' / 'config.json').write_text(text[: len(text) // 2])
  cases = []
  for name, args, fragment in _bad_inputs(entry):
    workdir = tmp_path / name.replace(' ', '_')
    args = [a.format(tmp=tmp_path) for a in args]
    if not any(a.startswith('--workdir') for a in args):
      args.append(f'--workdir={workdir}')
    cases.append((name, args, fragment))
  before = _listing(tmp_path)
  # Each as `python -m <module> --config=smoke args` runs, forked after one import of its
  # libraries (every case is refused before anything compiles).
  results = entry_runs.run_many(
    ENTRIES[entry].module,
    [['--config=smoke', *args] for _, args, _ in cases],
    cwd=str(tmp_path),
    env=helpers.entry_point_env(),
    workers=min(4, os.cpu_count() or 1),
  )
  failures = []
  for (name, args, fragment), r in zip(cases, results):
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    ok = (
      r.returncode == 2
      and len(lines) == 1
      and lines[0].startswith('error: ')
      and fragment in lines[0]
    )
    if not ok:
      failures.append(f'{name} {args}: rc={r.returncode}, stderr tail: {lines[-3:]}')
  assert not failures, '\n'.join(failures)
  assert len(cases) >= {'train': 54, 'sft': 26}[entry]
  # Nothing half-written: no file or folder was created or changed by a refused run.
  after = _listing(tmp_path)
  assert after == before, sorted(set(after.items()) ^ set(before.items()))


def test_debug_shows_the_traceback(tmp_path):
  r = _run(['--config.steps=0', '--debug', f'--workdir={tmp_path}/w'], cwd=str(tmp_path))
  assert r.returncode != 0 and 'Traceback' in r.stderr and 'ConfigError' in r.stderr


@pytest.mark.parametrize('entry', ENTRIES)
def test_a_used_workdir_is_moved_aside_on_request(tmp_path, entry):
  used = tmp_path / 'run'
  used.mkdir()
  (used / 'metrics.jsonl').write_text('{"step": 1}\n')
  args = ['--move_aside', f'--workdir={used}', '--config.steps=1', '--config.eval_every=0']
  r = _run(args, entry=entry)
  assert r.returncode == 0, r.stderr[-2000:]
  aside = [p for p in os.listdir(tmp_path) if p.startswith('run.')]
  assert len(aside) == 1
  assert (tmp_path / aside[0] / 'metrics.jsonl').read_text() == '{"step": 1}\n'
  assert os.path.exists(used / 'metrics.jsonl') and os.path.exists(used / 'config.json')


def _final_checksums(workdir) -> list[int]:
  """The array checksums in the newest checkpoint's meta: the parameters and moments, bitwise."""
  ckpts = workdir / 'checkpoints'
  step = max(int(p) for p in os.listdir(ckpts) if p.isdigit())
  for dirpath, _, files in os.walk(ckpts / str(step) / 'meta'):
    for f in files:
      if 'metadata' in f:
        with open(os.path.join(dirpath, f)) as fh:
          return json.load(fh)['array_checksums']
  raise AssertionError(f'no meta in {ckpts / str(step)}')


@dataclasses.dataclass(frozen=True)
class Reference:
  """An entry point's `Entry.run`, uninterrupted, checkpointed at every step."""

  entry: str
  workdir: os.PathLike

  @property
  def run(self) -> list[str]:
    return list(ENTRIES[self.entry].run)

  def rows(self, workdir=None) -> list[dict]:
    """The logged values an interrupted run must share with this one (of `workdir`'s run)."""
    path = str((workdir or self.workdir) / 'metrics.jsonl')
    return [{k: r.get(k) for k in ENTRIES[self.entry].keep} for r in metrics.read_jsonl(path)]


@pytest.fixture(scope='module', params=list(ENTRIES))
def reference(request, tmp_path_factory) -> Reference:
  """One per entry point (a test that takes it runs for both), made once."""
  workdir = tmp_path_factory.mktemp('reference') / 'ref'
  entry = request.param
  ref = _run(
    [*ENTRIES[entry].run, '--config.checkpoint_every=1', f'--workdir={workdir}'], entry=entry
  )
  assert ref.returncode == 0, ref.stderr[-2000:]
  return Reference(entry, workdir)


def _start(args: list[str]) -> subprocess.Popen:
  """`python -m <args>` from the project root, as a user starts it, in its own process group."""
  env = helpers.entry_point_env()
  return subprocess.Popen(
    [sys.executable, '-m', *args],
    cwd=ROOT,
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
    process_group=0,
  )


def _wait_for_step(workdir, proc: subprocess.Popen, step: int) -> None:
  """Until metrics.jsonl has a row of `step` (the loop is running, its handlers installed)."""
  path = workdir / 'metrics.jsonl'
  deadline = time.monotonic() + 300
  while not (path.exists() and any(r.get('step') == step for r in metrics.read_jsonl(str(path)))):
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    assert time.monotonic() < deadline, 'the run did not reach the step'
    time.sleep(0.05)


@pytest.mark.parametrize('signum', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_at_a_saved_step_then_resume_equals_an_uninterrupted_run(
  tmp_path, reference, signum
):
  """SIGTERM (a scheduler's preemption) or Ctrl-C: the run finishes its step, saves it (though
  no checkpoint was due), says so in one line and exits 128 + the signal; --resume ends where
  the uninterrupted run ends, bitwise."""
  workdir = tmp_path / 'stopped'
  run = [*reference.run, '--config.checkpoint_every=100', f'--workdir={workdir}']
  entry = ENTRIES[reference.entry]
  proc = _start([entry.module, '--config=smoke', *run])
  _wait_for_step(workdir, proc, 1)
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 128 + signum, err[-2000:]
  name = signal.Signals(signum).name
  stopped = [line for line in out.splitlines() if line.startswith('stopped at step')]
  assert len(stopped) == 1 and 'Traceback' not in err, (out[-1000:], err[-2000:])
  step = int(stopped[0].split()[3])
  assert stopped[0] == f'stopped at step {step} by {name}; checkpoint saved; resume with --resume'
  assert 1 <= step < entry.steps and sorted(os.listdir(workdir / 'checkpoints')) == [str(step)]
  resumed = _run([*run, '--resume'], entry=reference.entry)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert reference.rows(workdir) == reference.rows()
  assert _final_checksums(workdir) == _final_checksums(reference.workdir)


@pytest.mark.parametrize('entry', ENTRIES)
def test_a_second_ctrl_c_stops_at_once(tmp_path, entry):
  workdir = tmp_path / 'run'
  args = [ENTRIES[entry].module, '--config=smoke', *ENTRIES[entry].long, f'--workdir={workdir}']
  proc = _start(args)
  _wait_for_step(workdir, proc, 1)
  # The second Ctrl-C goes as soon as the first one's handler has said so (a step takes a
  # fraction of a second: after a fixed pause the run may have stopped at the step's end).
  chunks: list[str] = []
  reader = threading.Thread(target=lambda: chunks.extend(iter(proc.stderr.readline, '')))
  reader.start()
  proc.send_signal(signal.SIGINT)
  deadline = time.monotonic() + 60
  while not any('to stop at once' in c for c in chunks):
    assert proc.poll() is None and time.monotonic() < deadline, ''.join(chunks)[-2000:]
    time.sleep(0.001)
  t0 = time.monotonic()
  proc.send_signal(signal.SIGINT)
  proc.wait(timeout=60)
  reader.join()
  err = ''.join(chunks)
  assert proc.returncode == 130 and time.monotonic() - t0 < 10, err[-2000:]
  lines = [line for line in err.splitlines() if line.strip()]
  assert lines[-1].startswith('interrupted: stopped at once') and 'Traceback' not in err, lines


@pytest.mark.parametrize('entry', ENTRIES)
def test_a_signal_before_the_first_step_stops_at_once_in_one_line(tmp_path, entry):
  """SIGTERM while the job is built and compiles (the RL job: as soon as it names its workdir;
  the warm start: before its first evaluation): one line, exit 143, nothing saved, the workdir
  free."""
  workdir = tmp_path / 'run'
  proc = _start(
    [ENTRIES[entry].module, '--config=smoke', *ENTRIES[entry].run, f'--workdir={workdir}']
  )
  assert proc.stdout.readline().startswith('earl_jax'), proc.communicate()[1][-2000:]
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 143, err[-2000:]
  assert out.splitlines()[-1] == 'stopped by SIGTERM before the first step: nothing to save'
  assert 'Traceback' not in err, err[-2000:]
  assert not (workdir / '.lock').exists() and not (workdir / 'checkpoints').exists()
  rows = (
    metrics.read_jsonl(str(workdir / 'metrics.jsonl'))
    if (workdir / 'metrics.jsonl').exists()
    else []
  )
  assert not [r for r in rows if r['step'] > 0]


@pytest.mark.parametrize('entry', ENTRIES)
def test_a_second_run_in_a_live_workdir_is_refused_and_a_garbled_history_resumes(tmp_path, entry):
  """While a run lives, a second one in its workdir (here a --resume) is refused in one line;
  once the first has stopped on SIGTERM, a metrics.jsonl with a garbled line resumes, saying so
  in one line, with every readable row kept."""
  workdir = tmp_path / 'run'
  module, long = ENTRIES[entry].module, ENTRIES[entry].long
  proc = _start(
    [module, '--config=smoke', *long, '--config.checkpoint_every=1', f'--workdir={workdir}']
  )
  _wait_for_step(workdir, proc, 1)
  second = _run([*long, f'--workdir={workdir}', '--resume'], entry=entry)
  lines = [line for line in second.stderr.splitlines() if line.strip()]
  assert second.returncode == 2 and len(lines) == 1, second.stderr[-2000:]
  assert f'--workdir {workdir} is in use by a live run (host ' in lines[0]
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-2000:]
  step = int(next(x for x in out.splitlines() if x.startswith('stopped at step')).split()[3])
  kept = len(metrics.read_jsonl(str(workdir / 'metrics.jsonl')))
  with open(workdir / 'metrics.jsonl', 'a') as f:
    f.write('{"step": 99, "lo\n')  # a garbled row (a last one cut short goes without a word)
  steps = f'--config.steps={step + 1}'
  resumed = _run(
    [*long, steps, '--config.eval_every=0', f'--workdir={workdir}', '--resume'], entry=entry
  )
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  said = [x for x in resumed.stderr.splitlines() if 'metrics.jsonl of' in x]
  assert len(said) == 1 and f'line {kept + 1} unreadable' in said[0], resumed.stderr[-2000:]
  rows = metrics.read_jsonl(str(workdir / 'metrics.jsonl'))
  assert [r['step'] for r in rows if r['step'] > 0] == list(range(1, step + 2))


def _process_id(pid: int) -> int:
  """The JAX process index the launcher gave the worker `pid` (from its environment)."""
  with open(f'/proc/{pid}/environ', 'rb') as f:
    env = dict(v.split(b'=', 1) for v in f.read().split(b'\0') if b'=' in v)
  return int(env[b'EARL_PROCESS_ID'])


@pytest.mark.multiprocess
@pytest.mark.parametrize('reference', ['train'], indirect=True)
def test_a_signal_to_one_of_two_processes_stops_both_at_the_same_saved_step(tmp_path, reference):
  """SIGTERM to worker 1 alone (a scheduler preempting one host): both processes stop at the
  same step and save it, the launcher exits 143; --resume on two processes ends where the
  one-process run ends."""
  workdir = tmp_path / 'two'
  train = [sys.executable, '-m', 'experiments.train', '--config=smoke', *reference.run]
  train += ['--config.checkpoint_every=100', f'--workdir={workdir}']
  launch = ['earl_jax.launch', '-n', '2', '-d', '4', '--', *train]
  proc = _start(launch)
  _wait_for_step(workdir, proc, 1)
  workers = subprocess.run(
    ['pgrep', '-P', str(proc.pid)], capture_output=True, text=True, check=True
  ).stdout.split()
  assert len(workers) == 2, workers
  by_id = {_process_id(int(pid)): int(pid) for pid in workers}
  os.kill(by_id[1], signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 143, err[-3000:]
  assert 'received by one of the 2 processes' in err and 'exit code 143' in err, err[-2000:]
  stopped = [line for line in out.splitlines() if line.startswith('stopped at step')]
  assert len(stopped) == 1, out[-2000:]
  step = int(stopped[0].split()[3])
  assert 1 <= step < 4 and sorted(os.listdir(workdir / 'checkpoints')) == [str(step)]
  again = _start([*launch, '--resume'])
  _, err = again.communicate(timeout=300)
  assert again.returncode == 0, err[-3000:]
  rows, ref = reference.rows(workdir), reference.rows()
  assert [r['step'] for r in rows] == [r['step'] for r in ref]
  for a, b in zip(rows, ref):
    for k in ENTRIES['train'].keep:
      assert a[k] == pytest.approx(b[k], abs=1e-5), (a['step'], k, a[k], b[k])


def _mount(args: list[str], *, skip: bool = True) -> None:
  r = subprocess.run(['mount', *args], capture_output=True, text=True)
  if r.returncode and skip:
    pytest.skip(f'cannot mount here (root can mount a tmpfs): {r.stderr.strip()}')
  assert r.returncode == 0, r.stderr


def _one_error_line(r: subprocess.CompletedProcess) -> str:
  lines = [line for line in r.stderr.replace('\r', '\n').splitlines() if line.strip()]
  lines = [line for line in lines if 'it/s]' not in line and 's/it]' not in line]  # tqdm
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith('error: '), lines[-20:]
  return lines[0]


def test_a_full_or_read_only_disk_stops_the_run_in_one_line_and_resume_continues(
  tmp_path, reference
):
  """A save that cannot be written (a full tmpfs, then a read-only checkpoints folder) stops the
  run at that step with one line naming the path and the OS error; the checkpoints already
  complete are kept, and --resume continues once the disk is writable again."""
  if os.geteuid() != 0:
    pytest.skip('mounting a tmpfs needs root')
  disk = tmp_path / 'disk'
  disk.mkdir()
  _mount(['-t', 'tmpfs', '-o', 'size=16m', 'tmpfs', str(disk)])
  try:
    workdir = disk / 'run'
    run = [*reference.run, '--config.checkpoint_every=1', f'--workdir={workdir}']
    first = _run([*run, '--config.steps=2'], entry=reference.entry)
    assert first.returncode == 0, first.stderr[-2000:]
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    (disk / 'filler').write_bytes(b'\0' * (free - (256 << 10)))  # 256 KiB left: no checkpoint
    full = _run([*run, '--resume'], entry=reference.entry)
    line = _one_error_line(full)
    assert f'checkpoint step 3 could not be written to {workdir}/checkpoints' in line, line
    assert 'No space left on device' in line and 'ENOSPC' in line, line
    assert 'the checkpoints already complete are kept (newest: step 2)' in line, line
    assert sorted(os.listdir(workdir / 'checkpoints')) == ['1', '2']
    os.remove(disk / 'filler')
    ckpts = str(workdir / 'checkpoints')
    _mount(['--bind', ckpts, ckpts], skip=False)
    try:
      _mount(['-o', 'remount,ro,bind', ckpts], skip=False)
      read_only = _run([*run, '--resume'], entry=reference.entry)
    finally:
      subprocess.run(['umount', ckpts], check=True)
    line = _one_error_line(read_only)
    assert 'checkpoint step 3 could not be written' in line and 'EROFS' in line, line
    resumed = _run([*run, '--resume'], entry=reference.entry)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert reference.rows(workdir) == reference.rows()
    assert _final_checksums(workdir) == _final_checksums(reference.workdir)
  finally:
    subprocess.run(['umount', '-l', str(disk)], check=False)


def test_kill_during_a_save_then_resume_equals_an_uninterrupted_run(tmp_path, reference):
  """A real training process killed with SIGKILL while Orbax writes a checkpoint; `--resume`
  continues from the newest complete one, and ends where an uninterrupted run ends, bitwise."""
  run = [*reference.run, '--config.checkpoint_every=1']
  module = ENTRIES[reference.entry].module

  workdir = tmp_path / 'killed'
  env = helpers.entry_point_env()
  proc = subprocess.Popen(
    [sys.executable, '-m', module, '--config=smoke', *run, f'--workdir={workdir}'],
    cwd=ROOT,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  killed_in = None
  deadline = time.monotonic() + 300
  while proc.poll() is None and time.monotonic() < deadline:
    ckpts = workdir / 'checkpoints'
    names = os.listdir(ckpts) if ckpts.is_dir() else []
    tmp = [n for n in names if 'orbax-checkpoint-tmp' in n]
    if tmp and [n for n in names if n.isdigit()]:  # a later save, one checkpoint complete
      proc.kill()
      killed_in = tmp[0]
      break
  proc.wait()
  assert killed_in is not None, 'the run ended before a save could be interrupted'
  assert proc.returncode == -signal.SIGKILL

  resumed = _run([*run, f'--workdir={workdir}', '--resume'], entry=reference.entry)
  assert resumed.returncode == 0, resumed.stderr[-2000:]
  assert reference.rows(workdir) == reference.rows()
  assert _final_checksums(workdir) == _final_checksums(reference.workdir)
