"""Load a Hugging Face Qwen2 / Qwen2.5 checkpoint straight onto a mesh.

A checkpoint directory holds `config.json` and either one `model.safetensors` or a sharded set
described by `model.safetensors.index.json`. The safetensors files are memory-mapped; each
parameter is exposed as a lazy view in our layout (e.g. q_proj [H*Dh, D] -> [D, H, Dh] by a
reshape and a transpose, both views), and `jax.make_array_from_callback` reads, for every
addressable device, only that device's slice. No device ever holds an unsharded copy, and in a
multi-host run each host reads only its own shards.

Everything is validated before any array is created: missing files or tensors, shapes that do not
match the config, unsupported architectures, and meshes that do not divide the model.

  cfg, graphdef, state = hf_import.load(model_dir, mesh, param_dtype='bfloat16')
  model = nnx.merge(graphdef, state)
"""

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from earl_jax.config import ModelConfig
from earl_jax.errors import UserError
from earl_jax.models import qwen2
from earl_jax.sharding import mesh as mesh_lib

CONFIG_FILE = 'config.json'
SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'

_ST_DTYPES = {
  'F32': np.dtype(np.float32),
  'F16': np.dtype(np.float16),
  'BF16': np.dtype(ml_dtypes.bfloat16),
  'F64': np.dtype(np.float64),
}


class CheckpointError(UserError):
  """A checkpoint that is missing, incomplete or does not match its config or the mesh."""


def load_config(model_dir: str, **overrides: Any) -> ModelConfig:
  """Reads `config.json` of a Qwen2 checkpoint into a ModelConfig (plus `overrides`)."""
  path = os.path.join(model_dir, CONFIG_FILE)
  if not os.path.isdir(model_dir):
    raise CheckpointError(f'Checkpoint directory {model_dir!r} does not exist.')
  if not os.path.isfile(path):
    raise CheckpointError(f'No {CONFIG_FILE} in checkpoint directory {model_dir!r}.')
  try:
    with open(path, encoding='utf-8') as f:
      hf = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise CheckpointError(f'{path} is not valid JSON ({e}): expected a HF config.json.') from None
  if not isinstance(hf, dict):
    raise CheckpointError(f'{path} holds a JSON {type(hf).__name__}: expected an object.')
  model_type = hf.get('model_type')
  if model_type != 'qwen2':
    raise CheckpointError(
      f'{path}: model_type={model_type!r}; only Qwen2 / Qwen2.5 checkpoints (model_type '
      "'qwen2') are supported."
    )
  if hf.get('hidden_act', 'silu') != 'silu':
    raise CheckpointError(f"{path}: hidden_act={hf['hidden_act']!r}, expected 'silu'.")
  if hf.get('use_sliding_window', False):
    raise CheckpointError(f'{path}: use_sliding_window=true is not supported.')
  rope = hf.get('rope_parameters') or {}
  rope_theta = hf.get('rope_theta', rope.get('rope_theta', 10_000.0))
  rope_type = rope.get('rope_type', (hf.get('rope_scaling') or {}).get('type', 'default'))
  if rope_type not in ('default', None):
    raise CheckpointError(f'{path}: rope type {rope_type!r} is not supported (only default RoPE).')
  try:
    H = hf['num_attention_heads']
    kw = dict(  # noqa: C408
      name=os.path.basename(os.path.normpath(model_dir)),
      vocab_size=hf['vocab_size'],
      hidden_size=hf['hidden_size'],
      intermediate_size=hf['intermediate_size'],
      num_layers=hf['num_hidden_layers'],
      num_heads=H,
      num_kv_heads=hf.get('num_key_value_heads', H),
      head_dim=hf.get('head_dim') or hf['hidden_size'] // H,
      rope_theta=float(rope_theta),
      rms_norm_eps=float(hf.get('rms_norm_eps', 1e-6)),
      tie_word_embeddings=bool(hf.get('tie_word_embeddings', False)),
      max_position_embeddings=hf.get('max_position_embeddings', 32_768),
    )
  except KeyError as e:
    raise CheckpointError(f'{path}: missing key {e.args[0]!r}.') from None
  except (TypeError, ValueError) as e:  # a value of the wrong type
    raise CheckpointError(f'{path}: {e}: expected the numbers of a Qwen2 config.') from None
  kw.update(overrides)
  return ModelConfig(**kw)


