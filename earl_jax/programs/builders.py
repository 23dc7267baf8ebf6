"""The per-stage programs: what runs, what the selector sizes and measures, and what it switches.

A builder turns a `ProgramKey` (stage, parallel config, context bucket, rows, and for rollout the
prompt chunk and greedy flag) into a `Program`: a jitted step function with explicit in/out
shardings and donation, plus abstract arguments (ShapeDtypeStructs carrying shardings) to lower
it ahead of time, so that its memory is known before anything runs. The rollout engine, the
trainer and the profiler all run these same programs (through `executables.Executables`).

  rollout     `sampler.generate`: prefill a right-padded chunk of P new prompt tokens per row
              after what the cache of capacity S = bucket holds, then decode up to N =
              `spec.sampling.max_new_tokens` tokens (the cache is donated and comes back
              updated). The end-of-turn id is an argument: the engine passes the tokenizer's,
              the profiler -1 (never sampled), so that every measured call decodes exactly N
              tokens with the very executable the engine runs. Each row carries its episode id
              and turn: they key its sampling, and turn 0 resets the row's fill, so that one
              program refills any slot. Throughput counts B x N tokens.
  experience  `qwen2.token_logprobs` of [B, T] tokens: reference and old log-probs are the same
              program with other weights. Throughput counts B x T tokens.
  train       `train_step.train_step` on a [B, T] `Batch` (the train state is donated).
              Throughput counts B x T tokens.

The warm start's programs are the train and experience programs of objective 'sft'
(`ProgramKey.objective`, `earl_jax.sft.steps`): one AdamW update on the next-token loss of a
[B, T] `SFTBatch` (the train state donated), and that loss's sum and token count (held out).

  prog = builders.build(ProgramKey(stage=Stage.ROLLOUT, config=ParallelConfig(dp=2, tp=4),
                                   bucket=1024, rows=16, chunk=32), cfg, spec, mesh)
  compiled = prog.lower().compile()
  gen, cache = compiled(*builders.make_inputs(prog, params))     # params already on prog.mesh

Dimension letters as in `earl_jax.config`.
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
from earl_jax.models.tokenizer import Tokenizer
from earl_jax.rl import losses
from earl_jax.rl import train_step as train_lib
from earl_jax.rl.batch import Batch
from earl_jax.rollout import engine, sampler
from earl_jax.sft import steps as sft_steps
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.sharding import rules
from earl_jax.stage import Stage


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSpec:
  """Static settings of the stage programs (everything but the key).

  Attributes:
    sampling: the rollout's sampling (temperature, top-p, N = max_new_tokens per call). The
      experience and train log-probs are those of softmax(logits / temperature): the policy
      that sampled the tokens.
    chunk: P, the prompt chunk of a rollout program when its key names none (the one the
      profiler measures: a turn's new observation, the smallest prompt bucket).
    token_ids: the rollout's constrained reply vocabulary (`RolloutConfig.reply_tokens` as
      ids), or None: every stage's policy is then the softmax over these ids alone.
    micro_batches: gradient-accumulation slices of the train step.
    update_epochs: the train step's updates on each batch (`ExperimentConfig.update_epochs`):
      its KL-adaptive rate (`OptimConfig.kl_target`) adapts on every update but a batch's first.
    optim: optimizer of the train step (its state is part of the train program's memory).
    loss: loss settings of the train step.
    packed: the experience and train programs take packed rows (several episodes per row,
      `rl.packing`); their batch carries segment ids and positions.
    move_token_ids: the token of each of the environment's moves, in move order
      (`move_token_ids`): the train step's rules term (`LossConfig.legal_move_coef`) reads
      the policy's probability of the legal ones there. None without that term.
  """

  sampling: sampler.SamplingConfig = dataclasses.field(default_factory=sampler.SamplingConfig)
  chunk: int = 16
  token_ids: tuple[int, ...] | None = None
  micro_batches: int = 1
  update_epochs: int = 1
  optim: train_lib.OptimConfig = dataclasses.field(default_factory=train_lib.OptimConfig)
  loss: losses.LossConfig = dataclasses.field(default_factory=losses.LossConfig)
  packed: bool = False
  move_token_ids: tuple[int, ...] | None = None

  def __post_init__(self):
    if self.loss.legal_move_coef and self.move_token_ids is None:
      raise ValueError(
        'StageSpec: LossConfig.legal_move_coef > 0 needs the move tokens (move_token_ids).'
      )
    if self.token_ids is not None and (
      not isinstance(self.token_ids, tuple)
      or not self.token_ids
      or not all(isinstance(i, int) and i >= 0 for i in self.token_ids)
    ):
      raise ValueError(
        f'StageSpec.token_ids must be None or a non-empty tuple of ids, got {self.token_ids!r}.'
      )
    for name in ('chunk', 'micro_batches'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'StageSpec.{name} must be an int >= 1, got {value!r}.')

  @classmethod
  def for_rollout(
    cls, rollout: engine.RolloutConfig, tokenizer: Tokenizer, vocab_size: int, **train: Any
  ) -> 'StageSpec':
    """The settings a rollout config implies: its sampling, its smallest prompt bucket as the
    profiled chunk, its reply tokens as ids of `tokenizer`; `train` sets the other fields."""
    return cls(
      sampling=rollout.sampling,
      chunk=rollout.prompt_buckets[0],
      token_ids=engine.reply_token_ids(tokenizer, rollout.reply_tokens, vocab_size),
      **train,
    )

  @property
  def decode_tokens(self) -> int:
    """N: tokens a rollout call decodes at most (exactly, when no end-of-turn is sampled)."""
    return self.sampling.max_new_tokens

  @property
  def temperature(self) -> float:
    return self.sampling.temperature


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProgramKey:
  """What identifies one executable.

  Attributes:
    stage: the stage.
    config: the parallel layout.
    bucket: S, the cache capacity (rollout), or T, the sequence length (experience, train).
    rows: B, the batch rows (responses).
    chunk: P, the prompt tokens a rollout call prefills (0 for the other stages).
    greedy: a rollout program that decodes by argmax (evaluation).
    objective: 'rl', the RL job's programs; 'sft', the warm start's train and experience
      programs (its update, and its held-out loss).
  """

  stage: Stage
  config: ParallelConfig
  bucket: int
  rows: int
  chunk: int = 0
  greedy: bool = False
  objective: str = 'rl'

  def __post_init__(self):
    object.__setattr__(self, 'stage', Stage.parse(self.stage))
    for name in ('bucket', 'rows'):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f'ProgramKey.{name} must be a positive int, got {value!r}.')
    if self.stage == Stage.ROLLOUT:
      if not isinstance(self.chunk, int) or self.chunk < 1:
        raise ValueError(f'ProgramKey.chunk of a rollout program must be >= 1, got {self.chunk}.')
    elif self.chunk or self.greedy:
      raise ValueError(f'ProgramKey: chunk and greedy are rollout settings, not {self.stage}.')
    if self.objective not in ('rl', 'sft') or (
      self.objective == 'sft' and self.stage == Stage.ROLLOUT
    ):
      raise ValueError(
        f'ProgramKey.objective={self.objective!r} for {self.stage}: expected rl, or sft for the '
        'train and experience programs.'
      )

  def __str__(self) -> str:
    name = f'{self.stage}/{self.config.name}/S{self.bucket}/R{self.rows}'
    if self.stage == Stage.ROLLOUT:
      name += f'/P{self.chunk}' + ('/greedy' if self.greedy else '')
    return name + ('/sft' if self.objective == 'sft' else '')


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Program:
  """A stage's step function for one key, ready to lower ahead of time.

  Attributes:
    key: what the program is for.
    model: the model config.
    spec: the static stage settings.
    mesh: the stage mesh (over the canonical devices).
    fn: the jitted function (explicit in/out shardings, donation).
    abstract_args: ShapeDtypeStructs with shardings, one per positional argument (a
      `sampler.RolloutArgs` for a rollout program: its arguments by name).
    tokens: tokens produced or processed per call (the throughput numerator).
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

  @functools.cached_property
  def in_shardings(self) -> tuple[Any, ...]:
    """The shardings of `abstract_args`, argument by argument (a `sampler.RolloutArgs` for a
    rollout program). Computed once: the rollout engine reads it every turn."""
    return _shardings_of(self.abstract_args)

  @property
  def tree_shardings(self) -> Any:
    """Where the program wants its first argument, the tree a layout switch moves: the model
    parameters (rollout, experience) or the whole train state (train)."""
    return self.in_shardings[0]

  @property
  def param_shardings(self) -> Any:
    """Where the program wants the model parameters (inside the train state for train)."""
    first = self.tree_shardings
    return first.params if self.key.stage == Stage.TRAIN else first


Builder = Callable[[ProgramKey, ModelConfig, StageSpec, jax.sharding.Mesh], Program]


def _replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def _sds(shape, dtype, sharding) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def _shardings_of(abstract_args: tuple[Any, ...]) -> tuple[Any, ...]:
  """The shardings of each argument's ShapeDtypeStructs; a NamedTuple keeps its type."""
  shardings = [jax.tree.map(lambda a: a.sharding, arg) for arg in abstract_args]
  return abstract_args._make(shardings) if hasattr(abstract_args, '_make') else tuple(shardings)


def _with_shardings(shapes: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda s, sh: _sds(s.shape, s.dtype, sh), shapes, shardings)


def _setup(key: ProgramKey, model: ModelConfig, mesh: jax.sharding.Mesh):
  if mesh_lib.parallel_config_of(mesh) != key.config:
    raise ValueError(f'Program {key} built on a mesh of shape {dict(mesh.shape)}.')
  mesh_lib.check_model_fits(key.config, model)
  mesh_lib.check_batch_fits(key.config, key.rows, what='rows (responses)')
  graphdef, abstract_params = qwen2.abstract_model(model, mesh)
  return graphdef, abstract_params


def generation_shardings(mesh: jax.sharding.Mesh) -> sampler.Generation:
  bt = rules.sharding(('batch', None), mesh)
  b = rules.sharding(('batch',), mesh)
  return sampler.Generation(tokens=bt, logprobs=bt, num_tokens=b, stopped=b)


def rollout_program(
  key: ProgramKey, model: ModelConfig, spec: StageSpec, mesh: jax.sharding.Mesh
) -> Program:
  """Prefill of a P-token chunk, then decode of up to N tokens, for B rows with a cache of S.

  Arguments: a `sampler.RolloutArgs` (params, cache, prompt [B, P] int32, num_prompt [B] int32,
  key_data uint32[2] (`jax.random.key_data` of the rollout's key), episode_ids and turns [B]
  int32, eot_id [] int32); the cache is donated. Returns (Generation [B, N], cache). Rows with
  num_prompt == 0 idle (their cache and fill are unchanged). A row at turn 0 starts an episode:
  its fill is reset before the prefill, so any row (slot) takes a new episode through this one
  program. Token i of a row samples with a key of (episode id, turn, i) (`sampler.row_keys`).
  Prompt positions past the capacity are dropped (a small cache bucket with a larger prompt
  bucket).
  """
  S, B, N = key.bucket, key.rows, spec.decode_tokens
  graphdef, abstract_params = _setup(key, model, mesh)
  abstract_args = sampler.RolloutArgs(
    params=abstract_params,
    cache=qwen2.KVCache.abstract(model, B, S, mesh),
    prompt=_sds((B, key.chunk), jnp.int32, rules.sharding(('batch', 'seq'), mesh)),
    num_prompt=_sds((B,), jnp.int32, rules.sharding(('batch',), mesh)),
    # The PRNG key travels as its raw uint32 data: a plain host value every process can place.
    key_data=_sds((2,), jnp.uint32, _replicated(mesh)),
    episode_ids=_sds((B,), jnp.int32, rules.sharding(('batch',), mesh)),
    turns=_sds((B,), jnp.int32, rules.sharding(('batch',), mesh)),
    eot_id=_sds((), jnp.int32, _replicated(mesh)),
  )
  sampling = dataclasses.replace(spec.sampling, greedy=key.greedy or spec.sampling.greedy)

  # RolloutArgs, in its order.
  def step(params, cache, prompt, num_prompt, key_data, episode_ids, turns, eot_id):
    policy = nnx.merge(graphdef, params)
    keys = sampler.row_keys(jax.random.wrap_key_data(key_data), episode_ids, turns)
    return sampler.generate(
      policy,
      cache,
      prompt,
      num_prompt,
      keys,
      eot_id=eot_id,
      config=sampling,
      token_ids=spec.token_ids,
      restart=(turns == 0) & (num_prompt > 0),
    )

  shardings = _shardings_of(abstract_args)
  fn = jax.jit(
    step,
    in_shardings=tuple(shardings),
    out_shardings=(generation_shardings(mesh), shardings.cache),
    donate_argnums=(sampler.RolloutArgs._fields.index('cache'),),
  )
  return Program(
    key=key,
    model=model,
    spec=spec,
    mesh=mesh,
    fn=fn,
    abstract_args=abstract_args,
    tokens=B * N,
  )


def experience_program(
  key: ProgramKey, model: ModelConfig, spec: StageSpec, mesh: jax.sharding.Mesh
) -> Program:
  """Per-token log-probs of [B, T] tokens: (params, tokens) -> log-probs [B, T] f32; packed:
  (params, tokens, segment_ids, positions)."""
  graphdef, abstract_params = _setup(key, model, mesh)
  bt = rules.sharding(('batch', 'seq'), mesh)
  tokens = _sds((key.rows, key.bucket), jnp.int32, bt)

  def step(params, tokens, *segments):
    model = nnx.merge(graphdef, params)
    return qwen2.token_logprobs(
      model, tokens, spec.temperature, spec.token_ids, segments if segments else None
    )

  abstract_args = (abstract_params, tokens, *((tokens, tokens) if spec.packed else ()))
  param_sh = qwen2.state_shardings(abstract_params)
  fn = jax.jit(step, in_shardings=(param_sh, *[bt] * (len(abstract_args) - 1)), out_shardings=bt)
  return _token_rows(key, model, spec, mesh, fn, abstract_args)


def _token_rows(key: ProgramKey, model, spec, mesh, fn, abstract_args) -> Program:
  """A program over [B, T] = [rows, bucket] tokens: its throughput counts B x T tokens."""
  return Program(
    key=key,
    model=model,
    spec=spec,
    mesh=mesh,
    fn=fn,
    abstract_args=abstract_args,
    tokens=key.rows * key.bucket,
  )


def _mesh_of(where: ParallelConfig | jax.sharding.Mesh) -> jax.sharding.Mesh:
  return where if isinstance(where, jax.sharding.Mesh) else mesh_lib.make_mesh(where)


def abstract_train_state(
  model: ModelConfig, where: ParallelConfig | jax.sharding.Mesh, optim: train_lib.OptimConfig
) -> train_lib.TrainState:
  """The train state's ShapeDtypeStructs on a mesh (or a layout over all devices), moments
  sharded like their parameters."""
  _, abstract_params = qwen2.abstract_model(model, _mesh_of(where))
  return train_lib.abstract_train_state(abstract_params, train_lib.make_optimizer(optim))


def param_shardings(model: ModelConfig, where: ParallelConfig | jax.sharding.Mesh) -> Any:
  """The model's parameter shardings on a mesh (or a layout over all canonical devices)."""
  _, abstract = qwen2.abstract_model(model, _mesh_of(where))
  return qwen2.state_shardings(abstract)


def train_program(
  key: ProgramKey, model: ModelConfig, spec: StageSpec, mesh: jax.sharding.Mesh
) -> Program:
  """One optimizer update on a [B, T] batch: (state, batch) -> (state, metrics)."""
  if key.rows % spec.micro_batches:
    raise ValueError(f'rows={key.rows} is not divisible by micro_batches={spec.micro_batches}.')
  graphdef, _ = _setup(key, model, mesh)
  state = abstract_train_state(model, mesh, spec.optim)
  batch_sh = Batch.shardings(mesh)
  batch = _with_shardings(Batch.zeros(key.rows, key.bucket), batch_sh)
  fn = train_lib.make_train_step(
    graphdef,
    train_lib.make_optimizer(spec.optim),
    spec.loss,
    micro_batches=spec.micro_batches,
    update_epochs=spec.update_epochs,
    temperature=spec.temperature,
    token_ids=spec.token_ids,
    packed=spec.packed,
    move_token_ids=spec.move_token_ids,
    state_shardings=jax.tree.map(lambda a: a.sharding, state),
    batch_shardings=batch_sh,
    metrics_sharding=_replicated(mesh),
  )
  return _token_rows(key, model, spec, mesh, fn, (state, batch))


def sft_train_program(
  key: ProgramKey, model: ModelConfig, spec: StageSpec, mesh: jax.sharding.Mesh
) -> Program:
  """The warm start's update on a [B, T] `SFTBatch`: (state, batch) -> (state, metrics)
  (`sft_steps.sft_step`; the state is donated)."""
  graphdef, _ = _setup(key, model, mesh)
  state = abstract_train_state(model, mesh, spec.optim)
  state_sh = jax.tree.map(lambda a: a.sharding, state)
  batch_sh = sft_steps.SFTBatch.shardings(mesh)
  step = functools.partial(
    sft_steps.sft_step, graphdef=graphdef, optimizer=train_lib.make_optimizer(spec.optim)
  )
  fn = jax.jit(
    step,
    in_shardings=(state_sh, batch_sh),
    out_shardings=(state_sh, _replicated(mesh)),
    donate_argnums=(0,),
  )
  batch = sft_steps.SFTBatch.abstract(key.rows, key.bucket, batch_sh)
  return _token_rows(key, model, spec, mesh, fn, (state, batch))


def sft_heldout_program(
  key: ProgramKey, model: ModelConfig, spec: StageSpec, mesh: jax.sharding.Mesh
) -> Program:
  """The warm start's held-out loss of a [B, T] `SFTBatch`: (params, batch) -> {'nll_sum',
  'tokens'} over the masked tokens."""
  graphdef, abstract_params = _setup(key, model, mesh)
  batch_sh = sft_steps.SFTBatch.shardings(mesh)

  def sums(params, batch):
    return sft_steps.sft_loss(params, graphdef, batch)[1]

  fn = jax.jit(
    sums,
    in_shardings=(qwen2.state_shardings(abstract_params), batch_sh),
    out_shardings=_replicated(mesh),
  )
  batch = sft_steps.SFTBatch.abstract(key.rows, key.bucket, batch_sh)
  return _token_rows(key, model, spec, mesh, fn, (abstract_params, batch))


BUILDERS: dict[tuple[str, Stage], Builder] = {
  ('rl', Stage.ROLLOUT): rollout_program,
  ('rl', Stage.EXPERIENCE): experience_program,
  ('rl', Stage.TRAIN): train_program,
  ('sft', Stage.EXPERIENCE): sft_heldout_program,
  ('sft', Stage.TRAIN): sft_train_program,
}


def build(
  key: ProgramKey,
  model: ModelConfig,
  spec: StageSpec | None = None,
  mesh: jax.sharding.Mesh | None = None,
) -> Program:
  """The program of `key` on `mesh` (default: `key.config` over all canonical devices)."""
  mesh = mesh if mesh is not None else mesh_lib.make_mesh(key.config)
  return BUILDERS[key.objective, key.stage](key, model, spec or StageSpec(), mesh)


def make_inputs(program: Program, params: nnx.State, *, seed: int = 0) -> tuple[Any, ...]:
  """Concrete arguments for `program`, created on its mesh; `params` must already be there.

  rollout: a zero cache filled to S - P - N, a random P-token prompt on every row at turn 1
  (the fill is kept), the end-of-turn id -1 (so that every row decodes N tokens and fills the cache to S). experience:
  random tokens. train: a fresh train state built from a copy of `params` (the step donates it)
  and a random batch whose every row is valid with a loss on all positions but the first.
  """
  make = {
    Stage.ROLLOUT: _rollout_inputs,
    Stage.EXPERIENCE: _experience_inputs,
    Stage.TRAIN: _train_inputs,
  }[program.key.stage]
  return make(program, params, jax.random.key(seed))


def _rollout_inputs(program: Program, params: nnx.State, rng: jax.Array) -> sampler.RolloutArgs:
  key = program.key
  B, S = key.rows, key.bucket
  P, N = key.chunk, program.spec.decode_tokens
  if S < P + N:
    raise ValueError(
      f'rollout bucket {S} must be longer than chunk {P} + decode_tokens {N} to measure '
      f'program {key}.'
    )
  cache_abs = program.abstract_args.cache
  vocab_size = program.model.vocab_size

  def make_rest():
    cache = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), cache_abs)
    cache = cache.replace(lengths=jnp.full((B,), S - P - N, jnp.int32))
    prompt = jax.random.randint(rng, (B, P), 0, vocab_size, jnp.int32)
    num_prompt = jnp.full((B,), P, jnp.int32)
    key_data = jax.random.key_data(jax.random.fold_in(rng, 1))
    episode_ids = jnp.arange(B, dtype=jnp.int32)
    turns = jnp.ones((B,), jnp.int32)  # past the first turn: the fill is kept
    return cache, prompt, num_prompt, key_data, episode_ids, turns, jnp.int32(-1)

  rest = jax.jit(make_rest, out_shardings=tuple(program.in_shardings[1:]))()
  return sampler.RolloutArgs(params, *rest)


