"""Slot refill against lock-step: the same M episodes on B slots, side by side in one run.

  python experiments/rollout_refill.py                                  # think + default, B 8/16/32
  python experiments/rollout_refill.py --presets=think --slots=16 --ratios=4 --repeats=3
  python experiments/rollout_refill.py --presets=code --at_once     # needs the code warm start

For each preset, B (slots) and M = ratio x B (episodes), both schedules play the same M episodes
from the same parameters and seed: `lockstep` starts the next B episodes only when all B slots
are free (today's engine, in waves), `refill` hands a slot to the next episode as soon as its
episode ends. Each is warmed up once (every shape compiled), then timed --repeats times, the two
alternating and every other repeat in reverse order. The board-game presets (`think`, `default`,
`long`, ...) play the preset's model (untied) from a random init, its LM head biased toward the
column digits, so that games run several turns and end at different times as a partly trained
policy's do; presets that constrain replies (`think`: a thought or the move thought of) sample
within their reply tokens. `code` (the 'functions' tasks of the train split, 2 turns, replies of
up to 40 tokens judged by the sandbox) plays its warm start, `--code_checkpoint` (the
checkpoints of `python experiments/sft.py --config=code`), restored as the main job restores
`init_from` (`placement.load_warm_start`): a random-init policy writes no program that passes,
so every episode would run both turns. Its episodes are the preset's GRPO groups (4 samples of a
task at temperature 1); an episode ends after its first turn when the program passes, else after
the repair turn. With --at_once, a third schedule plays all M episodes at once on M slots (the
engine before slots; what `code` runs by default, 64 at once).

Reported per row (medians over the repeats): episodes/s, generated tokens/s, the padded
fraction of decode and prefill slot-tokens, slot occupancy (and the share of calls in the
drain, once no episode waits), p50/p95 episode latency, compiles during the timed runs (must be
0) and whether both schedules produced identical episodes (tokens equal, log-probs within
1e-5). The control (--control) caps every episode at 3 turns, which no Connect Four game ends
before, so that every episode has the same length: the two schedules make the same calls and
should tie (its runs are short, so it is repeated 5x as often). On `code` the control caps every
episode at 1 turn: the number of turns is then equal, but not the length in tokens (a reply
ends at its end-of-turn token, anywhere up to 40 tokens, and tasks differ in prompt length).
Both schedules still make the same calls (every slot frees after each call, so refill, like
lock-step, admits the next B at once) with the same padding inside each call, so they should
tie; only all-at-once differs (one call of M rows).
"""

import dataclasses
import json
import os
import statistics
import time

import jax
import jax.monitoring
import numpy as np
from absl import flags

from earl_jax import runtime
from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.errors import ConfigError

_PRESETS = flags.DEFINE_list('presets', ['think', 'default'], 'Presets of experiments/train.py.')
_SLOTS = flags.DEFINE_list('slots', ['8', '16', '32'], 'B, the slots.')
_RATIOS = flags.DEFINE_list('ratios', ['2', '4'], 'M / B, episodes per slot.')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed runs of each schedule (after a warm-up).')
_CONTROL = flags.DEFINE_bool('control', True, 'Add the equal-length control (3 turns each).')
_LAYOUT = flags.DEFINE_string('layout', 'dp8', 'The rollout layout (a ParallelConfig name).')
_SEED = flags.DEFINE_integer('seed', 0, 'Seeds the episodes and the parameters.')
_PROMPT_BUCKETS = flags.DEFINE_list(
  'prompt_buckets', [], "Override the presets' prompt buckets (empty: the preset's)."
)
_AT_ONCE = flags.DEFINE_bool(
  'at_once', False, 'Also run all M episodes at once on M slots (the engine before slots).'
)
_CODE_CHECKPOINT = flags.DEFINE_string(
  'code_checkpoint',
  'runs/code_sft/checkpoints',
  "The code preset's policy: the checkpoints of `python experiments/sft.py --config=code`.",
)
_OUT = flags.DEFINE_string('out', 'runs/rollout_refill.json', 'JSON results.')

SCHEDULES = ('lockstep', 'refill')
CONTROL_TURNS = 3  # no Connect Four game ends before the agent's fourth move
CODE_CONTROL_TURNS = 1  # every code episode one turn (its replies still differ in length)
CONTROL_REPEATS = 5  # x --repeats


class _CompileCounter:
  """Counts XLA backend compiles while installed."""

  def __init__(self):
    self.count = 0

  def __call__(self, event, duration, **kwargs):
    del duration, kwargs
    if event == '/jax/core/compile/backend_compile_duration':
      self.count += 1


def _biased_policy(model_cfg: ModelConfig, tokenizer, mesh, seed: int):
  """Random weights whose replies are (almost always) a column digit: every embedding +4 on
  dimension 0, which the LM head maps onto the digits '1'..'7'."""
  from earl_jax.models import qwen2

  _, params = qwen2.init_model(model_cfg, mesh, seed=seed)
  digits = [tokenizer.encode(str(d))[0] for d in range(1, 8)]
  embed = np.array(params['embed_tokens'][...])
  embed[:, 0] += 4.0
  head = np.array(params['lm_head'][...])
  head[0, digits] += 8.0
  params['embed_tokens'][...] = jax.device_put(embed, params['embed_tokens'][...].sharding)
  params['lm_head'][...] = jax.device_put(head, params['lm_head'][...].sharding)
  return params