class _TensorStore:
  """Memory-mapped tensors of a single-file or sharded safetensors checkpoint."""

  def __init__(self, model_dir: str):
    index_path = os.path.join(model_dir, INDEX_FILE)
    single_path = os.path.join(model_dir, SINGLE_FILE)
    if os.path.isfile(index_path):
      with open(index_path) as f:
        weight_map = json.load(f).get('weight_map')
      if not isinstance(weight_map, dict):
        raise CheckpointError(f'{index_path} has no "weight_map".')
      files = sorted(set(weight_map.values()))
    elif os.path.isfile(single_path):
      files = [SINGLE_FILE]
      weight_map = None
    else:
      raise CheckpointError(
        f'No {SINGLE_FILE} or {INDEX_FILE} in checkpoint directory {model_dir!r}.'
      )
    self.entries: dict[str, tuple[str, dict]] = {}
    self._maps: dict[str, np.memmap] = {}
    for name in files:
      path = os.path.join(model_dir, name)
      if not os.path.isfile(path):
        raise CheckpointError(f'Safetensors file {path} listed in {INDEX_FILE} does not exist.')
      header, data_start = _read_header(path)
      for tensor, meta in header.items():
        if tensor != '__metadata__':
          self.entries[tensor] = (path, dict(meta, data_start=data_start))
    if weight_map is not None:
      missing = [t for t, f in weight_map.items() if t not in self.entries]
      if missing:
        raise CheckpointError(
          f'{len(missing)} tensors listed in {INDEX_FILE} are not in their files, e.g. '
          f'{missing[:3]}.'
        )

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.entries[name][1]['shape'])

  def array(self, name: str) -> np.ndarray:
    """A read-only memmap view of tensor `name` (nothing is read until it is sliced)."""
    path, meta = self.entries[name]
    if path not in self._maps:
      self._maps[path] = np.memmap(path, dtype=np.uint8, mode='r')
    dtype = _ST_DTYPES.get(meta['dtype'])
    if dtype is None:
      raise CheckpointError(
        f'{path}: tensor {name} has dtype {meta["dtype"]}; supported: {sorted(_ST_DTYPES)}.'
      )
    start, end = meta['data_offsets']
    raw = self._maps[path][meta['data_start'] + start : meta['data_start'] + end]
    return raw.view(dtype).reshape(meta['shape'])


def _read_header(path: str) -> tuple[dict, int]:
  with open(path, 'rb') as f:
    head = f.read(8)
    if len(head) != 8:
      raise CheckpointError(f'{path} is not a safetensors file (too short).')
    n = int.from_bytes(head, 'little')
    if n <= 0 or n > os.path.getsize(path) - 8:
      raise CheckpointError(f'{path} is not a safetensors file (bad header length {n}).')
    try:
      header = json.loads(f.read(n))
    except json.JSONDecodeError as e:
      raise CheckpointError(f'{path} is not a safetensors file (header: {e}).') from None
  return header, 8 + n


# Our parameter path -> (HF tensor name, HF shape, view from HF layout to ours).
_View = Callable[[np.ndarray], np.ndarray]


def _param_map(cfg: ModelConfig) -> dict[tuple, tuple[str, tuple[int, ...], _View]]:
  D, V = cfg.hidden_size, cfg.vocab_size
  out = {
    ('embed_tokens',): ('model.embed_tokens.weight', (V, D), _identity),
    ('norm', 'scale'): ('model.norm.weight', (D,), _identity),
  }
  if not cfg.tie_word_embeddings:
    out['lm_head',] = ('lm_head.weight', (V, D), lambda a: a.T)
  for i in range(cfg.num_layers):
    out.update(_layer_param_map(cfg, i))
  return out


