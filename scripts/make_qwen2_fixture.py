"""Makes the tiny Qwen2 fixtures that let earl_jax test its model, importer and tokenizer.

The project itself never depends on torch or transformers: this script runs once, in a separate
virtual environment, and its outputs are committed under `tests/fixtures/`, where the tests read
them with nothing but numpy, safetensors and `tokenizers`.

How to run (CPU only, fully offline; nothing is downloaded):

  python3 -m venv /tmp/venv-torch
  /tmp/venv-torch/bin/pip install torch==2.13.0 transformers safetensors
  HF_HUB_OFFLINE=1 /tmp/venv-torch/bin/python scripts/make_qwen2_fixture.py \
      [--out_dir tests/fixtures] [--bench_dir /tmp/qwen2_bench]

(torch's CPU wheels live at --index-url https://download.pytorch.org/whl/cpu.) The outputs are
deterministic: fixed seeds, a fixed training corpus for the tokenizer, float32 throughout.

What it writes into --out_dir:
  qwen2_tiny/              a complete HF model directory: a random `Qwen2ForCausalLM` (V=512, D=64,
                           F=192, L=2, H=8, K=4, Dh=8, untied, float32) saved by `save_pretrained`
                           as one `model.safetensors` + `config.json`, plus `tokenizer.json` and
                           `tokenizer_config.json`. The q/k/v biases and RMSNorm weights are filled
                           with noise (the random init leaves them at 0 and 1), and the init scale
                           is raised so that attention is far from uniform: a port that drops the
                           biases, the norm weights or RoPE cannot match the logits by accident.
  qwen2_tiny_tied/         the same shapes with tied embeddings and another seed, saved as a
                           sharded checkpoint (several `model-0000i-of-0000n.safetensors` and
                           `model.safetensors.index.json`), plus the same tokenizer files.
  qwen2_tiny_reference.npz `tokens` int32 [N, T]; `logits_untied` and `logits_tied` float32
                           [N, T, V], the HF logits of both checkpoints (eval mode, no attention
                           mask, full sequences); `greedy_untied` int32 [8], the greedy
                           continuation of `tokens[0]` by the untied model (HF `generate`, checked
                           against a no-cache argmax loop); `greedy_untied_margin` float32 [8], the
                           top-1 minus top-2 logit at each greedy step.
  chat_template_golden.json  multi-turn conversations rendered by transformers' own
                           `apply_chat_template` with the real Qwen2.5 chat template, as strings
                           and token ids, so earl_jax can test its Python chat formatting.

With --bench_dir DIR it also writes a benchmark-sized random Qwen2 (V=4096, D=512, F=1408, L=8,
H=8, K=4, Dh=64, untied, float32, 27.8M parameters, 111 MB) with a tokenizer of the same kind
(vocabulary <= 4096; the small built-in corpus yields 734 tokens) into DIR, for decode-throughput
benchmarks. It is not a test fixture: do not commit it.
"""

import argparse
import json
import os
import pathlib
import shutil

os.environ.setdefault('HF_HUB_OFFLINE', '1')
os.environ.setdefault('TRANSFORMERS_OFFLINE', '1')

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

# The special tokens of the Qwen2 / Qwen2.5 tokenizers that the chat format uses.
ENDOFTEXT = '<|endoftext|>'
IM_START = '<|im_start|>'
IM_END = '<|im_end|>'
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)

