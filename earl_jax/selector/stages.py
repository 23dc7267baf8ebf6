"""The per-stage programs the selector compiles, sizes, measures and switches between.

A builder turns (stage, parallel config, context bucket, rows) into a `Program`: a jitted step
function with explicit in/out shardings and donation, plus abstract arguments (ShapeDtypeStructs
carrying shardings) to lower it ahead of time, so that its memory is known before anything runs.

  rollout     `sampler.decode` of `decode_tokens` tokens for `rows` responses against a KV cache of
              capacity `bucket` that is already filled to bucket - decode_tokens (the cache is
              donated and comes back updated). Throughput counts the decoded tokens.
  experience  `qwen2.token_logprobs` of [rows, bucket] tokens: reference and old log-probs are the
              same program with other weights. Throughput counts rows x bucket tokens.
  train       `train_step.train_step` on a [rows, bucket] `Batch` (the train state is donated).
              Throughput counts rows x bucket tokens.

  prog = stages.build('rollout', cfg, ParallelConfig(dp=2, tp=4), bucket=1024, rows=16)
  compiled = prog.lower().compile()
  args = stages.make_inputs(prog, params)          # params already on prog.mesh
  gen, cache = compiled(*args)

Dimension letters: B rows, S cache capacity (a bucket), T tokens (a bucket), V vocab, N decoded
tokens per call.
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.rl import losses
from earl_jax.rl import train_step as train_lib
from earl_jax.rl.trajectory import Batch
from earl_jax.rollout import sampler
from earl_jax.selector.candidates import check_stage
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSpec:
  """Static settings of the stage programs (everything but config, bucket and rows).

  Attributes:
    decode_tokens: N, tokens decoded per rollout call (the unit of a decode measurement).
    micro_batches: gradient-accumulation slices of the train step.
    optim: optimizer of the train step (its state is part of the train program's memory).
    loss: loss settings of the train step.
    temperature: the rollout's sampling temperature: experience and train log-probs are those of
      softmax(logits / temperature), the policy that sampled the tokens.
    token_ids: the rollout's constrained reply vocabulary (`engine.reply_token_ids`), or None:
      experience and train log-probs are then those of the softmax over these ids alone.
  """

  decode_tokens: int = 8
  micro_batches: int = 1
  optim: train_lib.OptimConfig = dataclasses.field(default_factory=train_lib.OptimConfig)
  loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)
  temperature: float = 1.0
  token_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if not self.temperature > 0:
      raise ValueError(f'StageSpec.temperature must be > 0, got {self.temperature}.')
    if self.token_ids is not None and (
      not isinstance(self.token_ids, tuple)
      or not self.token_ids
      or not all(isinstance(i, int) and i >= 0 for i in self.token_ids)
    ):
      raise ValueError(
        f'StageSpec.token_ids must be None or a non-empty tuple of ids, got {self.token_ids!r}.'
      )
    for name in ('decode_tokens', 'micro_batches'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'StageSpec.{name} must be an int >= 1, got {value!r}.')


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramKey:
  """What identifies one executable: (stage, parallel config, bucket, rows)."""

  stage: str
  config: ParallelConfig
  bucket: int
  rows: int

  def __post_init__(self):
    check_stage(self.stage)
    for name in ('bucket', 'rows'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'ProgramKey.{name} must be a positive int, got {value!r}.')

  def __str__(self) -> str:
    return f'{self.stage}/{self.config.name}/S{self.bucket}/R{self.rows}'


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Program:
  """A stage's step function for one key, ready to lower ahead of time.

  Attributes:
    key: (stage, config, bucket, rows).
    model: the model config.
    spec: the static stage settings.
    mesh: the stage mesh (over the canonical devices).
    fn: the jitted function (explicit in/out shardings, donation).
    abstract_args: ShapeDtypeStructs with shardings, one per positional argument.
    tokens: tokens processed per call (the throughput numerator).
  """

  key: ProgramKey
  model: ModelConfig
  spec: StageSpec
  mesh: jax.sharding.Mesh
  fn: Any
  abstract_args: tuple[Any, ...]
  tokens: int

  def lower(self) -> Any:
    """`fn.lower(*abstract_args)` under the stage mesh (thread-safe: the mesh context is per thread)."""
    with jax.set_mesh(self.mesh):
      return self.fn.lower(*self.abstract_args)

  @property
  def in_shardings(self) -> tuple[Any, ...]:
    return tuple(jax.tree.map(lambda a: a.sharding, arg) for arg in self.abstract_args)

  @property
  def param_shardings(self) -> Any:
    """Where the program wants the model parameters (inside the train state for train)."""
    first = self.in_shardings[0]
    return first.params if self.key.stage == 'train' else first


Builder = Callable[[ModelConfig, ParallelConfig, int, int, StageSpec], Program]


def _replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _with_shardings(shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)


def _setup(model: ModelConfig, parallel: ParallelConfig, rows: int):
  mesh_lib.check_model_fits(parallel, model)
  mesh_lib.check_batch_fits(parallel, rows, what='rows (responses)')
  mesh = mesh_lib.make_mesh(parallel)
  graphdef, abstract_params = qwen2.abstract_model(model, mesh)
  return mesh, graphdef, abstract_params


def _generation_shardings(mesh: jax.sharding.Mesh) -> sampler.Generation:
  bt = rules.sharding(('batch', None), mesh)
  b = rules.sharding(('batch',), mesh)
  return sampler.Generation(tokens=bt, logprobs=bt, num_tokens=b, stopped=b)


def rollout_program(
  model: ModelConfig, parallel: ParallelConfig, bucket: int, rows: int, spec: StageSpec
) -> Program:
  """Decode of `spec.decode_tokens` tokens for `rows` responses with a cache of capacity `bucket`.

  Arguments: (params, cache, logits [B, V] f32, active [B] bool, key uint32[2]); the cache is
  donated. Returns (Generation, cache). The end-of-turn id is -1 (never sampled), so every call
  decodes exactly N tokens per row, which is what a throughput measurement needs.
  """
  if bucket <= spec.decode_tokens:
    raise ValueError(
      f'rollout bucket {bucket} must be longer than decode_tokens={spec.decode_tokens}.'
    )
  mesh, graphdef, abstract_params = _setup(model, parallel, rows)
  cache = qwen2.KVCache.abstract(model, rows, bucket, mesh)
  logits = _sds((rows, model.vocab_size), jnp.float32, rules.sharding(('batch', 'act_vocab'), mesh))
  active = _sds((rows,), jnp.bool_, rules.sharding(('batch',), mesh))
  key = _sds((2,), jnp.uint32, _replicated(mesh))
  sampling = sampler.SamplingConfig(greedy=True, max_new_tokens=spec.decode_tokens)

  def step(params, cache, logits, active, key):
    m = nnx.merge(graphdef, params)
    return sampler.decode(m, cache, logits, active, key, eot_id=-1, config=sampling)

  abstract_args = (abstract_params, cache, logits, active, key)
  shardings = tuple(jax.tree.map(lambda a: a.sharding, x) for x in abstract_args)
  fn = jax.jit(
    step,
    in_shardings=shardings,
    out_shardings=(_generation_shardings(mesh), shardings[1]),
    donate_argnums=(1,),
  )
  return Program(
    key=ProgramKey(stage='rollout', config=parallel, bucket=bucket, rows=rows),
    model=model,
    spec=spec,
    mesh=mesh,
    fn=fn,
    abstract_args=abstract_args,
    tokens=rows * spec.decode_tokens,
  )


def experience_program(
  model: ModelConfig, parallel: ParallelConfig, bucket: int, rows: int, spec: StageSpec
) -> Program:
  """Per-token log-probs of [rows, bucket] tokens: (params, tokens) -> log-probs [B, T] f32."""
  mesh, graphdef, abstract_params = _setup(model, parallel, rows)
  bt = rules.sharding(('batch', 'seq'), mesh)
  tokens = _sds((rows, bucket), jnp.int32, bt)

  def step(params, tokens):
    model = nnx.merge(graphdef, params)
    return qwen2.token_logprobs(model, tokens, spec.temperature, spec.token_ids)

  abstract_args = (abstract_params, tokens)
  fn = jax.jit(step, in_shardings=(qwen2.state_shardings(abstract_params), bt), out_shardings=bt)
  return Program(
    key=ProgramKey(stage='experience', config=parallel, bucket=bucket, rows=rows),
    model=model,
    spec=spec,
    mesh=mesh,
    fn=fn,
    abstract_args=abstract_args,
    tokens=rows * bucket,
  )


@functools.lru_cache(maxsize=32)
def abstract_train_state(
  model: ModelConfig, parallel: ParallelConfig, optim: train_lib.OptimConfig
) -> train_lib.TrainState:
  """The train state's ShapeDtypeStructs on a layout (moments sharded like their parameters)."""
  _, abstract_params = qwen2.abstract_model(model, mesh_lib.make_mesh(parallel))
  return train_lib.abstract_train_state(abstract_params, train_lib.make_optimizer(optim))


def train_state_shardings(
  model: ModelConfig, parallel: ParallelConfig, optim: train_lib.OptimConfig
) -> train_lib.TrainState:
  """Target shardings of a whole train state (params and optimizer moments) on a layout."""
  return jax.tree.map(lambda a: a.sharding, abstract_train_state(model, parallel, optim))


def train_program(
  model: ModelConfig, parallel: ParallelConfig, bucket: int, rows: int, spec: StageSpec
) -> Program:
  """One optimizer update on a [rows, bucket] batch: (state, batch) -> (state, metrics)."""
  if rows % spec.micro_batches:
    raise ValueError(f'rows={rows} is not divisible by micro_batches={spec.micro_batches}.')
  mesh, graphdef, _ = _setup(model, parallel, rows)
  state = abstract_train_state(model, parallel, spec.optim)
  batch_sh = Batch.shardings(mesh)
  batch = _with_shardings(Batch.zeros(rows, bucket), batch_sh)
  fn = train_lib.make_train_step(
    graphdef,
    train_lib.make_optimizer(spec.optim),
    spec.loss,
    micro_batches=spec.micro_batches,
    temperature=spec.temperature,
    token_ids=spec.token_ids,
    state_shardings=jax.tree.map(lambda a: a.sharding, state),
    batch_shardings=batch_sh,
    metrics_sharding=_replicated(mesh),
  )
  return Program(
    key=ProgramKey(stage='train', config=parallel, bucket=bucket, rows=rows),
    model=model,
    spec=spec,
    mesh=mesh,
    fn=fn,
    abstract_args=(state, batch),
    tokens=rows * bucket,
  )


BUILDERS: dict[str, Builder] = {
  'rollout': rollout_program,
  'experience': experience_program,
  'train': train_program,
}


def build(
  stage: str,
  model: ModelConfig,
  parallel: ParallelConfig,
  bucket: int,
  rows: int,
  spec: StageSpec | None = None,
) -> Program:
  """The stage's program for (parallel, bucket, rows); see the module docstring."""
  check_stage(stage)
  return BUILDERS[stage](model, parallel, bucket, rows, spec or StageSpec())


def make_inputs(program: Program, params: nnx.State, *, seed: int = 0) -> tuple[Any, ...]:
  """Concrete arguments for `program`, created on its mesh; `params` must already be there.

  rollout: a zero cache filled to bucket - N, random logits, every row active. experience: random
  tokens. train: a fresh train state built from a copy of `params` (the step donates it) and a
  random batch whose every row is valid with a loss on all positions but the first.
  """
  key = program.key
  shardings = program.in_shardings
  B, S = key.rows, key.bucket
  model = program.model
  rng = jax.random.key(seed)
  if key.stage == 'rollout':
    N = program.spec.decode_tokens
    cache_abs = program.abstract_args[1]

    def make_rest():
      cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache_abs)
      cache = cache.replace(lengths=jnp.full((B,), S - N, jnp.int32))
      logits = jax.random.normal(rng, (B, model.vocab_size), jnp.float32)
      return cache, logits, jnp.ones((B,), jnp.bool_), jnp.zeros((2,), jnp.uint32)

    rest = jax.jit(make_rest, out_shardings=shardings[1:])()
    return (params, *rest)
  if key.stage == 'experience':
    tokens = jax.jit(
      lambda: jax.random.randint(rng, (B, S), 0, model.vocab_size, jnp.int32),
      out_shardings=shardings[1],
    )()
    return (params, tokens)
  state = train_lib.init_train_state(
    jax.tree.map(jnp.copy, params), train_lib.make_optimizer(program.spec.optim)
  )

  def make_batch():
    k1, k2 = jax.random.split(rng)
    mask = jnp.broadcast_to(jnp.arange(S) > 0, (B, S))
    return Batch.zeros(B, S, xp=jnp).replace(
      tokens=jax.random.randint(k1, (B, S), 0, model.vocab_size, jnp.int32),
      loss_mask=mask,
      advantages=jnp.where(mask, jax.random.normal(k2, (B, S)), 0.0),
      lengths=jnp.full((B,), S, jnp.int32),
      valid=jnp.ones((B,), jnp.bool_),
    )

  with jax.set_mesh(program.mesh):
    return state, jax.jit(make_batch, out_shardings=shardings[1])()