def _identity(a: np.ndarray) -> np.ndarray:
  return a


def _layer_param_map(cfg: ModelConfig, i: int) -> dict[tuple, tuple[str, tuple[int, ...], _View]]:
  """`_param_map`'s entries of decoder layer i."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  hf_layer = f'model.layers.{i}.'
  layer = ('layers', i)
  out = {
    (*layer, 'input_layernorm', 'scale'): (hf_layer + 'input_layernorm.weight', (D,), _identity),
    (*layer, 'post_attention_layernorm', 'scale'): (
      hf_layer + 'post_attention_layernorm.weight',
      (D,),
      _identity,
    ),
  }
  hf_attn = hf_layer + 'self_attn.'
  out[(*layer, 'self_attn', 'q_proj')] = (
    hf_attn + 'q_proj.weight',
    (H * Dh, D),
    lambda w: w.reshape(H, Dh, D).transpose(2, 0, 1),
  )
  for proj in ('k_proj', 'v_proj'):
    out[(*layer, 'self_attn', proj)] = (
      hf_attn + proj + '.weight',
      (K * Dh, D),
      lambda w: w.reshape(K, Dh, D).transpose(2, 0, 1),
    )
  out[(*layer, 'self_attn', 'o_proj')] = (
    hf_attn + 'o_proj.weight',
    (D, H * Dh),
    lambda w: w.reshape(D, H, Dh).transpose(1, 2, 0),
  )
  if cfg.qkv_bias:
    for name, heads in (('q', H), ('k', K), ('v', K)):
      out[(*layer, 'self_attn', f'{name}_bias')] = (
        hf_attn + f'{name}_proj.bias',
        (heads * Dh,),
        lambda b, heads=heads: b.reshape(heads, Dh),
      )
  hf_mlp = hf_layer + 'mlp.'
  out[(*layer, 'mlp', 'gate_proj')] = (hf_mlp + 'gate_proj.weight', (F, D), lambda w: w.T)
  out[(*layer, 'mlp', 'up_proj')] = (hf_mlp + 'up_proj.weight', (F, D), lambda w: w.T)
  out[(*layer, 'mlp', 'down_proj')] = (hf_mlp + 'down_proj.weight', (D, F), lambda w: w.T)
  return out


def _path_keys(path) -> tuple:
  """('layers', 0, 'mlp', 'up_proj') from a state leaf's key path (minus the Variable's field)."""
  keys = (getattr(k, 'key', getattr(k, 'idx', getattr(k, 'name', None))) for k in path)
  return tuple(k for k in keys if k != 'value')


def _state_paths(state: nnx.State) -> dict[tuple, Any]:
  return {_path_keys(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(state)[0]}


def validate(model_dir: str, cfg: ModelConfig) -> dict[str, Any]:
  """Checks every tensor the model needs exists with the right shape; returns a summary."""
  store = _TensorStore(model_dir)
  pmap = _param_map(cfg)
  missing, wrong = [], []
  for hf_name, hf_shape, _ in pmap.values():
    if hf_name not in store.entries:
      missing.append(hf_name)
    elif store.shape(hf_name) != hf_shape:
      wrong.append(f'{hf_name}: checkpoint {store.shape(hf_name)}, config expects {hf_shape}')
  if missing:
    raise CheckpointError(
      f'Checkpoint {model_dir!r} is missing {len(missing)} tensors needed by {cfg.name!r}: '
      f'{missing[:5]}{" ..." if len(missing) > 5 else ""}.'
    )
  if wrong:
    raise CheckpointError(
      f'Checkpoint {model_dir!r} does not match its config: ' + '; '.join(wrong[:5]) + '.'
    )
  used = {v[0] for v in pmap.values()}
  return {'tensors': len(used), 'unused': sorted(set(store.entries) - used)}


def load_params(
  model_dir: str, cfg: ModelConfig, mesh: jax.sharding.Mesh
) -> tuple[nnx.GraphDef, nnx.State]:
  """Reads the checkpoint's tensors into parameters sharded on `mesh` (dtype cfg.param_dtype)."""
  mesh_lib.check_model_fits(mesh_lib.parallel_config_of(mesh), cfg)
  validate(model_dir, cfg)
  store = _TensorStore(model_dir)
  pmap = _param_map(cfg)
  graphdef, abstract = qwen2.abstract_model(cfg, mesh)
  flat = _state_paths(abstract)
  if set(flat) != set(pmap):
    raise AssertionError(
      f'parameter map out of date: model-only {sorted(set(flat) - set(pmap))[:3]}, '
      f'map-only {sorted(set(pmap) - set(flat))[:3]}'
    )
  arrays = {}
  for path, leaf in flat.items():
    hf_name, _, view = pmap[path]
    ours = view(store.array(hf_name))
    if ours.shape != leaf.shape:
      raise CheckpointError(f'{hf_name}: viewed shape {ours.shape} != parameter shape {leaf.shape}')
    dtype = leaf.dtype

    def read(index, ours=ours, dtype=dtype):
      return np.ascontiguousarray(ours[index]).astype(dtype)

    arrays[path] = jax.make_array_from_callback(leaf.shape, leaf.sharding, read)

  state = jax.tree_util.tree_map_with_path(lambda p, _: arrays[_path_keys(p)], abstract)
  return graphdef, state