# Qwen2's pre-tokenizer split pattern (transformers' tokenization_qwen2.PRETOKENIZE_REGEX).
QWEN2_PRETOKENIZE_REGEX = (
  r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
  r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.'

# The chat template shipped in tokenizer_config.json of Qwen/Qwen2.5-*-Instruct.
QWEN25_CHAT_TEMPLATE = (
  '{%- if tools %}\n'
  "    {{- '<|im_start|>system\\n' }}\n"
  "    {%- if messages[0]['role'] == 'system' %}\n"
  "        {{- messages[0]['content'] }}\n"
  '    {%- else %}\n'
  "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
  '    {%- endif %}\n'
  '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.'
  '\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n'
  '    {%- for tool in tools %}\n'
  '        {{- "\\n" }}\n'
  '        {{- tool | tojson }}\n'
  '    {%- endfor %}\n'
  '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and '
  'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": '
  '<function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}\n'
  '{%- else %}\n'
  "    {%- if messages[0]['role'] == 'system' %}\n"
  "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
  '    {%- else %}\n'
  "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
  "assistant.<|im_end|>\\n' }}\n"
  '    {%- endif %}\n'
  '{%- endif %}\n'
  '{%- for message in messages %}\n'
  '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
  '(message.role == "assistant" and not message.tool_calls) %}\n'
  "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
  '    {%- elif message.role == "assistant" %}\n'
  "        {{- '<|im_start|>' + message.role }}\n"
  '        {%- if message.content %}\n'
  "            {{- '\\n' + message.content }}\n"
  '        {%- endif %}\n'
  '        {%- for tool_call in message.tool_calls %}\n'
  '            {%- if tool_call.function is defined %}\n'
  '                {%- set tool_call = tool_call.function %}\n'
  '            {%- endif %}\n'
  '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n'
  '            {{- tool_call.name }}\n'
  '            {{- \'", "arguments": \' }}\n'
  '            {{- tool_call.arguments | tojson }}\n'
  "            {{- '}\\n</tool_call>' }}\n"
  '        {%- endfor %}\n'
  "        {{- '<|im_end|>\\n' }}\n"
  '    {%- elif message.role == "tool" %}\n'
  '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
  "            {{- '<|im_start|>user' }}\n"
  '        {%- endif %}\n'
  "        {{- '\\n<tool_response>\\n' }}\n"
  '        {{- message.content }}\n'
  "        {{- '\\n</tool_response>' }}\n"
  '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
  "            {{- '<|im_end|>\\n' }}\n"
  '        {%- endif %}\n'
  '    {%- endif %}\n'
  '{%- endfor %}\n'
  '{%- if add_generation_prompt %}\n'
  "    {{- '<|im_start|>assistant\\n' }}\n"
  '{%- endif %}\n'
)

# Game boards in the compact text protocol of the built-in envs (lowercase, digits, X/O, . | : -).
_GAME_TEXT = [
  'board:\n.......\n.......\n.......\n.......\n...X...\n..OX...\nturn: X\nlegal: 0 1 2 3 4 5 6\n',
  'board:\n.......\n.......\n.......\n...O...\n...X...\n..OXX..\nturn: O\nlegal: 0 1 2 3 4 5 6\n',
  'board:\nX|O|.\n-+-+-\n.|X|.\n-+-+-\n.|.|O\nturn: X\nlegal: 2 3 5 6 7\n',
  'board:\nX|O|X\n-+-+-\nO|X|.\n-+-+-\n.|.|O\nturn: X\nlegal: 5 6 7\n',
  'you play X. reply with the column number only.\n',
  'you play O. reply with the cell number only.\n',
  'illegal move: column 3 is full. try again.\n',
  'opponent played 4. your move.\n',
  'game over: X wins. reward: 1\n',
  'game over: draw. reward: 0\n',
  'game over: O wins. reward: -1\n',
  'move: 3\n',
  'move: 0\n',
  'move: 6\n',
]

# A small, fixed English corpus so that common words become single tokens.
_ENGLISH_TEXT = [
  'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.',
  'You are a careful player of board games. Think about the position, then answer with a move.',
  'Connect four is played on a board with seven columns and six rows. Players take turns dropping '
  'a disc into a column. The first player to connect four discs in a row, a column or a diagonal '
  'wins the game. If the board is full and nobody has four in a row, the game is a draw.',
  'Tic tac toe is played on a three by three grid. The player who places three marks in a '
  'horizontal, vertical or diagonal row wins.',
  'The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a '
  'single step. Reinforcement learning trains an agent to choose actions that maximize the '
  'expected reward over many turns of an episode.',
  'Hello! How can I help you today? Please describe the problem and I will do my best to help.',
  'The model reads the observation, writes a short answer, and the environment replies with the '
  'next observation. The conversation grows turn by turn until the game is over.',
  'I will play in the center column, because it gives the most ways to connect four.',
  'Thank you. That move blocks the threat on the left side of the board.',
  'What is the capital of France? The capital of France is Paris.',
  'Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 42 100 2024.',
  "It's a good idea to check the rules first. Don't forget: they'll play again, we're ready.",
]


def _corpus() -> list[str]:
  # Repeat the game text so that its frequent pieces ('board', ' X', '...') win merges early,
  # and the chat roles so that 'system', 'user' and 'assistant' become single tokens.
  roles = ['system\n', 'user\n', 'assistant\n'] * 4
  return _ENGLISH_TEXT * 2 + _GAME_TEXT * 4 + roles


def build_tokenizer(vocab_size: int) -> tokenizers.Tokenizer:
  """Trains a byte-level BPE with Qwen2's pipeline and appends Qwen's special tokens.

  Args:
    vocab_size: the most tokens in total, special tokens included. The trainer may stop short
      of it when the corpus has no more pairs to merge.

  Returns:
    A `tokenizers.Tokenizer` whose normalizer, pre-tokenizer and decoder are those of the
    Qwen2 tokenizer; the three special tokens take the last ids, as in Qwen's vocabulary.
  """
  tok = tokenizers.Tokenizer(
    models.BPE(
      dropout=None,
      unk_token=None,
      continuing_subword_prefix='',
      end_of_word_suffix='',
      fuse_unk=False,
      byte_fallback=False,
    )
  )
  tok.normalizer = normalizers.NFC()
  tok.pre_tokenizer = pre_tokenizers.Sequence(
    [
      pre_tokenizers.Split(
        tokenizers.Regex(QWEN2_PRETOKENIZE_REGEX), behavior='isolated', invert=False
      ),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ]
  )
  tok.decoder = decoders.ByteLevel()
  tok.post_processor = processors.ByteLevel(
    add_prefix_space=False, trim_offsets=False, use_regex=False
  )
  trainer = trainers.BpeTrainer(
    vocab_size=vocab_size - len(SPECIAL_TOKENS),
    min_frequency=2,
    show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    special_tokens=[],
  )
  tok.train_from_iterator(_corpus(), trainer=trainer)
  tok.add_special_tokens(
    [
      tokenizers.AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False)
      for t in SPECIAL_TOKENS
    ]
  )
  total = tok.get_vocab_size(with_added_tokens=True)
  if total > vocab_size:
    raise RuntimeError(f'tokenizer has {total} tokens, more than the {vocab_size} allowed')
  return tok


