"""The analytic memory model: exact weight and K/V formulas, within its stated error of XLA."""

import pytest

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.models import qwen2
from earl_jax.profiling import analytic
from earl_jax.programs import builders, memory
from earl_jax.programs.executables import Executables
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import Stage

CFG = ModelConfig.preset('small-kv')
MiB = memory.MiB
SPEC = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=4))


@pytest.fixture(scope='module')
def exe():
  with Executables(CFG, spec=SPEC) as e:
    yield e


@pytest.mark.parametrize(
  'pc',
  [
    ParallelConfig(dp=8),
    ParallelConfig(dp=2, tp=4),
    ParallelConfig(fsdp=8),
    ParallelConfig(dp=2, fsdp=2, tp=2),
  ],
  ids=str,
)
def test_weight_and_kv_formulas_are_exact(pc):
  mesh = mesh_lib.make_mesh(pc)
  _, params = qwen2.init_model(CFG, mesh)
  assert memory.resident_bytes_per_device(params) == analytic.weight_bytes_per_device(CFG, pc)
  cache = qwen2.KVCache.init(CFG, 16, 256, mesh)
  kv = memory.resident_bytes_per_device((cache.k, cache.v))
  assert kv == analytic.kv_cache_bytes_per_device(CFG, pc, 256, 16)


# (stage, layout, bucket, rows): every stage, replicated, tensor- and fully-sharded layouts.
GRID = [
  (Stage.ROLLOUT, ParallelConfig(dp=8), 512, 16),
  (Stage.ROLLOUT, ParallelConfig(dp=2, tp=4), 1024, 8),
  (Stage.ROLLOUT, ParallelConfig(fsdp=8), 512, 16),
  (Stage.EXPERIENCE, ParallelConfig(dp=8), 256, 16),
  (Stage.EXPERIENCE, ParallelConfig(tp=8), 512, 8),
  (Stage.EXPERIENCE, ParallelConfig(dp=2, fsdp=2, tp=2), 512, 8),
  (Stage.TRAIN, ParallelConfig(dp=4, tp=2), 128, 8),
]


# The main job's own model ('tiny-game', 64 responses, the default's prompt chunk and one token
# per turn): the cells where the model errs most (small peaks; many rows per device).
GAME = ModelConfig.preset('tiny-game')
GAME_SPEC = builders.StageSpec(sampling=SamplingConfig(max_new_tokens=1), chunk=64)
GAME_GRID = [
  (Stage.EXPERIENCE, ParallelConfig(dp=8), 128, 64),
  (Stage.EXPERIENCE, ParallelConfig(dp=2, tp=4), 256, 64),
  (Stage.EXPERIENCE, ParallelConfig(dp=4, tp=2), 1024, 64),
  (Stage.ROLLOUT, ParallelConfig(dp=2, tp=4), 256, 64),
  (Stage.ROLLOUT, ParallelConfig(fsdp=8), 512, 64),
  (Stage.TRAIN, ParallelConfig(fsdp=8), 512, 64),
  # Context parallelism: each device holds T / cp tokens of its rows (ring attention).
  (Stage.TRAIN, ParallelConfig(dp=2, cp=4), 1024, 64),
  (Stage.TRAIN, ParallelConfig(dp=2, tp=2, cp=2), 4096, 8),
  (Stage.EXPERIENCE, ParallelConfig(dp=2, tp=2, cp=2), 4096, 8),
  # ... and the rollout's K/V cache splits its slots over cp (split-K decode attention).
  (Stage.ROLLOUT, ParallelConfig(dp=1, tp=2, cp=4), 4096, 16),
  (Stage.ROLLOUT, ParallelConfig(cp=8), 1536, 64),
]


@pytest.mark.parametrize('stage,pc,bucket,rows', GAME_GRID, ids=lambda x: str(x))
def test_analytic_model_is_within_its_stated_error_on_the_main_jobs_model(stage, pc, bucket, rows):
  with Executables(GAME, spec=GAME_SPEC) as exe:
    xla = exe.get(exe.key(stage, pc, bucket, rows)).memory.peak
  est = analytic.estimate(stage, GAME, pc, bucket, rows, decode_tokens=1, chunk=64).total
  assert analytic.within_stated_error(est, xla), (
    f'{stage} {pc} S={bucket} R={rows}: analytic {est / MiB:.2f} MiB vs XLA {xla / MiB:.2f} MiB '
    f'({analytic.relative_error(est, xla):+.0%}; stated {analytic.ANALYTIC_REL_ERROR:.0%})'
  )