def load(
  model_dir: str,
  mesh: jax.sharding.Mesh,
  *,
  param_dtype: str = 'float32',
  dtype: str | None = None,
  **overrides: Any,
) -> tuple[ModelConfig, nnx.GraphDef, nnx.State]:
  """Config + parameters of a HF Qwen2 checkpoint, sharded on `mesh`, in f32 or bf16."""
  cfg = load_config(model_dir, param_dtype=param_dtype, dtype=dtype or param_dtype, **overrides)
  graphdef, state = load_params(model_dir, cfg, mesh)
  return cfg, graphdef, state


def export_safetensors(
  cfg: ModelConfig, state: nnx.State, out_dir: str, *, extra_config: Mapping | None = None
) -> None:
  """Writes parameters back in HF layout (single file + config.json): the inverse of `load`."""
  from safetensors.numpy import save_file

  os.makedirs(out_dir, exist_ok=True)
  flat = _state_paths(state)
  tensors = {}
  for path, (hf_name, hf_shape, view) in _param_map(cfg).items():
    ours = np.asarray(jax.device_get(flat[path])).astype(np.float32)
    # Invert the view by applying it to an index array of the HF shape.
    idx = view(np.arange(int(np.prod(hf_shape))).reshape(hf_shape))
    hf = np.empty(int(np.prod(hf_shape)), np.float32)
    hf[idx.reshape(-1)] = ours.reshape(-1)
    tensors[hf_name] = hf.reshape(hf_shape)
  save_file(tensors, os.path.join(out_dir, SINGLE_FILE))
  config = {
    'architectures': ['Qwen2ForCausalLM'],
    'model_type': 'qwen2',
    'vocab_size': cfg.vocab_size,
    'hidden_size': cfg.hidden_size,
    'intermediate_size': cfg.intermediate_size,
    'num_hidden_layers': cfg.num_layers,
    'num_attention_heads': cfg.num_heads,
    'num_key_value_heads': cfg.num_kv_heads,
    'head_dim': cfg.head_dim,
    'rope_theta': cfg.rope_theta,
    'rms_norm_eps': cfg.rms_norm_eps,
    'tie_word_embeddings': cfg.tie_word_embeddings,
    'max_position_embeddings': cfg.max_position_embeddings,
    'hidden_act': 'silu',
    'torch_dtype': 'float32',
  }
  config.update(extra_config or {})
  with open(os.path.join(out_dir, CONFIG_FILE), 'w') as f:
    json.dump(config, f, indent=2)