def _warm_start(config) -> bool:
  """Whether the preset's policy is a warm start (`code`: `--code_checkpoint`), not random."""
  return config.init_from is not None


def _model(config) -> ModelConfig:
  """The policy's shapes: the preset's model (untied when it starts from a random init)."""
  from earl_jax.train import assembly

  model_cfg, _ = assembly.load_model(config)
  return model_cfg if _warm_start(config) else model_cfg.replace(tie_word_embeddings=False)


def _check_warm_starts(names: list[str]) -> None:
  """Raises a one-line ConfigError, before anything compiles, if a preset that plays a warm
  start has none at `--code_checkpoint` (or one of another model)."""
  from earl_jax.train import placement
  from experiments.configs import train as presets

  for name in names:
    config = presets.PRESETS[name]()
    if _warm_start(config):
      try:
        placement.check_warm_start(_CODE_CHECKPOINT.value, _model(config))
      except placement.WarmStartError as e:
        raise ConfigError(f"--code_checkpoint (the {name!r} preset's policy): {e}") from None


def _same_episodes(a, b) -> tuple[bool, float]:
  """Whether two rollouts hold the same episodes token for token, and the largest log-prob gap."""
  if a.tokens.shape != b.tokens.shape or not np.array_equal(a.row_ids, b.row_ids):
    return False, float('inf')
  gap = float(np.abs(a.logprobs - b.logprobs).max(initial=0.0))
  same = (
    np.array_equal(a.tokens, b.tokens)
    and np.array_equal(a.loss_mask, b.loss_mask)
    and a.outcomes == b.outcomes
    and gap <= 1e-5
  )
  return bool(same), gap


def _measure(eng, params, mesh, seed: int, counter: _CompileCounter):
  """One timed rollout: its figures and its trajectories."""
  before, compiles = counter.count, eng.programs.compiles
  t0 = time.perf_counter()
  traj = eng.run(params, mesh, seed=seed)
  wall = time.perf_counter() - t0
  stats = traj.rollout_stats
  return {
    'wall_s': wall,
    'episodes_per_s': traj.num_episodes / wall,
    'tokens_per_s': traj.generated_tokens / wall,
    'decode_padded': stats['decode_padded'],
    'prefill_padded': stats['prefill_padded'],
    'slot_occupancy': stats['slot_occupancy'],
    'drain_calls': stats['drain_calls'],
    'calls': stats['calls'],
    'latency_p50_s': float(np.percentile(traj.episode_seconds, 50)),
    'latency_p95_s': float(np.percentile(traj.episode_seconds, 95)),
    'compiles': (counter.count - before) + (eng.programs.compiles - compiles),
    'generate_s': traj.timings['generate_s'],
    'env_s': traj.timings['env_s'],
    'host_s': traj.timings['host_s'],
  }, traj


def _case(preset: str, B: int, M: int, control: bool, counter: _CompileCounter) -> dict:
  """Both schedules of one (preset, B, M), warmed up, then timed in alternating order."""
  from earl_jax.models import tokenizer as tokenizer_lib
  from earl_jax.programs import Executables, StageSpec
  from earl_jax.rollout import engine
  from experiments.configs import train as presets

  config = presets.PRESETS[preset]()
  model_cfg = _model(config)
  tok = tokenizer_lib.load_tokenizer(config.tokenizer)
  group = config.rollout.group_size
  control_turns = CODE_CONTROL_TURNS if _warm_start(config) else CONTROL_TURNS
  rollout = dataclasses.replace(
    config.rollout,
    num_episodes=M,
    num_slots=B,
    group_size=group if M % group == 0 else 1,
    max_turns=control_turns if control else config.rollout.max_turns,
  )
  if _PROMPT_BUCKETS.value:
    rollout = dataclasses.replace(
      rollout, prompt_buckets=tuple(_ints('prompt_buckets', _PROMPT_BUCKETS.value))
    )
  spec = StageSpec.for_rollout(rollout, tok, model_cfg.vocab_size)
  exe = Executables(model_cfg, spec=spec)
  mesh = exe.mesh(ParallelConfig.parse(_LAYOUT.value))
  if _warm_start(config):
    from earl_jax.train import placement

    params = placement.load_warm_start(_CODE_CHECKPOINT.value, model_cfg, mesh)
  else:
    params = _biased_policy(model_cfg, tok, mesh, _SEED.value)
  schedules = SCHEDULES + (('at_once',) if _AT_ONCE.value else ())
  settings = {
    'lockstep': {'refill': False},
    'refill': {'refill': True},
    'at_once': {'num_slots': None},
  }
  engines = {
    name: engine.RolloutEngine(
      model_cfg,
      tok,
      config.env,
      dataclasses.replace(rollout, **settings[name]),
      config.buckets,
      programs=exe,
    )
    for name in schedules
  }
  runs: dict[str, list[dict]] = {name: [] for name in schedules}
  trajs = {}
  for name in schedules:  # warm-up: every shape these episodes need
    _, trajs[name] = _measure(engines[name], params, mesh, _SEED.value, counter)
  same, gap = _same_episodes(trajs['lockstep'], trajs['refill'])
  for name in schedules[2:]:
    same &= _same_episodes(trajs['lockstep'], trajs[name])[0]
  # A control run is short (3 turns, 1 on code): more of them, so that the tie is not lost in the noise.
  repeats = _REPEATS.value * (CONTROL_REPEATS if control else 1)
  for r in range(repeats):
    order = schedules if r % 2 == 0 else schedules[::-1]
    for name in order:
      figures, traj = _measure(engines[name], params, mesh, _SEED.value, counter)
      runs[name].append(figures)
      same &= _same_episodes(trajs[name], traj)[0]
  exe.close()
  lengths = trajs['refill'].lengths
  return {
    'preset': preset,
    'control': control,
    'slots': B,
    'episodes': M,
    # at_once: all M episodes on M slots, the engine before slots (its B is M).
    'identical': same,
    'max_logprob_gap': gap,
    'episode_len_min': int(lengths.min()),
    'episode_len_mean': float(lengths.mean()),
    'episode_len_max': int(lengths.max()),
    'schedules': {
      name: {
        'median': {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]},
        'runs': runs[name],
      }
      for name in schedules
    },
  }


