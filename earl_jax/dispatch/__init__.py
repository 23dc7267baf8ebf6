"""The Data Dispatcher: move RL batches between stage layouts device to device.

  from earl_jax import dispatch
  src = dispatch.Layout.rows(rollout_mesh, batch, row_axes=('data',))   # TP engine output
  dst = dispatch.Layout.rows(train_mesh, batch)
  perm = dispatch.balanced_permutation(lengths_B, src, dst, like=batch)
  batch_t, report = dispatch.Dispatcher().dispatch(batch, dst, src=src, perm=perm)
  mean_B, std_B, count_B = dispatch.group_stats(batch_t['rewards'], batch_t['group_ids'],
                                                batch_t['valid'], num_groups=G, mesh=train_mesh)

The main job's path: layout (Layout, pad_rows) -> plan (make_plan, PlanOptions; pure numpy,
built from routing, schedule and tables) -> collectives (the shard_map kernels) -> dispatcher
(Dispatcher, DispatchConfig). Beside it: landing (XLA:CPU landing buffers), baselines (xla,
allgather and the single-controller gather_scatter, for Fig. 4), balance (token balancing),
group_stats (per-group reward statistics with collectives), accounting (reports, HLO collective
bytes).
"""

from earl_jax.dispatch.accounting import (
  DispatchReport,
  hlo_collective_counts,
  hlo_collectives,
  hlo_received_bytes,
)
from earl_jax.dispatch.balance import (
  balanced_permutation,
  kk_bins,
  lpt_bins,
  permutation_from_bins,
  rank_loads,
  target_ranks,
)
from earl_jax.dispatch.baselines import rotation_shift
from earl_jax.dispatch.dispatcher import DispatchConfig, Dispatcher, Strategy
from earl_jax.dispatch.group_stats import group_stats
from earl_jax.dispatch.layout import (
  FieldLayout,
  Layout,
  LayoutError,
  check_compatible,
  pad_rows,
  row_multiple,
)
from earl_jax.dispatch.plan import (
  Floor,
  Plan,
  PlanOptions,
  capacity_bucket,
  check_permutation,
  make_plan,
)

__all__ = [
  'DispatchConfig',
  'DispatchReport',
  'Dispatcher',
  'FieldLayout',
  'Floor',
  'Layout',
  'LayoutError',
  'Plan',
  'PlanOptions',
  'Strategy',
  'balanced_permutation',
  'capacity_bucket',
  'check_compatible',
  'check_permutation',
  'group_stats',
  'hlo_collective_counts',
  'hlo_collectives',
  'hlo_received_bytes',
  'kk_bins',
  'lpt_bins',
  'make_plan',
  'pad_rows',
  'permutation_from_bins',
  'rank_loads',
  'rotation_shift',
  'row_multiple',
  'target_ranks',
]