def write_tokenizer(tok: tokenizers.Tokenizer, model_dir: pathlib.Path) -> None:
  """Writes tokenizer.json and a Qwen2.5-Instruct-style tokenizer_config.json into model_dir."""
  tok.save(str(model_dir / 'tokenizer.json'))
  added = {
    str(tok.token_to_id(t)): {
      'content': t,
      'lstrip': False,
      'normalized': False,
      'rstrip': False,
      'single_word': False,
      'special': True,
    }
    for t in SPECIAL_TOKENS
  }
  config = {
    'add_bos_token': False,
    'add_prefix_space': False,
    'added_tokens_decoder': added,
    'additional_special_tokens': [IM_START, IM_END],
    'bos_token': None,
    'chat_template': QWEN25_CHAT_TEMPLATE,
    'clean_up_tokenization_spaces': False,
    'eos_token': IM_END,
    'errors': 'replace',
    'model_max_length': 4096,
    'pad_token': ENDOFTEXT,
    'split_special_tokens': False,
    'tokenizer_class': 'Qwen2Tokenizer',
    'unk_token': None,
  }
  with open(model_dir / 'tokenizer_config.json', 'w') as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
    f.write('\n')


def _seed(seed: int) -> None:
  torch.manual_seed(seed)
  np.random.seed(seed)