def _table(cases: list[dict]) -> str:
  head = (
    f'{"preset":<18}{"B":>4}{"M":>5}  {"schedule":<9}{"eps/s":>8}{"tok/s":>8}{"dec pad":>8}'
    f'{"pre pad":>8}{"occup":>7}{"drain":>7}{"p50 s":>7}{"p95 s":>7}{"comp":>5}'
    f'{"speedup":>8}  same'
  )
  lines = [head, '-' * len(head)]  # at_once: all M episodes on M slots
  for case in cases:
    name = case['preset'] + (' (control)' if case['control'] else '')
    base = case['schedules']['lockstep']['median']['episodes_per_s']
    for schedule, figures in case['schedules'].items():
      m = figures['median']
      lines.append(
        f'{name:<18}{case["slots"]:>4}{case["episodes"]:>5}  {schedule:<9}'
        f'{m["episodes_per_s"]:>8.2f}{m["tokens_per_s"]:>8.1f}{m["decode_padded"]:>8.2f}'
        f'{m["prefill_padded"]:>8.2f}{m["slot_occupancy"]:>7.2f}{m["drain_calls"]:>7.2f}'
        f'{m["latency_p50_s"]:>7.2f}{m["latency_p95_s"]:>7.2f}{int(m["compiles"]):>5}'
        f'{m["episodes_per_s"] / base:>7.2f}x  {"yes" if case["identical"] else "NO"}'
      )
  return '\n'.join(lines)


def _ints(name: str, values: list[str]) -> list[int]:
  if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
    raise ConfigError(f'--{name} must be positive integers, got {values}.')
  return [int(v) for v in values]


def main(argv):
  del argv
  from experiments.configs import train as presets

  slots, ratios = _ints('slots', _SLOTS.value), _ints('ratios', _RATIOS.value)
  unknown = sorted(set(_PRESETS.value) - set(presets.PRESETS))
  if unknown:
    raise ConfigError(f'--presets: unknown {unknown}; known: {sorted(presets.PRESETS)}.')
  if _REPEATS.value < 1:
    raise ConfigError(f'--repeats must be >= 1, got {_REPEATS.value}.')
  ParallelConfig.parse(_LAYOUT.value)
  runtime.setup(cpu_devices=8)
  _check_warm_starts(_PRESETS.value)
  counter = _CompileCounter()
  jax.monitoring.register_event_duration_secs_listener(counter)
  cases = []
  for preset in _PRESETS.value:
    plan = [(B, r * B, False) for B in slots for r in ratios]
    if _CONTROL.value:
      plan.append((slots[len(slots) // 2], ratios[-1] * slots[len(slots) // 2], True))
    for B, M, control in plan:
      print(f'{preset}{" control" if control else ""}: B={B}, M={M} ...', flush=True)
      cases.append(_case(preset, B, M, control, counter))
      print(_table(cases[-1:]), flush=True)
  print()
  print(_table(cases))
  result = {
    'layout': _LAYOUT.value,
    'prompt_buckets': _PROMPT_BUCKETS.value or 'preset',
    'repeats': _REPEATS.value,
    'seed': _SEED.value,
    'code_checkpoint': _CODE_CHECKPOINT.value,
    'jax': jax.__version__,
    'devices': len(jax.devices()),
    'cases': cases,
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(result, f, indent=2)
  print(f'wrote {_OUT.value}')


if __name__ == '__main__':
  runtime.run(main)
