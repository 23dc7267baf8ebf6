"""The analytic models: per-device bytes of a stage program, for shapes too large to compile, and
the roofline time of one call, the shape the cost model fits to measurements (`call_terms`).

Weights, optimizer state and gradients, KV cache and activations, for shapes such as Qwen2.5-72B
on 8 x H100-80GB. Its activation terms count the arrays XLA materialises for *this* model code
(for instance the attention score tiles of the blockwise attention, and the f32 transposed copy
of one layer's K/V in decode). `tests/profiling/analytic_test.py` checks it against XLA's memory
analysis of the compiled programs (`earl_jax.programs.memory.xla_memory`) on small models; the
measured error is `ANALYTIC_REL_ERROR`.
"""

import dataclasses
import math
from typing import Protocol, runtime_checkable

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.stage import Stage


@runtime_checkable
class ProgramShapes(Protocol):
  """What the analytic models read of the stage programs' static settings (a
  `programs.StageSpec` has these)."""

  @property
  def decode_tokens(self) -> int: ...

  @property
  def chunk(self) -> int: ...

  @property
  def micro_batches(self) -> int: ...


MiB = 1 << 20

# The analytic model's stated error against XLA's peak: |analytic - xla| <= max(REL x xla, ABS),
# a bound over the programs `scripts/fit_analytic.py` fits it on (the measured errors are in
# docs/results/paper-figures.md, "Fig. 3 at the paper's scale");
# tests/profiling/analytic_test.py checks a subset. Where a stage is compiled, XLA's own figure
# decides (a program it refuses is marked and left out).
ANALYTIC_REL_ERROR = 0.30
ANALYTIC_ABS_ERROR = 3 * MiB

_BYTES = {'float32': 4, 'bfloat16': 2}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Coefficients:
  """How many arrays of each kind the compiled programs hold at their peak.

  Fitted (non-negative least squares on relative error) to XLA:CPU's memory analysis of this
  model code with its default 'blockwise' attention (see ANALYTIC_REL_ERROR;
  `scripts/fit_analytic.py` refits them). "Scores" are the f32 attention arrays: [B, H, T, T]
  for one dense block, or one [B, H, b, b] tile of the blockwise attention, whose loops
  (`models/attention.py`) hold a few tiles at a time. On a GPU with fused attention use
  `fused_attention()`: no score tiles and no decode K/V copies.

  Attributes:
    experience_scores: score-tile arrays live in the experience forward.
    experience_act_d: [B, T, D] activation arrays live in the forward.
    experience_logits: [B, C, V] f32 arrays of the chunked LM head.
    experience_act_f: [B, T, F] arrays of the MLP live in the forward.
    train_scores: score-tile arrays live in the train step (forward + recomputing backward).
    train_act_d: [B, T, D] arrays saved per layer for the backward.
    train_act_f: [B, T, F] arrays saved per layer for the backward.
    decode_kv_copies: f32 copies of one layer's K and V made by decode attention (0 since the
      cache is [B, K, S, Dh] and decode batches its matmuls over (B, K): nothing is copied).
    decode_logits: [B, V] f32 arrays live in a decode step (sampling).
    update_copies: parameter-sized arrays of the optimizer update (grads, updates).
  """

  experience_scores: float = 1.77
  experience_act_d: float = 1.58
  experience_logits: float = 0.51
  experience_act_f: float = 3.08
  train_scores: float = 3.64
  train_act_d: float = 8.87
  train_act_f: float = 6.82
  decode_kv_copies: float = 0.0
  decode_logits: float = 4.0
  update_copies: float = 2.0

  @classmethod
  def fused_attention(cls) -> 'Coefficients':
    """A GPU engine with fused (flash / paged) attention: no score tiles, no K/V copies."""
    return cls(experience_scores=0.0, train_scores=0.0, decode_kv_copies=0.0)


