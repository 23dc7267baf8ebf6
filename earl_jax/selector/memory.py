"""Per-device memory of a stage program: XLA's own numbers, an analytic model, and the budget.

Two sources, one unit (bytes per device):

* `xla_memory(compiled)`: `compiled.memory_analysis()` of the AOT-compiled SPMD program, i.e. what
  one device holds: arguments + outputs - aliased (donated) + temporaries. This is the source of
  truth for anything that can be compiled here; an infeasible program is refused before it runs.
* `estimate(...)`: an analytic model (weights, optimizer state and gradients, KV cache,
  activations) for shapes too large to compile here, such as Qwen2.5-72B on 8 x H100-80GB. Its
  activation terms count the arrays XLA materialises for *this* model code (for instance the
  [B, H, T, T] attention scores of `jax.nn.dot_product_attention`'s XLA path, and the f32
  transposed copy of one layer's K/V in decode). `tests/selector/memory_test.py` checks it
  against XLA on small models; the measured error is `ANALYTIC_REL_ERROR`.

The budget is per device: on a GPU the device's own limit (`memory_stats()['bytes_limit']`); on
CPU, where nothing runs out of memory, an emulated figure that must be given (a flag), so that
"does not fit" is real and testable here.
"""

import contextlib
import dataclasses
import math
from typing import Any

import jax

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.selector.candidates import check_stage

MiB = 1 << 20
GiB = 1 << 30

# The analytic model's stated error against XLA's peak: |analytic - xla| <= max(REL x xla, ABS).
# Measured on 233 programs (3 small models, 4-6 layouts each, T = 128..2048, 8..32 rows, 8 fake
# CPU devices, XLA:CPU): the largest relative error for peaks >= 8 MiB per device is 10% for
# rollout (68 programs), 21% for experience (109) and 12% for train (56); below 8 MiB the
# largest absolute error is under 2 MiB. Tested on a subset in tests/selector/memory_test.py.
ANALYTIC_REL_ERROR = 0.25
ANALYTIC_ABS_ERROR = 2 * (1 << 20)

_BYTES = {'float32': 4, 'bfloat16': 2}


