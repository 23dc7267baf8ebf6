"""The warm start's examples: the rollout's first turn with the reply the environment passes,
through a chat template, near misses and repairs, and batches that see every example."""

import re

import numpy as np

from earl_jax.config import BucketConfig, ParallelConfig
from earl_jax.envs import base, code_env
from earl_jax.models import tokenizer
from earl_jax.sandbox import Sandbox, SandboxConfig
from earl_jax.sft import examples as sft
from earl_jax.testing import fixture_path

DP4TP2 = ParallelConfig(dp=4, tp=2)


def test_examples_are_the_rollout_first_turn_with_the_reply_the_env_passes():
  tok = tokenizer.load_tokenizer('code')
  env = base.CodeEnvConfig(task='functions', split='heldout')
  examples = sft.build_examples(env, tok)
  pairs = sft.first_turns(env)
  assert len(examples) == len(pairs) == 128 and examples.pad_id == tok.pad_id
  replies = []
  for i, (task, observation) in enumerate(pairs):
    ids, mask = examples.tokens[i].tolist(), examples.loss_mask[i]
    prompt = tok.turn_prompt_ids(code_env.printable(task.prompt), first=True)
    assert observation == code_env.printable(task.prompt) and ids[: len(prompt)] == prompt
    assert not mask[: len(prompt)].any() and mask[len(prompt) :].all()  # reply + eot only
    assert ids[-1] == tok.eot_id and tok.decode(ids[len(prompt) : -1]) == task.reference
    replies.append(tok.decode(ids[len(prompt) : -1]))
  # What the masked tokens spell (the eot dropped, as the engine does) passes every hidden test.
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=2.0, program_timeout_s=5.0)) as pool:
    game = code_env.CodeEnv(env, tasks=[t for t, _ in pairs[:6]], sandbox=pool)
    game.reset(6, 0)
    result = game.step([replies[game.tasks.index(t)] for t in game.episode_tasks])
  assert game.outcomes == ['win'] * 6 and (result.rewards == 1.0).all()


def test_examples_through_a_chat_template():
  tok = tokenizer.load_tokenizer(fixture_path('qwen2_tiny'))
  examples = sft.build_examples(base.CodeEnvConfig(task='functions'), tok)
  (task, observation), ids = sft.first_turns(base.CodeEnvConfig())[0], examples.tokens[0]
  prompt = tok.turn_prompt_ids(observation, first=True)
  assert tok.decode(ids[: len(prompt)]).startswith('<|im_start|>system\n')
  assert (
    not examples.loss_mask[0][: len(prompt)].any() and examples.loss_mask[0][len(prompt) :].all()
  )
  assert tok.decode(ids[len(prompt) :]) == task.reference + '<|im_end|>'


def _edited_constants(reply: str, reference: str) -> int | None:
  """How many constants (digits, quoted letters) `reply` changes in `reference`; None when it
  differs elsewhere."""
  if len(reply) != len(reference):
    return None
  spots = {m.start() for m in sft._CONSTANT.finditer(reference)}
  changed = [i for i, (a, b) in enumerate(zip(reply, reference)) if a != b]
  return len(changed) if set(changed) <= spots else None


def test_near_misses_are_a_sibling_then_one_constant_changed():
  tasks = code_env.CodeEnv(base.CodeEnvConfig(split='heldout')).tasks
  for task in tasks:
    misses = sft.near_misses(task, tasks, 4)
    assert misses == sft.near_misses(task, tasks, 4)  # a hash of the task id, not a global RNG
    assert len(set(misses)) == len(misses) == 4 and task.reference not in misses
    template = task.task_id.rsplit('/', 1)[0]
    sibling = {t.reference for t in tasks if t.task_id.rsplit('/', 1)[0] == template}
    assert misses[0] in sibling or misses[0] in {t.reference for t in tasks}
    constants = len(sft._CONSTANT.findall(task.reference))
    for miss in misses[1 : 1 + 2 * constants]:  # one constant changed (each before any twice)
      assert _edited_constants(miss, task.reference) == 1, (task.task_id, miss)
  # The commonest slip first: one constant copied into the other's place.
  two = next(
    t
    for t in tasks
    if t.task_id.startswith('functions/affine/') and len(set(re.findall(r'\d', t.reference))) == 2
  )
  a, b = re.findall(r'\d', two.reference)
  swapped = {two.reference.replace(a, b, 1), two.reference[::-1].replace(b, a, 1)[::-1]}
  assert set(sft.near_misses(two, tasks, 3)[1:]) == swapped


