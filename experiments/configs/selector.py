"""Presets of the selector benchmarks: `selector_heatmap.py` (Fig. 3) and `context_growth.py`.

  cfg = selector.get_config('cpu')      # or 'smoke'

'cpu' (the default) runs on 8 fake CPU devices in a few minutes per benchmark. Its model is
`small-kv` (H = K = 8, so tp 1, 2, 4 and 8 are all valid) with a wider MLP (F = 2048: 1.84M
parameters, 7.0 MiB in f32), and its per-device budget is emulated. Every layout holds the same
K/V cache per device (rows split by dp, heads by tp); what separates their peaks is the weights,
replicated over dp and split by tp, as in the paper, where TP4 holds 36 GB of Qwen2.5-72B per GPU
and TP8 18 GB. At the largest cell (64 responses x 4096) XLA's peaks are 73.0 (dp8), 69.5
(dp4.tp2), 67.8 (dp2.tp4) and 67.0 MiB (tp8): the 67.4 MiB budget leaves only tp8 there, as
only TP8 fitted 128 x 32K in the paper. The growth benchmark runs 16 responses with a 17.9 MiB
budget (peaks at 4096: 23.5, 20.0, 18.3, 17.4 MiB; at 2048 at most 15.3): dp2.tp4, the fastest
layout at every shorter context, stops fitting at 4096, where only tp8 does. The margins are
0.4-0.5 MiB, a tp8's share of the weights; XLA's memory analysis is deterministic, so the same
cells are refused on every run of this JAX version.
(Until the cache was laid out [B, K, S, Dh], XLA:CPU's decode also copied one layer's K and V at
every step, and that copy, not the weights, set the earlier budgets of 90 and 23 MiB.)
'smoke' is a one-minute version for checking the code.
"""

import dataclasses

from earl_jax.config import BucketConfig, ModelConfig, ParallelConfig
from earl_jax.errors import ConfigError
from earl_jax.profiling.table import MeasureConfig
from earl_jax.programs.builders import StageSpec
from earl_jax.rollout.sampler import SamplingConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class SelectorBench:
  """One benchmark setup.

  Attributes:
    model: the model (random weights).
    buckets: context buckets (heatmap rows; the growth schedule's table).
    rows: numbers of responses (heatmap columns; the profile's load bins).
    budget_mib: emulated per-device budget on CPU (a GPU uses its own limit when smaller).
    candidates: layouts to compare (None: every valid dp x tp, plus fsdp if `with_fsdp`).
    with_fsdp: include fsdp layouts in the default candidates.
    decode_tokens: tokens decoded per measured call (N of the rollout program).
    chunk: prompt tokens each measured call prefills first (P of the rollout program; 1 makes
      the measurement the paper's decode throughput).
    warmup, repeats, min_seconds, rounds: the profiler's measurement (the median of at least
      rounds x repeats calls, each visit timing at least min_seconds).
    compare: the two layouts of the paper's Eq. 1 speedup, (a, b): (TGS(b) - TGS(a)) / TGS(a).
    growth_schedule: mean context length per step of the growth benchmark.
    growth_rows: responses per step of the growth benchmark (its profile has this one load).
    growth_budget_mib: per-device budget of the growth benchmark (None: budget_mib).
    growth_spread: per-row contexts are uniform in mean x (1 +- spread).
    calls_per_step: decode calls per growth step (a step decodes calls x decode_tokens tokens).
    growth_passes: the growth benchmark runs every policy this many times (per-step medians).
  """

  model: ModelConfig
  buckets: BucketConfig
  rows: tuple[int, ...]
  budget_mib: float
  candidates: tuple[ParallelConfig, ...] | None = None
  with_fsdp: bool = False
  decode_tokens: int = 8
  chunk: int = 1
  warmup: int = 1
  repeats: int = 2
  min_seconds: float = 0.0
  rounds: int = 2
  compare: tuple[ParallelConfig, ParallelConfig] = (
    ParallelConfig(dp=2, tp=4),
    ParallelConfig(tp=8),
  )
  growth_schedule: tuple[int, ...] = ()
  growth_rows: int = 64
  growth_budget_mib: float | None = None
  growth_spread: float = 0.2
  calls_per_step: int = 4
  growth_passes: int = 1

  def __post_init__(self):
    if self.budget_mib <= 0:
      raise ValueError(f'budget_mib must be positive, got {self.budget_mib}.')
    if not 0 <= self.growth_spread < 1:
      raise ValueError(f'growth_spread must be in [0, 1), got {self.growth_spread}.')

  @property
  def spec(self) -> StageSpec:
    """The stage settings of the measured rollout programs (greedy decoding)."""
    sampling = SamplingConfig(max_new_tokens=self.decode_tokens, greedy=True)
    return StageSpec(sampling=sampling, chunk=self.chunk)

  @property
  def measure(self) -> MeasureConfig:
    return MeasureConfig(
      warmup=self.warmup, repeats=self.repeats, min_seconds=self.min_seconds, rounds=self.rounds
    )


def get_config(name: str = 'cpu') -> SelectorBench:
  """The named preset ('cpu' or 'smoke'); ValueError names the known ones."""
  small_kv = ModelConfig.preset('small-kv')
  if name == 'cpu':
    return SelectorBench(
      model=small_kv.replace(name='small-kv-wide', intermediate_size=2048),
      buckets=BucketConfig(lengths=(128, 256, 512, 1024, 2048, 4096)),
      rows=(16, 32, 64),
      budget_mib=67.4,
      decode_tokens=8,
      repeats=2,
      min_seconds=0.5,
      rounds=4,
      # Slow growth first (as in a real run), then the long contexts where only tp8 fits: with 16
      # responses at 4096, dp2.tp4 needs 18.3 MiB per device and tp8 17.4 MiB.
      growth_schedule=(
        *(100, 105, 110, 115),
        *(200, 210, 220),
        *(400, 420, 440),
        *(700, 800),
        *(1300, 1600),
        *(2600, 3000),
      ),
      growth_rows=16,
      growth_budget_mib=17.9,
      growth_spread=0.1,
      calls_per_step=16,
      growth_passes=2,
    )
  if name == 'smoke':
    return SelectorBench(
      model=small_kv,
      buckets=BucketConfig(lengths=(256, 1024)),
      rows=(8, 16),
      budget_mib=6.0,
      decode_tokens=4,
      repeats=3,
      rounds=1,
      growth_schedule=(200, 200, 700, 800),
      growth_rows=16,
      calls_per_step=2,
    )
  raise ConfigError(f"--preset={name!r} is unknown: expected one of ['cpu', 'smoke'].")
