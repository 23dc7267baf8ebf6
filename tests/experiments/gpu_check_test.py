"""The prepared GPU check in its CPU mode, as a user runs it: every section runs and writes the
JSON, with the attention, FLOP and memory accounting it states."""

import json
import subprocess

import pytest

from earl_jax.config import ModelConfig
from earl_jax.models import attention
from earl_jax.testing import helpers
from experiments import gpu_check


def _run(*args: str) -> subprocess.CompletedProcess:
  return helpers.run_module('experiments.gpu_check', *args)


@pytest.mark.multiprocess
def test_cpu_mode_runs_every_section_and_accounts_for_it(tmp_path):
  out = tmp_path / 'gpu_check.json'
  proc = _run('--cpu', f'--out={out}')
  assert proc.returncode == 0, proc.stderr[-3000:]
  r = json.loads(out.read_text())
  assert r['mode'] == 'cpu' and r['platform'] == 'cpu' and r['devices'] == 2
  # No cuDNN on the CPU: the model keeps its blockwise attention there.
  assert r['attention_impl'] == 'blockwise'
  plan = gpu_check.CPU_PLAN

  assert [row['batch'] for row in r['decode']['rows']] == list(plan.decode_batches)
  for row in r['decode']['rows']:
    assert row['tokens_per_s'] == pytest.approx(row['batch'] * plan.decode_tokens / row['median_s'])

  [t] = r['train']['models']
  cfg = ModelConfig.preset('tiny')
  T, B = plan.train_context, plan.train_rows
  embed = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size
  attn = 6 * cfg.num_layers * B * T * T * cfg.num_heads * cfg.head_dim
  assert t['model_flops_per_step'] == 6 * (cfg.num_params - embed) * B * T + attn
  assert t['achieved_flops'] == pytest.approx(t['model_flops_per_step'] / t['median_s'])
  assert t['peak_flops'] is None and t['mfu'] is None  # no datasheet peak for a CPU

  s = r['selector']
  assert s['budget_source'] == 'emulated'
  assert s['budget_mib'] == pytest.approx(plan.emulated_budget / 2**20)
  assert set(s['candidates']) == {'dp2.tp1', 'dp1.tp2'}
  ooms = 0
  for cell in s['cells']:
    # A layout is OOM (never run) exactly when XLA's peak exceeds the budget.
    assert set(cell['oom']) == {c for c, mib in cell['need_mib'].items() if mib > s['budget_mib']}
    assert all((c in cell['oom']) == (tgs is None) for c, tgs in cell['tgs'].items())
    assert cell['choice'] not in cell['oom']
    ooms += len(cell['oom'])
  assert ooms > 0  # the emulated budget is below the replicated-weights layout's peak

  rs = r['reshard']
  assert rs['round_trip_equal'] and rs['dp_to_tp_ms'] > 0
  assert rs['param_bytes'] == 2 * ModelConfig.preset('tiny').num_params
  assert set(r['seconds']) == {'decode', 'train', 'selector', 'reshard', 'total'}


def test_bad_sections_end_in_one_line():
  proc = _run('--cpu', '--sections=decode,flops')
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1].startswith('error: --sections: unknown')
  assert 'Traceback' not in proc.stderr


def test_peak_flops_by_device_kind():
  assert gpu_check.peak_flops('NVIDIA H100 80GB HBM3') == 989.4e12
  assert gpu_check.peak_flops('NVIDIA H100 PCIe') == 756.0e12
  assert gpu_check.peak_flops('NVIDIA H200') == 989.4e12
  assert gpu_check.peak_flops('cpu') is None


def test_cudnn_is_not_chosen_on_cpu():
  assert not attention.cudnn_supported()
