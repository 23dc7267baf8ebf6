"""Presets of experiments/train.py.

default   the embedded default: a tiny model from scratch, the built-in tokenizer, Connect Four
          against the random opponent, 8 fake CPU devices, under 10 minutes on 2 cores; 64
          episodes a step on 16 rollout slots, each refilled as soon as its episode ends;
          replies constrained to the column digits, REINFORCE++ with turn-level discounted
          credit, the rules' label of the legal moves (`loss.legal_move_coef`), two updates a
          batch, half the training games started with a full column.
long      the same task to >= 85% greedy wins against random (docs/results/main-job.md) in 600
          steps, past the plateau another way: a cue naming full columns instead of the rules'
          label, only the opponent's last move in each observation (the agent tracks the game
          in its own context), one update a batch at a third of the rate, annealed.
think     Fig. 1's task (experiments/context_cap.py): the default's model and loop, Connect Four
          against a 2-ply minimax opponent, only its last move in each observation, and thinking
          (`EnvConfig.think_depth`): before each move the policy thinks up to 3 times, a turn and
          a ply of search each, then plays the move it thought of. Deeper thoughts win more, so
          its contexts grow inside each move as it learns, as an LLM's reasoning grows inside
          its turn.
long_context  contexts to 16K tokens on 8 fake CPU devices: the default's model and loop, each
          episode a match of Connect Four games against random in one context
          (`EnvConfig.series_games`), more games per match in stages (`series_schedule`), so that
          the contexts double every few steps from ~1K to ~16K; 2 episodes a step, under an
          emulated per-device memory budget that no layout without context parallelism fits at
          16K: the selector switches the experience and train stages to a context-parallel one
          there (docs/results/main-job.md). `--config.selector.with_cp=false`: the same run,
          refused at that bucket.
smoke     a few seconds: the loop with every stage, for tests and CI.
qwen      a real Qwen2.5 checkpoint (--config.model_dir=...), chat template, for GPUs.
code      code RL: the 'tiny-code' model with the code tokenizer from the supervised warm start
          (`init_from`: run `python experiments/sft.py --config=code` first), GRPO on the
          generated 'functions' tasks in up to 2 attempts (a failed one answered with a failing
          public test), evaluated greedily on the held-out tasks; 8 fake CPU devices.
humaneval_qwen  a Qwen2.5 (or Qwen2.5-Coder) Instruct checkpoint (--config.model_dir=...) through
          its chat template on HumanEval-style prompts: the generated 'functions' tasks (a
          signature, a docstring in words, two examples) in up to 3 attempts, each failed one
          answered with its failing public tests; evaluated greedily on HumanEval's 164
          problems (first attempt), which it never trains on. For GPUs.
swe_qwen  the same model fixing bugs in real Python projects (the `swe` task: the instances
          of experiments/build_swe_tasks.py, in runs/swe_tasks): it lists, views, searches and
          edits files and runs the tests through Qwen2.5's own tool calls, in up to 12 turns,
          rewarded when every FAIL_TO_PASS and PASS_TO_PASS test passes; evaluated on the
          held-out instances. For GPUs.
"""

import dataclasses

from earl_jax.config import BucketConfig
from earl_jax.envs.base import PLAY_HINT, THINK, CodeEnvConfig, EnvConfig
from earl_jax.experiment import ExperimentConfig
from earl_jax.profiling.table import MeasureConfig
from earl_jax.rl.advantages import AdvantageConfig
from earl_jax.rl.losses import LossConfig
from earl_jax.rl.train_step import OptimConfig
from earl_jax.rollout.engine import RolloutConfig
from earl_jax.rollout.sampler import SamplingConfig
from earl_jax.selector.selector import ProfileSettings, SelectorConfig
from earl_jax.stage import STAGES, Stage
from earl_jax.testing import configs

