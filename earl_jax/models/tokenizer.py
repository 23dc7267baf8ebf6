"""Tokenizers for the multi-turn rollout engine: a HF (Qwen chat format) one and character ones.

The rollout engine builds each conversation turn by turn and extends the KV cache as it goes, so
a tokenizer here does more than `encode`/`decode`: it says which tokens to prefill before the
agent answers an observation (`turn_prompt_ids`) and what closes a reply that hit the per-turn
token limit (`reply_suffix_ids`). Every implementation follows the same turn layout:

  turn 1:  turn_prompt_ids(obs_1, first=True)   reply_1 ids   [eot]
  turn i:  turn_prompt_ids(obs_i, first=False)  reply_i ids   [eot]

Generated tokens are the reply ids and the `eot_id` the model emitted itself; everything else
is template. When a reply stops on the per-turn token limit without emitting `eot_id`, the
engine appends `reply_suffix_ids()` (just `[eot_id]` for both tokenizers), and those tokens are
template (loss-masked), not generated. A later turn's prompt starts right after that `eot`, so
the two cases leave the same well-formed context. `conversation_ids` spells this out.

Three implementations:
  HFTokenizer    a `tokenizers` tokenizer.json from a HF model directory, with the ChatML /
                 Qwen2.5 chat format written in Python (no Jinja): every message is
                 `<|im_start|>{role}\\n{content}<|im_end|>\\n`, after a system message that the
                 Qwen2.5 template always adds. `eot_id` is `<|im_end|>`, and the `\\n` that the
                 template writes after it opens the next turn's prompt, so concatenating the
                 turns reproduces `apply_chat_template` token for token (plus that final `\\n`
                 when the conversation ends on a reply).
  GameTokenizer  a character-level tokenizer for the compact game text protocol of the
                 built-in envs, with exactly 64 ids (the 'tiny-game' model's vocabulary).
  CodeTokenizer  a character-level tokenizer for the code environments: printable ASCII, tab
                 and newline, 128 ids (fits the 'tiny' model's vocabulary).

`load_tokenizer('game')`, `load_tokenizer('code')` or `load_tokenizer('/path/to/model_dir')`
picks one.
"""

import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, SupportsIndex, runtime_checkable

import numpy as np
import tokenizers

from earl_jax.errors import UserError

