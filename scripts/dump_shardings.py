"""Writes the golden train-state shardings of the `qwen` preset's model (tests/fixtures/golden).

  python scripts/dump_shardings.py            # rewrite the golden file after a deliberate change
  python scripts/dump_shardings.py --check    # exit 1 if the current rules differ from it

The dump is made on 8 fake CPU devices from abstract shapes only (nothing is allocated): for
every layout, each leaf of the train state (parameters, AdamW moments, counters) with its
PartitionSpec and its per-device shard shape. `tests/programs/golden_shardings_test.py` compares
the current rules against it, so that a change of the logical-axis table shows up as a diff.
"""

import json
import os
import sys

from absl import flags

from earl_jax import runtime

_CHECK = flags.DEFINE_bool('check', False, 'Compare with the golden file instead of writing it.')

GOLDEN = os.path.join(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
  'tests',
  'fixtures',
  'golden',
  'qwen_train_state_shardings.json',
)


def main(argv):
  del argv
  runtime.setup(cpu_devices=8)
  from earl_jax.testing import golden

  current = golden.qwen_train_state_shardings()
  if _CHECK.value:
    with open(GOLDEN) as f:
      diff = golden.diff(json.load(f), current)
    print('\n'.join(diff) if diff else 'the shardings match the golden file')
    sys.exit(1 if diff else 0)
  os.makedirs(os.path.dirname(GOLDEN), exist_ok=True)
  with open(GOLDEN, 'w') as f:
    json.dump(current, f, indent=1, sort_keys=True)  # one leaf per line: reviewable diffs
    f.write('\n')
  print(f'wrote {GOLDEN}')


if __name__ == '__main__':
  runtime.run(main)