def make_model(
  *,
  seed: int,
  tied: bool,
  tok: tokenizers.Tokenizer,
  vocab_size: int = 512,
  hidden_size: int = 64,
  intermediate_size: int = 192,
  num_layers: int = 2,
  num_heads: int = 8,
  num_kv_heads: int = 4,
  rope_theta: float = 10_000.0,
  max_position_embeddings: int = 4096,
  initializer_range: float = 0.15,
  perturb: bool = True,
) -> transformers.Qwen2ForCausalLM:
  """Builds a random float32 Qwen2ForCausalLM in eval mode.

  With `perturb`, the q/k/v biases get N(0, 0.2^2) noise and every RMSNorm weight becomes
  1 + N(0, 0.2^2), so that a port which ignores either cannot match the reference logits.
  """
  _seed(seed)
  config = transformers.Qwen2Config(
    vocab_size=vocab_size,
    hidden_size=hidden_size,
    intermediate_size=intermediate_size,
    num_hidden_layers=num_layers,
    num_attention_heads=num_heads,
    num_key_value_heads=num_kv_heads,
    head_dim=hidden_size // num_heads,
    rope_theta=rope_theta,
    rms_norm_eps=1e-6,
    max_position_embeddings=max_position_embeddings,
    tie_word_embeddings=tied,
    initializer_range=initializer_range,
    bos_token_id=tok.token_to_id(ENDOFTEXT),
    eos_token_id=tok.token_to_id(IM_END),
    pad_token_id=tok.token_to_id(ENDOFTEXT),
    use_sliding_window=False,
    dtype=torch.float32,
  )
  model = transformers.Qwen2ForCausalLM(config).to(torch.float32).eval()
  if perturb:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
      for name, param in model.named_parameters():
        if name.endswith(('q_proj.bias', 'k_proj.bias', 'v_proj.bias')):
          param.copy_(0.2 * torch.randn(param.shape, generator=gen))
        elif name.endswith('norm.weight'):
          param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
  if tied and model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
    raise RuntimeError('tie_word_embeddings=True but lm_head does not share the embedding')
  return model


def save_model(
  model: transformers.Qwen2ForCausalLM,
  tok: tokenizers.Tokenizer,
  model_dir: pathlib.Path,
  *,
  max_shard_size: str | None = None,
) -> None:
  """save_pretrained (safetensors) plus the tokenizer files; replaces model_dir."""
  if model_dir.exists():
    shutil.rmtree(model_dir)
  model_dir.mkdir(parents=True)
  kwargs = {} if max_shard_size is None else {'max_shard_size': max_shard_size}
  model.save_pretrained(model_dir, safe_serialization=True, **kwargs)
  # The generation config is not part of what earl_jax reads; keep the fixture minimal.
  (model_dir / 'generation_config.json').unlink(missing_ok=True)
  write_tokenizer(tok, model_dir)


@torch.no_grad()
def logits_of(model: transformers.Qwen2ForCausalLM, tokens: np.ndarray) -> np.ndarray:
  """Float32 logits [N, T, V] of full sequences, no attention mask."""
  out = model(input_ids=torch.from_numpy(tokens.astype(np.int64)), use_cache=False)
  return out.logits.to(torch.float32).numpy()


@torch.no_grad()
def greedy(
  model: transformers.Qwen2ForCausalLM, prompt: np.ndarray, n: int
) -> tuple[np.ndarray, np.ndarray]:
  """Greedy continuation by HF generate (KV cache), checked against a no-cache argmax loop.

  Returns:
    (new_tokens int32 [n], margins float32 [n]): margins are top-1 minus top-2 logits.
  """
  ids = torch.from_numpy(prompt.astype(np.int64))[None]
  gen = model.generate(
    ids,
    attention_mask=torch.ones_like(ids),
    max_new_tokens=n,
    min_new_tokens=n,
    do_sample=False,
    eos_token_id=None,
    pad_token_id=model.config.pad_token_id,
  )
  new = gen[0, ids.shape[1] :].numpy().astype(np.int32)
  seq, margins = ids, []
  for _ in range(n):
    logits = model(input_ids=seq, use_cache=False).logits[0, -1]
    top2 = torch.topk(logits, 2).values
    margins.append(float(top2[0] - top2[1]))
    seq = torch.cat([seq, logits.argmax().view(1, 1)], dim=1)
  loop = seq[0, ids.shape[1] :].numpy().astype(np.int32)
  if not np.array_equal(new, loop):
    raise RuntimeError(f'generate() gave {new.tolist()} but the argmax loop gave {loop.tolist()}')
  return new, np.asarray(margins, np.float32)