# The ChatML special tokens of the Qwen2 / Qwen2.5 tokenizers.
IM_START = '<|im_start|>'
IM_END = '<|im_end|>'
ENDOFTEXT = '<|endoftext|>'
# The system message the Qwen2.5-Instruct chat template adds when a conversation has none.
QWEN_DEFAULT_SYSTEM_PROMPT = 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.'
# What the Qwen2.5 chat template writes around the declared tools (`qwen_tool_system_prompt`).
_QWEN_TOOLS_HEAD = (
  '\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n'
  'You are provided with function signatures within <tools></tools> XML tags:\n<tools>'
)
_QWEN_TOOLS_TAIL = (
  '\n</tools>\n\nFor each function call, return a json object with function name and '
  'arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": '
  '<function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def qwen_tool_system_prompt(tools: Sequence[dict], system: str | None = None) -> str:
  """The system message Qwen2.5's chat template writes when `tools` (OpenAI function schemas)
  are declared: `system` (None: Qwen's default), then each tool as JSON (transformers'
  `tojson`: `json.dumps` without ASCII escaping), then how to call one. With it as
  `HFTokenizer`'s system prompt, a reply `<tool_call>...</tool_call>` and the next observation
  `<tool_response>\n...\n</tool_response>` render as the template renders an assistant's
  tool call and a tool message (tests/fixtures/chat_template_golden.json)."""
  declared = ''.join('\n' + json.dumps(tool, ensure_ascii=False) for tool in tools)
  return (system or QWEN_DEFAULT_SYSTEM_PROMPT) + _QWEN_TOOLS_HEAD + declared + _QWEN_TOOLS_TAIL


class TokenizerError(UserError):
  """A tokenizer that cannot be loaded: an unknown name, or files that do not read as one."""


class TokenizerNotFoundError(TokenizerError, FileNotFoundError):
  """A tokenizer directory, or its tokenizer.json, that does not exist."""


@runtime_checkable
class Tokenizer(Protocol):
  """What the rollout engine needs from a tokenizer (see the module docstring for the layout).

  Attributes:
    vocab_size: number of ids the tokenizer can produce; every id it emits is below it. A
      model's vocabulary may be larger (real Qwen checkpoints pad the embedding table).
    pad_id: the id used to pad rows; never part of a conversation.
    eot_id: the token that ends an agent turn; generation stops when the model emits it.
  """

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...

  @property
  def eot_id(self) -> int: ...

  def encode(self, text: str) -> list[int]:
    """Ids of `text`, without any template or BOS."""
    ...

  def decode(self, ids: Iterable[SupportsIndex], *, skip_special_tokens: bool = False) -> str:
    """Text of `ids`. Pad ids are always dropped; other special tokens stay visible unless
    `skip_special_tokens`."""
    ...

  def turn_prompt_ids(self, observation: str, *, first: bool) -> list[int]:
    """Ids to prefill before the agent replies to `observation`.

    The first turn carries the conversation's opening (BOS / system prompt); a later turn
    starts right after the previous reply's `eot_id`. Both end with the assistant prefix, so
    the next generated token is the first token of the reply.
    """
    ...

  def reply_suffix_ids(self) -> list[int]:
    """Template ids that close a reply which stopped on the token limit without `eot_id`."""
    ...


def _as_id_list(ids: Iterable[SupportsIndex]) -> list[int]:
  array = np.asarray(ids)
  if array.size == 0:
    return []
  if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
    raise ValueError(
      f'Expected a 1-D sequence of integer token ids, got shape {array.shape} and dtype '
      f'{array.dtype}.'
    )
  return [int(i) for i in array]


def conversation_ids(
  tokenizer: Tokenizer,
  observations: Sequence[str],
  replies: Sequence[Iterable[SupportsIndex]],
) -> tuple[list[int], list[bool]]:
  """Builds a conversation the way the rollout engine does, turn by turn.

  Args:
    tokenizer: any `Tokenizer`.
    observations: the env's text for each turn, O of them.
    replies: the ids the model generated for each turn, O of them, or O - 1 when the last
      observation still awaits its reply (the result then ends with that turn's prompt). A
      reply either ends with `eot_id` (the model stopped) or contains none (it hit the token
      limit; `reply_suffix_ids()` is appended as template).

  Returns:
    (ids, generated): the token ids and, for each, whether the model generated it.

  Raises:
    ValueError: if the numbers of observations and replies do not fit, or a reply has an
      `eot_id` before its last token.
  """
  if len(replies) not in (len(observations), len(observations) - 1) or not observations:
    raise ValueError(
      f'Expected one reply per observation (or one fewer), got {len(observations)} '
      f'observations and {len(replies)} replies.'
    )
  ids: list[int] = []
  generated: list[bool] = []
  for turn, observation in enumerate(observations):
    prompt = tokenizer.turn_prompt_ids(observation, first=turn == 0)
    ids += prompt
    generated += [False] * len(prompt)
    if turn == len(replies):
      break
    reply = _as_id_list(replies[turn])
    if tokenizer.eot_id in reply[:-1]:
      raise ValueError(
        f'Reply {turn} has eot_id={tokenizer.eot_id} before its end: {reply}; generation '
        'stops at the first end-of-turn token.'
      )
    ids += reply
    generated += [True] * len(reply)
    if not reply or reply[-1] != tokenizer.eot_id:
      suffix = tokenizer.reply_suffix_ids()
      ids += suffix
      generated += [False] * len(suffix)
  return ids, generated


class HFTokenizer:
  """A HF `tokenizer.json` with the ChatML / Qwen2.5 chat format written in Python.

  Rendered turns (`S` is the system prompt):
    first:  <|im_start|>system\\nS<|im_end|>\\n<|im_start|>user\\n{obs}<|im_end|>\\n
            <|im_start|>assistant\\n
    later:  \\n<|im_start|>user\\n{obs}<|im_end|>\\n<|im_start|>assistant\\n
  A reply is its text followed by `<|im_end|>` (`eot_id`). The leading `\\n` of a later turn is
  the newline the template puts after every `<|im_end|>`.

  Text is encoded as HF does for `apply_chat_template` output: special-token strings inside
  an observation become special tokens. Because byte-level BPE never merges across a special
  token, the turns encoded one by one give the ids of the whole rendering, with one caveat: a
  reply that starts with whitespace ending in a newline would merge with the `\\n` of
  'assistant\\n' when the whole text is re-tokenized (the engine keeps the generated ids, so
  this only matters when comparing with a re-tokenized transcript).
  """

  def __init__(
    self,
    tokenizer: tokenizers.Tokenizer,
    *,
    pad_token: str = ENDOFTEXT,
    system_prompt: str | None = None,
    source: str = 'a tokenizers.Tokenizer',
  ):
    """Wraps a `tokenizers.Tokenizer` that has the ChatML special tokens.

    Args:
      tokenizer: the tokenizer; it must know `<|im_start|>`, `<|im_end|>` and `pad_token`.
      pad_token: the padding token (Qwen: `<|endoftext|>`).
      system_prompt: the system message of every conversation; None means Qwen2.5's default.
      source: where the tokenizer came from, for error messages.

    Raises:
      ValueError: naming the token and the source, if a required token is missing.
    """
    self._tok = tokenizer
    self._source = source
    self._system_prompt = QWEN_DEFAULT_SYSTEM_PROMPT if system_prompt is None else system_prompt
    self._im_start_id = self._token_id(IM_START)
    self._eot_id = self._token_id(IM_END)
    self._pad_id = self._token_id(pad_token)
    self._special_ids = frozenset(self._tok.get_added_tokens_decoder())
    self._vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

  def _token_id(self, token: str) -> int:
    token_id = self._tok.token_to_id(token)
    if token_id is None:
      raise TokenizerError(
        f'Tokenizer from {self._source} has no token {token!r}; HFTokenizer implements the '
        f'ChatML / Qwen chat format, which needs {IM_START!r}, {IM_END!r} and a pad token.'
      )
    return token_id

  @classmethod
  def from_dir(
    cls, model_dir: str | os.PathLike[str], *, system_prompt: str | None = None
  ) -> 'HFTokenizer':
    """Loads `tokenizer.json` (and `tokenizer_config.json` when present) from a model directory.

    `tokenizer_config.json` is optional. When present, its `pad_token` is used, and its chat
    template (also looked for in `chat_template.jinja`) must be a ChatML one.

    Args:
      model_dir: a HF model directory (e.g. a Qwen2.5 checkpoint).
      system_prompt: the system message of every conversation; None means Qwen2.5's default.

    Raises:
      TokenizerNotFoundError (a FileNotFoundError): naming the path, if the directory or its
        tokenizer.json is missing.
      TokenizerError (a ValueError): a file that does not read, a chat template that is not
        ChatML, or a required special token that is missing.
    """
    model_dir = pathlib.Path(model_dir)
    if not model_dir.is_dir():
      raise TokenizerNotFoundError(
        f'Tokenizer directory {str(model_dir)!r} does not exist or is not a directory '
        '(expected a HF model directory containing tokenizer.json).'
      )
    tokenizer_path = model_dir / 'tokenizer.json'
    if not tokenizer_path.is_file():
      raise TokenizerNotFoundError(
        f'No tokenizer.json in {str(model_dir)!r}: expected {str(tokenizer_path)!r} (a HF '
        '`tokenizers` file; slow vocab.json/merges.txt tokenizers are not supported).'
      )
    config = _read_tokenizer_config(model_dir)
    template = _chat_template(model_dir, config)
    if template is not None and IM_START not in template:
      raise TokenizerError(
        f'The chat template of {str(model_dir)!r} is not ChatML (it never writes {IM_START!r}); '
        'HFTokenizer only implements the Qwen / ChatML chat format.'
      )
    pad_token = _token_content(config.get('pad_token')) or ENDOFTEXT
    try:
      tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    except Exception as e:  # the `tokenizers` bindings raise a bare Exception
      raise TokenizerError(
        f'{str(tokenizer_path)!r} is not a readable HF tokenizers file ({e}): expected the '
        'tokenizer.json of a HF model directory.'
      ) from None
    return cls(
      tokenizer,
      pad_token=pad_token,
      system_prompt=system_prompt,
      source=str(tokenizer_path),
    )

  @property
  def vocab_size(self) -> int:
    return self._vocab_size

  @property
  def pad_id(self) -> int:
    return self._pad_id

  @property
  def eot_id(self) -> int:
    """The id of `<|im_end|>`."""
    return self._eot_id

  @property
  def im_start_id(self) -> int:
    return self._im_start_id

  @property
  def system_prompt(self) -> str:
    return self._system_prompt

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids: Iterable[SupportsIndex], *, skip_special_tokens: bool = False) -> str:
    """Decodes ids; ids past the tokenizer's vocabulary (model padding) decode to ''."""
    kept = [i for i in _as_id_list(ids) if i != self._pad_id]
    return self._tok.decode(kept, skip_special_tokens=skip_special_tokens)

  def turn_prompt_text(self, observation: str, *, first: bool) -> str:
    """The text that `turn_prompt_ids` encodes."""
    if first:
      opening = f'{IM_START}system\n{self._system_prompt}{IM_END}\n'
    else:
      opening = '\n'  # the template's newline after the previous reply's <|im_end|>
    return f'{opening}{IM_START}user\n{observation}{IM_END}\n{IM_START}assistant\n'

  def turn_prompt_ids(self, observation: str, *, first: bool) -> list[int]:
    return self.encode(self.turn_prompt_text(observation, first=first))

  def reply_suffix_ids(self) -> list[int]:
    return [self._eot_id]

  def __repr__(self) -> str:
    return f'HFTokenizer({self._source!r}, vocab_size={self._vocab_size})'


