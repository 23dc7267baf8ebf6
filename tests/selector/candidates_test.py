"""Candidate layouts: every factorisation that divides the model and the load, for every stage."""

import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.selector.candidates import candidates_for, named_stages, stage_candidates
from earl_jax.sharding.mesh import ShardingError
from earl_jax.stage import STAGES, Stage
from earl_jax.testing.typecheck import unchecked


@pytest.mark.parametrize('stage', STAGES)
def test_every_valid_factorisation(stage):
  small_kv = ModelConfig.preset('small-kv')  # H = K = 8: every tp of 8 devices
  names = [c.name for c in stage_candidates(stage, small_kv, num_devices=8)]
  assert len(names) == 10
  assert names[:4] == ['dp8.tp1', 'dp4.fsdp2.tp1', 'dp2.fsdp4.tp1', 'dp1.fsdp8.tp1']
  assert [c.name for c in stage_candidates(stage, small_kv, num_devices=8, with_fsdp=False)] == [
    'dp8.tp1',
    'dp4.tp2',
    'dp2.tp4',
    'dp1.tp8',
  ]


def test_the_model_and_the_load_must_divide():
  tiny = ModelConfig.preset('tiny')  # K = 4: tp8 splits no KV head
  cands = stage_candidates(Stage.ROLLOUT, tiny, num_devices=8, with_fsdp=False)
  assert [c.tp for c in cands] == [1, 2, 4]
  # 4 responses cannot split over 8 data shards.
  cands = stage_candidates(Stage.ROLLOUT, tiny, num_devices=8, rows=(4, 12), with_fsdp=False)
  assert [c.name for c in cands] == ['dp4.tp2', 'dp2.tp4']
  qwen = ModelConfig.preset('qwen2.5-72b')  # H=64, K=8: TP4 and TP8 both valid, as in the paper
  assert ParallelConfig(tp=8) in stage_candidates(Stage.ROLLOUT, qwen, num_devices=8)


def test_errors_name_the_problem():
  odd = ModelConfig.preset('tiny').replace(num_heads=3, num_kv_heads=3, head_dim=8)
  with pytest.raises(ShardingError, match='No layout of 8 devices is valid for train'):
    stage_candidates(Stage.TRAIN, odd, num_devices=8, rows=(3,))
  with pytest.raises(ShardingError, match=r'dp1\.tp8 is not valid for rollout.*num_kv_heads'):
    stage_candidates(
      Stage.ROLLOUT, ModelConfig.preset('tiny'), num_devices=8, only=[ParallelConfig(tp=8)]
    )
  with pytest.raises(ShardingError, match='uses 4 devices; the rollout stage has 8'):
    stage_candidates(
      Stage.ROLLOUT, ModelConfig.preset('tiny'), num_devices=8, only=[ParallelConfig(dp=4)]
    )
  with pytest.raises(ShardingError, match=r'lengths \[100\] do not split over the cp=8'):
    stage_candidates(
      Stage.TRAIN,
      ModelConfig.preset('tiny'),
      num_devices=8,
      lengths=(128, 100),
      only=[ParallelConfig(cp=8)],
    )
  with unchecked(), pytest.raises(ValueError, match="Unknown stage 'decode'"):
    stage_candidates('decode', ModelConfig.preset('tiny'), num_devices=8)


def test_context_parallel_layouts_of_every_stage():
  """cp > 1 layouts come after every cp = 1 layout, and only where each bucket splits over cp."""
  tiny = ModelConfig.preset('tiny')  # K = 4
  for stage in STAGES:
    names = [
      c.name
      for c in stage_candidates(
        stage, tiny, num_devices=8, lengths=(128, 256), with_fsdp=False, with_cp=True
      )
    ]
    assert names == [
      'dp8.tp1',
      'dp4.tp2',
      'dp2.tp4',
      'dp4.tp1.cp2',
      'dp2.tp2.cp2',
      'dp1.tp4.cp2',
      'dp2.tp1.cp4',
      'dp1.tp2.cp4',
      'dp1.tp1.cp8',
    ]
  # A bucket of 132 tokens splits over cp=2 and cp=4, not cp=8.
  cps = {
    c.cp for c in stage_candidates(Stage.TRAIN, tiny, num_devices=8, lengths=(132,), with_cp=True)
  }
  assert cps == {1, 2, 4}
  assert named_stages(True) == tuple(STAGES) and named_stages(('train',)) == (Stage.TRAIN,)
  # One response on 8 devices: tensor parallelism stops at the 4 KV heads, so only layouts that
  # split the sequence use every device.
  with pytest.raises(ShardingError, match='No layout of 8 devices is valid for rollout'):
    stage_candidates(Stage.ROLLOUT, tiny, num_devices=8, rows=(1,))
  one = stage_candidates(Stage.ROLLOUT, tiny, num_devices=8, rows=(1,), with_cp=True)
  assert [c.name for c in one] == ['dp1.tp4.cp2', 'dp1.tp2.cp4', 'dp1.tp1.cp8']


def test_candidates_for_drops_cp_layouts_of_other_stages():
  tiny = ModelConfig.preset('tiny')
  only = [ParallelConfig(dp=8), ParallelConfig(dp=2, cp=4)]
  kwargs = {'num_devices': 8, 'rows': (8,), 'with_fsdp': (), 'only': only, 'lengths': (128,)}
  assert candidates_for(Stage.ROLLOUT, tiny, with_cp=(Stage.TRAIN,), **kwargs) == only[:1]
  assert candidates_for(Stage.TRAIN, tiny, with_cp=(Stage.TRAIN,), **kwargs) == only
  assert candidates_for(Stage.EXPERIENCE, tiny, with_cp=(Stage.TRAIN,), **kwargs) == only[:1]