class InfeasibleError(ValueError):
  """No candidate layout fits the per-device memory budget."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryUse:
  """Bytes per device of one compiled program (from `compiled.memory_analysis()`)."""

  arguments: int
  outputs: int
  aliased: int
  temporaries: int
  code: int = 0

  @property
  def peak(self) -> int:
    """arguments + outputs - aliased + temporaries: everything live at once, at worst."""
    return self.arguments + self.outputs - self.aliased + self.temporaries

  def as_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), 'peak': self.peak}


def xla_memory(compiled: Any) -> MemoryUse:
  """Per-device memory of an AOT-compiled program (`jit(...).lower(...).compile()`)."""
  m = compiled.memory_analysis()
  if m is None:
    raise RuntimeError('This backend gives no memory_analysis() for compiled programs.')
  return MemoryUse(
    arguments=int(m.argument_size_in_bytes),
    outputs=int(m.output_size_in_bytes),
    aliased=int(m.alias_size_in_bytes),
    temporaries=int(m.temp_size_in_bytes),
    code=int(getattr(m, 'generated_code_size_in_bytes', 0) or 0),
  )


def device_budget(devices: list[Any] | None = None, *, emulated: int | None = None) -> int:
  """Per-device memory budget in bytes.

  Args:
    devices: the stage's devices (default: all).
    emulated: the figure to use when the devices report no limit (CPU): required there.

  Returns:
    The smallest `bytes_limit` over the devices (GPU/TPU), or `emulated`. When both exist the
    smaller one wins, so an emulated budget can also shrink a real device.

  Raises:
    ValueError: CPU devices and no emulated budget.
  """
  devices = list(jax.devices() if devices is None else devices)
  limits = []
  for d in devices:
    stats = d.memory_stats() if hasattr(d, 'memory_stats') else None
    if stats and stats.get('bytes_limit'):
      limits.append(int(stats['bytes_limit']))
  if limits:
    return min([*limits, *([emulated] if emulated else [])])
  if emulated is None or emulated <= 0:
    raise ValueError(
      f'Devices of platform {devices[0].platform!r} report no memory limit; give an emulated '
      f'per-device budget in bytes (got {emulated!r}).'
    )
  return int(emulated)


def resolve_budget(emulated: int | None = None, devices: list[Any] | None = None) -> int | None:
  """The per-device budget a selector uses: `device_budget`, or None (unlimited) on CPU with none.

  On a GPU the device's own limit (or `emulated` when smaller); on CPU the emulated figure when
  given, otherwise None, and nothing is ever refused for memory.
  """
  try:
    return device_budget(devices, emulated=emulated)
  except ValueError:
    return None


def fits(need: int, budget: int, *, margin: float = 0.0) -> bool:
  """need x (1 + margin) <= budget."""
  return need * (1.0 + margin) <= budget


def resident_bytes_per_device(tree: Any, device: Any | None = None) -> int:
  """Bytes of the arrays of `tree` that live on `device` (default: the first canonical one)."""
  leaves = jax.tree.leaves(tree)
  if device is None:
    device = min((d for x in leaves for d in x.sharding.device_set), key=lambda d: d.id)
  total = 0
  for x in leaves:
    for shard in x.addressable_shards:
      if shard.device == device:
        total += shard.data.nbytes
  return total


def _proc_status_bytes(field: str) -> int:
  with open('/proc/self/status') as f:
    for line in f:
      if line.startswith(field + ':'):
        return int(line.split()[1]) * 1024
  raise RuntimeError(f'/proc/self/status has no {field}.')


def measure_run_peak(fn: Any, args: tuple[Any, ...]) -> tuple[int, Any]:
  """Runs `fn(*args)` once and measures its real per-device peak on host-platform devices.

  On CPU the fake devices share this process's memory, so the program's extra memory is the
  rise of the process's resident set: freed heap is returned to the OS first (glibc
  `malloc_trim`), the peak-RSS mark is reset (`/proc/self/clear_refs`), and the rise of the
  mark during the run, split over the devices, is added to the bytes the arguments already hold
  on one device. Linux only; call it with nothing else running in the process.

  Returns:
    (per-device peak bytes, the outputs).
  """
  import ctypes

  leaves = jax.tree.leaves(args)
  devices = {d for x in leaves for d in x.sharding.device_set}
  if any(d.platform != 'cpu' for d in devices):
    raise RuntimeError('measure_run_peak measures host memory: CPU devices only.')
  jax.block_until_ready(args)
  resident = resident_bytes_per_device(args)
  with contextlib.suppress(OSError):
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  base = _proc_status_bytes('VmRSS')
  with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')  # resets VmHWM to the current RSS
  out = jax.block_until_ready(fn(*args))
  rise = max(0, _proc_status_bytes('VmHWM') - base)
  return resident + rise // len(devices), out


# ------------------------------------------------------------------------------------------------
# Analytic model.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Coefficients:
  """How many arrays of each kind the compiled programs hold at their peak.

  Fitted (non-negative least squares on relative error) to XLA:CPU's memory analysis of this
  model code with its default 'blockwise' attention, over 233 programs (see
  ANALYTIC_REL_ERROR). "Scores" are the f32 attention tiles: [B, H, T, T] for one dense block,
  or the lower-triangle tiles [B, H, b, (i + 1) b] of the blockwise attention, which XLA
  schedules side by side, (T^2 + T b) / 2 per array. On a GPU with fused attention use
  `fused_attention()`: no score tiles and no decode K/V copies.

  Attributes:
    experience_scores: score-tile arrays live in the experience forward.
    experience_act_d: [B, T, D] activation arrays live in the forward.
    experience_logits: [B, C, V] f32 arrays of the chunked LM head.
    train_scores: score-tile arrays live in the train step (forward + recomputing backward).
    train_act_d: [B, T, D] arrays saved per layer for the backward.
    train_act_f: [B, T, F] arrays saved per layer for the backward.
    decode_kv_copies: f32 copies of one layer's K and V made by decode attention.
    decode_logits: [B, V] f32 arrays live in a decode step (sampling).
    update_copies: parameter-sized arrays of the optimizer update (grads, updates).
  """

  experience_scores: float = 1.8
  experience_act_d: float = 1.35
  experience_logits: float = 1.25
  train_scores: float = 4.8
  train_act_d: float = 8.0
  train_act_f: float = 6.7
  decode_kv_copies: float = 1.0
  decode_logits: float = 4.0
  update_copies: float = 2.0

  @classmethod
  def fused_attention(cls) -> 'Coefficients':
    """A GPU engine with fused (flash / paged) attention: no score tiles, no K/V copies."""
    return cls(experience_scores=0.0, train_scores=0.0, decode_kv_copies=0.0)


def attention_score_bytes(
  model: ModelConfig, rows_per_device: int, heads_per_device: int, T: int
) -> int:
  """f32 bytes of one set of attention score tiles for a [B, T] chunk on one device."""
  b = model.attention_block
  if model.attention_impl == 'blockwise' and 0 < b < T and T % b == 0:
    area = (T * T + T * b) // 2  # the lower-triangle tiles of T / b query blocks
  else:
    area = T * T
  return rows_per_device * heads_per_device * area * 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class Estimate:
  """Analytic bytes per device, by component."""

  weights: int
  optimizer: int
  gradients: int
  kv_cache: int
  activations: int
  io: int

  @property
  def total(self) -> int:
    return (
      self.weights + self.optimizer + self.gradients + self.kv_cache + self.activations + self.io
    )

  def as_dict(self) -> dict[str, int]:
    return {**dataclasses.asdict(self), 'total': self.total}


def weight_bytes_per_device(model: ModelConfig, parallel: ParallelConfig) -> int:
  """Parameter bytes one device holds under the logical-axis table of `sharding.rules`.

  tp splits heads, KV heads, MLP width and vocab; fsdp splits the embed (D) dimension of weights;
  dp replicates. Norm scales are replicated; q/k/v biases are split by tp.
  """
  D, F, V, Dh = model.hidden_size, model.intermediate_size, model.vocab_size, model.head_dim
  H, K = model.num_heads, model.num_kv_heads
  tp, fsdp = parallel.tp, parallel.fsdp
  per_layer = (
    D * H * Dh // (fsdp * tp)  # q_proj [D, H, Dh]
    + 2 * D * K * Dh // (fsdp * tp)  # k_proj, v_proj [D, K, Dh]
    + H * Dh * D // (tp * fsdp)  # o_proj [H, Dh, D]
    + 3 * D * F // (fsdp * tp)  # gate, up [D, F]; down [F, D]
    + 2 * D  # two norm scales, replicated
  )
  if model.qkv_bias:
    per_layer += (H * Dh + 2 * K * Dh) // tp
  embed = V * D // (tp * fsdp) * (1 if model.tie_word_embeddings else 2)
  total = model.num_layers * per_layer + embed + D
  return total * _BYTES[model.param_dtype]


def kv_cache_bytes_per_device(
  model: ModelConfig, parallel: ParallelConfig, bucket: int, rows: int
) -> int:
  """K and V of every layer for `rows` x `bucket` tokens: rows split by dp x fsdp, heads by tp."""
  B_l = math.ceil(rows / parallel.batch_shards)
  K_l = math.ceil(model.num_kv_heads / parallel.tp)
  return 2 * model.num_layers * B_l * bucket * K_l * model.head_dim * _BYTES[model.dtype]


def estimate(
  stage: str,
  model: ModelConfig,
  parallel: ParallelConfig,
  bucket: int,
  rows: int,
  *,
  decode_tokens: int = 8,
  micro_batches: int = 1,
  coefficients: Coefficients = Coefficients(),
) -> Estimate:
  """Analytic per-device bytes of a stage program (see the module docstring).

  Args:
    stage: 'rollout' (decode with a KV cache of capacity `bucket`), 'experience' (log-probs of
      [rows, bucket] tokens) or 'train' (AdamW step on [rows, bucket]).
    model: model shapes and dtypes.
    parallel: the layout.
    bucket: context length (cache capacity for rollout, sequence length otherwise).
    rows: responses (batch rows) of the whole stage.
    decode_tokens: tokens decoded per rollout call (the Generation output).
    micro_batches: gradient-accumulation slices (train).
    coefficients: activation array counts (defaults: XLA:CPU, this model code).
  """
  check_stage(stage)
  c = coefficients
  f32 = 4
  act = _BYTES[model.dtype]
  B_l = math.ceil(rows / parallel.batch_shards)
  H_l = math.ceil(model.num_heads / parallel.tp)
  K_l = math.ceil(model.num_kv_heads / parallel.tp)
  F_l = math.ceil(model.intermediate_size / parallel.tp)
  V_l = math.ceil(model.vocab_size / parallel.tp)
  D, Dh, L, T = model.hidden_size, model.head_dim, model.num_layers, bucket
  weights = weight_bytes_per_device(model, parallel)
  # Under fsdp the weights are gathered before use. Decode hoists the gathers out of its token
  # loop (the whole model lives gathered); a forward / backward gathers about a layer at a time.
  gathered = 0
  if parallel.fsdp > 1:
    full = weight_bytes_per_device(model, dataclasses.replace(parallel, fsdp=1))
    gathered = full if stage == 'rollout' else 2 * full // model.num_layers
  optimizer = gradients = kv = 0
  if stage == 'rollout':
    kv = kv_cache_bytes_per_device(model, parallel, bucket, rows)
    N = decode_tokens
    activations = (
      c.decode_kv_copies * 2 * B_l * T * K_l * Dh * f32  # f32 K/V of one layer, transposed
      + 2 * B_l * H_l * T * f32  # scores and probabilities of one token
      + c.decode_logits * B_l * V_l * f32
      + 4 * B_l * (D + F_l) * act
    )
    io = B_l * V_l * f32 + B_l * (2 * N * 4 + 16)  # logits in, Generation out
  elif stage == 'experience':
    C = min(model.logprob_chunk, T) if T % min(model.logprob_chunk, T) == 0 else T
    activations = (
      c.experience_scores * attention_score_bytes(model, B_l, H_l, T)
      + c.experience_act_d * B_l * T * D * act
      + c.experience_logits * B_l * C * V_l * f32
    )
    io = B_l * T * (4 + 4)  # tokens in, log-probs out
  else:
    Bm = math.ceil(B_l / micro_batches)
    optimizer = 2 * weights  # AdamW moments, sharded like the parameters
    gradients = int((c.update_copies + (1 if micro_batches > 1 else 0)) * weights)
    activations = (
      c.train_scores * attention_score_bytes(model, Bm, H_l, T)
      + L * Bm * T * (c.train_act_d * D + c.train_act_f * F_l) * act
    )
    io = B_l * T * (4 * 6 + 1 * 2) + B_l * 16  # the Batch fields
  return Estimate(
    weights=weights,
    optimizer=optimizer,
    gradients=gradients,
    kv_cache=kv,
    activations=int(activations + gathered),
    io=int(io),
  )


def relative_error(analytic: int, xla: int) -> float:
  """|analytic - xla| / xla."""
  return abs(analytic - xla) / max(xla, 1)


def within_stated_error(analytic: int, xla: int) -> bool:
  """|analytic - xla| <= max(ANALYTIC_REL_ERROR x xla, ANALYTIC_ABS_ERROR)."""
  return abs(analytic - xla) <= max(ANALYTIC_REL_ERROR * xla, ANALYTIC_ABS_ERROR)


def kv_capacity_tokens(
  model: ModelConfig,
  parallel: ParallelConfig,
  budget_bytes: int,
) -> int:
  """Tokens of K/V the whole layout can hold next to its weights within a per-device budget.

  The paper's rule of thumb (EARL §3): a TP engine stops fitting its working set when
  responses x context exceeds this. Per device: (budget - weights - gathered weights) over the
  K/V bytes of one token of one of its rows; times the batch shards (dp x fsdp).
  """
  weights = weight_bytes_per_device(model, parallel)
  if parallel.fsdp > 1:
    weights += weight_bytes_per_device(model, dataclasses.replace(parallel, fsdp=1))
  per_token = 2 * model.num_layers * math.ceil(model.num_kv_heads / parallel.tp) * model.head_dim
  per_token *= _BYTES[model.dtype]
  free = budget_bytes - weights
  return max(0, free // per_token) * parallel.batch_shards