def reference_tokens(tok: tokenizers.Tokenizer, *, n: int, t: int, vocab_size: int) -> np.ndarray:
  """Token sequences [n, t]: one real chat prompt, then random ids over the whole model vocab."""
  rng = np.random.default_rng(1234)
  chat = (
    f'{IM_START}system\n{DEFAULT_SYSTEM_PROMPT}{IM_END}\n{IM_START}user\n'
    f'{_GAME_TEXT[0]}{IM_END}\n{IM_START}assistant\n'
  )
  rows = [tok.encode(chat).ids[-t:]]
  # Random rows cover every id range, including ids past the tokenizer (as in real Qwen, the
  # model's vocabulary is larger than the tokenizer's) and the special tokens.
  rows.append(rng.integers(0, vocab_size, size=t).tolist())
  low_ids = rng.integers(0, 64, size=t)
  rows.append(np.where(rng.random(t) < 0.5, low_ids, rng.integers(0, vocab_size, size=t)).tolist())
  out = np.asarray(rows[:n], np.int32)
  if out.shape != (n, t) or out.min() < 0 or out.max() >= vocab_size:
    raise RuntimeError(
      f'bad reference tokens: shape {out.shape}, ids in [{out.min()}, {out.max()}]'
    )
  return out


def _conversations() -> list[dict]:
  system = 'You play connect four as X. Reply with a column number.'
  board1, board2, board3 = _GAME_TEXT[0], _GAME_TEXT[1], _GAME_TEXT[3]
  game = [
    {'role': 'system', 'content': system},
    {'role': 'user', 'content': board1},
    {'role': 'assistant', 'content': '3'},
    {'role': 'user', 'content': board2},
    {'role': 'assistant', 'content': 'I will play in the center column: 3'},
    {'role': 'user', 'content': 'illegal move: column 3 is full. try again.\n'},
    {'role': 'assistant', 'content': 'move: 4'},
  ]
  chat = [
    {'role': 'user', 'content': 'Hello! What is the capital of France?'},
    {'role': 'assistant', 'content': 'The capital of France is Paris.'},
    {'role': 'user', 'content': "Thank you. It's a good idea to check. Don't forget the rules."},
    {'role': 'assistant', 'content': 'You are welcome!\nHow can I help you today?'},
  ]
  ttt = [
    {'role': 'system', 'content': 'You play tic tac toe.'},
    {'role': 'user', 'content': _GAME_TEXT[2]},
    {'role': 'assistant', 'content': ' 5'},
    {'role': 'user', 'content': board3},
    {'role': 'assistant', 'content': '7 (blocks the diagonal)'},
  ]
  return [
    {'name': 'game_3_turns', 'messages': game, 'add_generation_prompt': False},
    {'name': 'game_3rd_prompt', 'messages': game[:-1], 'add_generation_prompt': True},
    {'name': 'game_1st_prompt', 'messages': game[:2], 'add_generation_prompt': True},
    {'name': 'chat_default_system_2_turns', 'messages': chat, 'add_generation_prompt': False},
    {'name': 'chat_default_system_2nd_prompt', 'messages': chat[:3], 'add_generation_prompt': True},
    {'name': 'tic_tac_toe_2_turns', 'messages': ttt, 'add_generation_prompt': False},
    {'name': 'tic_tac_toe_2nd_prompt', 'messages': ttt[:-1], 'add_generation_prompt': True},
  ]


def chat_golden(tok: tokenizers.Tokenizer, model_dir: pathlib.Path) -> dict:
  """Renders the conversations with transformers' apply_chat_template (Jinja) and tokenizes them.

  The ids are cross-checked between AutoTokenizer (Qwen2Tokenizer), PreTrainedTokenizerFast over
  tokenizer.json, apply_chat_template(tokenize=True) and the raw `tokenizers` object.
  """
  auto = transformers.AutoTokenizer.from_pretrained(str(model_dir))
  fast = transformers.PreTrainedTokenizerFast(
    tokenizer_file=str(model_dir / 'tokenizer.json'),
    eos_token=IM_END,
    pad_token=ENDOFTEXT,
  )
  fast.chat_template = QWEN25_CHAT_TEMPLATE
  cases = []
  for case in _conversations():
    msgs, gen = case['messages'], case['add_generation_prompt']
    text = auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    text_fast = fast.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    if text != text_fast:
      raise RuntimeError(f'{case["name"]}: AutoTokenizer and PreTrainedTokenizerFast disagree')
    ids = auto(text, add_special_tokens=False)['input_ids']
    encoded = auto.apply_chat_template(
      msgs, tokenize=True, add_generation_prompt=gen, return_dict=True
    )['input_ids']
    for other in (fast(text, add_special_tokens=False)['input_ids'], tok.encode(text).ids, encoded):
      if list(other) != list(ids):
        raise RuntimeError(f'{case["name"]}: tokenizations disagree: {ids} vs {list(other)}')
    if auto.decode(ids) != text:
      raise RuntimeError(f'{case["name"]}: decode(encode(text)) != text')
    cases.append({**case, 'text': text, 'ids': list(map(int, ids))})
  return {
    'about': 'Qwen2.5 chat template rendered by transformers '
    f'{transformers.__version__} apply_chat_template; ids from the qwen2_tiny tokenizer.',
    'tokenizer_dir': model_dir.name,
    'default_system_prompt': DEFAULT_SYSTEM_PROMPT,
    'special_token_ids': {t: tok.token_to_id(t) for t in SPECIAL_TOKENS},
    'vocab_size': tok.get_vocab_size(with_added_tokens=True),
    'cases': cases,
  }


