"""Typed, frozen configuration for earl_jax.

Every config is a `kw_only` frozen dataclass validated in `__post_init__`, so a bad value fails
where it is written, before any mesh is built or any program is compiled. Experiment-level
configs (RL, selector, dispatcher, the whole experiment) live beside the code that reads them
and are assembled in `experiments/configs/`.

The dimension alphabet, declared here once and used by every module (in shape suffixes such as
`tokens_BxT`, in einsum strings and in jaxtyping annotations); no module gives a letter another
meaning:

  B   rows of a batch: episodes, responses (a stage's load)
  G   groups of episodes that share their randomness (GRPO); G divides B
  T   tokens of a row or a chunk: a bucketed sequence length, or the longest episode
  S   KV-cache capacity (a context bucket); in an attention einsum, the key positions
  P   prompt tokens one rollout call prefills (a prompt bucket)
  N   tokens one rollout call decodes at most (the per-turn limit)
  C   positions of one log-prob chunk (`ModelConfig.logprob_chunk`)
  E   entries of a flattened table (B per-row values, or B x T per-token values)
  D   model width        F   MLP width          V   vocabulary
  H   query heads        K   KV heads           Dh  head dim (d in einsum strings)
  Q   query heads per KV head (H / K, grouped-query attention)
  J   queries of one KV head in the cache attention: Q x T flattened (`qwen2.Attention`)
  L   decoder layers

Lower-case letters are per-module: each module that uses one declares it in its docstring
(e.g. b = one attention block in `models.attention`, b and r = rows per rank in `rl.packing`).
"""

import dataclasses
import math
from typing import Any, Literal

from earl_jax.errors import ConfigError

DType = Literal['float32', 'bfloat16']
_DTYPES = ('float32', 'bfloat16')


# The largest finite float32: rewards, coefficients and budgets reach the device as float32, where
# a larger finite Python float becomes inf.
F32_MAX = 3.4028234663852886e38
# Seeds: the step seed is `(seed * 1_000_003 + step) % (2**31 - 1)`, so seeds that differ by a
# multiple of the prime 2**31 - 1 replay the same run (2147483647 is seed 0), and JAX's keys keep
# the low 32 bits of a seed; [0, 2**31 - 2] holds distinct runs only.
MAX_SEED = 2**31 - 2


def check_positive(obj: Any, *names: str) -> None:
  """Raises ConfigError naming `type(obj).name` when one of the fields is not a positive int."""
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise ConfigError(f'{type(obj).__name__}.{name} must be a positive int, got {value!r}.')


# The train state's step counter is int32: a run of more steps could not count them.
MAX_STEPS = 2**31 - 1


def check_steps(obj: Any, name: str = 'steps') -> None:
  """Raises ConfigError unless the field is a positive int the int32 step counter holds."""
  check_positive(obj, name)
  value = getattr(obj, name)
  if value > MAX_STEPS:
    raise ConfigError(
      f'{type(obj).__name__}.{name}={value}: expected at most {MAX_STEPS:,} (the train '
      "state's int32 step counter)."
    )


def check_float32(obj: Any, *names: str) -> None:
  """Raises ConfigError naming the field when one of them is not a finite number that float32
  holds: NaN, inf and |x| > 3.4e38 all become NaN or inf on the device."""
  for name in names:
    value = getattr(obj, name)
    if (
      not isinstance(value, int | float)
      or isinstance(value, bool)
      or not math.isfinite(value)
      or abs(value) > F32_MAX
    ):
      raise ConfigError(
        f'{type(obj).__name__}.{name} must be a finite number (float32 holds up to 3.4e38), got '
        f'{value!r}.'
      )


