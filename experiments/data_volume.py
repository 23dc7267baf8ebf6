"""Intermediate data volume against context length: the analogue of the paper's Table 1.

  python experiments/data_volume.py --out=runs/data_volume.json
  python experiments/data_volume.py --rows=64 --lengths=1024,2048 --out=/tmp/v.json

Builds the RL batch the main job hands from stage to stage (`rl.batch.Batch`, every field the
trainer dispatches, in its dtypes) at each context length and counts the bytes of its arrays:
per field (dtype, bytes per token or per row) and per step for `--rows` episodes. Then it scales
the batch to the paper's setting: `--gpus` GPUs with `--rows_per_gpu` episodes each (default 16:
the paper's Fig. 3 load of 128 responses per 8-GPU engine), next to the paper's estimate
(15,625 MiB per 1K tokens of context on 1,024 GPUs, Table 1), and says how many bytes per token
per GPU that estimate implies. Writes a JSON and, with --png, the chart.
"""

import json
import os

from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError

_LENGTHS = flags.DEFINE_list(
  'lengths', ['1024', '2048', '4096', '8192', '16384', '32768'], 'Context lengths T.'
)
_ROWS = flags.DEFINE_integer('rows', 64, 'Episodes per step (the main job: 64).', lower_bound=1)
_GPUS = flags.DEFINE_integer('gpus', 1024, "GPUs of the paper's setting.", lower_bound=1)
_ROWS_PER_GPU = flags.DEFINE_integer(
  'rows_per_gpu', 16, "Episodes per GPU in the paper's setting.", lower_bound=1
)
_OUT = flags.DEFINE_string('out', 'runs/data_volume.json', 'Results JSON.')
_PNG = flags.DEFINE_string('png', None, 'Optional chart (PNG).')

MiB = 1 << 20
# Table 1 of the paper: estimated intermediate batch (MiB) on 1,024 GPUs per context length.
PAPER_MIB = {1024: 15_625, 2048: 31_250, 4096: 62_500, 8192: 125_000, 16384: 250_000,
             32768: 500_000}  # fmt: skip
PAPER_GPUS = 1024


def _lengths() -> list[int]:
  try:
    lengths = [int(x) for x in _LENGTHS.value]
  except ValueError:
    raise UserError(f'--lengths {",".join(_LENGTHS.value)}: expected integers') from None
  if not lengths or min(lengths) < 1:
    raise UserError(f'--lengths {",".join(_LENGTHS.value)}: expected positive lengths')
  return lengths


def measure(lengths: list[int], rows: int) -> dict:
  """Per-field dtypes and byte counts of the RL batch at each context length."""
  import numpy as np

  from earl_jax.rl.batch import Batch

  fields, per_length = {}, []
  for T in lengths:
    batch = Batch.zeros(rows, T)
    total = 0
    for name in Batch.__dataclass_fields__:
      x = np.asarray(getattr(batch, name))
      total += x.nbytes
      per_token = x.ndim == 2
      unit = x.nbytes / (rows * T if per_token else rows)
      fields.setdefault(
        name,
        {'dtype': str(x.dtype), 'per': 'token' if per_token else 'row', 'bytes': unit},
      )
    per_length.append({'context': T, 'rows': rows, 'bytes': total, 'mib': total / MiB})
  per_token = sum(f['bytes'] for f in fields.values() if f['per'] == 'token')
  per_row = sum(f['bytes'] for f in fields.values() if f['per'] == 'row')
  return {'fields': fields, 'bytes_per_token': per_token, 'bytes_per_row': per_row,
          'per_length': per_length}  # fmt: skip


