"""Tests for earl_jax.models.tokenizer: the game tokenizer, the HF/Qwen one and the turn layout.

The HF side is checked against `tests/fixtures/chat_template_golden.json`, which
`scripts/make_qwen2_fixture.py` rendered with transformers' own `apply_chat_template` and the
real Qwen2.5 chat template.
"""

import json
import pathlib
import re
import shutil

import numpy as np
import pytest
import tokenizers

from earl_jax.models import tokenizer as tok_lib

FIXTURES = pathlib.Path(__file__).resolve().parents[1] / 'fixtures'
MODEL_DIR = FIXTURES / 'qwen2_tiny'
TIED_MODEL_DIR = FIXTURES / 'qwen2_tiny_tied'
TINY_MODEL_VOCAB = 512  # ModelConfig.preset('tiny').vocab_size, the fixture checkpoints' V


def _golden() -> dict:
  with open(FIXTURES / 'chat_template_golden.json') as f:
    return json.load(f)


GOLDEN = _golden()
CASES = {case['name']: case for case in GOLDEN['cases']}


@pytest.fixture(scope='module')
def hf() -> tok_lib.HFTokenizer:
  return tok_lib.HFTokenizer.from_dir(MODEL_DIR)


def _split_messages(messages: list[dict]) -> tuple[str | None, list[str], list[str]]:
  """(system prompt or None, user contents, assistant contents) of an alternating chat."""
  system = None
  if messages[0]['role'] == 'system':
    system, messages = messages[0]['content'], messages[1:]
  users = [m['content'] for m in messages[0::2]]
  assistants = [m['content'] for m in messages[1::2]]
  assert all(m['role'] == 'user' for m in messages[0::2])
  assert all(m['role'] == 'assistant' for m in messages[1::2])
  return system, users, assistants


# ---------------------------------------------------------------------------------------------
# GameTokenizer


def test_game_vocab_and_special_ids():
  game = tok_lib.GameTokenizer()
  assert game.vocab_size == 64
  assert (game.pad_id, game.bos_id, game.eot_id, game.obs_id, game.act_id) == (0, 1, 2, 3, 4)
  assert game.decode([1, 2, 3, 4]) == '<bos><eot><obs><act>'


def test_game_alphabet_ids_are_distinct_and_fit_the_vocab():
  game = tok_lib.GameTokenizer()
  ids = game.encode(game.ALPHABET)
  assert len(set(ids)) == len(game.ALPHABET)
  assert min(ids) >= len(game.SPECIAL_TOKENS)
  assert max(ids) < game.vocab_size
  for char in '0123456789abcdefghijklmnopqrstuvwxyz' + 'XO .\n|:-':
    assert len(game.encode(char)) == 1


@pytest.mark.parametrize(
  'text',
  [
    'board:\n.......\n...X...\n..OX...\nturn: x\nlegal: 0 1 2 3 4 5 6\n',
    'X|O|.\n-|-|-\n',
    '',
    'game over: draw. reward: 0',
  ],
)
def test_game_round_trip(text):
  game = tok_lib.GameTokenizer()
  assert game.decode(game.encode(text)) == text


def test_game_encode_rejects_unknown_character_naming_it_and_the_alphabet():
  game = tok_lib.GameTokenizer()
  with pytest.raises(ValueError, match=r"'Y' at index 3") as info:
    game.encode('abcY')
  assert repr(game.ALPHABET) in str(info.value)
  with pytest.raises(ValueError, match=r"'<' at index 0"):
    game.encode('<eot>')


def test_game_decode_never_raises_in_range_and_rejects_out_of_range():
  game = tok_lib.GameTokenizer()
  for i in range(64):
    assert isinstance(game.decode([i]), str)
  assert game.decode([0]) == ''  # pad is always dropped
  assert game.decode([63]) == '<unused63>'
  assert game.decode([63], skip_special_tokens=True) == ''
  with pytest.raises(ValueError, match='id 64 is outside'):
    game.decode([64])
  with pytest.raises(ValueError, match='id -1 is outside'):
    game.decode([-1])


