"""Renders a tool-calling conversation of the `swe` environment with transformers' own
`apply_chat_template` and the real Qwen2.5 chat template (the qwen2_tiny fixture's), so that
earl_jax can test that its tool format (`tokenizer.qwen_tool_system_prompt`, `<tool_call>`
replies, `<tool_response>` observations) is the one Qwen2.5-Instruct was trained on.

How to run (no torch needed; nothing is downloaded but the two packages):

  python3 -m venv /tmp/venv-hf && /tmp/venv-hf/bin/pip install transformers jinja2
  HF_HUB_OFFLINE=1 /tmp/venv-hf/bin/python scripts/make_tool_call_golden.py

Writes tests/fixtures/tool_call_golden.json: the tools (`earl_jax.swe.tools.qwen_tools()`), the
messages, and the rendered text and ids of each prefix a rollout prompts with.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault('HF_HUB_OFFLINE', '1')
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import transformers  # noqa: E402

from earl_jax.swe import tools  # noqa: E402  (stdlib only: no jax needed)


def main():
  fixture = ROOT / 'tests' / 'fixtures'
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(fixture / 'qwen2_tiny'))
  declared = tools.qwen_tools()
  view = {'name': 'view_file', 'arguments': {'path': 'pkg/core.py', 'start': 1, 'end': 3}}
  edit = {
    'name': 'replace_lines',
    'arguments': {
      'path': 'pkg/core.py',
      'start': 2,
      'end': 2,
      'text': '    return a + b  # fixed "quote"',
    },
  }
  messages = [
    {'role': 'user', 'content': '1 test of pkg 1.0 fails (3 in its suite):\n\n  tests/test_core.py::test_add\n      AssertionError: assert -1 == 5'},
    {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': view}]},
    {'role': 'tool', 'name': 'view_file', 'content': 'pkg/core.py:\n1|def add(a, b):\n2|    return a - b\n3|'},
    {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': edit}]},
    {'role': 'tool', 'name': 'replace_lines', 'content': 'pkg/core.py: replaced lines 2-2 with 1 lines; now 3'},
    {'role': 'assistant', 'content': '', 'tool_calls': [{'type': 'function', 'function': {'name': 'submit', 'arguments': {}}}]},
  ]  # fmt: skip
  cases = []
  for name, count, prompt in (
    ('first_prompt', 1, True),
    ('third_prompt', 3, True),
    ('whole', len(messages), False),
  ):
    text = tokenizer.apply_chat_template(
      messages[:count], tools=declared, tokenize=False, add_generation_prompt=prompt
    )
    ids = tokenizer.apply_chat_template(
      messages[:count], tools=declared, tokenize=True, add_generation_prompt=prompt
    )
    if hasattr(ids, 'keys'):  # transformers >= 5 returns a BatchEncoding
      ids = ids['input_ids']
    cases.append({'name': name, 'messages': count, 'add_generation_prompt': prompt,
                  'text': text, 'ids': list(ids)})  # fmt: skip
  out = {
    'about': f'Qwen2.5 chat template with tools, rendered by transformers '
             f'{transformers.__version__} apply_chat_template; ids from the qwen2_tiny tokenizer.',
    'tools': declared,
    'messages': messages,
    'replies': [json.dumps(m['tool_calls'][0]['function']) for m in messages[1::2]],
    'cases': cases,
  }  # fmt: skip
  with open(fixture / 'tool_call_golden.json', 'w') as f:
    json.dump(out, f, indent=1, ensure_ascii=False)
    f.write('\n')
  print(f'wrote {fixture / "tool_call_golden.json"}')


if __name__ == '__main__':
  main()