def at_scale(m: dict, lengths: list[int], gpus: int, rows_per_gpu: int) -> list[dict]:
  """Our batch at the paper's scale, next to the paper's Table 1."""
  rows = gpus * rows_per_gpu
  out = []
  for T in lengths:
    ours = rows * (T * m['bytes_per_token'] + m['bytes_per_row'])
    paper = PAPER_MIB.get(T)
    entry = {'context': T, 'gpus': gpus, 'rows': rows, 'ours_mib': ours / MiB}
    if paper is not None:
      # The paper's per-token, per-GPU constant (its estimate is linear in T).
      entry.update(
        paper_mib=paper,
        paper_over_ours=paper / (ours / MiB),
        paper_bytes_per_token_per_gpu=paper * MiB / T / PAPER_GPUS,
      )
    out.append(entry)
  return out


def main(argv):
  del argv
  lengths = _lengths()
  m = measure(lengths, _ROWS.value)
  scale = at_scale(m, lengths, _GPUS.value, _ROWS_PER_GPU.value)
  report = {
    'experiment': 'data_volume',
    'rows': _ROWS.value,
    'gpus': _GPUS.value,
    'rows_per_gpu': _ROWS_PER_GPU.value,
    **m,
    'at_scale': scale,
  }
  print(f'RL batch fields ({len(m["fields"])}; per token {m["bytes_per_token"]:.0f} B, per row '
        f'{m["bytes_per_row"]:.0f} B):')  # fmt: skip
  for name, f in m['fields'].items():
    print(f'  {name:16s} {f["dtype"]:8s} {f["bytes"]:4.0f} B per {f["per"]}')
  print(f'\n{"context":>8} {"ours, " + str(_ROWS.value) + " rows":>16} '
        f'{"ours, " + str(_GPUS.value) + " GPUs":>16} {"paper (1,024 GPUs)":>19} {"paper/ours":>10}')  # fmt: skip
  for p, s in zip(m['per_length'], scale):
    paper = f'{s["paper_mib"]:,.0f} MiB' if 'paper_mib' in s else '-'
    ratio = f'{s["paper_over_ours"]:.1f}x' if 'paper_over_ours' in s else '-'
    print(
      f'{p["context"]:>8} {p["mib"]:12.1f} MiB {s["ours_mib"]:12,.0f} MiB {paper:>19} {ratio:>10}'
    )
  implied = [
    s['paper_bytes_per_token_per_gpu'] for s in scale if 'paper_bytes_per_token_per_gpu' in s
  ]
  if implied:
    per_gpu = m['bytes_per_token'] * _ROWS_PER_GPU.value
    print(f'\nThe paper\'s estimate implies {implied[0]:,.0f} B per token of context per GPU; our batch '
          f'holds {per_gpu:,.0f} B ({m["bytes_per_token"]:.0f} B x {_ROWS_PER_GPU.value} episodes per GPU).')  # fmt: skip
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(report, f, indent=1)
  print(f'wrote {_OUT.value}')
  if _PNG.value:
    plot(report, _PNG.value)
    print(f'wrote {_PNG.value}')


def plot(report: dict, out: str) -> None:
  import matplotlib

  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  scale = report['at_scale']
  xs = [s['context'] for s in scale]
  fig, ax = plt.subplots(figsize=(6.4, 4.2))
  ax.plot(xs, [s['ours_mib'] / 1024 for s in scale], '-o', color='#d94801',
          label=f'ours, {report["gpus"]} GPUs x {report["rows_per_gpu"]} episodes')  # fmt: skip
  paper = [s for s in scale if 'paper_mib' in s]
  ax.plot([s['context'] for s in paper], [s['paper_mib'] / 1024 for s in paper], '--s',
          color='#555555', label='paper, Table 1 (1,024 GPUs, estimated)')  # fmt: skip
  ax.set_xscale('log', base=2)
  ax.set_yscale('log')
  ax.set_xlabel('context length (tokens)')
  ax.set_ylabel('intermediate batch per step (GiB)')
  ax.set_title('Intermediate data volume vs context (Table 1)', fontsize=10)
  ax.legend(fontsize=8)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  fig.savefig(out, dpi=130)


if __name__ == '__main__':
  runtime.run(main)