# Connect Four with the built-in character tokenizer: a turn is ~58 tokens, an episode up to ~1300.
GAME_BUCKETS = BucketConfig(lengths=(128, 256, 384, 512, 768, 1024, 1536))


def default() -> ExperimentConfig:
  return ExperimentConfig(
    name='default',
    model='tiny-game',
    tokenizer='game',
    # Half the training games start with one column already full of alternating stones, so
    # that the state in which a one-column policy loses is met from the first step; the
    # evaluation starts from the empty board.
    env=EnvConfig(
      game='connect_four', opponent='random', legal_move_reward=0.1, full_column_starts=0.5
    ),
    eval_env=EnvConfig(game='connect_four', opponent='random'),
    # 64 episodes on 16 slots, each refilled as soon as its episode ends: on this CPU a rollout
    # program's cost grows with its rows, and refill keeps the slots busy (experiments/
    # rollout_refill.py: faster than all 64 at once and than lock-step waves, same episodes).
    # Replies are sampled among the column digits (`reply_tokens`).
    rollout=RolloutConfig(
      num_episodes=64,
      num_slots=16,
      refill=True,
      group_size=1,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=1),
      prompt_buckets=(64, 128),
      reply_tokens=tuple('1234567'),
    ),
    # REINFORCE++ with turn-level credit discounted by 0.9 a turn, an invalid move's penalty
    # for that move alone (`move_credit='own_turn'`).
    advantages=AdvantageConfig(
      estimator='reinforce_pp', credit='turn', gamma=0.9, move_credit='own_turn'
    ),
    # The rules' label of the legal moves (`legal_move_coef`), two updates a batch: without
    # them the greedy policy stacks one column from step 10 (0.641-0.672 on seeds 0-2, a third
    # of its games lost by playing into the full column); with them all three seeds leave it
    # (0.742-0.828 at step 60; docs/results/tried.md, "The rules' label of the legal moves on
    # the default").
    loss=LossConfig(clip_eps=0.2, kl_coef=0.0, aggregation='token', legal_move_coef=3.0),
    optim=OptimConfig(learning_rate=3e-3, grad_clip=1.0),
    update_epochs=2,
    buckets=GAME_BUCKETS,
    # Every stage ranked by measurements of its own program, each figure the median of 3 calls
    # after a warm-up (measured between steps as the run reaches a bucket, cached), and by the
    # cost model fitted to them where a layout is not measured yet; the train stage with an
    # fsdp layout among its candidates, every stage with a context-parallel one (each row over
    # a ring of 4 devices; measured where the model puts it near the best).
    selector=SelectorConfig(
      statistic='max',
      candidates=('dp8', 'dp4.tp2', 'dp2.tp4', 'fsdp8', 'dp2.cp4'),
      with_fsdp=(Stage.TRAIN,),
      profile=ProfileSettings(
        stages=STAGES,
        cache='.earl_cache/profile_default.json',
        # At least 0.2 s of calls a cell: a rollout call takes 20-60 ms here, and its time
        # varies by up to 1.5x from call to call.
        measure=MeasureConfig(min_seconds=0.2),
        lazy=True,
      ),
    ),
    steps=60,
    eval_every=10,
    eval_episodes=128,
    checkpoint_every=20,
  )