def check_seed(obj: Any, *names: str) -> None:
  """Raises ConfigError naming the field when one of them is not an int in [0, MAX_SEED]."""
  for name in names:
    value = getattr(obj, name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
      raise ConfigError(
        f'{type(obj).__name__}.{name}={value!r}: expected an int in [0, {MAX_SEED}] (2**31 - 2; '
        'a larger seed replays a smaller one).'
      )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """Shapes of a Qwen2 / Qwen2.5 decoder.

  Attributes:
    name: preset name, used in cache keys and logs.
    vocab_size: V.
    hidden_size: D.
    intermediate_size: F, the SwiGLU width.
    num_layers: L.
    num_heads: H, query heads.
    num_kv_heads: K, key/value heads (grouped-query attention: H % K == 0).
    head_dim: Dh; Qwen2 uses D // H.
    rope_theta: RoPE base frequency.
    rms_norm_eps: epsilon of every RMSNorm.
    tie_word_embeddings: the LM head reuses the [V, D] embedding table.
    qkv_bias: q/k/v projections carry a bias (always true for Qwen2).
    max_position_embeddings: the longest context the checkpoint was trained for.
    param_dtype: storage dtype of the parameters.
    dtype: compute dtype of activations (softmax, norms and log-probs always run in f32).
    logprob_chunk: tokens per chunk when turning hidden states into log-probs, so that a
      [B, T, V] logits tensor never exists in one piece.
    attention_impl: causal self-attention of training / experience forwards: 'blockwise' (exact,
      query blocks of `attention_block` tokens that skip the upper triangle; any backend),
      'dot_product' (jax.nn.dot_product_attention with XLA's implementation: the whole [T, T]
      score matrix) or 'cudnn' (the same call with implementation='cudnn': cuDNN's fused flash
      attention; NVIDIA GPUs with bf16/f16 activations only, see
      `earl_jax.models.attention.cudnn_supported`). Packed rows (segment ids) under 'cudnn' use
      XLA's implementation, since cuDNN's masks are causal and padding only.
    attention_block: query block of the blockwise attention (0: one dense block).
  """

  name: str = 'custom'
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 1_000_000.0
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = True
  max_position_embeddings: int = 32_768
  param_dtype: DType = 'float32'
  dtype: DType = 'float32'
  logprob_chunk: int = 256
  attention_impl: Literal['blockwise', 'dot_product', 'cudnn'] = 'blockwise'
  attention_block: int = 128

  def __post_init__(self):
    check_positive(
      self,
      'vocab_size',
      'hidden_size',
      'intermediate_size',
      'num_layers',
      'num_heads',
      'num_kv_heads',
      'head_dim',
      'max_position_embeddings',
      'logprob_chunk',
    )
    if self.num_heads % self.num_kv_heads:
      raise ConfigError(
        f'ModelConfig {self.name!r}: num_heads={self.num_heads} must be a multiple of '
        f'num_kv_heads={self.num_kv_heads} (grouped-query attention).'
      )
    if self.head_dim % 2:
      raise ConfigError(f'ModelConfig {self.name!r}: head_dim={self.head_dim} must be even (RoPE).')
    for field in ('param_dtype', 'dtype'):
      if getattr(self, field) not in _DTYPES:
        raise ConfigError(
          f'ModelConfig.{field} must be one of {_DTYPES}, got {getattr(self, field)!r}.'
        )
    if self.attention_impl not in ('blockwise', 'dot_product', 'cudnn'):
      raise ConfigError(
        "ModelConfig.attention_impl must be 'blockwise', 'dot_product' or 'cudnn', got "
        f'{self.attention_impl!r}.'
      )
    if self.attention_block < 0:
      raise ConfigError(f'ModelConfig.attention_block must be >= 0, got {self.attention_block}.')
    if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
      raise ConfigError('ModelConfig: rope_theta and rms_norm_eps must be positive.')

  @property
  def num_params(self) -> int:
    """Parameter count (embedding counted once when tied)."""
    D, F, V, Dh = self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim
    H, K = self.num_heads, self.num_kv_heads
    attn = D * H * Dh + 2 * D * K * Dh + H * Dh * D
    if self.qkv_bias:
      attn += H * Dh + 2 * K * Dh
    layer = attn + 3 * D * F + 2 * D
    embed = V * D * (1 if self.tie_word_embeddings else 2)
    return self.num_layers * layer + embed + D

  def replace(self, **changes: Any) -> 'ModelConfig':
    return dataclasses.replace(self, **changes)

  @classmethod
  def preset(cls, name: str) -> 'ModelConfig':
    """Returns a named preset; raises ValueError naming the known presets."""
    try:
      return _MODEL_PRESETS[name]
    except KeyError:
      raise ConfigError(
        f'Unknown model preset {name!r}; known presets: {sorted(_MODEL_PRESETS)}.'
      ) from None

  @classmethod
  def preset_names(cls) -> list[str]:
    return sorted(_MODEL_PRESETS)


def _qwen25(name, *, V, D, F, L, H, K, tied) -> ModelConfig:
  return ModelConfig(
    name=name,
    vocab_size=V,
    hidden_size=D,
    intermediate_size=F,
    num_layers=L,
    num_heads=H,
    num_kv_heads=K,
    head_dim=D // H,
    tie_word_embeddings=tied,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32_768,
    param_dtype='bfloat16',
    dtype='bfloat16',
  )


# Tiny CPU presets. Heads and KV heads divide by 1, 2, 4 and 8 so every mesh of 8 fake devices
# is valid. `tiny` has the shapes of the committed HF fixture checkpoint.
_TINY = ModelConfig(
  name='tiny',
  vocab_size=512,
  hidden_size=64,
  intermediate_size=192,
  num_layers=2,
  num_heads=8,
  num_kv_heads=4,
  head_dim=8,
  rope_theta=10_000.0,
  max_position_embeddings=4096,
  logprob_chunk=64,
)

_TINY_GAME = _TINY.replace(
  name='tiny-game',
  vocab_size=64,
  intermediate_size=128,
  num_heads=4,
  head_dim=16,
  tie_word_embeddings=True,
  logprob_chunk=128,
)

_MODEL_PRESETS: dict[str, ModelConfig] = {
  # The real Qwen2.5 shapes (config.json of the Qwen/Qwen2.5-*-Instruct checkpoints).
  'qwen2.5-0.5b': _qwen25('qwen2.5-0.5b', V=151_936, D=896, F=4864, L=24, H=14, K=2, tied=True),
  'qwen2.5-1.5b': _qwen25('qwen2.5-1.5b', V=151_936, D=1536, F=8960, L=28, H=12, K=2, tied=True),
  'qwen2.5-7b': _qwen25('qwen2.5-7b', V=152_064, D=3584, F=18_944, L=28, H=28, K=4, tied=False),
  'qwen2.5-72b': _qwen25('qwen2.5-72b', V=152_064, D=8192, F=29_568, L=80, H=64, K=8, tied=False),
  'tiny': _TINY,
  # The code presets' policy: `tiny`'s size with 4 heads of 16 dims instead of 8 of 8. Warm
  # started on the 'functions' tasks (experiments/configs/sft.py `code`), it learns to copy a
  # task's constants from the words into the body; with 8-dim heads, or 2 heads of 32, it had
  # not after 400 steps of one init seed (docs/results/main-job.md, "The warm start's init
  # seed").
  'tiny-code': _TINY.replace(name='tiny-code', num_heads=4, head_dim=16),
  # The embedded default's policy: small enough to train from scratch on 2 CPU cores, with the
  # built-in game tokenizer's vocabulary (64 symbols).
  'tiny-game': _TINY_GAME,
  # tiny-game with 8 heads of 16 (twice the attention width): it learns to read a full column
  # from the board text in fewer updates (docs/results/tried.md, issue 41).
  'tiny-game-8h': _TINY_GAME.replace(name='tiny-game-8h', num_heads=8, num_kv_heads=8),
  # Sized for the selector's CPU heatmap: the KV cache, not the weights, decides what fits.
  'small-kv': _TINY.replace(
    name='small-kv',
    hidden_size=128,
    intermediate_size=256,
    num_kv_heads=8,
    head_dim=16,
    max_position_embeddings=65_536,
    logprob_chunk=128,
  ),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
  """One parallel layout: data x fsdp x context x tensor over a stage's devices.

  The mesh axes are always ('data', 'fsdp', 'context', 'tensor') with sizes (dp, fsdp, cp, tp);
  tensor is the fastest-varying axis, so a tensor-parallel group is a run of consecutive devices
  of the canonical device list (one NVLink island on a GPU host), and a context-parallel ring
  the next fastest.

  Attributes:
    dp: data-parallel ways: the batch is split over them, the weights are replicated.
    fsdp: fully sharded data-parallel ways: the batch and the weights' model dimension (with
      the optimizer moments) are split over them.
    tp: tensor-parallel ways: heads, MLP columns and the vocabulary are split over them.
    cp: context-parallel ways: the tokens of each sequence are split over them (the weights
      are replicated), for contexts too long for one device.
  """

  dp: int = 1
  fsdp: int = 1
  tp: int = 1
  cp: int = 1

  def __post_init__(self):
    check_positive(self, 'dp', 'fsdp', 'tp', 'cp')

  @property
  def shape(self) -> tuple[int, int, int, int]:
    """The mesh's shape: (dp, fsdp, cp, tp)."""
    return (self.dp, self.fsdp, self.cp, self.tp)

  @property
  def num_devices(self) -> int:
    return self.dp * self.fsdp * self.cp * self.tp

  @property
  def batch_shards(self) -> int:
    """How many ways the batch (rows) is split: data x fsdp."""
    return self.dp * self.fsdp

  @property
  def name(self) -> str:
    parts = [f'dp{self.dp}']
    if self.fsdp > 1:
      parts.append(f'fsdp{self.fsdp}')
    parts.append(f'tp{self.tp}')
    if self.cp > 1:
      parts.append(f'cp{self.cp}')
    return '.'.join(parts)

  def __str__(self) -> str:
    return self.name

  @classmethod
  def parse(cls, text: str) -> 'ParallelConfig':
    """Parses 'dp2.tp4', 'dp2.fsdp2.tp2', 'dp2.cp4' or '2x4' / '2x2x2' (dp x [fsdp x] tp)."""
    text = text.strip().lower()
    try:
      if 'x' in text:
        sizes = [int(s) for s in text.split('x')]
        if len(sizes) == 2:
          return cls(dp=sizes[0], tp=sizes[1])
        if len(sizes) == 3:
          return cls(dp=sizes[0], fsdp=sizes[1], tp=sizes[2])
      else:
        kw = {}
        for part in text.split('.'):
          for key in ('fsdp', 'dp', 'tp', 'cp'):
            if part.startswith(key):
              kw[key] = int(part[len(key) :])
              break
          else:
            raise ConfigError(part)
        if kw:
          return cls(**kw)
    except ValueError:
      pass
    raise ConfigError(
      f"Cannot parse parallel config {text!r}; expected e.g. 'dp2.tp4', 'dp2.fsdp2.tp2', "
      "'dp2.cp4', '2x4' or '2x2x2'."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class BucketConfig:
  """The explicit, sorted table of context-length buckets.

  Every length that reaches a jitted program is padded up to one of these, so that a program
  is compiled once per (stage, parallel config, bucket).

  Attributes:
    lengths: the bucket lengths in tokens, strictly increasing; the last is the longest context
      a run can hold (the context cap).
  """

  lengths: tuple[int, ...] = (256, 512, 1024, 2048, 4096)

  def __post_init__(self):
    lengths = tuple(self.lengths)
    if not lengths:
      raise ConfigError('BucketConfig.lengths is empty; give at least one context length.')
    if any(not isinstance(n, int) or n <= 0 for n in lengths):
      raise ConfigError(f'BucketConfig.lengths must be positive ints, got {lengths}.')
    if list(lengths) != sorted(set(lengths)):
      raise ConfigError(
        f'BucketConfig.lengths must be strictly increasing, got {lengths}; '
        f'did you mean {tuple(sorted(set(lengths)))}?'
      )
    object.__setattr__(self, 'lengths', lengths)

  @property
  def max_length(self) -> int:
    return self.lengths[-1]

  def bucket_for(self, length: int) -> int:
    """The smallest bucket that holds `length` tokens."""
    if length > self.lengths[-1]:
      raise ValueError(
        f'Length {length} is longer than the largest bucket {self.lengths[-1]} '
        f'(buckets: {self.lengths}).'
      )
    for n in self.lengths:
      if n >= length:
        return n
    raise AssertionError('unreachable')

  @classmethod
  def powers_of_two(cls, lo: int, hi: int) -> 'BucketConfig':
    if lo <= 0 or hi < lo:
      raise ConfigError(f'powers_of_two needs 0 < lo <= hi, got lo={lo}, hi={hi}.')
    n = 1 << max(0, math.ceil(math.log2(lo)))
    out = []
    while n < hi:
      out.append(n)
      n *= 2
    out.append(hi)
    return cls(lengths=tuple(sorted(set(out))))
