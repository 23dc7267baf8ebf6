"""The warm start's examples and batches: next-token examples on the tasks' reference solutions.

An example is the first turn of a code episode exactly as the RL rollout plays it: the
observation `CodeEnv.reset` shows (the task's prompt), rendered by the tokenizer's
`turn_prompt_ids(observation, first=True)` (a HF tokenizer's chat template), then the task's
reference completion and the end-of-turn token: the reply the environment parses
(`code_env.extract_code`, `program_source`) and passes. `tokenizer.conversation_ids` builds it
as the rollout engine builds a turn, and its `generated` flags are the loss mask: the prompt
carries no loss, the reply and its end-of-turn token do. With `repair` a task also gives repair
examples: a near miss as the first reply (`near_misses`), the environment's feedback on it, then
the reference (the loss on that last reply alone), so that the RL job's repair turns start in
distribution.

  examples = build_examples(env_config, tokenizer, repair=4)
  buckets = example_buckets(examples, bucket_table)
  host = pad_batch(examples, batch_indices(buckets, step, rows, seed), rows, bucket_table)

A step takes up to B = `rows` examples of one bucket (`batch_plan`: each epoch every bucket's
examples in a seeded permutation, cut into batches, the batches in a seeded order, so a resumed
run sees the same batches), padded to that bucket (a first turn is not padded to a repair
example's length).

Dimension letters as in `earl_jax.config`; E is the number of examples.
"""

import collections
import dataclasses
import hashlib
import itertools
import re
import string
from collections.abc import Sequence
from typing import Any

import numpy as np

from earl_jax import buckets as buckets_lib
from earl_jax.config import BucketConfig
from earl_jax.envs import base as envs
from earl_jax.envs import code_env
from earl_jax.models import tokenizer as tokenizer_lib
from earl_jax.sft.steps import SFTBatch
from earl_jax.sharding import mesh as mesh_lib

# -- examples and batches --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Examples:
  """E next-token examples, unpadded: example e is `tokens[e]` with `loss_mask[e]` (the tokens
  the policy generates: the reply and its end-of-turn token)."""

  task_ids: tuple[str, ...]
  tokens: tuple[np.ndarray, ...]  # int32 [T_e] each
  loss_mask: tuple[np.ndarray, ...]  # bool [T_e] each
  pad_id: int

  def __len__(self) -> int:
    return len(self.tokens)

  @property
  def lengths(self) -> np.ndarray:
    return np.array([len(t) for t in self.tokens], np.int64)


def first_turns(env: envs.CodeEnvConfig, *, seed: int = 0) -> list[tuple[Any, str]]:
  """(task, first observation) of every task of `env`, one episode each, as `CodeEnv.reset`
  shows them to the rollout (no program runs: the sandbox is not started)."""
  game = code_env.CodeEnv(env)
  observations = game.reset(len(game.tasks), seed)
  return list(zip(game.episode_tasks, observations))


def example_ids(
  tokenizer: tokenizer_lib.Tokenizer, observation: str, reply: str
) -> tuple[list[int], list[bool]]:
  """The ids of a first turn answered by `reply`, as the rollout engine lays it out, and the
  loss mask (True on the reply's ids and its end-of-turn id)."""
  reply_ids = [*tokenizer.encode(reply), tokenizer.eot_id]
  return tokenizer_lib.conversation_ids(tokenizer, [observation], [reply_ids])


# A constant of a 'functions' reference: a digit, or a quoted letter.
_CONSTANT = re.compile(r"\d|(?<=')[a-z](?=')")


def near_misses(task: Any, tasks: Sequence[Any], count: int) -> list[str]:
  """Up to `count` distinct wrong replies close to `task`'s, as the tiny model's errors are.

  The first is the reference of another task of `tasks` of the same 'functions' template (or of
  the same argument when the template has one task): constants copied wrong, or the neighbour
  template's body. The rest change one constant of the reference (`_CONSTANT`): to the task's
  other constant where it has two (the model's commonest error, one digit copied into the other's
  place), else to another digit or letter; references with no constant (`sorted(xs)`) take
  further siblings. All picked by a hash of the task id, so a task's near misses never change.
  """
  template = task.task_id.rsplit('/', 1)[0]
  signature = task.prompt.split('\n', 1)[0]
  others = [t for t in tasks if t.reference != task.reference]
  siblings = [t for t in others if t.task_id.rsplit('/', 1)[0] == template] or [
    t for t in others if t.prompt.split('\n', 1)[0] == signature
  ]
  rng = np.random.default_rng(int(hashlib.sha256(task.task_id.encode()).hexdigest(), 16) % 2**63)
  ref = task.reference
  edits = []
  spots = [m.start() for m in _CONSTANT.finditer(ref)]
  for at in rng.permutation(spots).tolist():
    old = ref[at]
    alphabet = '0123456789' if old.isdigit() else string.ascii_lowercase
    other = [ref[b] for b in spots if b != at and ref[b] != old and ref[b] in alphabet]
    rest = [c for c in rng.permutation(list(alphabet)).tolist() if c != old and c not in other]
    edits.append([ref[:at] + c + ref[at + 1 :] for c in other + rest])
  # Round robin over the constants: each changed once before any twice.
  ordered = [e for group in itertools.zip_longest(*edits) for e in group if e is not None]
  first = [siblings[i].reference for i in rng.permutation(len(siblings)).tolist()]
  out = []
  for reply in [*first[:1], *ordered, *first[1:]]:
    if reply != ref and reply not in out:
      out.append(reply)
  return out[:count]


