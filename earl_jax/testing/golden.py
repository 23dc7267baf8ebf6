"""Golden sharding dumps: the train state of the `qwen` preset's model on the layouts it can run.

Made from abstract shapes only, on a mesh of 8 (fake or real) devices, by
`scripts/dump_shardings.py`; compared by `tests/programs/golden_shardings_test.py`.
"""

import re
from typing import Any

import jax

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.programs import builders
from earl_jax.rl import train_step as train_lib

MODEL = 'qwen2.5-0.5b'  # the qwen preset's checkpoint shape (Qwen2.5-0.5B-Instruct)
LAYOUTS = ('dp8', 'dp4.tp2', 'dp1.fsdp8.tp1', 'dp2.fsdp2.tp2')


def _spec_text(spec: jax.sharding.PartitionSpec) -> list:
  return [list(a) if isinstance(a, tuple) else a for a in spec]


def train_state_shardings(model: ModelConfig, parallel: ParallelConfig) -> dict[str, str]:
  """{leaf path: 'spec [...] shard [...] of [...]'} of the train state.

  Decoder layers share their shardings, so their leaves are written once, as ['layers'][*]; a
  layer that differed from the others would be written under its own index.
  """
  abstract = builders.abstract_train_state(model, parallel, train_lib.OptimConfig())
  out: dict[str, str] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
    name = jax.tree_util.keystr(path)
    text = (
      f'spec {_spec_text(leaf.sharding.spec)} shard {list(leaf.sharding.shard_shape(leaf.shape))}'
      f' of {list(leaf.shape)}'
    )
    shared = re.sub(r"\['layers'\]\[\d+\]", "['layers'][*]", name)
    if out.get(shared, text) == text:
      out[shared] = text
    else:
      out[name] = text
  return out


def qwen_train_state_shardings() -> dict[str, Any]:
  model = ModelConfig.preset(MODEL)
  return {
    'model': MODEL,
    'layouts': {name: train_state_shardings(model, ParallelConfig.parse(name)) for name in LAYOUTS},
  }


def diff(golden: dict[str, Any], current: dict[str, Any], limit: int = 20) -> list[str]:
  """Readable differences (at most `limit`), [] when equal."""
  out = []
  if golden.get('model') != current.get('model'):
    out.append(f'model: {golden.get("model")} -> {current.get("model")}')
  for layout in sorted(set(golden['layouts']) | set(current['layouts'])):
    a, b = golden['layouts'].get(layout, {}), current['layouts'].get(layout, {})
    for leaf in sorted(set(a) | set(b)):
      if a.get(leaf) != b.get(leaf):
        out.append(f'{layout} {leaf}: {a.get(leaf)} -> {b.get(leaf)}')
  return out[:limit] + ([f'... {len(out) - limit} more'] if len(out) > limit else [])
