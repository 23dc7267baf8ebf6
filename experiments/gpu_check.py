"""The prepared one-GPU check: decode throughput, train MFU, the selector's budget, weight reshard.

  scripts/gpu_check.sh                  # one H100/H200: writes runs/gpu_check.json (< 8 minutes)
  scripts/gpu_check.sh --cpu            # tiny shapes on 2 fake CPU devices (what the tests run)

Four sections, each timed and written to the JSON as soon as it is done (a run cut short keeps
what it measured):

1. decode: the rollout program (`programs.builders.rollout_program`, what the main job runs) for
   a random Qwen2.5-0.5B-shaped model in bf16, batches 8, 32 and 128: a 128-token prompt chunk
   prefilled into a cache already filled to S - P - N, then N = 128 tokens decoded; new tokens/s.
2. train: the RL train program (`train_program`: policy-gradient loss, AdamW, f32 parameters,
   bf16 activations) for 0.5B and 1.5B shapes at 4K context; MFU = model FLOPs per second over
   the device's peak dense bf16 FLOP/s. Model FLOPs per step, stated in the JSON:
     6 x N x tokens + 6 x L x rows x T^2 x H x Dh
   where N counts the parameters that multiply activations (every weight but the embedding
   table's lookup; a tied table counts once, as the LM head), and the second term is causal
   attention forward + backward (QK^T and PV, 2 x 2 x T^2 x H x Dh per layer and row forward,
   halved by causality, x 3 with the backward). Recomputation is not counted.
3. selector: the rollout profile over context buckets x responses for the decode model, with the
   device's real memory (`memory_stats()['bytes_limit']`) as the budget: per cell, each layout's
   decode tokens/device/s, OOM where XLA's peak exceeds the budget, and the selector's choice.
4. reshard: the 0.5B weights moved device to device from the dp layout to the tp layout and back
   (`sharding.reshard.Resharder`, what the loop uses between stages); needs >= 2 devices: on one
   device the two layouts are the same placement, which the JSON says instead of a time.

Attention: 'cudnn' (`jax.nn.dot_product_attention(implementation='cudnn')`) where
`attention.cudnn_supported()` compiles it, else the blockwise attention (the CPU path, unchanged).
"""

import dataclasses
import json
import os
import statistics
import time

import jax
import numpy as np
from absl import flags

from earl_jax import runtime
from earl_jax.errors import ConfigError

_CPU = flags.DEFINE_bool('cpu', False, 'Tiny shapes on fake CPU devices (a smoke run for tests).')
_CPU_DEVICES = flags.DEFINE_integer('cpu_devices', 2, 'Fake CPU devices of --cpu.', lower_bound=1)
_OUT = flags.DEFINE_string('out', 'runs/gpu_check.json', 'Results JSON.')
_SECTIONS = flags.DEFINE_list(
  'sections', ['decode', 'train', 'selector', 'reshard'], 'Sections to run, in this order.'
)
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed calls per measurement (after a warm-up).')
_TRAIN_ROWS = flags.DEFINE_integer(
  'train_rows',
  0,
  "Rows of the train step (0: the plan's, 2 on GPU; the analytic memory model puts the 1.5B "
  'step at 4K x 2 at 65 GB, x 1 at 48 GB).',
  lower_bound=0,
)

SECTIONS = ('decode', 'train', 'selector', 'reshard')