def make_fixtures(out_dir: pathlib.Path) -> None:
  out_dir.mkdir(parents=True, exist_ok=True)
  # 500 tokens in total, below the model's 512: real Qwen checkpoints also pad the embedding
  # table past the tokenizer (151,665 tokens, V=151,936), so the ids 500..511 never decode.
  tok = build_tokenizer(vocab_size=500)
  # Seed 2 is chosen for a clear greedy path: every step's top-1 beats top-2 by > 0.15.
  untied = make_model(seed=2, tied=False, tok=tok)
  tied = make_model(seed=3, tied=True, tok=tok)
  save_model(untied, tok, out_dir / 'qwen2_tiny')
  save_model(tied, tok, out_dir / 'qwen2_tiny_tied', max_shard_size='200KB')

  # Reload from disk, so the reference logits are those of the saved files.
  untied = transformers.Qwen2ForCausalLM.from_pretrained(
    out_dir / 'qwen2_tiny', dtype=torch.float32
  ).eval()
  tied = transformers.Qwen2ForCausalLM.from_pretrained(
    out_dir / 'qwen2_tiny_tied', dtype=torch.float32
  ).eval()
  tokens = reference_tokens(tok, n=3, t=32, vocab_size=untied.config.vocab_size)
  greedy_ids, margins = greedy(untied, tokens[0], 8)
  np.savez(
    out_dir / 'qwen2_tiny_reference.npz',
    tokens=tokens,
    logits_untied=logits_of(untied, tokens),
    logits_tied=logits_of(tied, tokens),
    greedy_untied=greedy_ids,
    greedy_untied_margin=margins,
  )
  golden = chat_golden(tok, out_dir / 'qwen2_tiny')
  with open(out_dir / 'chat_template_golden.json', 'w') as f:
    json.dump(golden, f, indent=1, ensure_ascii=False)
    f.write('\n')
  print(f'greedy continuation {greedy_ids.tolist()}, min top-2 margin {margins.min():.4f}')
  print(f'tokenizer vocabulary: {tok.get_vocab_size(with_added_tokens=True)} tokens')


def make_bench(bench_dir: pathlib.Path) -> None:
  tok = build_tokenizer(vocab_size=4096)
  model = make_model(
    seed=4,
    tied=False,
    tok=tok,
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=4,
    rope_theta=1_000_000.0,
    max_position_embeddings=32_768,
    initializer_range=0.02,
    perturb=False,
  )
  save_model(model, tok, bench_dir)
  n = sum(p.numel() for p in model.parameters())
  print(
    f'bench model: {n / 1e6:.1f}M parameters, tokenizer vocabulary '
    f'{tok.get_vocab_size(with_added_tokens=True)} -> {bench_dir}'
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  default_out = pathlib.Path(__file__).resolve().parents[1] / 'tests' / 'fixtures'
  parser.add_argument('--out_dir', type=pathlib.Path, default=default_out)
  parser.add_argument('--bench_dir', type=pathlib.Path, default=None)
  args = parser.parse_args()
  torch.use_deterministic_algorithms(True)
  torch.set_num_threads(1)  # summation order, hence the last bits of the logits, is fixed
  make_fixtures(args.out_dir)
  if args.bench_dir is not None:
    make_bench(args.bench_dir)


if __name__ == '__main__':
  main()
