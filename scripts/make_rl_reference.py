"""Computes the advantages and policy losses of earl_jax's RL loop with verl's own functions
(`verl.trainer.ppo.core_algos`, in torch), on shared inputs, so that tests/rl/reference_test.py
can check ours against an independent implementation of the field (agreement within 1e-5).

How to run (CPU torch and verl in an environment of their own, never the project's):

  python3 -m venv /tmp/venv-ref
  /tmp/venv-ref/bin/pip install torch verl==0.9.1 --no-deps   # a CPU torch wheel, then verl
  /tmp/venv-ref/bin/pip install numpy omegaconf packaging 'tensordict>=0.8,<=0.10' ray \\
      transformers codetiming                                 # what importing core_algos needs
  /tmp/venv-ref/bin/python scripts/make_rl_reference.py

Writes tests/fixtures/rl_reference.json: the inputs (rewards and groups; log-probs of the
policy, the sampler and the reference; the loss mask) and, per case, verl's outputs: the
advantages of GRPO (`compute_grpo_outcome_advantage`), Dr. GRPO (the same with
`norm_adv_by_std_in_grpo=False`) and RLOO (`compute_rloo_outcome_advantage`); the loss of
PPO-clip with clip-higher (`compute_policy_loss_vanilla`) and of GSPO
(`compute_policy_loss_gspo`) under 'token-mean' and 'seq-mean-token-mean' aggregation
(`agg_loss`), each with its gradient with respect to the policy's log-probs; and the k3 KL to
the reference (`kl_penalty(..., 'low_var_kl')`). Everything in float64.
"""

import json
import pathlib

import numpy as np
import torch
import verl
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, T, GROUP = 16, 12, 4  # 4 groups of 4 episodes, 12 token positions
CLIP_LOW, CLIP_HIGH = 0.2, 0.28


def inputs(seed: int = 0) -> dict:
  """Rewards (one group all equal, one binary, two continuous), group ids, a loss mask whose
  rows keep 3 to 12 tokens, and log-probs within 0.3 of each other (no ratio reaches verl's
  dual-clip bound of 3, which earl_jax does not apply)."""
  rng = np.random.default_rng(seed)
  rewards = np.concatenate(
    [np.full(GROUP, 0.5), [1.0, 0.0, 1.0, 1.0], rng.normal(size=GROUP), rng.normal(size=GROUP)]
  )
  lengths = rng.integers(3, T + 1, size=B)
  mask = np.arange(T)[None, :] < lengths[:, None]
  old = -rng.uniform(0.05, 3.0, size=(B, T))
  logp = old + rng.uniform(-0.3, 0.3, size=(B, T))
  ref = old + rng.uniform(-0.3, 0.3, size=(B, T))
  return {
    'rewards': rewards.tolist(),
    'groups': (np.arange(B) // GROUP).tolist(),
    'mask': mask.tolist(),
    'logp': logp.tolist(),
    'old_logp': old.tolist(),
    'ref_logp': ref.tolist(),
    'advantages': rng.normal(size=B).tolist(),  # per episode, for the losses
  }


def _t(x) -> torch.Tensor:
  return torch.tensor(np.asarray(x), dtype=torch.float64)


def advantage_cases(data: dict) -> list[dict]:
  mask = _t(data['mask'])
  scores = torch.zeros(B, T, dtype=torch.float64)
  last = mask.sum(-1).long() - 1
  scores[torch.arange(B), last] = _t(data['rewards'])  # an outcome reward on the last token
  index = np.asarray(data['groups'])
  out = []
  for name, fn, kwargs in (
    ('grpo', core_algos.compute_grpo_outcome_advantage, {'norm_adv_by_std_in_grpo': True}),
    ('dr_grpo', core_algos.compute_grpo_outcome_advantage, {'norm_adv_by_std_in_grpo': False}),
    ('rloo', core_algos.compute_rloo_outcome_advantage, {}),
  ):
    adv, _ = fn(scores.clone(), mask, index, epsilon=1e-6, **kwargs)
    out.append(
      {'estimator': name, 'verl': fn.__name__, 'kwargs': kwargs, 'advantages': adv.tolist()}
    )
  return out


def loss_cases(data: dict) -> list[dict]:
  mask = _t(data['mask'])
  old, ref = _t(data['old_logp']), _t(data['ref_logp'])
  adv = _t(data['advantages'])[:, None].expand(B, T) * mask
  config = ActorConfig(
    strategy='fsdp',
    clip_ratio=CLIP_LOW,
    clip_ratio_low=CLIP_LOW,
    clip_ratio_high=CLIP_HIGH,
    ppo_micro_batch_size_per_gpu=1,
    use_dynamic_bsz=False,
    rollout_n=GROUP,
  )
  out = []
  for ratio, fn in (
    ('token', core_algos.compute_policy_loss_vanilla),
    ('sequence', core_algos.compute_policy_loss_gspo),
  ):
    for aggregation, mode in (('token', 'token-mean'), ('sequence', 'seq-mean-token-mean')):
      logp = _t(data['logp']).requires_grad_(True)
      loss, _ = fn(old, logp, adv, mask, loss_agg_mode=mode, config=config)
      loss.backward()
      out.append(
        {
          'ratio': ratio,
          'aggregation': aggregation,
          'verl': f'{fn.__name__}(loss_agg_mode={mode!r})',
          'loss': loss.item(),
          'grad_logp': logp.grad.tolist(),
        }
      )
  logp = _t(data['logp'])
  kl = core_algos.kl_penalty(logp, ref, 'low_var_kl')
  out.append(
    {'kl': 'low_var_kl', 'verl': "kl_penalty(..., 'low_var_kl')", 'kl_per_token': kl.tolist()}
  )
  return out


def main():
  data = inputs()
  golden = {
    'made_by': 'scripts/make_rl_reference.py',
    'verl': verl.__version__,
    'torch': torch.__version__,
    'clip_low': CLIP_LOW,
    'clip_high': CLIP_HIGH,
    'inputs': data,
    'advantages': advantage_cases(data),
    'losses': loss_cases(data),
  }
  path = ROOT / 'tests' / 'fixtures' / 'rl_reference.json'
  path.write_text(json.dumps(golden, indent=1) + '\n')
  print(f'wrote {path}: verl {verl.__version__}, torch {torch.__version__}')


if __name__ == '__main__':
  main()