def attention_score_bytes(
  model: ModelConfig, rows_per_device: int, heads_per_device: int, T: int, cp: int = 1
) -> int:
  """f32 bytes of one attention score array for a [B, T] chunk on one device: one [b, b] tile
  of the blockwise attention (its loops hold one tile at a time), or [T, T] for a dense block;
  with cp > 1 (T is then a device's T / cp tokens) one tile of the ring attention
  (`context_attention.ring_tile`)."""
  b = model.attention_block
  if cp > 1:
    from earl_jax.models.context_attention import ring_tile

    b = math.gcd(ring_tile(b if b > 0 else T, cp), T)
    return rows_per_device * heads_per_device * b * b * 4
  if model.attention_impl == 'blockwise' and 0 < b < T and T % b == 0:
    area = b * b
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
  """K and V of every layer for `rows` x `bucket` tokens: rows split by dp x fsdp, heads by tp,
  slots by cp."""
  B_l = math.ceil(rows / parallel.batch_shards)
  K_l = math.ceil(model.num_kv_heads / parallel.tp)
  S_l = math.ceil(bucket / parallel.cp)
  return 2 * model.num_layers * B_l * S_l * K_l * model.head_dim * _BYTES[model.dtype]


def estimate(
  stage: Stage | str,
  model: ModelConfig,
  parallel: ParallelConfig,
  bucket: int,
  rows: int,
  *,
  decode_tokens: int = 8,
  chunk: int = 0,
  micro_batches: int = 1,
  coefficients: Coefficients = Coefficients(),
) -> Estimate:
  """Analytic per-device bytes of a stage program (see the module docstring).

  Args:
    stage: ROLLOUT (prefill a chunk of `chunk` tokens, then decode `decode_tokens` with a KV
      cache of capacity `bucket`), EXPERIENCE (log-probs of [rows, bucket] tokens) or TRAIN
      (AdamW step on [rows, bucket]).
    model: model shapes and dtypes.
    parallel: the layout.
    bucket: context length (cache capacity for rollout, sequence length otherwise).
    rows: responses (batch rows) of the whole stage.
    decode_tokens: N, tokens decoded per rollout call (the Generation output).
    chunk: P, prompt tokens a rollout call prefills before decoding (0: decode only).
    micro_batches: gradient-accumulation slices (train).
    coefficients: activation array counts (defaults: XLA:CPU, this model code).

  With context parallelism (`parallel.cp` > 1) a device holds T / cp tokens of each of its
  rows: the experience and train activations scale with those, and the attention scores are one
  tile of the ring (`context_attention.ring_tile`). Measured against XLA on the main job's model
  (docs/results/model-and-tests.md): 12-32% under on every CP cell.
  """
  # One piece (about 60 lines of code): the three stages' terms read the same ten per-device
  # dimensions computed first; split apart, every part would take all of them as arguments.
  stage = Stage.parse(stage)
  c = coefficients
  f32 = 4
  act = _BYTES[model.dtype]
  B_l = math.ceil(rows / parallel.batch_shards)
  H_l = math.ceil(model.num_heads / parallel.tp)
  K_l = math.ceil(model.num_kv_heads / parallel.tp)
  F_l = math.ceil(model.intermediate_size / parallel.tp)
  V_l = math.ceil(model.vocab_size / parallel.tp)
  D, Dh, L, T = model.hidden_size, model.head_dim, model.num_layers, bucket
  T_l = math.ceil(T / parallel.cp)  # the tokens of a row one device holds (context parallelism)
  weights = weight_bytes_per_device(model, parallel)
  # Under fsdp the weights are gathered before use. Decode hoists the gathers out of its token
  # loop (the whole model lives gathered); a forward / backward gathers about a layer at a time.
  gathered = 0
  if parallel.fsdp > 1:
    full = weight_bytes_per_device(model, dataclasses.replace(parallel, fsdp=1))
    gathered = full if stage == Stage.ROLLOUT else 2 * full // model.num_layers
  optimizer = gradients = kv = 0
  if stage == Stage.ROLLOUT:
    kv = kv_cache_bytes_per_device(model, parallel, bucket, rows)
    N, P = decode_tokens, chunk
    # With cp > 1 a device holds T_l = T / cp slots of each row's cache and scores its queries
    # against those only; the prompt's P tokens are split over cp outside attention.
    kv_copies = c.decode_kv_copies * 2 * B_l * T_l * K_l * Dh * f32  # f32 K/V of one layer
    decode = (
      2 * B_l * H_l * T_l * f32 + c.decode_logits * B_l * V_l * f32 + 4 * B_l * (D + F_l) * act
    )
    # The prefill runs first: scores and probabilities of P queries against the whole cache.
    P_l = math.ceil(P / parallel.cp)
    prefill = 2 * B_l * H_l * P * T_l * f32 + 4 * B_l * P_l * (D + F_l) * act
    activations = kv_copies + max(decode, prefill)
    io = B_l * (P * 4 + 4) + B_l * (2 * N * 4 + 16)  # the prompt in, the Generation out
  elif stage == Stage.EXPERIENCE:
    C = min(model.logprob_chunk, T_l) if T_l % min(model.logprob_chunk, T_l) == 0 else T_l
    activations = (
      c.experience_scores * attention_score_bytes(model, B_l, H_l, T_l, parallel.cp)
      + c.experience_act_d * B_l * T_l * D * act
      + c.experience_logits * B_l * C * V_l * f32
      + c.experience_act_f * B_l * T_l * F_l * act
    )
    io = B_l * T_l * (4 + 4)  # tokens in, log-probs out
  else:
    Bm = math.ceil(B_l / micro_batches)
    optimizer = 2 * weights  # AdamW moments, sharded like the parameters
    gradients = int((c.update_copies + (1 if micro_batches > 1 else 0)) * weights)
    activations = (
      c.train_scores * attention_score_bytes(model, Bm, H_l, T_l, parallel.cp)
      + L * Bm * T_l * (c.train_act_d * D + c.train_act_f * F_l) * act
    )
    io = B_l * T_l * (4 * 6 + 1 * 2) + B_l * 16  # the Batch fields
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