def test_game_decode_skips_pad_and_optionally_specials():
  game = tok_lib.GameTokenizer()
  ids = [game.bos_id, *game.encode('ab'), game.pad_id, game.eot_id, game.pad_id]
  assert game.decode(ids) == '<bos>ab<eot>'
  assert game.decode(ids, skip_special_tokens=True) == 'ab'
  assert game.decode(np.asarray(ids, np.int32)) == '<bos>ab<eot>'


def test_game_turn_layout():
  game = tok_lib.GameTokenizer()
  first = game.turn_prompt_ids('1.', first=True)
  later = game.turn_prompt_ids('1.', first=False)
  assert first == [game.bos_id, game.obs_id, *game.encode('1.'), game.act_id]
  assert later == [game.obs_id, *game.encode('1.'), game.act_id]
  assert game.reply_suffix_ids() == [game.eot_id]


def test_game_conversation_marks_generated_tokens():
  game = tok_lib.GameTokenizer()
  stopped = [*game.encode('3'), game.eot_id]  # the model emitted <eot>
  truncated = game.encode('45')  # hit the token limit
  ids, generated = tok_lib.conversation_ids(game, ['x.', 'o.', 'x.'], [stopped, truncated])
  expected = [
    *game.turn_prompt_ids('x.', first=True),
    *stopped,
    *game.turn_prompt_ids('o.', first=False),
    *truncated,
    game.eot_id,
    *game.turn_prompt_ids('x.', first=False),
  ]
  assert ids == expected
  assert game.decode(ids) == '<bos><obs>x.<act>3<eot><obs>o.<act>45<eot><obs>x.<act>'
  assert [i for i, g in zip(ids, generated) if g] == [*stopped, *truncated]
  assert len(generated) == len(ids)


def test_conversation_ids_rejects_bad_shapes_and_early_eot():
  game = tok_lib.GameTokenizer()
  with pytest.raises(ValueError, match='2 observations and 0 replies'):
    tok_lib.conversation_ids(game, ['a', 'b'], [])
  with pytest.raises(ValueError, match='before its end'):
    tok_lib.conversation_ids(game, ['a'], [[game.eot_id, *game.encode('1')]])


# ---------------------------------------------------------------------------------------------
# HFTokenizer


def test_hf_special_ids_match_the_fixture(hf):
  specials = GOLDEN['special_token_ids']
  assert hf.eot_id == specials['<|im_end|>']
  assert hf.im_start_id == specials['<|im_start|>']
  assert hf.pad_id == specials['<|endoftext|>']
  assert hf.reply_suffix_ids() == [hf.eot_id]
  assert hf.encode('<|im_end|>') == [hf.eot_id]


def test_hf_vocab_fits_the_tiny_model(hf):
  assert hf.vocab_size == GOLDEN['vocab_size']
  assert hf.vocab_size <= TINY_MODEL_VOCAB
  all_ids = [i for case in GOLDEN['cases'] for i in case['ids']]
  all_ids += hf.encode('Any text at all: ünïcödé, 日本語, emoji 🎲, tabs\tand\r\nnewlines.')
  assert max(all_ids) < hf.vocab_size


def test_hf_both_fixture_dirs_load_the_same_tokenizer(hf):
  tied = tok_lib.HFTokenizer.from_dir(TIED_MODEL_DIR)
  text = GOLDEN['cases'][0]['text']
  assert tied.encode(text) == hf.encode(text)
  assert (tied.vocab_size, tied.pad_id, tied.eot_id) == (hf.vocab_size, hf.pad_id, hf.eot_id)


@pytest.mark.parametrize(
  'text',
  [
    'Hello! What is the capital of France?',
    'board:\n.......\n...X...\nturn: X\n',
    '  leading spaces, trailing newline\n\n',
    'ünïcödé 日本語 🎲',
    '',
  ],
)
def test_hf_round_trip(hf, text):
  assert hf.decode(hf.encode(text)) == text