def _experience_inputs(program: Program, params: nnx.State, rng: jax.Array) -> tuple[Any, ...]:
  B, S = program.key.rows, program.key.bucket
  shardings = program.in_shardings
  tokens = jax.jit(
    lambda: jax.random.randint(rng, (B, S), 0, program.model.vocab_size, jnp.int32),
    out_shardings=shardings[1],
  )()
  if not program.spec.packed:
    return (params, tokens)
  segments = jax.jit(lambda: _packed_segments(B, S), out_shardings=(shardings[2], shardings[3]))()
  return (params, tokens, *segments)


def _train_inputs(
  program: Program, params: nnx.State, rng: jax.Array
) -> tuple[train_lib.TrainState, Batch]:
  B, S = program.key.rows, program.key.bucket
  vocab_size = program.model.vocab_size
  packed = program.spec.packed
  state = train_lib.init_train_state(
    jax.tree.map(jnp.copy, params), train_lib.make_optimizer(program.spec.optim)
  )

  def make_batch():
    token_key, advantage_key = jax.random.split(rng)
    mask = jnp.broadcast_to(jnp.arange(S) > 0, (B, S))
    segment_ids, positions = _packed_segments(B, S) if packed else (mask + 0, None)
    batch = Batch.zeros(B, S, xp=jnp).replace(
      tokens=jax.random.randint(token_key, (B, S), 0, vocab_size, jnp.int32),
      loss_mask=mask,
      advantages=jnp.where(mask, jax.random.normal(advantage_key, (B, S)), 0.0),
      segment_ids=segment_ids,
      lengths=jnp.full((B,), S, jnp.int32),
      valid=jnp.ones((B,), jnp.bool_),
    )
    return batch if positions is None else batch.replace(positions=positions)

  with jax.set_mesh(program.mesh):
    return state, jax.jit(make_batch, out_shardings=program.in_shardings[1])()


def _packed_segments(B: int, S: int):
  """Segment ids and positions of rows packed with four sequences of S / 4 tokens (measuring)."""
  segment_len = max(1, S // 4)
  column = jnp.arange(S, dtype=jnp.int32)
  segment = jnp.minimum(column // segment_len, 3)
  segment_ids = jnp.broadcast_to(segment + 1, (B, S))
  positions = jnp.broadcast_to(column - segment * segment_len, (B, S))
  return segment_ids, positions