def repair_turns(
  env: envs.CodeEnvConfig,
  *,
  count: int = 1,
  sandbox: code_env.ProgramChecker | None = None,
  seed: int = 0,
) -> list[tuple[Any, str, str, str]]:
  """(task, first observation, near miss, the observation after it) for up to `count` near
  misses (`near_misses`, among `env`'s own tasks) of every task of `env`, those that fail a
  public test: the feedback their sandbox verdict makes, then the prompt again (`CodeEnv` in
  two turns). Ordered by near miss, then task."""
  game = code_env.CodeEnv(env.replace(max_turns=2), sandbox=sandbox)
  num_tasks = len(game.tasks)
  observations = game.reset(count * num_tasks, seed)
  tasks = game.episode_tasks  # episode e plays task e mod T
  misses = {t.task_id: near_misses(t, game.tasks, count) for t in game.tasks}
  wrong = []
  for e, task in enumerate(tasks):
    mine = misses[task.task_id]
    wrong.append(mine[e // num_tasks] if e // num_tasks < len(mine) else task.reference)
  result = game.step(wrong)
  turns = zip(tasks, observations, wrong, result.observations, result.dones)
  return [(task, obs, miss, feedback) for task, obs, miss, feedback, done in turns if not done]


def build_examples(
  env: envs.CodeEnvConfig,
  tokenizer: tokenizer_lib.Tokenizer,
  *,
  repair: int = 0,
  sandbox: code_env.ProgramChecker | None = None,
) -> Examples:
  """One example per task of `env`: its first observation answered by its reference; with
  `repair` > 0, also up to that many per task from `repair_turns` (task id '<id>#repair<k>'): a
  near miss and its feedback, then the reference, the loss on that last reply alone."""
  task_ids, tokens, masks = [], [], []
  for task, observation in first_turns(env):
    ids, mask = example_ids(tokenizer, observation, task.reference)
    task_ids.append(task.task_id)
    tokens.append(np.asarray(ids, np.int32))
    masks.append(np.asarray(mask, bool))
  made: collections.Counter[str] = collections.Counter()
  for task, observation, miss, feedback in (
    repair_turns(env, count=repair, sandbox=sandbox) if repair else ()
  ):
    replies = [[*tokenizer.encode(text), tokenizer.eot_id] for text in (miss, task.reference)]
    ids, mask = tokenizer_lib.conversation_ids(tokenizer, [observation, feedback], replies)
    attempt = len(tokenizer.turn_prompt_ids(observation, first=True)) + len(replies[0])
    task_ids.append(f'{task.task_id}#repair{made[task.task_id]}')
    made[task.task_id] += 1
    tokens.append(np.asarray(ids, np.int32))
    masks.append(np.asarray([False] * attempt + mask[attempt:], bool))
  return Examples(tuple(task_ids), tuple(tokens), tuple(masks), tokenizer.pad_id)


def batch_plan(buckets: np.ndarray, rows: int, seed: int, epoch: int) -> list[np.ndarray]:
  """The batches of one epoch, each int64 [<= B] example indices of one bucket: every bucket's
  examples (`buckets[e]`, the bucket example e pads to) in a permutation seeded by (seed,
  epoch), cut into ceil(n / B) batches of near-equal size, the batches in a seeded order. Every
  example is in one batch; every epoch has the same number of batches."""
  rng = np.random.default_rng([seed, epoch])
  batches: list[np.ndarray] = []
  for bucket in np.unique(buckets).tolist():
    members = np.flatnonzero(buckets == bucket)
    members = members[rng.permutation(len(members))]
    batches += np.array_split(members, -(-len(members) // rows))
  return [batches[i] for i in rng.permutation(len(batches)).tolist()]


def batch_indices(buckets: np.ndarray, step: int, rows: int, seed: int) -> np.ndarray:
  """int64 [<= B]: the examples of step `step` (from 0), the batch `step` of an endless stream
  of `batch_plan` epochs; a function of (step, seed), so a resumed run sees the same batches."""
  per_epoch = sum(-(-int((buckets == b).sum()) // rows) for b in np.unique(buckets).tolist())
  epoch, k = divmod(step, per_epoch)
  return batch_plan(buckets, rows, seed, epoch)[k]


def example_buckets(examples: Examples, table: BucketConfig) -> np.ndarray:
  """int64 [E]: the bucket of `table` each example pads to."""
  return np.array([table.bucket_for(n) for n in examples.lengths.tolist()], np.int64)


def pad_batch(
  examples: Examples, indices: Sequence[int] | np.ndarray, rows: int, table: BucketConfig
) -> SFTBatch:
  """Host arrays [B = rows, T]: the examples `indices` left-aligned, then padding rows (no loss),
  T the smallest bucket of `table` that holds the longest."""
  indices = list(indices)
  width = max(len(examples.tokens[i]) for i in indices)
  tokens = np.full((rows, width), examples.pad_id, np.int32)
  mask = np.zeros((rows, width), bool)
  for row, i in enumerate(indices):
    tokens[row, : len(examples.tokens[i])] = examples.tokens[i]
    mask[row, : len(examples.loss_mask[i])] = examples.loss_mask[i]
  tokens, _ = buckets_lib.pad_to_bucket(tokens, table, axis=1, pad_value=examples.pad_id)
  mask, _ = buckets_lib.pad_to_bucket(mask, table, axis=1, pad_value=False)
  return SFTBatch(tokens=tokens, loss_mask=mask)


def put_batch(batch: SFTBatch, shardings: SFTBatch) -> SFTBatch:
  """A host batch (the same on every process) as global arrays on `shardings`."""
  rows = np.arange(batch.tokens.shape[0])
  put = lambda x, sh: mesh_lib.put_rows(x, rows, x.shape, sh)  # noqa: E731
  return SFTBatch(
    tokens=put(batch.tokens, shardings.tokens), loss_mask=put(batch.loss_mask, shardings.loss_mask)
  )