def long() -> ExperimentConfig:
  c = default()
  # The default's greedy policy learns to stack one column (70% against random by itself) and then
  # loses by playing into it once it is full: the state is rare while the policy is broad, and
  # once it has collapsed onto the column the gradient that would lower it vanishes. Here the
  # 'illegal:4' line makes that state salient, and constrained decoding keeps every sampled reply
  # a column, so the policy learns to leave a full column (stack, then play on elsewhere).
  env = EnvConfig(
    game='connect_four', opponent='random', observation='last_move', show_illegal=True
  )
  return dataclasses.replace(
    c,
    name='long',
    env=env,
    eval_env=env,
    # Short prompts (the last move): a call's cost is mostly fixed, so all 64 episodes at once
    # beat 16 refilled slots here (experiments/rollout_refill.py --at_once).
    rollout=dataclasses.replace(
      c.rollout, num_slots=None, prompt_buckets=(32, 64), reply_tokens=tuple('1234567')
    ),
    # An invalid move's penalty for that move alone (`move_credit='own_turn'`): without it the
    # moves before it share the blame, a legal column tried in the full-column state scores the
    # next turn's repeat of the invalid move, and one seed of three stays on one column for all
    # 600 steps (docs/results/main-job.md).
    advantages=AdvantageConfig(
      estimator='reinforce_pp', credit='turn', gamma=0.9, move_credit='own_turn'
    ),
    # A third of the default's rate, annealed as PPO does. At 3e-3 the sampled policy collapses
    # onto one column within ~40 steps for some seeds, before the cue has been learned, and at a
    # constant rate a late Adam step tipped a run that had held 0.86 for 450 steps into a
    # deterministic stacking policy (entropy and gradient ~0).
    # Its own route past the plateau (the cue), without the default's rules' label: one update
    # a batch.
    loss=dataclasses.replace(c.loss, legal_move_coef=0.0),
    update_epochs=1,
    optim=dataclasses.replace(c.optim, learning_rate=1e-3, decay_steps=600),
    selector=dataclasses.replace(
      c.selector,
      profile=dataclasses.replace(c.selector.profile, cache='.earl_cache/profile_long.json'),
    ),
    steps=600,
    eval_every=50,
    eval_episodes=512,  # +-1.6 points of standard error (128 games: +-3.5)
    checkpoint_every=100,
  )


def think() -> ExperimentConfig:
  c = default()
  env = EnvConfig(
    game='connect_four',
    opponent='minimax',
    minimax_depth=2,
    observation='last_move',
    think_depth=3,
    legal_move_reward=0.1,
  )
  return dataclasses.replace(
    c,
    name='think',
    env=env,
    eval_env=env.replace(legal_move_reward=0.0),
    # The policy decides how long to think: a reply is a thought or the move thought of. Its
    # prompts (the last move or a hint) are under 16 tokens: a 64-token bucket would be ~90%
    # padding. With prompts that short a call's cost is mostly fixed, so all 64 episodes at once
    # beat 16 refilled slots (experiments/rollout_refill.py --at_once).
    rollout=dataclasses.replace(
      c.rollout, num_slots=None, prompt_buckets=(16, 64, 128), reply_tokens=(THINK, PLAY_HINT)
    ),
    # REINFORCE with a batch baseline and one update a batch: a reply is a thought or a move
    # here, so the default's turn credit and its rules' label of the legal moves do not apply.
    advantages=AdvantageConfig(estimator='reinforce'),
    loss=dataclasses.replace(c.loss, legal_move_coef=0.0),
    update_epochs=1,
    selector=dataclasses.replace(
      c.selector,
      profile=dataclasses.replace(c.selector.profile, cache='.earl_cache/profile_think.json'),
    ),
  )


# A Connect Four match in one context: a game is ~300-1000 tokens (a turn ~60), 22 games ~14K.
CONTEXT_BUCKETS = BucketConfig(lengths=(1024, 2048, 4096, 8192, 16384))