# -- time -------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Speeds:
  """Nominal per-device speeds of the analytic time model (about an H100's).

  Only their ratios shape the cost model: measured cells scale it to the device at hand
  (`profiling.cost_model`), and until then its figures are in these nominal units.

  Attributes:
    flops: matmul FLOP/s.
    memory_bytes: bytes/s read or written in device memory.
    link_bytes: bytes/s a device sends to its peers in a collective.
    collective_s: the fixed cost of one collective (launch and synchronisation).
  """

  flops: float = 4e14
  memory_bytes: float = 3e12
  link_bytes: float = 2e11
  collective_s: float = 1e-5


@dataclasses.dataclass(frozen=True)
class _Work:
  """What one call of a stage program does on one device (`attention_flops`: the part of `flops`
  in the attention scores, quadratic in the context)."""

  flops: float
  memory_bytes: float
  link_bytes: float
  collectives: int
  attention_flops: float = 0.0


def call_seconds(
  stage: Stage | str,
  model: ModelConfig,
  parallel: ParallelConfig,
  bucket: int,
  rows: int,
  *,
  decode_tokens: int = 8,
  chunk: int = 0,
  micro_batches: int = 1,
  speeds: Speeds = Speeds(),
) -> float:
  """Analytic seconds of one call of a stage program on one device: matmul and attention FLOPs,
  the bytes of weights, K/V and activations it reads, and its collectives (tp all-reduces of the
  activations, fsdp gathers of the weights, the dp all-reduce of the gradients), at `speeds`.

  A roofline sum, not a simulation: the shape over buckets, loads and layouts that the cost
  model (`profiling.cost_model`) fits to measurements, term by term (`call_terms`). Arguments as
  in `estimate`.
  """
  return sum(
    call_terms(
      stage,
      model,
      parallel,
      bucket,
      rows,
      decode_tokens=decode_tokens,
      chunk=chunk,
      micro_batches=micro_batches,
      speeds=speeds,
    )
  )


def call_terms(
  stage: Stage | str,
  model: ModelConfig,
  parallel: ParallelConfig,
  bucket: int,
  rows: int,
  *,
  decode_tokens: int = 8,
  chunk: int = 0,
  micro_batches: int = 1,
  speeds: Speeds = Speeds(),
) -> tuple[float, float, float, float]:
  """`call_seconds` in its four terms, seconds of: the weights' matmul FLOPs, the attention
  scores' FLOPs (quadratic in the context), memory traffic, and communication. The first three
  are one device's share of the stage's work (divided by the layout's width); communication is
  its collectives (tp all-reduces that grow with the bucket, fsdp gathers, the gradient
  all-reduce) and their fixed costs. Apart, so that a device whose speeds stand in other ratios
  than `speeds` (a CPU, whose attention costs far more per FLOP than its matmuls) can be fitted
  term by term."""
  stage = Stage.parse(stage)
  work = _work(stage, model, parallel, bucket, rows, decode_tokens, chunk, micro_batches)
  comm = work.link_bytes / speeds.link_bytes + work.collectives * speeds.collective_s
  matmul = (work.flops - work.attention_flops) / speeds.flops
  return matmul, work.attention_flops / speeds.flops, work.memory_bytes / speeds.memory_bytes, comm