def _read_tokenizer_config(model_dir: pathlib.Path) -> dict[str, Any]:
  path = model_dir / 'tokenizer_config.json'
  if not path.is_file():
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      config = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise TokenizerError(f'{str(path)!r} is not valid JSON: {e}') from None
  if not isinstance(config, dict):
    raise TokenizerError(f'{str(path)!r} must hold a JSON object, got {type(config).__name__}.')
  return config


def _chat_template(model_dir: pathlib.Path, config: dict[str, Any]) -> str | None:
  """The chat template: tokenizer_config.json's `chat_template` or chat_template.jinja."""
  template = config.get('chat_template')
  if isinstance(template, list):  # [{'name': 'default', 'template': ...}, ...]
    by_name = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    template = by_name.get('default', next(iter(by_name.values()), None))
  if isinstance(template, str):
    return template
  jinja_path = model_dir / 'chat_template.jinja'
  if jinja_path.is_file():
    return jinja_path.read_text()
  return None


def _token_content(token: Any) -> str | None:
  """A special token as tokenizer_config.json writes it: a string or {'content': ...}."""
  if isinstance(token, dict):
    token = token.get('content')
  return token if isinstance(token, str) else None


class CharTokenizer:
  """A character-level tokenizer: five special ids, then one id per character of `ALPHABET`.

  Ids: `<pad>`=0, `<bos>`=1, `<eot>`=2, `<obs>`=3, `<act>`=4, then one id per character of
  `ALPHABET` in order, then unused ids up to `VOCAB_SIZE - 1`. An unused id decodes to a visible
  `<unusedN>` (dropped by `skip_special_tokens`), so a model that emits one shows it instead of
  failing.

  Turns: first = [<bos>, <obs>, *obs, <act>]; later = [<obs>, *obs, <act>]; a reply is its
  characters then <eot>; `reply_suffix_ids()` = [<eot>].

  Subclasses set `VOCAB_SIZE` and `ALPHABET`.
  """

  VOCAB_SIZE: int
  ALPHABET: str
  SPECIAL_TOKENS = ('<pad>', '<bos>', '<eot>', '<obs>', '<act>')
  # Whether `decode` drops ids at or past VOCAB_SIZE (a larger model vocabulary) or raises.
  DROP_PAST_VOCAB = False

  def __init__(self):
    name = type(self).__name__
    self._char_to_id = {c: len(self.SPECIAL_TOKENS) + i for i, c in enumerate(self.ALPHABET)}
    if len(self._char_to_id) != len(self.ALPHABET):
      raise ValueError(f'{name}.ALPHABET has repeated characters.')
    self._id_to_text = [*self.SPECIAL_TOKENS, *self.ALPHABET]
    self._id_to_text += [f'<unused{i}>' for i in range(len(self._id_to_text), self.VOCAB_SIZE)]
    self._num_used = len(self.SPECIAL_TOKENS) + len(self.ALPHABET)
    if self._num_used > self.VOCAB_SIZE:
      raise ValueError(f'{name} needs {self._num_used} ids, more than {self.VOCAB_SIZE}.')

  @property
  def vocab_size(self) -> int:
    return self.VOCAB_SIZE

  @property
  def pad_id(self) -> int:
    return 0

  @property
  def bos_id(self) -> int:
    return 1

  @property
  def eot_id(self) -> int:
    return 2

  @property
  def obs_id(self) -> int:
    return 3

  @property
  def act_id(self) -> int:
    return 4

  def encode(self, text: str) -> list[int]:
    """One id per character.

    Raises:
      ValueError: naming the first character outside `ALPHABET`, its position and the alphabet.
    """
    try:
      return [self._char_to_id[c] for c in text]
    except KeyError:
      index, char = next((i, c) for i, c in enumerate(text) if c not in self._char_to_id)
      raise ValueError(
        f'{type(self).__name__} cannot encode character {char!r} at index {index} of '
        f'{text[:80]!r}; its alphabet is {self.ALPHABET!r} (special tokens are not parsed from '
        'text).'
      ) from None

  def decode(self, ids: Iterable[SupportsIndex], *, skip_special_tokens: bool = False) -> str:
    """Decodes ids in [0, VOCAB_SIZE); pad is dropped, specials and unused ids are shown unless
    skipped; ids past the vocabulary are dropped when `DROP_PAST_VOCAB`.

    Raises:
      ValueError: naming the id, if one is negative or (unless dropped) past the vocabulary.
    """
    pieces = []
    for i in _as_id_list(ids):
      if i >= self.VOCAB_SIZE and self.DROP_PAST_VOCAB:
        continue
      if not 0 <= i < self.VOCAB_SIZE:
        raise ValueError(f'{type(self).__name__} id {i} is outside [0, {self.VOCAB_SIZE}).')
      is_char = len(self.SPECIAL_TOKENS) <= i < self._num_used
      if i == self.pad_id or (skip_special_tokens and not is_char):
        continue
      pieces.append(self._id_to_text[i])
    return ''.join(pieces)

  def turn_prompt_ids(self, observation: str, *, first: bool) -> list[int]:
    opening = [self.bos_id, self.obs_id] if first else [self.obs_id]
    return [*opening, *self.encode(observation), self.act_id]

  def reply_suffix_ids(self) -> list[int]:
    return [self.eot_id]

  def __repr__(self) -> str:
    return f'{type(self).__name__}()'