# Peak dense bf16 tensor-core FLOP/s per device (vendor datasheets, no sparsity), by a substring
# of `device_kind`; the first match wins.
PEAK_BF16_FLOPS = (
  ('H200', 989.4e12),
  ('H100 PCIe', 756.0e12),
  ('H100', 989.4e12),  # SXM
  ('H800', 989.4e12),
  ('A100', 312.0e12),
  ('L40S', 362.0e12),
  ('L4', 121.0e12),
  ('A10G', 70.0e12),
  ('T4', 65.0e12),  # fp16
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """The shapes of one run (the GPU plan, or the tiny CPU one)."""

  decode_model: str
  decode_batches: tuple[int, ...]
  decode_chunk: int  # P
  decode_tokens: int  # N
  decode_bucket: int  # S
  train_models: tuple[str, ...]
  train_context: int
  train_rows: int
  selector_buckets: tuple[int, ...]
  selector_rows: tuple[int, ...]
  selector_tokens: int
  emulated_budget: int | None  # CPU: the budget the devices do not report


GPU_PLAN = Plan(
  decode_model='qwen2.5-0.5b',
  decode_batches=(8, 32, 128),
  decode_chunk=128,
  decode_tokens=128,
  decode_bucket=1024,
  train_models=('qwen2.5-0.5b', 'qwen2.5-1.5b'),
  train_context=4096,
  train_rows=2,
  selector_buckets=(4096, 32768),
  selector_rows=(32, 128, 512),
  selector_tokens=32,
  emulated_budget=None,
)

CPU_PLAN = Plan(
  decode_model='tiny',
  decode_batches=(2, 4),
  decode_chunk=8,
  decode_tokens=8,
  decode_bucket=64,
  train_models=('tiny',),
  train_context=64,
  train_rows=2,
  selector_buckets=(64, 128),
  selector_rows=(2, 4),
  selector_tokens=4,
  emulated_budget=int(0.9 * 2**20),  # between the layouts' peaks: dp2 (1.0-1.1 MiB) does not fit
)


def peak_flops(device_kind: str) -> float | None:
  for name, flops in PEAK_BF16_FLOPS:
    if name in device_kind:
      return flops
  return None


def matmul_params(cfg) -> int:
  """Parameters that multiply activations: all but the embedding lookup (a tied table counts
  once, as the LM head)."""
  embed = cfg.vocab_size * cfg.hidden_size
  return cfg.num_params - (0 if cfg.tie_word_embeddings else embed)


def train_flops(cfg, rows: int, T: int) -> float:
  """Model FLOPs of one train step (see the module docstring)."""
  attn = 6 * cfg.num_layers * rows * T * T * cfg.num_heads * cfg.head_dim
  return 6 * matmul_params(cfg) * rows * T + attn


def _time(fn, repeats):
  jax.block_until_ready(fn())  # warm-up (compiled already)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def _model(name: str, dtype: str, param_dtype: str, impl: str):
  from earl_jax.config import ModelConfig

  return ModelConfig.preset(name).replace(dtype=dtype, param_dtype=param_dtype, attention_impl=impl)


def _decode(plan: Plan, impl: str, repeats: int) -> dict:
  from earl_jax.config import ParallelConfig
  from earl_jax.models import qwen2
  from earl_jax.programs import builders
  from earl_jax.rollout.sampler import SamplingConfig
  from earl_jax.sharding import mesh as mesh_lib
  from earl_jax.stage import Stage

  cfg = _model(plan.decode_model, 'bfloat16', 'bfloat16', impl)
  parallel = ParallelConfig()
  mesh = mesh_lib.make_mesh(parallel, jax.devices()[:1])
  _, params = qwen2.init_model(cfg, mesh)
  spec = builders.StageSpec(
    sampling=SamplingConfig(greedy=True, max_new_tokens=plan.decode_tokens), chunk=plan.decode_chunk
  )
  rows = []
  for b in plan.decode_batches:
    key = builders.ProgramKey(
      stage=Stage.ROLLOUT, config=parallel, bucket=plan.decode_bucket, rows=b, chunk=spec.chunk
    )
    prog = builders.build(key, cfg, spec, mesh)
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    compile_s = time.perf_counter() - t0
    box = list(builders.make_inputs(prog, params))
    lengths = np.asarray(box[1].lengths)  # S - P - N on every row
    lengths_sharding = box[1].lengths.sharding

    def call(box=box, compiled=compiled, lengths=lengths, sharding=lengths_sharding):
      gen, cache = compiled(*box)  # the cache is donated: the next call takes the returned one,
      box[1] = cache.replace(lengths=jax.device_put(lengths, sharding))  # refilled to S - P - N
      return gen

    median, times = _time(call, repeats)
    rows.append(
      {
        'batch': b,
        'tokens_per_s': b * plan.decode_tokens / median,
        'median_s': median,
        'times_s': times,
        'compile_s': compile_s,
      }
    )
    print(f'  decode batch {b:>4}: {rows[-1]["tokens_per_s"]:10.0f} new tokens/s', flush=True)
  return {
    'model': cfg.name,
    'params': cfg.num_params,
    'dtype': 'bfloat16',
    'prompt_chunk': plan.decode_chunk,
    'new_tokens': plan.decode_tokens,
    'cache_bucket': plan.decode_bucket,
    'rows': rows,
  }


def _train(plan: Plan, impl: str, repeats: int) -> dict:
  from earl_jax.config import ParallelConfig
  from earl_jax.models import qwen2
  from earl_jax.programs import builders
  from earl_jax.sharding import mesh as mesh_lib
  from earl_jax.stage import Stage

  device = jax.devices()[0]
  peak = peak_flops(device.device_kind)
  parallel = ParallelConfig()
  mesh = mesh_lib.make_mesh(parallel, [device])
  out = []
  for name in plan.train_models:
    cfg = _model(name, 'bfloat16', 'float32', impl)
    _, params = qwen2.init_model(cfg, mesh)
    key = builders.ProgramKey(
      stage=Stage.TRAIN, config=parallel, bucket=plan.train_context, rows=plan.train_rows
    )
    prog = builders.build(key, cfg, None, mesh)
    t0 = time.perf_counter()
    compiled = prog.lower().compile()
    compile_s = time.perf_counter() - t0
    state, batch = builders.make_inputs(prog, params)
    del params
    state_box = [state]

    def step(compiled=compiled, batch=batch, box=state_box):
      box[0], metrics = compiled(box[0], batch)  # the state is donated
      return metrics

    median, times = _time(step, repeats)
    flops = train_flops(cfg, plan.train_rows, plan.train_context)
    rec = {
      'model': cfg.name,
      'params': cfg.num_params,
      'matmul_params': matmul_params(cfg),
      'rows': plan.train_rows,
      'context': plan.train_context,
      'tokens_per_step': plan.train_rows * plan.train_context,
      'model_flops_per_step': flops,
      'median_s': median,
      'times_s': times,
      'compile_s': compile_s,
      'achieved_flops': flops / median,
      'peak_flops': peak,
      'mfu': flops / median / peak if peak else None,
      'tokens_per_s': plan.train_rows * plan.train_context / median,
    }
    out.append(rec)
    mfu = f'{100 * rec["mfu"]:.1f}%' if rec['mfu'] is not None else 'n/a (no peak for this device)'
    print(
      f'  train {cfg.name} T={plan.train_context} x {plan.train_rows}: {median:.3f} s/step, '
      f'{rec["achieved_flops"] / 1e12:.2f} TFLOP/s, MFU {mfu}',
      flush=True,
    )
    del state, batch, state_box
  return {
    'flops_formula': '6 * matmul_params * tokens + 6 * L * rows * T^2 * H * Dh',
    'dtype': 'bf16 activations, f32 parameters and AdamW state',
    'device_kind': device.device_kind,
    'models': out,
  }


def _selector(plan: Plan, impl: str) -> dict:
  from earl_jax.config import BucketConfig
  from earl_jax.profiling import profiler
  from earl_jax.profiling.profiler import ProfileGrid
  from earl_jax.profiling.table import MeasureConfig
  from earl_jax.programs import Executables, builders, memory
  from earl_jax.rollout.sampler import SamplingConfig
  from earl_jax.selector.selector import ProfileSettings, Selector, SelectorConfig, StepStats
  from earl_jax.stage import Stage

  cfg = _model(plan.decode_model, 'bfloat16', 'bfloat16', impl)
  budget = memory.device_budget(emulated=plan.emulated_budget)
  buckets = BucketConfig(lengths=plan.selector_buckets)
  spec = builders.StageSpec(
    sampling=SamplingConfig(greedy=True, max_new_tokens=plan.selector_tokens), chunk=1
  )
  pconfig = ProfileGrid(
    stages=(Stage.ROLLOUT,),
    buckets=buckets,
    rows=plan.selector_rows,
    budget_bytes=budget,
    with_fsdp=False,
    measure=MeasureConfig(warmup=1, repeats=3, rounds=1),
    spec=spec,
  )
  with Executables(cfg, spec=spec) as exe:
    profile = profiler.run(cfg, pconfig, executables=exe)
  names = [c.name for c in profile.candidates(Stage.ROLLOUT)]
  sel_cfg = SelectorConfig(
    budget_mib=budget / memory.MiB, profile=ProfileSettings(stages=(Stage.ROLLOUT,))
  )
  cells = []
  for bucket in plan.selector_buckets:
    for n in plan.selector_rows:
      cell = {c: profile.cell(Stage.ROLLOUT, bucket, n, c) for c in names}
      rec = {
        'bucket': bucket,
        'responses': n,
        'tgs': {c: v.throughput for c, v in cell.items()},
        'need_mib': {c: v.peak_bytes / memory.MiB for c, v in cell.items()},
        'oom': [c for c, v in cell.items() if v.throughput is None],
      }
      try:
        sel = Selector(sel_cfg, buckets=buckets, rows=plan.selector_rows, profile=profile)
        d = sel.decide(Stage.ROLLOUT, StepStats(episode_lengths=(bucket,), num_responses=n))
        rec['choice'], rec['reason'] = d.config.name, d.reason
      except memory.InfeasibleError as e:
        rec['choice'], rec['reason'] = None, str(e)
      cells.append(rec)
      tgs = ', '.join(f'{c} {"OOM" if t is None else f"{t:.0f}"}' for c, t in rec['tgs'].items())
      print(f'  selector S={bucket:>6} x {n:>4}: {tgs} -> {rec["choice"]}', flush=True)
  return {
    'model': cfg.name,
    'budget_mib': budget / memory.MiB,
    'budget_source': 'emulated' if plan.emulated_budget else 'device bytes_limit',
    'candidates': names,
    'decode_tokens': plan.selector_tokens,
    'cells': cells,
  }


def _reshard(plan: Plan, repeats: int) -> dict:
  from earl_jax.config import ParallelConfig
  from earl_jax.models import qwen2
  from earl_jax.programs import builders
  from earl_jax.sharding import mesh as mesh_lib
  from earl_jax.sharding import reshard as reshard_lib

  cfg = _model(plan.decode_model, 'bfloat16', 'bfloat16', 'blockwise')
  n = len(jax.devices())
  nbytes = cfg.num_params * 2
  if n < 2:
    return {
      'model': cfg.name,
      'param_bytes': nbytes,
      'devices': n,
      'ms': None,
      'reason': 'one device: the dp and tp layouts are the same placement, nothing moves',
    }
  dp, tp = ParallelConfig(dp=n), ParallelConfig(tp=n)
  mesh_lib.check_model_fits(tp, cfg)
  _, params = qwen2.init_model(cfg, mesh_lib.make_mesh(dp))
  resharder = reshard_lib.Resharder()
  to_tp = builders.param_shardings(cfg, tp)
  to_dp = builders.param_shardings(cfg, dp)
  resharder.prepare(params, to_tp, donate=False)
  tp_params = jax.block_until_ready(resharder(params, to_tp, donate=False))
  resharder.prepare(tp_params, to_dp, donate=False)
  dp_to_tp, _ = _time(lambda: resharder(params, to_tp, donate=False), repeats)
  tp_to_dp, _ = _time(lambda: resharder(tp_params, to_dp, donate=False), repeats)
  back = resharder(tp_params, to_dp, donate=False)
  same = all(
    np.array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back))
  )
  print(
    f'  reshard {cfg.name} ({nbytes / 2**20:.0f} MiB bf16) dp{n} -> tp{n}: '
    f'{1e3 * dp_to_tp:.1f} ms, back: {1e3 * tp_to_dp:.1f} ms',
    flush=True,
  )
  return {
    'model': cfg.name,
    'param_bytes': nbytes,
    'devices': n,
    'from': dp.name,
    'to': tp.name,
    'dp_to_tp_ms': 1e3 * dp_to_tp,
    'tp_to_dp_ms': 1e3 * tp_to_dp,
    'round_trip_equal': same,
  }