def test_hf_decode_drops_pad_keeps_other_specials_unless_asked(hf):
  ids = [*hf.encode('hi'), hf.eot_id, hf.pad_id, hf.pad_id]
  assert hf.decode(ids) == 'hi<|im_end|>'
  assert hf.decode(ids, skip_special_tokens=True) == 'hi'
  assert hf.decode(np.asarray(ids, np.int64)) == 'hi<|im_end|>'
  # The model's ids past the tokenizer's vocabulary decode to nothing rather than raising.
  assert hf.decode([*hf.encode('a'), TINY_MODEL_VOCAB - 1]) == 'a'


def test_hf_default_and_custom_system_prompt(hf):
  assert hf.system_prompt == GOLDEN['default_system_prompt']
  custom = tok_lib.HFTokenizer.from_dir(MODEL_DIR, system_prompt='Play well.')
  text = custom.decode(custom.turn_prompt_ids('x', first=True))
  assert text.startswith('<|im_start|>system\nPlay well.<|im_end|>\n<|im_start|>user\nx')
  assert text.endswith('<|im_end|>\n<|im_start|>assistant\n')
  later = custom.decode(custom.turn_prompt_ids('x', first=False))
  assert later == '\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n'


@pytest.mark.parametrize('name', sorted(CASES))
def test_hf_turns_reproduce_the_chat_template(name):
  """prompt_1 + reply_1 + eot + prompt_2 + ... == apply_chat_template(messages), id for id."""
  case = CASES[name]
  system, users, assistants = _split_messages(case['messages'])
  tok = tok_lib.HFTokenizer.from_dir(MODEL_DIR, system_prompt=system)
  replies = [[*tok.encode(text), tok.eot_id] for text in assistants]
  ids, generated = tok_lib.conversation_ids(tok, users, replies)
  if case['add_generation_prompt']:
    assert len(replies) == len(users) - 1
  else:
    # A conversation that ends on a reply: the template's newline after the last <|im_end|>.
    ids += tok.encode('\n')
  assert ids == case['ids']
  assert tok.decode(ids) == case['text']
  assert [i for i, g in zip(ids, generated) if g] == [i for r in replies for i in r]


def test_hf_truncated_reply_gives_the_same_context_as_a_stopped_one(hf):
  case = CASES['game_3_turns']
  system, users, assistants = _split_messages(case['messages'])
  tok = tok_lib.HFTokenizer.from_dir(MODEL_DIR, system_prompt=system)
  stopped = [[*tok.encode(a), tok.eot_id] for a in assistants]
  truncated = [tok.encode(a) for a in assistants]
  ids_stopped, gen_stopped = tok_lib.conversation_ids(tok, users, stopped)
  ids_truncated, gen_truncated = tok_lib.conversation_ids(tok, users, truncated)
  assert ids_truncated == ids_stopped
  # The closing <|im_end|> is generated in one case and template in the other.
  assert sum(gen_stopped) == sum(gen_truncated) + len(assistants)


def test_hf_missing_dir_names_the_path(tmp_path):
  missing = tmp_path / 'no_such_model'
  with pytest.raises(FileNotFoundError, match='no_such_model'):
    tok_lib.HFTokenizer.from_dir(missing)


def test_hf_missing_tokenizer_json_names_the_file(tmp_path):
  (tmp_path / 'config.json').write_text('{}')
  with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / 'tokenizer.json'))):
    tok_lib.HFTokenizer.from_dir(tmp_path)


def test_hf_tokenizer_config_is_optional(tmp_path, hf):
  shutil.copy(MODEL_DIR / 'tokenizer.json', tmp_path / 'tokenizer.json')
  bare = tok_lib.HFTokenizer.from_dir(tmp_path)
  assert (bare.pad_id, bare.eot_id, bare.vocab_size) == (hf.pad_id, hf.eot_id, hf.vocab_size)


def test_hf_pad_token_comes_from_tokenizer_config(tmp_path, hf):
  shutil.copy(MODEL_DIR / 'tokenizer.json', tmp_path / 'tokenizer.json')
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps({'pad_token': '<|im_start|>'}))
  assert tok_lib.HFTokenizer.from_dir(tmp_path).pad_id == hf.im_start_id