def long_context() -> ExperimentConfig:
  c = default()
  env = EnvConfig(
    game='connect_four',
    opponent='random',
    legal_move_reward=0.1,
    show_illegal=True,
    series_games=22,
  )
  return dataclasses.replace(
    c,
    name='long_context',
    env=env,
    eval_env=env.replace(series_games=1, legal_move_reward=0.0),
    # Two matches a step, both at once: at 16K each row alone is what a device can hold, so
    # only splitting the row's tokens (context parallelism) spreads it further.
    rollout=dataclasses.replace(
      c.rollout,
      num_episodes=2,
      num_slots=None,
      prompt_buckets=(64, 128),
      reply_tokens=tuple('1234567'),
    ),
    advantages=AdvantageConfig(estimator='reinforce_pp', credit='turn', gamma=0.9),
    loss=dataclasses.replace(c.loss, legal_move_coef=0.0),
    update_epochs=1,
    buckets=CONTEXT_BUCKETS,
    # The games of a match about double every 3 steps: a game is ~500-600 tokens here, so the
    # contexts reach the buckets 1K, 2K, 4K, 8K and then 16K.
    series_schedule=((0, 1), (3, 3), (6, 6), (9, 11), (12, 22)),
    # Every valid layout of 8 devices (data, fsdp, tensor, context), ranked by the cost model
    # (this CPU cannot judge their speed: docs/results/model-and-tests.md), refused by XLA's
    # memory analysis of each stage's program against an emulated budget of an accelerator.
    selector=SelectorConfig(
      statistic='max',
      candidates=None,
      with_fsdp=True,
      budget_mib=80.0,
      profile=ProfileSettings(stages=()),
    ),
    steps=15,
    eval_every=5,
    eval_episodes=64,
    checkpoint_every=5,
  )


def smoke() -> ExperimentConfig:
  return configs.smoke_experiment()


def qwen() -> ExperimentConfig:
  c = default()
  return dataclasses.replace(
    c,
    name='qwen',
    model_dir='/path/to/Qwen2.5-0.5B-Instruct',
    param_dtype='bfloat16',
    env=EnvConfig(game='connect_four', opponent='random', parse='lenient'),
    eval_env=EnvConfig(game='connect_four', opponent='random', parse='lenient'),
    rollout=RolloutConfig(
      num_episodes=64,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=64),
      prompt_buckets=(128, 256, 512),
    ),
    advantages=AdvantageConfig(estimator='reinforce'),
    optim=OptimConfig(learning_rate=1e-6),
    loss=LossConfig(kl_coef=0.01),
    update_epochs=1,
    buckets=BucketConfig(lengths=(1024, 2048, 4096, 8192, 16384, 32768)),
    selector=SelectorConfig(
      statistic='p95', profile=ProfileSettings(cache='.earl_cache/profile_qwen.json')
    ),
    steps=200,
  )


# The 'functions' tasks with the code tokenizer: a first prompt is 70 to 141 tokens, a repair
# turn's (a failing test cut to 80 characters, then the prompt again) up to 221, a reply up to
# 35 (40 allowed): a 2-turn episode fits 448.
CODE_BUCKETS = BucketConfig(lengths=(256, 448))
CODE_WARM_START = 'runs/code_sft/checkpoints'


