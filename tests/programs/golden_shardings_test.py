"""The qwen preset's train-state shardings equal the golden dump (a rules change shows as a diff)."""

import json
import os

from earl_jax.testing import fixture_path, golden


def test_train_state_shardings_match_the_golden_dump():
  with open(fixture_path('golden', 'qwen_train_state_shardings.json')) as f:
    want = json.load(f)
  got = golden.qwen_train_state_shardings()
  assert golden.diff(want, got) == [], (
    'The train-state shardings changed; if that is deliberate, run '
    'python scripts/dump_shardings.py and commit the new golden file.'
  )
  # The dump is not vacuous: it covers every layout, parameters and both AdamW moments.
  layouts = want['layouts']
  assert sorted(layouts) == sorted(golden.LAYOUTS)
  dp4tp2 = layouts['dp4.tp2']
  q = [k for k in dp4tp2 if k.endswith("['layers'][*]['self_attn']['q_proj'].value")]
  assert len(q) == 3  # the parameter and both AdamW moments, shared by every layer
  spec = "spec ['fsdp', 'tensor', None]"
  assert all(dp4tp2[k] == f'{spec} shard [896, 7, 64] of [896, 14, 64]' for k in q)
  fsdp = layouts['dp1.fsdp8.tp1']
  assert all(fsdp[k] == f'{spec} shard [112, 14, 64] of [896, 14, 64]' for k in q)


def test_a_rules_change_would_show_as_a_diff():
  got = golden.qwen_train_state_shardings()
  changed = json.loads(json.dumps(got))
  leaf = next(iter(changed['layouts']['dp4.tp2']))
  changed['layouts']['dp4.tp2'][leaf] = "spec ['data'] shard [1] of [8]"
  assert golden.diff(got, changed) == [
    f'dp4.tp2 {leaf}: {got["layouts"]["dp4.tp2"][leaf]} -> {changed["layouts"]["dp4.tp2"][leaf]}'
  ]
  assert os.path.basename(fixture_path('golden')) == 'golden'