@pytest.mark.parametrize('stage,pc,bucket,rows', GRID, ids=lambda x: str(x))
def test_analytic_model_is_within_its_stated_error(exe, stage, pc, bucket, rows):
  xla = exe.get(exe.key(stage, pc, bucket, rows)).memory.peak
  est = analytic.estimate(stage, CFG, pc, bucket, rows, decode_tokens=4, chunk=SPEC.chunk).total
  assert analytic.within_stated_error(est, xla), (
    f'{stage} {pc} S={bucket} R={rows}: analytic {est / MiB:.2f} MiB vs XLA {xla / MiB:.2f} MiB '
    f'({analytic.relative_error(est, xla):+.0%}; stated {analytic.ANALYTIC_REL_ERROR:.0%})'
  )
  # And the stated error is not vacuous: a model that forgot the activations would fail it.
  if stage != Stage.ROLLOUT and xla >= 8 * MiB:
    bare = analytic.estimate(stage, CFG, pc, bucket, rows, decode_tokens=4)
    assert not analytic.within_stated_error(bare.total - bare.activations, xla)


def test_qwen25_72b_on_8xh100_tp4_runs_out_before_tp8():
  # The paper's setting, too large to compile here: the analytic model with fused attention.
  cfg = ModelConfig.preset('qwen2.5-72b')
  budget = int(0.9 * 80e9)  # an inference engine's usual 90% of an H100's 80 GB
  tp4, tp8 = ParallelConfig(dp=2, tp=4), ParallelConfig(tp=8)
  gpu = analytic.Coefficients.fused_attention()
  w4, w8 = (analytic.weight_bytes_per_device(cfg, p) for p in (tp4, tp8))
  assert w4 == pytest.approx(cfg.num_params * 2 / 4, rel=0.01)  # ~36 GB of bf16 weights
  assert w8 == pytest.approx(w4 / 2, rel=0.01)
  cap4, cap8 = (analytic.kv_capacity_tokens(cfg, p, budget) for p in (tp4, tp8))
  # 320 KiB of K/V per token: ~0.43M tokens per TP4 engine (paper: ~0.39M), 0.87M for two.
  assert 0.75e6 < cap4 < 0.95e6 and 1.2e6 < cap8 < 1.45e6
  for rows, ctx in ((32, 32768), (64, 16384), (128, 8192)):  # ~1M resident tokens
    need4 = analytic.estimate(Stage.ROLLOUT, cfg, tp4, ctx, rows, coefficients=gpu).total
    need8 = analytic.estimate(Stage.ROLLOUT, cfg, tp8, ctx, rows, coefficients=gpu).total
    assert need4 > budget >= need8, (rows, ctx)
  for rows, ctx in ((32, 8192), (128, 1024)):  # short context: both fit
    assert analytic.estimate(Stage.ROLLOUT, cfg, tp4, ctx, rows, coefficients=gpu).total < budget


@pytest.mark.parametrize('stage', [Stage.EXPERIENCE, Stage.TRAIN])
def test_the_time_terms_of_a_context_parallel_layout(stage):
  """Ring attention over cp devices: each device holds T / cp tokens of cp times the rows. In
  zig-zag order (2 cp divides T) the causal work is balanced: the score FLOPs are those of data
  parallelism. In the contiguous order (T = 4 (mod 8) here) every visit waits for the device
  with the most, (cp - 1/2) / (cp / 2) as much. The weights' FLOPs are the same, and the K/V
  shards it passes on grow with the bucket."""
  model = ModelConfig.preset('tiny-game')
  dp8, ring = ParallelConfig(dp=8), ParallelConfig(dp=2, cp=4)
  terms = {
    (c, T): analytic.call_terms(stage, model, c, T, 8, chunk=16)
    for c in (dp8, ring)
    for T in (256, 1024, 260)
  }
  for T, ratio in ((256, 1.0), (1024, 1.0), (260, 3.5 / 2)):
    (mm_dp, att_dp, _, comm_dp), (mm_cp, att_cp, _, comm_cp) = terms[dp8, T], terms[ring, T]
    assert mm_cp == pytest.approx(mm_dp, rel=1e-9)
    assert att_cp / att_dp == pytest.approx(ratio, rel=1e-9)
    assert comm_cp > comm_dp
  grows = lambda c: terms[c, 1024][3] - terms[c, 256][3]  # noqa: E731
  assert grows(ring) > 0 and grows(dp8) == pytest.approx(0.0, abs=1e-12)


def test_the_time_terms_of_a_context_parallel_rollout():
  """Decode on a cache split over cp: a device scores its queries against bucket / cp slots of
  cp times the rows (the same score work as data parallelism, balanced), runs the prompt's
  chunk / cp tokens through the weights but each decode token whole, and combines the softmax
  statistics over the ring."""
  model = ModelConfig.preset('tiny-game')
  N, P = 4, 64
  kw = {'decode_tokens': N, 'chunk': P}
  dp8 = analytic.call_terms(Stage.ROLLOUT, model, ParallelConfig(dp=8), 1024, 8, **kw)
  ring = analytic.call_terms(Stage.ROLLOUT, model, ParallelConfig(dp=2, cp=4), 1024, 8, **kw)
  assert ring[1] == pytest.approx(dp8[1], rel=1e-9)  # attention
  assert ring[0] / dp8[0] == pytest.approx(4 * (P / 4 + N) / (P + N), rel=1e-9)  # weights
  assert dp8[3] == 0 and ring[3] > 0
