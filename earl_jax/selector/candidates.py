"""Candidate parallel layouts of a stage: every factorisation of its devices the model allows.

A candidate is a `ParallelConfig(dp, fsdp, tp, cp)` whose product is the stage's device count and
that divides what it splits: heads, KV heads, MLP width and vocabulary by tp; the hidden size by
fsdp; the rows (responses) of the stage by dp x fsdp; every bucket length by cp.

Context-parallel layouts (cp > 1: each row's tokens split over a ring of devices) are candidates
of every stage: the experience and train forwards run ring attention on them
(`models.context_attention`), the rollout decodes on a KV cache split along its slots
(`models.context_decode`).

  cands = candidates.stage_candidates(Stage.ROLLOUT, cfg, num_devices=8, rows=(8, 16, 32))
  [c.name for c in cands]          # ['dp8.tp1', 'dp4.tp2', 'dp2.tp4', 'dp1.tp8', ...]
"""

from collections.abc import Sequence

from earl_jax.config import ModelConfig, ParallelConfig
from earl_jax.sharding import mesh as mesh_lib
from earl_jax.stage import STAGES, Stage


def why_invalid(
  parallel: ParallelConfig,
  model: ModelConfig,
  rows: Sequence[int] = (),
  lengths: Sequence[int] = (),
) -> str | None:
  """None when `parallel` is a valid layout of `model` for every row count and bucket length,
  else the reason."""
  try:
    mesh_lib.check_model_fits(parallel, model)
    for n in rows:
      mesh_lib.check_batch_fits(parallel, n, what='responses')
    mesh_lib.check_context_fits(parallel, lengths)
  except mesh_lib.ShardingError as e:
    return str(e)
  return None


def stage_candidates(
  stage: Stage,
  model: ModelConfig,
  *,
  num_devices: int,
  rows: Sequence[int] = (),
  lengths: Sequence[int] = (),
  with_fsdp: bool = True,
  with_cp: bool = False,
  only: Sequence[ParallelConfig] | None = None,
) -> list[ParallelConfig]:
  """Every valid layout of `num_devices` devices for `stage` of `model`.

  Args:
    stage: the stage (all three have candidates; the rules are the same).
    model: the model whose dimensions the layout must divide.
    num_devices: the stage's device count (the product of every candidate).
    rows: row counts (responses) the layout must split over data x fsdp.
    lengths: the bucket lengths a context-parallel layout must split over cp.
    with_fsdp: include fsdp > 1 layouts.
    with_cp: include cp > 1 layouts.
    only: restrict to these layouts (each must be valid, else ShardingError naming why).

  Returns:
    Candidates sorted by (cp, tp, fsdp, dp), the order of `mesh.factorizations`.

  Raises:
    ShardingError: no layout is valid (the message names each layout's problem), or a layout
      in `only` is invalid.
  """
  stage = Stage.parse(stage)
  if only is not None:
    out = []
    for p in only:
      if p.num_devices != num_devices:
        raise mesh_lib.ShardingError(
          f'Candidate {p} uses {p.num_devices} devices; the {stage} stage has {num_devices}.'
        )
      reason = why_invalid(p, model, rows, lengths)
      if reason is not None:
        raise mesh_lib.ShardingError(f'Candidate {p} is not valid for {stage}: {reason}')
      out.append(p)
    return sorted(set(out), key=mesh_lib.layout_order)
  out, problems = [], []
  for p in mesh_lib.factorizations(num_devices, with_fsdp=with_fsdp, with_cp=with_cp):
    reason = why_invalid(p, model, rows, lengths)
    if reason is None:
      out.append(p)
    else:
      problems.append(reason)
  if not out:
    raise mesh_lib.ShardingError(
      f'No layout of {num_devices} devices is valid for {stage} of model {model.name!r}: '
      + ' | '.join(problems)
    )
  return out


def named_stages(setting: bool | Sequence[Stage | str]) -> tuple[Stage, ...]:
  """The stages a `with_fsdp` or `with_cp` setting names (True: every stage, False: none)."""
  if isinstance(setting, bool):
    return tuple(STAGES) if setting else ()
  return tuple(Stage.parse(s) for s in setting)


def candidates_for(
  stage: Stage,
  model: ModelConfig,
  *,
  num_devices: int,
  rows: Sequence[int],
  with_fsdp: Sequence[Stage],
  only: Sequence[ParallelConfig] | None,
  with_cp: Sequence[Stage] = (),
  lengths: Sequence[int] = (),
) -> list[ParallelConfig]:
  """A stage's candidates: `only` (fsdp layouts kept for the `with_fsdp` stages, cp layouts for
  the `with_cp` stages), or every valid layout of the devices."""
  fsdp, cp = stage in with_fsdp, stage in with_cp
  if only is not None:
    only = [c for c in only if (fsdp or c.fsdp == 1) and (cp or c.cp == 1)]
  return stage_candidates(
    stage,
    model,
    num_devices=num_devices,
    rows=rows,
    lengths=lengths,
    with_fsdp=fsdp,
    with_cp=cp,
    only=only,
  )