def test_hf_rejects_a_non_chatml_template(tmp_path):
  shutil.copy(MODEL_DIR / 'tokenizer.json', tmp_path / 'tokenizer.json')
  config = {'chat_template': '{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}'}
  (tmp_path / 'tokenizer_config.json').write_text(json.dumps(config))
  with pytest.raises(ValueError, match='not ChatML'):
    tok_lib.HFTokenizer.from_dir(tmp_path)


def test_hf_rejects_a_tokenizer_without_chatml_tokens(tmp_path):
  word_level = tokenizers.Tokenizer(
    tokenizers.models.WordLevel({'<unk>': 0, 'a': 1}, unk_token='<unk>')
  )
  word_level.save(str(tmp_path / 'tokenizer.json'))
  with pytest.raises(ValueError, match=r"no token '<\|im_start\|>'"):
    tok_lib.HFTokenizer.from_dir(tmp_path)


# ---------------------------------------------------------------------------------------------
# CodeTokenizer

PRINTABLE = ''.join(chr(c) for c in range(32, 127))


def test_code_vocab_and_special_ids():
  code = tok_lib.CodeTokenizer()
  assert code.vocab_size == 128
  assert (code.pad_id, code.bos_id, code.eot_id, code.obs_id, code.act_id) == (0, 1, 2, 3, 4)
  assert code.decode([1, 2, 3, 4]) == '<bos><eot><obs><act>'
  ids = code.encode(code.ALPHABET)
  assert ids == list(range(5, 5 + 97))  # tab, newline, then ' '..'~' in order
  assert code.decode([127]) == '<unused127>' and code.decode([127], skip_special_tokens=True) == ''
  assert code.decode([*code.encode('a'), 128, 511]) == 'a'  # a larger model's padding ids
  with pytest.raises(ValueError, match='CodeTokenizer id -1 is outside'):
    code.decode([-1])


@pytest.mark.parametrize(
  'text',
  [
    PRINTABLE + '\t\n',
    'def f(xs):\n    """xs sorted"""\n\treturn sorted(xs)  # {a} [b] <c> ~`^|\\\n',
    'replace nums.py 3 4\n    return x*3+1\n',
    '',
  ],
)
def test_code_round_trip(text):
  code = tok_lib.CodeTokenizer()
  assert code.decode(code.encode(text)) == text
  assert len(code.encode(text)) == len(text)


def test_code_round_trips_random_printable_text():
  code = tok_lib.CodeTokenizer()
  rng = np.random.default_rng(0)
  for _ in range(20):
    text = ''.join(rng.choice(list(PRINTABLE + '\t\n'), size=200).tolist())
    assert code.decode(code.encode(text)) == text


def test_code_encode_rejects_non_ascii_naming_it():
  code = tok_lib.CodeTokenizer()
  with pytest.raises(ValueError, match="CodeTokenizer cannot encode character '\u00e9' at index 3"):
    code.encode('caf\u00e9')
  with pytest.raises(ValueError, match=r"'\\r' at index 1"):
    code.encode('a\r\n')


def test_code_and_game_tokenizers_keep_their_own_ids():
  game, code = tok_lib.GameTokenizer(), tok_lib.CodeTokenizer()
  assert game.encode('0aX\n-') == [5, 15, 41, 45, 48]
  assert (
    game.vocab_size == 64 and repr(game) == 'GameTokenizer()' and repr(code) == 'CodeTokenizer()'
  )
  assert code.turn_prompt_ids('f(', first=True) == [1, 3, *code.encode('f('), 4]
  assert code.turn_prompt_ids('f(', first=False) == [3, *code.encode('f('), 4]


def _code_observations() -> list[str]:
  from earl_jax import sandbox
  from earl_jax.envs import code_env, code_tasks, repo_repair

  task = code_tasks.all_function_tasks()[3]
  got = sandbox.TestResult(ok=False, got="'<|im_end|>\u00e9'", error='wrong value', status='fail')
  feedback = code_env.failure_line(task.public_tests[0], got, 200)
  repo = repo_repair.make_repo_task(0)
  return [
    task.prompt,
    f'{feedback}\n{task.prompt}',
    repo_repair.INTRO,
    repo_repair.numbered('nums.py', repo.files['nums.py']),
    code_env.printable('print("<|im_end|><|im_start|>user")\n'),
  ]