def _work(stage, model, parallel, bucket, rows, decode_tokens, chunk, micro_batches) -> _Work:
  act = _BYTES[model.dtype]
  tp, fsdp, dp = parallel.tp, parallel.fsdp, parallel.dp
  B_l = math.ceil(rows / parallel.batch_shards)
  H_l = math.ceil(model.num_heads / tp)
  K_l = math.ceil(model.num_kv_heads / tp)
  F_l = math.ceil(model.intermediate_size / tp)
  D, Dh, L = model.hidden_size, model.head_dim, model.num_layers
  gathered = weight_bytes_per_device(model, dataclasses.replace(parallel, fsdp=1))
  matmul = 2 * gathered / _BYTES[model.param_dtype]  # FLOPs per token of the weights it uses
  reduce = 2 * (tp - 1) / tp  # bytes sent per byte of a ring all-reduce
  if stage == Stage.ROLLOUT:
    # Prefill of P tokens, then N decode steps, each attending to the whole cache of `bucket`.
    # With cp > 1 each device attends to its bucket / cp slots (split-K), runs the prompt's
    # P / cp tokens through the weights but every decode token whole, and combines the
    # queries' softmax statistics over the ring: three all-reduces a layer and pass.
    cp = parallel.cp
    passes, tokens = decode_tokens + 1, chunk + decode_tokens
    attention = B_l * tokens * 4 * L * H_l * Dh * math.ceil(bucket / cp)
    flops = B_l * (math.ceil(chunk / cp) + decode_tokens) * matmul + attention
    kv = kv_cache_bytes_per_device(model, parallel, bucket, rows)
    memory_bytes = passes * (gathered + kv)
    combine = (cp - 1) / cp * 2 * L * B_l * tokens * H_l * (Dh + 2) * 4 if cp > 1 else 0
    link = (
      (2 * L * B_l * tokens * D * act * reduce if tp > 1 else 0)
      + gathered * (fsdp - 1) / fsdp
      + combine
    )
    collectives = (
      (2 * L * passes if tp > 1 else 0) + (L if fsdp > 1 else 0) + (3 * L * passes if cp > 1 else 0)
    )
    return _Work(flops, memory_bytes, link, collectives, attention)
  # A forward over [B_l, T_l] (T_l = T / cp tokens of each row per device). Causal attention
  # computes half the score tiles; on cp > 1, ring attention visits cp key/value shards in turn
  # and each visit waits for the device with the most work. In zig-zag order (where 2 cp
  # divides T, `uses_zigzag`) every device does the same: cp / 2 blocks of T_l x T_l in all. In
  # the contiguous order the last device does a half block (the diagonal), then a whole one
  # (cp - 1 times). Each visit passes a K/V shard on.
  from earl_jax.models.context_attention import uses_zigzag

  T_l = bucket // parallel.cp
  blocks = parallel.cp / 2 if uses_zigzag(bucket, parallel.cp) else parallel.cp - 0.5
  attention = B_l * 4 * L * H_l * Dh * T_l * T_l * blocks
  flops = B_l * T_l * matmul + attention
  memory_bytes = gathered + 4 * L * B_l * T_l * (D + F_l) * act
  ring = (parallel.cp - 1) * L * 2 * B_l * T_l * K_l * Dh * act
  link = (
    (2 * L * B_l * T_l * D * act * reduce if tp > 1 else 0) + gathered * (fsdp - 1) / fsdp + ring
  )
  collectives = (2 * L if tp > 1 else 0) + (L if fsdp > 1 else 0) + (parallel.cp - 1) * L
  if stage == Stage.EXPERIENCE:
    return _Work(flops, memory_bytes + ring, link, collectives, attention)
  # The update: forward and backward (about 3x the forward; the backward ring passes K/V and
  # their gradients), every micro-batch; then AdamW over the local shard (weights, gradients and
  # two moments read and written), after the gradients are reduced over every replica of the
  # weights (dp x cp).
  local = weight_bytes_per_device(model, parallel)
  replicas = dp * parallel.cp
  grads = (2 * (replicas - 1) / replicas) * local + (gathered * (fsdp - 1) / fsdp)
  return _Work(
    flops=3 * flops + 12 * local / _BYTES[model.param_dtype],
    memory_bytes=3 * memory_bytes + 8 * local + 3 * ring,
    link_bytes=2 * link + ring + grads,
    collectives=micro_batches * 2 * collectives
    + (1 if replicas > 1 else 0)
    + (L if fsdp > 1 else 0),
    attention_flops=3 * attention,
  )