def code() -> ExperimentConfig:
  # 0.4 of the 638 tasks held out: 256, every one evaluated once; 382 to train on.
  env = CodeEnvConfig(
    task='functions',
    split='train',
    heldout_fraction=0.4,
    max_turns=2,
    feedback_tests=1,
    feedback_chars=80,
  )
  return ExperimentConfig(
    name='code',
    model='tiny-code',
    tokenizer='code',
    init_from=CODE_WARM_START,
    env=env,
    eval_env=env.replace(split='heldout'),
    # Groups of 4 (16 tasks a step) at temperature 1: a task the warm start memorised gives a
    # group that all passes (no advantage), so the updates go to the tasks it never saw (half
    # of them; experiments/configs/sft.py), where 4 samples often differ. 64 slots: the
    # evaluation's episodes run on the rows of the training programs. All 64 at once: 16 or 32
    # refilled slots measured slower (most episodes take both turns, so refill makes as many
    # calls as lock-step; 64 at once 1.17-1.27x the episodes/s of 32 or 16,
    # docs/results/main-job.md, "Rollout slot refill against lock-step").
    rollout=RolloutConfig(
      num_episodes=64,
      num_slots=64,
      group_size=4,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=40),
      prompt_buckets=(144, 224),
    ),
    advantages=AdvantageConfig(estimator='grpo'),
    loss=LossConfig(clip_eps=0.2, kl_coef=0.0, aggregation='token'),
    # Two updates per rollout, the second bounded by the clip; 3e-4 decaying to a tenth over the
    # run's 240 updates. From the 800-step warm starts of init seeds 0, 1, 2 (held-out final
    # pass 0.555, 0.555, 0.598) it ends at 0.547, 0.574, 0.574: RL moves the held-out pass by
    # -2.4 to +1.9, it does not raise it (1e-4: 0.559 from seed 1's). A constant 5e-4 lowered
    # the 400-step warm start's by 4 points in 40 steps (docs/results/main-job.md, "Four near
    # misses per warm-start task").
    optim=OptimConfig(learning_rate=3e-4, warmup_steps=10, decay_steps=230, end_lr_fraction=0.1),
    update_epochs=2,
    buckets=CODE_BUCKETS,
    # Ranked by the analytic model: measuring every layout at each bucket would cost minutes of
    # the run's budget on 2 cores.
    selector=SelectorConfig(
      statistic='max',
      candidates=('dp8', 'dp4.tp2', 'dp2.tp4', 'fsdp8'),
      with_fsdp=(Stage.TRAIN,),
      profile=ProfileSettings(stages=()),
    ),
    steps=120,
    eval_every=40,
    # The 256 held-out tasks once each (greedy), a multiple of the 8 devices; and 16 samples of
    # each of the first 128 at temperature 1 (about 16 s an evaluation): the sampled pass@1 and
    # pass@16 beside the greedy pass.
    eval_episodes=256,
    eval_samples=16,
    eval_sample_tasks=128,
    checkpoint_every=40,
  )


def humaneval_qwen() -> ExperimentConfig:
  c = qwen()
  env = CodeEnvConfig(task='functions', split='train', max_turns=3)
  return dataclasses.replace(
    c,
    name='humaneval_qwen',
    env=env,
    eval_env=CodeEnvConfig(task='humaneval', max_turns=1),
    rollout=RolloutConfig(
      num_episodes=64,
      group_size=8,
      sampling=SamplingConfig(temperature=1.0, max_new_tokens=256),
      prompt_buckets=(256, 512, 1024),
    ),
    advantages=AdvantageConfig(estimator='grpo'),
    buckets=BucketConfig(lengths=(1024, 2048, 4096)),
    selector=SelectorConfig(
      statistic='p95', profile=ProfileSettings(cache='.earl_cache/profile_humaneval_qwen.json')
    ),
    eval_episodes=168,  # the 164 problems (4 twice): a multiple of 8 devices
  )


def swe_qwen() -> ExperimentConfig:
  c = humaneval_qwen()
  # Qwen2.5's tokenizer: the declared tools are ~600 tokens, a problem statement up to ~500.
  env = CodeEnvConfig(
    task='swe', split='train', max_turns=12, tool_format='qwen', max_reply_chars=8192,
    output_chars=4000,
  )  # fmt: skip
  return dataclasses.replace(
    c,
    name='swe_qwen',
    env=env,
    eval_env=env.replace(split='heldout'),
    rollout=dataclasses.replace(
      c.rollout,
      sampling=dataclasses.replace(c.rollout.sampling, max_new_tokens=512),
      prompt_buckets=(1024, 2048),
    ),
    buckets=BucketConfig(lengths=(4096, 8192, 16384, 32768)),
    selector=SelectorConfig(
      statistic='p95', profile=ProfileSettings(cache='.earl_cache/profile_swe_qwen.json')
    ),
    eval_episodes=120,  # the held-out fifth of 6 x 100 instances, a multiple of 8 devices
  )


PRESETS = {
  'default': default,
  'long': long,
  'think': think,
  'long_context': long_context,
  'smoke': smoke,
  'qwen': qwen,
  'code': code,
  'humaneval_qwen': humaneval_qwen,
  'swe_qwen': swe_qwen,
}