class GameTokenizer(CharTokenizer):
  """The character tokenizer of the compact game text protocol, with exactly 64 ids (the
  'tiny-game' model's vocabulary): `ALPHABET` is digits, a-z, 'X', 'O', ' ', '.', '\\n', '|',
  ':', '-' (see `CharTokenizer` for the ids and the turn layout)."""

  VOCAB_SIZE = 64
  ALPHABET = '0123456789abcdefghijklmnopqrstuvwxyzXO .\n|:-'


class CodeTokenizer(CharTokenizer):
  """The character tokenizer that spells Python for the tiny models, with 128 ids.

  `ALPHABET` is '\\t', '\\n' and the 95 printable ASCII characters (' ' to '~'), ids 5..101;
  ids 102..127 are unused. The code environments keep their observations inside this alphabet
  (`earl_jax.envs.code_env.printable`). See `CharTokenizer` for the turn layout. A model whose
  vocabulary is larger (the 'tiny' preset has 512) may emit ids past 127: they decode to '', as
  the padding ids of a HF model do in `HFTokenizer`.
  """

  VOCAB_SIZE = 128
  DROP_PAST_VOCAB = True
  ALPHABET = '\t\n' + ''.join(chr(c) for c in range(32, 127))


_CHAR_TOKENIZERS: dict[str, type[CharTokenizer]] = {'game': GameTokenizer, 'code': CodeTokenizer}


def load_tokenizer(spec: str | os.PathLike[str], *, system_prompt: str | None = None) -> Tokenizer:
  """Returns the tokenizer named by `spec`.

  Args:
    spec: 'game' for `GameTokenizer`, 'code' for `CodeTokenizer`, or the path of a HF model
      directory for `HFTokenizer`.
    system_prompt: the HF tokenizer's system message (None: Qwen2.5's default); not used by
      the game tokenizer.

  Raises:
    TokenizerError (a ValueError): naming `spec`, if it is neither 'game', 'code' nor an
      existing directory, or its files do not read.
    TokenizerNotFoundError (a FileNotFoundError): if the directory has no tokenizer.json.
  """
  if isinstance(spec, str) and spec in _CHAR_TOKENIZERS:
    return _CHAR_TOKENIZERS[spec]()
  if pathlib.Path(spec).is_dir():
    return HFTokenizer.from_dir(spec, system_prompt=system_prompt)
  raise TokenizerError(
    f"Unknown tokenizer {str(spec)!r}: expected 'game', 'code' or the path of an existing HF "
    'model directory containing tokenizer.json.'
  )