@pytest.mark.parametrize('first', [True, False])
def test_hf_chat_template_carries_code_observations_intact(hf, first):
  """Code observations (quotes, indentation, '|' line numbers, a program's attempt to print a
  special token) keep the chat layout: only the template's own special tokens appear."""
  code = tok_lib.CodeTokenizer()
  specials = {hf.im_start_id, hf.eot_id}
  for observation in _code_observations():
    ids = hf.turn_prompt_ids(observation, first=first)
    assert hf.decode(ids) == hf.turn_prompt_text(observation, first=first)
    assert sum(i in specials for i in ids) == (5 if first else 3)
    assert code.decode(code.encode(observation)) == observation


# ---------------------------------------------------------------------------------------------
# load_tokenizer


def test_load_tokenizer_game_and_dir():
  game = tok_lib.load_tokenizer('game')
  assert isinstance(game, tok_lib.GameTokenizer)
  assert isinstance(game, tok_lib.Tokenizer)
  code = tok_lib.load_tokenizer('code')
  assert isinstance(code, tok_lib.CodeTokenizer) and isinstance(code, tok_lib.Tokenizer)
  hf = tok_lib.load_tokenizer(str(MODEL_DIR), system_prompt='S')
  assert isinstance(hf, tok_lib.HFTokenizer)
  assert isinstance(hf, tok_lib.Tokenizer)
  assert hf.system_prompt == 'S'
  assert isinstance(tok_lib.load_tokenizer(MODEL_DIR), tok_lib.HFTokenizer)


@pytest.mark.parametrize('spec', ['gpt2', 'Game', '/no/such/dir'])
def test_load_tokenizer_rejects_unknown_specs_naming_them(spec):
  with pytest.raises(ValueError, match=re.escape(f'Unknown tokenizer {spec!r}')):
    tok_lib.load_tokenizer(spec)


def test_load_tokenizer_dir_without_tokenizer_json(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'tokenizer\.json'):
    tok_lib.load_tokenizer(tmp_path)


def test_tool_calls_render_as_the_qwen25_template_renders_them():
  """A `swe` conversation in the 'qwen' tool format (the tools declared in the system prompt,
  `<tool_call>` replies, `<tool_response>` observations) is, text and ids, what transformers'
  `apply_chat_template(messages, tools=...)` renders with the real Qwen2.5 template
  (tests/fixtures/tool_call_golden.json, scripts/make_tool_call_golden.py)."""
  from earl_jax.swe import tools

  with open(FIXTURES / 'tool_call_golden.json') as f:
    golden = json.load(f)
  assert golden['tools'] == tools.qwen_tools()  # the env declares what the golden rendered
  hf = tok_lib.HFTokenizer.from_dir(
    MODEL_DIR, system_prompt=tok_lib.qwen_tool_system_prompt(tools.qwen_tools())
  )
  messages = golden['messages']
  observations = [messages[0]['content']] + [
    f'<tool_response>\n{m["content"]}\n</tool_response>' for m in messages[2::2]
  ]
  replies = [f'<tool_call>\n{r}\n</tool_call>' for r in golden['replies']]
  for reply, message in zip(replies, messages[1::2]):
    assert tools.parse_qwen(reply).name == {'view_file': 'view', 'replace_lines': 'replace',
                                            'submit': 'submit'}[message['tool_calls'][0]['function']['name']]  # fmt: skip
  for case in golden['cases']:
    turns = (case['messages'] + 1) // 2  # observations shown so far
    answered = case['messages'] // 2
    obs, said = observations[:turns], [[*hf.encode(r), hf.eot_id] for r in replies[:answered]]
    ids, _ = tok_lib.conversation_ids(hf, obs, said)
    text = ''.join(
      hf.turn_prompt_text(o, first=k == 0) + (replies[k] + tok_lib.IM_END if k < answered else '')
      for k, o in enumerate(obs)
    )
    expected = case['text'] if case['add_generation_prompt'] else case['text'].removesuffix('\n')
    assert text == expected, case['name']
    golden_ids = case['ids'] if case['add_generation_prompt'] else case['ids'][:-1]
    assert ids == golden_ids, case['name']