def check_flags() -> None:
  bad = [s for s in _SECTIONS.value if s not in SECTIONS]
  if bad:
    raise ConfigError(f'--sections: unknown {bad}; expected a subset of {list(SECTIONS)}.')
  if _REPEATS.value < 1:
    raise ConfigError(f'--repeats must be >= 1, got {_REPEATS.value}.')


def main(argv):
  del argv
  check_flags()
  if _CPU.value:
    jax.config.update('jax_platforms', 'cpu')
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  from earl_jax.models import attention

  plan = CPU_PLAN if _CPU.value else GPU_PLAN
  if _TRAIN_ROWS.value:
    plan = dataclasses.replace(plan, train_rows=_TRAIN_ROWS.value)
  devices = jax.devices()
  if not _CPU.value and devices[0].platform == 'cpu':
    raise ConfigError('no accelerator found: run on a GPU, or pass --cpu for the tiny CPU check.')
  impl = 'cudnn' if attention.cudnn_supported() else 'blockwise'
  result = {
    'mode': 'cpu' if _CPU.value else 'gpu',
    'jax': jax.__version__,
    'platform': devices[0].platform,
    'device_kind': devices[0].device_kind,
    'devices': len(devices),
    'attention_impl': impl,
    'plan': dataclasses.asdict(plan),
    'seconds': {},
  }
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)

  def save():
    with open(_OUT.value, 'w') as f:
      json.dump(result, f, indent=1)

  print(
    f'gpu_check ({result["mode"]}): {len(devices)} x {devices[0].device_kind}, attention {impl}',
    flush=True,
  )
  t_all = time.perf_counter()
  runs = {
    'decode': lambda: _decode(plan, impl, _REPEATS.value),
    'train': lambda: _train(plan, impl, _REPEATS.value),
    'selector': lambda: _selector(plan, impl),
    'reshard': lambda: _reshard(plan, _REPEATS.value),
  }
  failed = []
  for section in _SECTIONS.value:
    print(f'{section} ...', flush=True)
    t0 = time.perf_counter()
    try:
      result[section] = runs[section]()
    except Exception as e:  # one section's failure (e.g. out of memory) keeps the others' figures
      if _CPU.value:
        raise
      result[section] = {'error': f'{type(e).__name__}: {e}'[:4000]}
      failed.append(section)
      print(f'  {section} failed: {result[section]["error"][:300]}', flush=True)
    result['seconds'][section] = time.perf_counter() - t0
    save()
  result['seconds']['total'] = time.perf_counter() - t_all
  save()
  print(f'wrote {_OUT.value} in {result["seconds"]["total"]:.0f} s')
  if failed:
    raise SystemExit(f'gpu_check: sections {failed} failed (their errors are in {_OUT.value}).')


if __name__ == '__main__':
  runtime.run(main)