def test_repair_examples_answer_the_feedback_of_a_near_miss_with_the_reference():
  tok = tokenizer.load_tokenizer('code')
  env = base.CodeEnvConfig(split='heldout', feedback_tests=1, feedback_chars=80)
  tasks = {t.task_id: t for t in code_env.CodeEnv(env).tasks}
  with Sandbox(SandboxConfig(workers=2, test_timeout_s=2.0, program_timeout_s=5.0)) as pool:
    examples = sft.build_examples(env, tok, repair=3, sandbox=pool)
  assert sorted(examples.task_ids[: len(tasks)]) == sorted(tasks)  # first turns, then repairs
  repairs = examples.task_ids[len(tasks) :]
  names = [re.fullmatch(r'(.*)#repair(\d)', task_id).groups() for task_id in repairs]
  # A near miss that passes both public tests has none (s.count of a letter neither shows).
  assert len(set(repairs)) == len(repairs) and 0.9 * 3 * len(tasks) <= len(repairs)
  attempts = {}
  for i, (task_id, _) in enumerate(names, len(tasks)):
    task = tasks[task_id]
    text, mask = tok.decode(examples.tokens[i].tolist()), examples.loss_mask[i]
    first, attempt, feedback, reply = re.fullmatch(
      r'<bos><obs>(.*?)<act>(.*?)<eot><obs>(.*?)<act>(.*?)<eot>', text, re.S
    ).groups()
    # The near miss: one of the task's `near_misses`, which fails a public test the feedback
    # names (one line, at most 80 characters), then the prompt again.
    assert first == task.prompt and attempt in sft.near_misses(task, list(tasks.values()), 3)
    attempts.setdefault(task_id, []).append(attempt)
    line, rest = feedback.split('\n', 1)
    assert rest == task.prompt and ' failed: ' in line and len(line) <= 80
    assert line.split(' == ')[0] in {t.call for t in task.public_tests}
    # The loss: the reference and its end-of-turn token, nothing before.
    assert reply == task.reference and tok.decode(examples.tokens[i][mask].tolist()) == (
      task.reference + '<eot>'
    )
  assert all(len(set(a)) == len(a) for a in attempts.values())  # each task's misses differ


def test_batches_are_bucketed_and_every_epoch_sees_every_example():
  tok = tokenizer.load_tokenizer('code')
  examples = sft.build_examples(base.CodeEnvConfig(split='heldout'), tok)
  table = BucketConfig(lengths=(128, 192))
  buckets = sft.example_buckets(examples, table)
  sizes = {b: int((buckets == b).sum()) for b in (128, 192)}
  assert sizes[128] and sizes[192] and sum(sizes.values()) == len(examples) == 128
  per_epoch = sum(-(-n // 6) for n in sizes.values())  # ceil(n / 6) batches of each bucket
  epoch = [sft.batch_indices(buckets, s, 6, seed=3) for s in range(per_epoch)]
  seen = np.concatenate(epoch)
  assert sorted(seen.tolist()) == list(range(len(examples)))  # one epoch, each example once
  for indices in epoch:  # each batch holds up to 6 examples of one bucket
    assert 1 <= len(indices) <= 6 and len(set(buckets[indices].tolist())) == 1
  order = [int(buckets[i[0]]) for i in epoch]
  assert order != sorted(order)  # the buckets' batches are shuffled together
  np.testing.assert_array_equal(
    sft.batch_indices(buckets, 2, 6, 3), sft.batch_indices(buckets, 2, 6, 3)
  )
  again = [sft.batch_indices(buckets, s, 6, 3) for s in range(per_epoch, 2 * per_epoch)]
  assert sorted(np.concatenate(again).tolist()) == list(range(len(examples)))
  assert not all(map(np.array_equal, again, epoch))  # the next epoch reshuffles
  other = [sft.batch_indices(buckets, s, 6, 4) for s in range(per_epoch)]
  assert not all(map(np.array_equal, other, epoch))  # another seed, other batches
  short = int(examples.lengths.argmin())
  batch = sft.pad_batch(examples, [short], 8, table)
  assert batch.tokens.shape == (8, 128) and batch.loss_mask[1:].sum() == 0
  assert (batch.tokens[0, examples.lengths[short] :] == tok.pad_id).all()
  longest = int(examples.lengths.argmax())
  assert sft.pad_batch(examples, [short, longest], 8, table).bucket == 192
